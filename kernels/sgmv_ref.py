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


# Per slot: (A of every slice stacked [slices * rank, in], block-diagonal B scaled by
#            the slot's LoRA scale [sum of slice widths, slices * rank]), or None when empty.
PackedSlots = list[tuple[torch.Tensor, torch.Tensor] | None]


def pack_slot(
    lora_a: list[torch.Tensor],  # per slice: [num_slots, max_rank, hidden]
    lora_b: list[torch.Tensor],  # per slice: [num_slots, slice_width, max_rank]
    slot: int,
    rank: int,
    scale: float | torch.Tensor,
    slice_offsets: list[int],  # [num_slices + 1] column offsets
) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's weights as ``PackedSlots`` holds them: every slice's A stacked
    ``[slices * rank, in]`` and a block-diagonal B ``[out, slices * rank]`` times ``scale``."""
    a = torch.cat([la[slot, :rank] for la in lora_a])  # [slices * rank, in]
    b = a.new_zeros(slice_offsets[-1], a.shape[0])  # [out, slices * rank]
    for k, lb in enumerate(lora_b):
        b[slice_offsets[k]:slice_offsets[k + 1], k * rank:(k + 1) * rank] = lb[slot, :, :rank] * scale
    return a, b


def add_lora_ref(
    out: torch.Tensor,  # [num_tokens, sum(slice widths)], accumulated into
    x: torch.Tensor,  # [num_tokens, hidden]
    lora_a: list[torch.Tensor],  # per slice: [num_slots, max_rank, hidden]
    lora_b: list[torch.Tensor],  # per slice: [num_slots, slice_width, max_rank]
    scales: torch.Tensor,  # [num_slots]
    meta: SGMVMeta,
    slice_offsets: list[int],  # [num_slices + 1] column offsets into out
    packed: PackedSlots | None = None,
    segment_ids: Sequence[int] | None = None,
) -> None:
    """Shrink and expand fused per slot: the CPU fast path.

    Same arithmetic as ``sgmv_shrink_ref`` followed by ``sgmv_expand_ref``. When each
    slot's tokens are one contiguous run (the runner arranges it), rows are sliced and
    accumulated in place with no gather or scatter. ``segment_ids``: only these segments
    (default: all).
    """
    firsts = meta.seg_first_tokens
    for i in range(len(meta.active_slots_list)) if segment_ids is None else segment_ids:
        slot, start, length = (meta.active_slots_list[i], meta.seg_starts_list[i],
                               meta.seg_lens_list[i])
        rank = meta.slot_ranks_list[slot]
        scale = scales[slot]
        if firsts is not None:
            rows = slice(firsts[i], firsts[i] + length)
            xs = x[rows]  # [length, hidden]
            pair = packed[slot] if packed is not None else None
            if pair is not None:
                a_all, b_all = pair
                y = xs @ a_all.T  # [length, slices * rank]; the scale is folded into b_all
                out[rows, slice_offsets[0]:slice_offsets[-1]].addmm_(y.to(out.dtype), b_all.T)
                continue
            for k, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
                y = (xs @ a[slot, :rank].T) * scale  # [length, rank]
                out[rows, slice_offsets[k]:slice_offsets[k + 1]].addmm_(
                    y.to(out.dtype), b[slot, :, :rank].T)
            continue
        idx = meta.sorted_token_ids[start:start + length]
        xs = x.index_select(0, idx)
        parts = [((xs @ a[slot, :rank].T) * scale) @ b[slot, :, :rank].T
                 for a, b in zip(lora_a, lora_b, strict=True)]
        delta = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [length, out]
        out[:, slice_offsets[0]:slice_offsets[-1]].index_add_(0, idx, delta.to(out.dtype))
