"""Triton SGMV shrink/expand: LoRA for a batch whose tokens use different adapter slots.

Segments come from :class:`SGMVMeta`: segment ``i`` is the run of token indices
``sorted_token_ids[seg_starts[i] : seg_starts[i] + seg_lens[i]]`` that use slot
``active_slots[i]``. Programs gather their rows through those indices, so activations are
never permuted, prefill and decode tokens mix freely, and base-model rows (slot -1) are
never read or written.

Work is bounded by each slot's own rank: shrink splits the rank axis into tiles and a tile
past the slot's rank does no multiply (it only writes the zero padding the reference
writes); expand loops over rank up to the slot's rank. Weights may be stored padded to
``max_lora_rank``.

Semantics match :mod:`loraplex_kernels.sgmv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex_kernels.meta import SGMVMeta

MAX_SLICES = 3
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 is the correctness path (CPU oracle parity); TF32 would cost ~1e-3 relative error.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, scales_ptr, out_ptr,
    sorted_ids_ptr, active_slots_ptr, seg_starts_ptr, seg_lens_ptr, slot_ranks_ptr,
    hidden, out_rank,
    stride_xt, stride_xh,
    stride_as, stride_ar, stride_ah,
    stride_ok, stride_ot, stride_or,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_sk = tl.program_id(2)
    seg = pid_sk // NUM_SLICES
    k = pid_sk % NUM_SLICES

    seg_len = tl.load(seg_lens_ptr + seg)
    m0 = pid_m * BLOCK_M
    if m0 >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(active_slots_ptr + seg).to(tl.int64)
    rank = tl.load(slot_ranks_ptr + slot)
    scale = tl.load(scales_ptr + slot).to(tl.float32)

    if k == 0:
        a_ptr = a0_ptr
    elif k == 1:
        a_ptr = a1_ptr
    else:
        a_ptr = a2_ptr

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
    a_cols = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar  # [1, BLOCK_R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # A rank tile wholly past this slot's rank skips the hidden loop: that is the per-adapter
    # rank saving. It still stores, because the reference zero-fills columns rank..max_rank.
    k_end = tl.where(pid_r * BLOCK_R < rank, hidden, 0)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < hidden
        xt = tl.load(x_rows + kk[None, :] * stride_xh, mask=m_mask[:, None] & k_mask[None, :],
                     other=0.0)  # [BLOCK_M, BLOCK_K]
        at = tl.load(a_cols + kk[:, None] * stride_ah, mask=k_mask[:, None] & r_mask[None, :],
                     other=0.0)  # [BLOCK_K, BLOCK_R]
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)

    acc = acc * scale
    out_ptrs = out_ptr + k * stride_ok + tok[:, None] * stride_ot + offs_r[None, :] * stride_or
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (offs_r[None, :] < out_rank))


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, b0_ptr, b1_ptr, b2_ptr, out_ptr,
    sorted_ids_ptr, active_slots_ptr, seg_starts_ptr, seg_lens_ptr, slot_ranks_ptr,
    width0, width1, width2, col0, col1, col2, stride_bs0, stride_bs1, stride_bs2,
    num_n_tiles,
    stride_yk, stride_yt, stride_yr,
    stride_bn, stride_br,
    stride_ot, stride_on,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    seg = tl.program_id(1)
    k = tl.program_id(2)
    pid_m = pid_mn // num_n_tiles
    pid_n = pid_mn % num_n_tiles

    seg_len = tl.load(seg_lens_ptr + seg)
    m0 = pid_m * BLOCK_M
    if m0 >= seg_len:
        return

    if k == 0:
        b_ptr = b0_ptr
        width = width0
        col = col0
        stride_bs = stride_bs0
    elif k == 1:
        b_ptr = b1_ptr
        width = width1
        col = col1
        stride_bs = stride_bs1
    else:
        b_ptr = b2_ptr
        width = width2
        col = col2
        stride_bs = stride_bs2
    n0 = pid_n * BLOCK_N
    # The grid is sized for the widest slice; narrower slices (k/v under GQA) stop early.
    if n0 >= width:
        return

    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(active_slots_ptr + seg).to(tl.int64)
    rank = tl.load(slot_ranks_ptr + slot)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    offs_r = tl.arange(0, BLOCK_R)

    y_rows = y_ptr + k * stride_yk + tok[:, None] * stride_yt  # [BLOCK_M, 1]
    b_cols = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The reduction stops at this slot's rank, never at the padded maximum.
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + offs_r
        r_mask = rr < rank
        yt = tl.load(y_rows + rr[None, :] * stride_yr, mask=m_mask[:, None] & r_mask[None, :],
                     other=0.0)  # [BLOCK_M, BLOCK_R]
        bt = tl.load(b_cols + rr[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :],
                     other=0.0)  # [BLOCK_R, BLOCK_N]
        acc = tl.dot(yt, bt, acc, input_precision=DOT_PRECISION)

    # Each (token, column) belongs to exactly one program, so a plain read-add-write is safe.
    out_ptrs = out_ptr + tok[:, None] * stride_ot + (col + offs_n)[None, :] * stride_on
    o_mask = m_mask[:, None] & n_mask[None, :]
    cur = tl.load(out_ptrs, mask=o_mask, other=0.0)
    tl.store(out_ptrs, (cur.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def _check_meta(meta: SGMVMeta, num_tokens: int, device: torch.device) -> None:
    assert meta.num_tokens == num_tokens, (
        f"meta built for {meta.num_tokens} tokens, activations have {num_tokens}")
    for name in ("sorted_token_ids", "active_slots", "seg_starts", "seg_lens", "slot_ranks"):
        t: torch.Tensor = getattr(meta, name)
        assert t.device == device, f"meta.{name} is on {t.device}, activations on {device}"
        assert t.is_contiguous(), f"meta.{name} must be contiguous"


def _check_weights(weights: list[torch.Tensor], name: str, num_slots: int,
                   device: torch.device) -> None:
    assert 1 <= len(weights) <= MAX_SLICES, (
        f"{name}: 1..{MAX_SLICES} slices supported, got {len(weights)}")
    for i, w in enumerate(weights):
        assert w.dim() == 3, f"{name}[{i}] must be 3-D, got shape {tuple(w.shape)}"
        assert w.device == device, f"{name}[{i}] is on {w.device}, activations on {device}"
        assert w.dtype == weights[0].dtype, (
            f"{name}[{i}] dtype {w.dtype} differs from {name}[0] dtype {weights[0].dtype}")
        assert w.shape[0] == num_slots, (
            f"{name}[{i}] has {w.shape[0]} slots, meta has {num_slots}")
        assert w.stride(2) == 1, f"{name}[{i}] innermost dimension must be contiguous"


def _block_m(max_seg_len: int) -> int:
    # Decode segments are a handful of tokens: small row tiles avoid idle MMA rows.
    return 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64


def sgmv_shrink_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    lora_a: list[torch.Tensor],  # per slice: [num_slots, max_rank, hidden]
    scales: torch.Tensor,  # [num_slots] float32
    meta: SGMVMeta,
    out: torch.Tensor,  # [num_slices, num_tokens, max_rank]
) -> None:
    """``out[k, t, :r_s] = (x[t] @ lora_a[k][s, :r_s].T) * scales[s]``; zero up to max_rank.

    Rows of base-model tokens (slot -1) are left untouched.
    """
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}"
    assert x.dtype in _FLOAT_DTYPES, f"x dtype {x.dtype} not supported"
    num_tokens, hidden = x.shape
    num_slots = len(meta.slot_ranks_list)
    _check_meta(meta, num_tokens, x.device)
    _check_weights(lora_a, "lora_a", num_slots, x.device)
    a0 = lora_a[0]
    assert a0.dtype == x.dtype, f"lora_a dtype {a0.dtype} differs from x dtype {x.dtype}"
    max_rank = a0.shape[1]
    for i, a in enumerate(lora_a):
        assert a.shape == a0.shape, (
            f"lora_a[{i}] shape {tuple(a.shape)} differs from lora_a[0] {tuple(a0.shape)}")
        assert a.stride() == a0.stride(), f"lora_a[{i}] strides differ from lora_a[0]"
    assert a0.shape[2] == hidden, f"lora_a hidden {a0.shape[2]} != x hidden {hidden}"
    assert meta.max_rank <= max_rank, (
        f"an active slot has rank {meta.max_rank} > stored max rank {max_rank}")
    assert scales.shape == (num_slots,), (
        f"scales must be [num_slots={num_slots}], got {tuple(scales.shape)}")
    assert scales.device == x.device, f"scales on {scales.device}, x on {x.device}"
    assert out.shape == (len(lora_a), num_tokens, max_rank), (
        f"out must be [num_slices={len(lora_a)}, num_tokens={num_tokens}, "
        f"max_rank={max_rank}], got {tuple(out.shape)}")
    assert out.dtype in _FLOAT_DTYPES, f"out dtype {out.dtype} not supported"
    assert out.device == x.device, f"out on {out.device}, x on {x.device}"
    if not meta.has_lora or num_tokens == 0:
        return

    scales = scales.contiguous()
    a_ptrs = [*lora_a, *[a0] * (MAX_SLICES - len(lora_a))]
    block_m = _block_m(meta.max_seg_len)
    block_r = 16 if meta.max_rank <= 16 else 32
    block_k = 128 if block_m <= 32 else 64
    grid = (triton.cdiv(meta.max_seg_len, block_m), triton.cdiv(max_rank, block_r),
            len(meta.active_slots_list) * len(lora_a))
    _sgmv_shrink_kernel[grid](
        x, a_ptrs[0], a_ptrs[1], a_ptrs[2], scales, out,
        meta.sorted_token_ids, meta.active_slots, meta.seg_starts, meta.seg_lens,
        meta.slot_ranks,
        hidden, max_rank,
        x.stride(0), x.stride(1),
        a0.stride(0), a0.stride(1), a0.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_SLICES=len(lora_a),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=4,
    )


def sgmv_expand_triton(
    y: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    lora_b: list[torch.Tensor],  # per slice: [num_slots, slice_width, max_rank]
    meta: SGMVMeta,
    out: torch.Tensor,  # [num_tokens, sum(slice widths)], accumulated into
    slice_offsets: list[int],  # [num_slices + 1] column offsets into out
) -> None:
    """``out[t, off_k:off_k+n_k] += y[k, t, :r_s] @ lora_b[k][s, :, :r_s].T``.

    Rows of base-model tokens (slot -1) are left untouched.
    """
    assert y.dim() == 3, f"y must be [num_slices, num_tokens, max_rank], got {tuple(y.shape)}"
    assert y.dtype in _FLOAT_DTYPES, f"y dtype {y.dtype} not supported"
    num_slices, num_tokens, max_rank = y.shape
    num_slots = len(meta.slot_ranks_list)
    _check_meta(meta, num_tokens, y.device)
    _check_weights(lora_b, "lora_b", num_slots, y.device)
    assert len(lora_b) == num_slices, f"y has {num_slices} slices, lora_b has {len(lora_b)}"
    assert len(slice_offsets) == num_slices + 1, (
        f"slice_offsets needs {num_slices + 1} entries, got {len(slice_offsets)}")
    assert lora_b[0].dtype == y.dtype, f"lora_b dtype {lora_b[0].dtype} != y dtype {y.dtype}"
    widths: list[int] = []
    for i, b in enumerate(lora_b):
        assert b.shape[2] == max_rank, f"lora_b[{i}] max rank {b.shape[2]} != y's {max_rank}"
        assert b.shape[1] == slice_offsets[i + 1] - slice_offsets[i], (
            f"lora_b[{i}] width {b.shape[1]} != slice_offsets span "
            f"{slice_offsets[i + 1] - slice_offsets[i]}")
        assert (b.stride(1), b.stride(2)) == (lora_b[0].stride(1), lora_b[0].stride(2)), (
            f"lora_b[{i}] row strides differ from lora_b[0]")
        widths.append(b.shape[1])
    assert meta.max_rank <= max_rank, (
        f"an active slot has rank {meta.max_rank} > stored max rank {max_rank}")
    assert out.dim() == 2 and out.shape[0] == num_tokens, (
        f"out must be [num_tokens={num_tokens}, width], got {tuple(out.shape)}")
    assert 0 <= slice_offsets[0] and slice_offsets[-1] <= out.shape[1], (
        f"slice_offsets {slice_offsets} exceed out width {out.shape[1]}")
    assert out.dtype in _FLOAT_DTYPES, f"out dtype {out.dtype} not supported"
    assert out.device == y.device, f"out on {out.device}, y on {y.device}"
    if not meta.has_lora or num_tokens == 0:
        return

    pad = MAX_SLICES - num_slices
    b_ptrs = [*lora_b, *[lora_b[0]] * pad]
    w = [*widths, *[0] * pad]
    cols = [*slice_offsets[:num_slices], *[0] * pad]
    slot_strides = [b.stride(0) for b in b_ptrs]
    block_m = _block_m(meta.max_seg_len)
    block_n = 64 if block_m == 64 else 128
    num_n_tiles = triton.cdiv(max(widths), block_n)
    grid = (triton.cdiv(meta.max_seg_len, block_m) * num_n_tiles,
            len(meta.active_slots_list), num_slices)
    _sgmv_expand_kernel[grid](
        y, b_ptrs[0], b_ptrs[1], b_ptrs[2], out,
        meta.sorted_token_ids, meta.active_slots, meta.seg_starts, meta.seg_lens,
        meta.slot_ranks,
        w[0], w[1], w[2], cols[0], cols[1], cols[2],
        slot_strides[0], slot_strides[1], slot_strides[2],
        num_n_tiles,
        y.stride(0), y.stride(1), y.stride(2),
        lora_b[0].stride(1), lora_b[0].stride(2),
        out.stride(0), out.stride(1),
        NUM_SLICES=num_slices,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=16,
        DOT_PRECISION=_dot_precision(y.dtype),
        num_warps=4,
    )
