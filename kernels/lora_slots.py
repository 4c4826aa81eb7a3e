"""One projection's LoRA weights for every adapter slot: the one copy the kernels read.

Two layouts, one per kind of kernel, never both:

- ``"per_slot"`` (CPU: the native kernel and the PyTorch reference): each loaded slot holds
  A of every slice transposed ``[in, R]`` and the block-diagonal B with the LoRA scale
  folded in, transposed ``[R, out]``, where ``R`` is the sum of the slices' own ranks
  rounded up to 16 (the prefill matmuls' K runs faster so). Allocated when an adapter is
  loaded, at its own rank; an empty slot holds nothing. The native kernel reads its own
  copy of both, the sum of ranks rounded up only to what it needs
  (``cpu_native.lora_rank_multiple``: 8, or 16 for bfloat16 where AMX tiles are built in;
  a decode step's LoRA reads its adapters' bytes at about the streaming rate, and 16 cost a
  rank-8 adapter a quarter more of them), in the tiled layout (``tiled_layout``): each
  tile of ranks or columns it keeps in registers is one contiguous run of memory, so that
  a decode step's LoRA reads stream (read in place they ran at about half the streaming
  rate), and in bfloat16 pair-interleaved along the summed axis, as its AVX-512 BF16 dot
  products read them. The reference and the prefill matmuls read the plain ones. LoRA
  weights are small (rank x (in + out) per slot), so two copies cost little.
- ``"stacked"`` (Triton): per slice, A ``[num_slots, max_rank, in]`` and B
  ``[num_slots, out_k, max_rank]``, allocated up front, because the kernels address a slot
  by its stride. A slot's rows past its rank stay zero and are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["per_slot", "stacked"]
_MATMUL_RANK_MULTIPLE = 16


def default_layout(device: torch.device) -> Layout:
    """The layout the default backend of ``device`` reads (Triton on CUDA)."""
    return "stacked" if device.type == "cuda" else "per_slot"


class LoRASlots:
    """Every slot's LoRA weights for one (possibly packed) projection; see the module."""

    def __init__(self, in_features: int, slice_widths: Sequence[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device,
                 layout: Layout) -> None:
        self.in_features = in_features
        self.slice_offsets = [0]
        for w in slice_widths:
            self.slice_offsets.append(self.slice_offsets[-1] + w)
        self.layout = layout
        self.dtype = dtype
        self.device = device
        # per_slot: (A^T [in, R], scaled block-diagonal B^T [R, out]) or None when empty
        self.weights: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        # per_slot: each targeted slice's (first rank, last rank, first column, last
        # column) in A^T's columns and B^T's blocks, for the per-slice prefill matmuls
        self.slices: list[tuple[tuple[int, int, int, int], ...]] = [()] * num_slots
        # per_slot: the native kernel's tiled copies (kept alive here)
        self.native: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        # per_slot, for the native kernel: each slot's addresses and R (0 = empty), and
        # its targeted slices as ``slices`` holds them (the kernel expands per slice)
        self.at_ptrs = torch.zeros(num_slots, dtype=torch.int64)
        self.bt_ptrs = torch.zeros(num_slots, dtype=torch.int64)
        self.ranks = torch.zeros(num_slots, dtype=torch.int64)
        self.slice_table = torch.zeros(num_slots, len(slice_widths), 4,
                                       dtype=torch.int64)  # [num_slots, num_slices, 4]
        self.num_slices = torch.zeros(num_slots, dtype=torch.int64)
        self.lora_a: list[torch.Tensor] = []
        self.lora_b: list[torch.Tensor] = []
        if layout == "stacked":
            # [num_slots, max_rank, in] and [num_slots, out_k, max_rank], one per slice
            self.lora_a = [torch.zeros(num_slots, max_rank, in_features, dtype=dtype,
                                       device=device) for _ in slice_widths]
            self.lora_b = [torch.zeros(num_slots, w, max_rank, dtype=dtype, device=device)
                           for w in slice_widths]

    @property
    def num_slots(self) -> int:
        return len(self.weights)

    def set(self, slot: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
            scale: float) -> None:
        """Writes one slot: per slice, ``(A [rank, in], B [out_k, rank])`` or None (slice
        not targeted). All None empties the slot. ``scale`` is folded into B in the
        per-slot layout; the stacked layout's kernels take it per step."""
        if self.layout == "stacked":
            for k, pair in enumerate(pairs):
                self.lora_a[k][slot].zero_()
                self.lora_b[k][slot].zero_()
                if pair is not None:
                    rank = pair[0].shape[0]
                    self.lora_a[k][slot, :rank].copy_(pair[0])
                    self.lora_b[k][slot, :, :rank].copy_(pair[1])
            return
        self.install(slot, self.prepare(pairs, scale))

    def prepare(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                scale: float) -> SlotWeights | None:
        """The per-slot layout's tensors for one adapter (``set``'s arguments), built apart
        from any slot so that a loader thread can build them ahead and ``install`` only
        points a slot at them. None when no slice is targeted."""
        assert self.layout == "per_slot", "the stacked layout is written in place (set)"
        total = sum(p[0].shape[0] for p in pairs if p is not None)
        if total == 0:
            return None
        width = round_up(total, _MATMUL_RANK_MULTIPLE)
        at = torch.zeros(self.in_features, width, dtype=self.dtype, device=self.device)
        bt = torch.zeros(width, self.slice_offsets[-1], dtype=self.dtype, device=self.device)
        r0 = 0
        slices = []
        for k, pair in enumerate(pairs):
            if pair is None:
                continue
            a, b = pair
            r1 = r0 + a.shape[0]
            lo, hi = self.slice_offsets[k], self.slice_offsets[k + 1]
            at[:, r0:r1] = a.t()
            bt[r0:r1, lo:hi] = b.t() * scale
            slices.append((r0, r1, lo, hi))
            r0 = r1
        native = None
        rank = width
        tile = _native_tile(self.dtype) if self.device.type == "cpu" else None
        if tile is not None:
            rank = round_up(total, _native_rank_multiple(self.dtype))
            native = tiled_layout(at[:, :rank], bt[:rank], slices, tile,
                                  pairs=self.dtype == torch.bfloat16)
        return SlotWeights(at, bt, native, tuple(slices), rank)

    def install(self, slot: int, weights: SlotWeights | None) -> None:
        """Points a slot at ``prepare``'s tensors (None empties it): no copy; the slot
        shares them, read-only, with whoever else holds them (the host cache)."""
        if weights is None:
            self.weights[slot] = self.native[slot] = None
            self.slices[slot] = ()
            self.at_ptrs[slot] = self.bt_ptrs[slot] = self.ranks[slot] = 0
            self.num_slices[slot] = 0
            return
        assert self.layout == "per_slot" and weights.at.dtype == self.dtype
        assert weights.at.shape[0] == self.in_features
        assert weights.bt.shape[1] == self.slice_offsets[-1]
        native = weights.native or (weights.at, weights.bt)  # the latter: no native kernel
        self.weights[slot] = (weights.at, weights.bt)
        self.slices[slot] = weights.slices
        self.native[slot] = weights.native
        self.at_ptrs[slot] = native[0].data_ptr()
        self.bt_ptrs[slot] = native[1].data_ptr()
        self.ranks[slot] = weights.rank
        self.slice_table[slot].zero_()
        self.slice_table[slot, :len(weights.slices)] = torch.tensor(weights.slices,
                                                                     dtype=torch.int64)
        self.num_slices[slot] = len(weights.slices)


@dataclass(frozen=True, eq=False)
class SlotWeights:
    """One adapter's weights for one projection in the per-slot layout (``prepare``)."""

    at: torch.Tensor  # A^T of every targeted slice side by side [in, width]
    bt: torch.Tensor  # scaled block-diagonal B^T [width, out]
    native: tuple[torch.Tensor, torch.Tensor] | None  # the native kernel's tiled copies
    slices: tuple[tuple[int, int, int, int], ...]
    # the R the kernels are told: the native copies' (the slices' ranks together, rounded
    # up to the kernel's multiple), else ``at``'s width (rounded up to 16)
    rank: int


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (a slot's summed rank to a layout's)."""
    return -(-n // multiple) * multiple


def vnni_pair_layout(w: torch.Tensor) -> torch.Tensor:
    """``w [k, n]`` as ``[ceil(k / 2), n, 2]``, element ``[i, j, p] = w[2i + p, j]`` (a zero
    row appended when k is odd): each pair along k side by side, as vdpbf16ps reads it."""
    k, n = w.shape
    if k % 2:
        w = torch.cat([w, w.new_zeros(1, n)])
    return w.view(-1, 2, n).transpose(1, 2).contiguous()  # [ceil(k / 2), n, 2]


def _native_tile(dtype: torch.dtype) -> int | None:
    from loraplex_kernels import cpu_native  # it imports this module

    return cpu_native.lora_tile(dtype)


def _native_rank_multiple(dtype: torch.dtype) -> int:
    from loraplex_kernels import cpu_native  # it imports this module

    multiple = cpu_native.lora_rank_multiple(dtype)
    assert multiple is not None, "asked only where the native kernel takes the dtype"
    return multiple


def tiled_layout(at: torch.Tensor, bt: torch.Tensor,
                 slices: Sequence[tuple[int, int, int, int]], tile: int,
                 pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernel's copies of ``at [in, R]`` and ``bt [R, out]`` (``prepare``), flat,
    each block it reads in one pass one contiguous run (csrc/cpu_lora_f32.c):

    - A: per block of ``w = min(tile, R - k0)`` ranks from ``k0``, ``at[:, k0:k0 + w]``;
    - B: per slice ``(kb, ke, lo, hi)`` in order, per tile of ``min(tile, hi - o0)`` columns
      from ``o0``, ``bt[kb:ke, o0:o0 + tile]``; only the diagonal blocks.

    ``pairs`` (bfloat16): both pair-interleaved along the summed axis first
    (``vnni_pair_layout``), a slice's ranks widened to whole pairs ``kb // 2 .. ceil(ke /
    2)``; the kernel then reads ``[rows / 2, width, 2]`` blocks."""
    rank = at.shape[1]
    a = vnni_pair_layout(at) if pairs else at  # [in2, R, 2] or [in, R]
    a_blocks = [a[:, k0:k0 + tile].reshape(-1) for k0 in range(0, rank, tile)]
    b_blocks = []
    for kb, ke, lo, hi in slices:
        if pairs:
            rows = bt[kb // 2 * 2:-(-ke // 2) * 2, lo:hi]  # R is even: whole pairs
            rows = vnni_pair_layout(rows)  # [pairs, width, 2]
        else:
            rows = bt[kb:ke, lo:hi]
        b_blocks += [rows[:, o:o + tile].reshape(-1) for o in range(0, hi - lo, tile)]
    return torch.cat(a_blocks), torch.cat(b_blocks)
