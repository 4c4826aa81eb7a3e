"""PyTorch reference of SGMV shrink/expand: the CPU path and the tests' oracle.

Each active slot's tokens are gathered, multiplied at that slot's own rank (never the
padded maximum), and scattered back; base-model rows (slot -1) are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex_kernels.meta import SGMVMeta


def sgmv_shrink_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    lora_a: list[torch.Tensor],  # per slice: [num_slots, max_rank, hidden]
    scales: torch.Tensor,  # [num_slots] float32
    meta: SGMVMeta,
    out: torch.Tensor,  # [num_slices, num_tokens, max_rank]
) -> None:
    """``out[k, t, :r_s] = (x[t] @ lora_a[k][s, :r_s].T) * scales[s]`` for tokens of slot s."""
    for slot, start, length in zip(meta.active_slots_list, meta.seg_starts_list,
                                   meta.seg_lens_list, strict=True):
        rank = meta.slot_ranks_list[slot]
        idx = meta.sorted_token_ids[start:start + length]
        xs = x.index_select(0, idx)  # [length, hidden]
        scale = scales[slot]
        for k, a in enumerate(lora_a):
            ys = (xs @ a[slot, :rank].T) * scale  # [length, rank]
            out[k].index_copy_(0, idx, torch.nn.functional.pad(ys, (0, out.shape[2] - rank)))


def sgmv_expand_ref(
    y: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    lora_b: list[torch.Tensor],  # per slice: [num_slots, slice_width, max_rank]
    meta: SGMVMeta,
    out: torch.Tensor,  # [num_tokens, sum(slice widths)], accumulated into
    slice_offsets: list[int],  # [num_slices + 1] column offsets into out
) -> None:
    """``out[t, off_k:off_k+n_k] += y[k, t, :r_s] @ lora_b[k][s, :, :r_s].T``."""
    for slot, start, length in zip(meta.active_slots_list, meta.seg_starts_list,
                                   meta.seg_lens_list, strict=True):
        rank = meta.slot_ranks_list[slot]
        idx = meta.sorted_token_ids[start:start + length]
        for k, b in enumerate(lora_b):
            lo, hi = slice_offsets[k], slice_offsets[k + 1]
            delta = y[k].index_select(0, idx)[:, :rank] @ b[slot, :, :rank].T  # [length, n_k]
            out[:, lo:hi].index_add_(0, idx, delta.to(out.dtype))


def add_lora_ref(
    out: torch.Tensor,  # [num_tokens, out], accumulated into
    x: torch.Tensor,  # [num_tokens, in]
    weights: Sequence[tuple[torch.Tensor, torch.Tensor] | None],  # per slot, see below
    meta: SGMVMeta,
    segment_ids: Sequence[int] | None = None,
) -> None:
    """LoRA of every segment's tokens from the per-slot layout (``LoRASlots``): per slot,
    ``(A^T [in, R], scaled block-diagonal B^T [R, out])``, or None for no delta; one shrink
    and one expand matmul per segment. When each slot's tokens are one contiguous run (the
    runner arranges it), rows are sliced and accumulated in place with no gather or
    scatter. ``segment_ids``: only these segments (default: all).
    """
    firsts = meta.seg_first_tokens
    for i in range(len(meta.active_slots_list)) if segment_ids is None else segment_ids:
        pair = weights[meta.active_slots_list[i]]
        if pair is None:
            continue
        at, bt = pair
        start, length = meta.seg_starts_list[i], meta.seg_lens_list[i]
        if firsts is not None:
            rows = slice(firsts[i], firsts[i] + length)
            y = x[rows] @ at  # [length, R]
            out[rows].addmm_(y.to(out.dtype), bt)
            continue
        idx = meta.sorted_token_ids[start:start + length]
        delta = (x.index_select(0, idx) @ at) @ bt  # [length, out]
        out.index_add_(0, idx, delta.to(out.dtype))
