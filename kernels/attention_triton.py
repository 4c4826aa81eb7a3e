"""Triton KV store and paged attention over a block-table KV cache.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; position ``p`` of
sequence ``b`` lives in block ``block_tables[b, p // block_size]`` at row
``p % block_size``. Every kernel looks the block up per key position, so the kernel's key
tile need not match the cache's block size and block tables may be in any order.

Attention is split by query length, decided per sequence on the device:

- decode (one query): one program per (sequence, KV head, KV split) handles all query
  heads of its GQA group at once, so each K/V row is read once per group. With more than
  one split (long contexts, few sequences) each program writes a partial softmax state and
  a second kernel merges them.
- prefill with a cached prefix (several queries, ``seq_len >= query_len``): one program per
  (sequence, query tile, head) with the causal mask aligned bottom-right; its key loop
  stops at the last key any of its queries may see.

Both use an online softmax in fp32. Semantics match :mod:`loraplex_kernels.attention_ref`,
sliding windows and soft-capped scores included: with a window (``WINDOW``) a program's
key loop starts at the first key its first query sees, so no block before a sequence's
window is read (the engine may have released it), and with soft-capping (``SOFTCAP``) a
score ``s`` is ``cap * tanh(s / cap)`` before the mask. Both are compile-time switches, so
the kernels without them are the same code as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex_kernels.meta import AttentionMeta

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
# Below this many keys per split, the merge costs more than the parallelism gains.
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 64


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 is the correctness path (CPU oracle parity); TF32 would cost ~1e-3 relative error.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cp, stride_ch,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + offs_d, mask=d_mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + offs_d, mask=d_mask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cp + h * stride_ch
    tl.store(k_cache_ptr + dst + offs_d, k, mask=d_mask)
    tl.store(v_cache_ptr + dst + offs_d, v, mask=d_mask)


@triton.jit
def _softcap(s, scale, softcap):
    """``softcap * tanh(s * scale / softcap)`` in log2 units (times log2 e), for exp2.
    Triton has no tanh: as Cephes' tanhf, an odd polynomial below |y| = 0.625 and
    (1 - e) / (1 + e) with e = exp(-2|y|) above (never overflows), as the CPU kernels."""
    y = s * scale / softcap
    a = tl.abs(y)
    z = a * a
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
              + 1.33314422036e-1) * z - 3.33332819422e-1) * z * a + a
    e = tl.exp(-2.0 * a)
    t = tl.where(a < 0.625, small, (1.0 - e) / (1.0 + e))
    return tl.where(y < 0, -t, t) * (softcap * 1.4426950408889634)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2, group, head_dim, block_size, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_ch, stride_bt,
    scale, softcap, window,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    q_row = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_row
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    # Splits own whole key tiles so every non-empty split starts on a tile boundary; with
    # a window the tiles are counted from its first key (of the last `window`), and no
    # key before it is read.
    if WINDOW:
        first = tl.maximum(seq_len - window, 0)
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), num_splits)
        start = first + split * tiles_per_split * BLOCK_N
    else:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
        start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(seq_len, start + tiles_per_split * BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < group
    heads = kvh * group + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for p0 in range(start, end, BLOCK_N):
        pos = p0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        blk = tl.load(table + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        row = blk * stride_cb + (pos % block_size) * stride_cp + kvh * stride_ch  # [BLOCK_N]
        kt = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None],
                     mask=d_mask[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        if SOFTCAP:
            s = _softcap(tl.dot(q, kt, input_precision=DOT_PRECISION), scale, softcap)
        else:
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :],
                     mask=p_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Unnormalised partial state; an empty split leaves m=-inf, l=0 and weighs nothing.
        part = (b.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)
    else:
        o = acc / l_i[:, None]
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_ptr,
    num_splits, head_dim, num_heads, stride_ot, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_row = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_row
    if q_len != 1:
        return
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    part = (b.to(tl.int64) * num_heads + h) * num_splits + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)  # finite: the first split always holds a key
    w = tl.exp2(m - m_max)
    acc = tl.load(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_part * w, axis=0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2, group, head_dim, block_size, num_q_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_ch, stride_bt,
    scale, softcap, window,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = pid // num_q_tiles
    q_tile = pid % num_q_tiles

    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    q0 = q_tile * BLOCK_Q
    # Decode rows belong to the decode kernel; tiles past this sequence's queries are idle.
    if (q_len == 1) | (q0 >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # keys already cached before this chunk
    kvh = h // group

    offs_q = q0 + tl.arange(0, BLOCK_Q)
    q_mask = offs_q < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    rows = (q_start + offs_q).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=q_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]

    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    # Bottom-right causal mask: query i sees keys 0 .. context + i. Keys past the tile's
    # last query are invisible to all of it, so the loop stops there. With a window, query
    # i sees keys from context + i - window + 1 on: the loop starts at its first query's.
    end = tl.minimum(seq_len, context + q0 + BLOCK_Q)
    if WINDOW:
        begin = tl.maximum(context + q0 - window + 1, 0)
    else:
        begin = 0
    for p0 in range(begin, end, BLOCK_N):
        pos = p0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        blk = tl.load(table + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        row = blk * stride_cb + (pos % block_size) * stride_cp + kvh * stride_ch  # [BLOCK_N]
        kt = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None],
                     mask=d_mask[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        if SOFTCAP:
            s = _softcap(tl.dot(q, kt, input_precision=DOT_PRECISION), scale, softcap)
        else:
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_Q, BLOCK_N]
        visible = p_mask[None, :] & (pos[None, :] <= context + offs_q[:, None])
        if WINDOW:
            visible = visible & (pos[None, :] > context + offs_q[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if WINDOW:
            # A row whose window starts past this tile has seen nothing yet: m stays
            # -inf, and exp2(-inf - -inf) would be NaN (l and acc are zero, any factor
            # keeps them).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
        else:
            # Key 0 is visible to every row, so m_new is finite from the first tile on.
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :],
                     mask=p_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        m_i = m_new

    if WINDOW:
        # Every query sees its own key, but the tile's rows past the chunk's may see none
        # (never stored): no 0 / 0.
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask[:, None] & d_mask[None, :])


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4, (
        f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(k_cache.shape)}")
    assert v_cache.shape == k_cache.shape, (
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    assert v_cache.stride() == k_cache.stride(), "k_cache and v_cache strides differ"
    assert v_cache.dtype == k_cache.dtype, f"k_cache {k_cache.dtype} != v_cache {v_cache.dtype}"
    assert v_cache.device == k_cache.device, "k_cache and v_cache on different devices"
    assert k_cache.stride(3) == 1, "cache head_dim must be contiguous"
    assert k_cache.dtype in _FLOAT_DTYPES, f"cache dtype {k_cache.dtype} not supported"


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Writes each token's K/V at its flat slot ``block * block_size + offset``."""
    _check_cache(k_cache, v_cache)
    assert key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got {key.shape}"
    assert value.shape == key.shape, f"value shape {value.shape} != key shape {key.shape}"
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.shape[1:] == k_cache.shape[2:], (
        f"key heads/dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}")
    assert key.dtype == value.dtype == k_cache.dtype, (
        f"key {key.dtype} / value {value.dtype} / cache {k_cache.dtype} dtypes differ")
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value head_dim must be contiguous"
    assert key.device == k_cache.device == slot_mapping.device, "tensors on different devices"
    assert slot_mapping.shape == (num_tokens,), (
        f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}")
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        head_dim, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_decode: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
    """KV splits for decode: enough programs to fill the GPU, never splits under 512 keys."""
    if device.type != "cuda" or num_decode == 0:
        return 1
    programs = num_decode * num_kv_heads
    target = 2 * _num_sms(device.index if device.index is not None else 0)
    wanted = triton.cdiv(target, programs)
    return max(1, min(wanted, max_seq_len // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of each sequence's new queries over its cached keys.

    ``num_splits`` forces the decode KV split count (tests); by default it is chosen from
    the batch size and context length so that long-context, small-batch decode fills the GPU.
    ``window`` > 0: query position p sees keys p - window < k <= p only, and nothing before
    a program's first such key is read; ``softcap`` > 0: scores s become
    softcap * tanh(s / softcap). 0 turns either off.
    """
    assert window >= 0 and softcap >= 0.0, (
        f"window {window} and softcap {softcap} must be >= 0 (0: off)")
    _check_cache(k_cache, v_cache)
    assert query.dim() == 3, (
        f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert head_dim == cache_head_dim, f"query head_dim {head_dim} != cache {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    assert query.dtype == k_cache.dtype, f"query {query.dtype} != cache {k_cache.dtype}"
    assert query.stride(2) == 1, "query head_dim must be contiguous"
    assert out.shape == query.shape, f"out shape {tuple(out.shape)} != query {query.shape}"
    assert out.dtype == query.dtype, f"out dtype {out.dtype} != query dtype {query.dtype}"
    assert out.stride(2) == 1, "out head_dim must be contiguous"
    assert query.device == k_cache.device == out.device, "tensors on different devices"
    assert meta.block_size == block_size, (
        f"meta.block_size {meta.block_size} != cache block size {block_size}")
    assert sum(meta.query_lens_list) == num_tokens, (
        f"meta covers {sum(meta.query_lens_list)} query rows, query has {num_tokens}")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        t: torch.Tensor = getattr(meta, name)
        assert t.dtype == torch.int32, f"meta.{name} must be int32, got {t.dtype}"
        assert t.device == query.device, f"meta.{name} on {t.device}, query on {query.device}"
    assert meta.block_tables.stride(-1) == 1, "meta.block_tables rows must be contiguous"
    if meta.num_seqs == 0:
        return

    group = num_heads // num_kv_heads
    scale_log2 = float(scale) * _LOG2E
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = _dot_precision(query.dtype)
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               meta.block_tables.stride(0))
    extra = (float(scale), float(softcap), int(window))
    switches = {"WINDOW": window > 0, "SOFTCAP": softcap > 0.0}

    num_decode = sum(1 for q in meta.query_lens_list if q == 1)
    if num_decode:
        decode_max_len = max(s for s, q in zip(meta.seq_lens_list, meta.query_lens_list,
                                               strict=True) if q == 1)
        if window:
            decode_max_len = min(decode_max_len, window)  # the keys a row reads
        splits = num_splits if num_splits is not None else choose_num_splits(
            num_decode, num_kv_heads, decode_max_len, query.device)
        assert splits >= 1, f"num_splits must be >= 1, got {splits}"
        if splits > 1:
            # [num_seqs, num_heads, splits, head_dim] and (m, l) pairs, fp32
            part_acc = torch.empty(meta.num_seqs, num_heads, splits, head_dim,
                                   dtype=torch.float32, device=query.device)
            part_ml = torch.empty(meta.num_seqs, num_heads, splits, 2,
                                  dtype=torch.float32, device=query.device)
        else:
            part_acc = part_ml = out  # unused when SPLIT is false
        _paged_decode_kernel[(meta.num_seqs, num_kv_heads, splits)](
            query, k_cache, v_cache, out, part_acc, part_ml,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale_log2, group, head_dim, block_size, num_heads,
            *strides, *extra,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64, BLOCK_D=block_d,
            SPLIT=splits > 1, DOT_PRECISION=precision, **switches,
            num_warps=4,
        )
        if splits > 1:
            _merge_splits_kernel[(meta.num_seqs, num_heads)](
                out, part_acc, part_ml, meta.query_start_loc,
                splits, head_dim, num_heads, out.stride(0), out.stride(1),
                BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
                num_warps=1,
            )

    if num_decode < meta.num_seqs:
        block_q = 64 if meta.max_query_len > 32 else 32
        num_q_tiles = triton.cdiv(meta.max_query_len, block_q)
        _paged_prefill_kernel[(meta.num_seqs * num_q_tiles, num_heads)](
            query, k_cache, v_cache, out,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale_log2, group, head_dim, block_size, num_q_tiles,
            *strides, *extra,
            BLOCK_Q=block_q, BLOCK_N=64 if block_d <= 64 else 32, BLOCK_D=block_d,
            DOT_PRECISION=precision, **switches,
            num_warps=4,
        )
