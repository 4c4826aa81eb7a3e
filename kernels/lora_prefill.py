"""LoRA of long (prefill) segments on CPU: one shrink per slot, one expand per slice.

The per-slot layout (``LoRASlots``) keeps each slot's B as one block-diagonal ``[R, out]``
matrix, so a single expand multiplies every slice's ranks against every slice's columns:
for q/k/v three times the useful work, for gate/up twice. At prefill sizes a segment's
expand runs at the GEMM's compute rate, so for a packed projection the shrink stays one
GEMM over all slices' A side by side and the expand runs per slice on its diagonal block,
accumulated in place into that slice's columns. A single-slice projection keeps the one
expand (its block is the whole of B). The blocks skipped are zero, so the result is the
reference's (``add_lora_ref``, the oracle) up to summation order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex_kernels.lora_slots import LoRASlots
from loraplex_kernels.meta import SGMVMeta


def add_lora_sliced(
    out: torch.Tensor,  # [num_tokens, out], accumulated into
    x: torch.Tensor,  # [num_tokens, in]
    slots: LoRASlots,  # the per-slot layout
    meta: SGMVMeta,  # contiguous segments (``seg_first_tokens`` set)
    segment_ids: Sequence[int],
) -> None:
    """``out[rows] += x[rows] @ A_s^T @ B_s^T`` (scale folded into B) for these segments,
    each a contiguous run of one slot's tokens; empty slots add nothing."""
    firsts = meta.seg_first_tokens
    assert firsts is not None, "per-slice LoRA needs contiguous segments"
    for i in segment_ids:
        slot = meta.active_slots_list[i]
        pair = slots.weights[slot]
        if pair is None:
            continue
        at, bt = pair
        blocks = slots.slices[slot]
        rows = slice(firsts[i], firsts[i] + meta.seg_lens_list[i])
        y = x[rows] @ at  # [length, R], all slices at once
        out_rows = out[rows]
        if len(blocks) == 1:
            # one slice: B is one block; the padded K (a multiple of 16) runs faster
            out_rows.addmm_(y, bt)
            continue
        for r0, r1, lo, hi in blocks:
            out_rows[:, lo:hi].addmm_(y[:, r0:r1], bt[r0:r1, lo:hi])
