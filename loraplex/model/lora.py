"""LoRA-aware linear layers: a base projection plus every token's own adapter delta.

Each packed projection keeps, per slice (q/k/v, gate/up), the A and B weights of all
``max_loras`` slots stacked: A ``[num_slots, max_rank, in]``, B ``[num_slots, out_k, max_rank]``.
A slot's rows beyond its rank stay zero and are never read by the kernels, which stop at
each slot's own rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loraplex_kernels import cpu_native
from loraplex_kernels.meta import SGMVMeta
from loraplex_kernels.ops import Backend, PackedWeight, add_lora, linear, pack_linear_weight
from loraplex_kernels.sgmv_ref import pack_slot

# PEFT module name -> (our packed module, slice index within it)
MODULE_SLICES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


@dataclass(frozen=True)
class LoRAStep:
    """What every LoRA layer needs for one forward pass."""

    meta: SGMVMeta
    scales: torch.Tensor  # [num_slots] float32
    backend: Backend | None = None


class LoRALinear(nn.Module):
    """A (possibly packed) linear projection with per-token LoRA deltas."""

    def __init__(self, in_features: int, slice_widths: list[int], bias: bool,
                 num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.slice_widths = list(slice_widths)
        self.slice_offsets = [0]
        for w in slice_widths:
            self.slice_offsets.append(self.slice_offsets[-1] + w)
        out = self.slice_offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        # [num_slots, max_rank, in] and [num_slots, out_k, max_rank], one per slice
        self.lora_a = [torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device)
                       for _ in slice_widths]
        self.lora_b = [torch.zeros(num_slots, w, max_rank, dtype=dtype, device=device)
                       for w in slice_widths]
        # Per slot, every slice at once: A [num_slices * rank, in] and a block-diagonal,
        # pre-scaled B [out, num_slices * rank]. The CPU path does one shrink and one expand
        # per slot with them instead of three ops per slice: on CPU the op count is the cost.
        self.packed: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        # The same, laid out for the native CPU kernel (float32 on CPU only).
        self.native = cpu_native.NativeLoRASlots(num_slots)
        self.packed_weight: PackedWeight | None = None  # see pack_weight

    def forward(self, x: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.packed_weight)  # [num_tokens, out]
        if lora is not None and lora.meta.has_lora:
            add_lora(out, x, self.lora_a, self.lora_b, lora.scales, lora.meta,
                     self.slice_offsets, lora.backend, packed=self.packed, native=self.native)
        return out

    def pack_weight(self) -> None:
        """Keeps a GEMM-packed copy of the (loaded, now fixed) base weight where that is
        faster (float32 on CPU; see ``pack_linear_weight``). A oneDNN-packed copy is all
        the GEMM reads, so the plain weight is released (half the base weights' memory);
        ``weight`` is then an empty tensor. Packing twice is a no-op."""
        if self.packed_weight is not None:
            return
        self.packed_weight = pack_linear_weight(self.weight)
        if self.packed_weight is not None and self.packed_weight.kind == "onednn":
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack_slot(self, slot: int, rank: int, scale: float) -> None:
        """Rebuilds the slot's packed weights from its slices, with the LoRA scale folded
        into B (``rank`` 0: an empty slot)."""
        if rank == 0:
            self.packed[slot] = None
            self.native.set(slot, None)
            return
        self.packed[slot] = pack_slot(self.lora_a, self.lora_b, slot, rank, scale,
                                      self.slice_offsets)
        self.native.set(slot, self.packed[slot])

    def set_slot(self, slot: int, slice_idx: int, a: torch.Tensor | None,
                 b: torch.Tensor | None) -> None:
        """Writes one slice of one slot; ``None`` clears it (module not targeted)."""
        self.lora_a[slice_idx][slot].zero_()
        self.lora_b[slice_idx][slot].zero_()
        if a is not None and b is not None:
            rank = a.shape[0]
            self.lora_a[slice_idx][slot, :rank].copy_(a)
            self.lora_b[slice_idx][slot, :, :rank].copy_(b)
