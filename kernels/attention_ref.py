"""PyTorch reference of the KV store and paged attention: the CPU path and the oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex_kernels.meta import AttentionMeta


def store_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Writes each token's K/V at its flat slot ``block * block_size + offset``."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int,
            first: int = 0) -> torch.Tensor:
    # cache [num_blocks, block_size, kv_heads, head_dim] -> [length - first, kv_heads,
    # head_dim]: positions first .. length - 1, read from first's block on (the blocks
    # before a sliding window's start may have been released and hold anything)
    block_size = cache.shape[1]
    b0 = first // block_size
    num_blocks = -(-length // block_size)
    return cache.index_select(0, block_table[b0:num_blocks].long()).flatten(0, 1)[
        first - b0 * block_size:length - b0 * block_size]


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float, group: int) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA has no option for: as HuggingFace's
    Gemma 2 eager attention (divide, tanh, multiply), in float32 throughout. q [n, heads,
    q_len, dim], k and v [n, kv_heads, len, dim], mask (True: seen) broadcast to [n,
    heads, q_len, len]; every row sees a key."""
    if group > 1:
        k = k.repeat_interleave(group, 1)  # [n, heads, len, dim]
        v = v.repeat_interleave(group, 1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [n, heads, q_len, len]
    s = torch.tanh(s / softcap) * softcap
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(p, v.float()).to(q.dtype)  # [n, heads, q_len, dim]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float, softcap: float, group: int) -> torch.Tensor:
    """SDPA with a boolean ``mask`` (True: seen), or, soft-capped, ``_capped_attention``."""
    if softcap > 0.0:
        return _capped_attention(q, k, v, mask, scale, softcap, group)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=group > 1)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of each sequence's new queries over its cached keys.

    Decode rows (one query each) are done in one padded batch; each prefill chunk is done
    on its own with a bottom-right aligned causal mask. ``window`` > 0: the query at
    position p sees keys p - window < k <= p only, and no block wholly before a sequence's
    earliest window start is read; ``softcap`` > 0: scores s become softcap * tanh(s /
    softcap), in float32 (``_capped_attention``). Without either, SDPA as ever.
    """
    group = query.shape[1] // k_cache.shape[2]
    decode = [b for b, q in enumerate(meta.query_lens_list) if q == 1]
    if decode and (window or softcap):
        _decode_batch_windowed(query, k_cache, v_cache, meta, decode, scale, group, out,
                               window, softcap)
    elif decode:
        _decode_batch(query, k_cache, v_cache, meta, decode, scale, group, out)
    prefill_attention_ref(query, k_cache, v_cache, meta, scale, out, window, softcap)


def prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """The sequences with more than one new query token (prefill chunks), one at a time,
    with a bottom-right aligned causal mask; decode rows are left alone. ``window`` and
    ``softcap`` as for ``paged_attention_ref``."""
    group = query.shape[1] // k_cache.shape[2]
    prefill = [b for b, q in enumerate(meta.query_lens_list) if q > 1]
    starts = meta.query_start_loc.tolist() if prefill else []
    for b in prefill:
        lo, hi = starts[b], starts[b + 1]
        seq_len = meta.seq_lens_list[b]
        q_len = hi - lo
        context = seq_len - q_len
        # the first query's window start: no key before it is read
        first = max(0, context - window + 1) if window else 0
        keys = _gather(k_cache, meta.block_tables[b], seq_len, first)  # [len, kv_heads, dim]
        values = _gather(v_cache, meta.block_tables[b], seq_len, first)
        # 4-D [1, heads, len, dim]: SDPA's fused CPU kernel takes 4-D inputs only (the 3-D
        # call falls back to the unfused path, ~3x slower here).
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        k = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, len, dim]
        v = values.transpose(0, 1).unsqueeze(0)
        if window or softcap:
            q_pos = torch.arange(context, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(first, seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos  # [q_len, len], causal aligned bottom-right
            if window:
                mask &= k_pos > q_pos - window
            o = _attend(q, k, v, mask, scale, softcap, group)
        elif q_len == seq_len:  # nothing cached: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
        else:
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril(
                seq_len - q_len)  # [q_len, seq_len], causal aligned bottom-right
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=group > 1)
        out[lo:hi] = o[0].transpose(0, 1)


def _decode_batch_windowed(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    seqs: list[int],
    scale: float,
    group: int,
    out: torch.Tensor,
    window: int,
    softcap: float,
) -> None:
    """``_decode_batch`` with a sliding window or soft-capping: each row's keys gathered
    from its window's first block on (the blocks before may be stale), its own blocks
    repeated as padding, and every position outside its window zeroed before use, so
    that whatever those hold never reaches the sums (a masked NaN would, times 0)."""
    device = query.device
    block_size = k_cache.shape[1]
    n = len(seqs)
    rows = torch.tensor(seqs, device=device)
    tables = meta.block_tables.index_select(0, rows).long()  # [n, max_blocks]
    token_rows = meta.query_start_loc.index_select(0, rows).long()
    lens = [meta.seq_lens_list[b] for b in seqs]
    firsts = [max(0, length - window) if window else 0 for length in lens]
    b0 = [f // block_size for f in firsts]
    b1 = [-(-length // block_size) for length in lens]  # past each row's last block
    width = max(e - s for s, e in zip(b0, b1, strict=True))
    start = torch.tensor(b0, device=device)
    cols = torch.minimum(start[:, None] + torch.arange(width, device=device)[None, :],
                         torch.tensor(b1, device=device)[:, None] - 1)  # [n, width]
    blocks = tables.gather(1, cols).flatten()
    length = width * block_size
    # positions of the gathered rows: [n, length]
    pos = (start * block_size)[:, None] + torch.arange(length, device=device)[None, :]
    seen = (pos >= torch.tensor(firsts, device=device)[:, None]) \
        & (pos < torch.tensor(lens, device=device)[:, None])
    hidden = ~seen[:, :, None, None]
    keys = k_cache.index_select(0, blocks).view(n, length, *k_cache.shape[2:]).masked_fill(
        hidden, 0)  # [n, length, kv_heads, dim]
    values = v_cache.index_select(0, blocks).view(n, length, *v_cache.shape[2:]).masked_fill(
        hidden, 0)
    q = query.index_select(0, token_rows).unsqueeze(2)  # [n, heads, 1, dim]
    o = _attend(q, keys.transpose(1, 2), values.transpose(1, 2), seen[:, None, None, :],
                scale, softcap, group)
    out.index_copy_(0, token_rows, o.squeeze(2))


def _decode_batch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    seqs: list[int],
    scale: float,
    group: int,
    out: torch.Tensor,
) -> None:
    block_size = k_cache.shape[1]
    if len(seqs) == meta.num_seqs:
        rows = torch.arange(len(seqs), device=query.device)
        tables = meta.block_tables
    else:
        rows = torch.tensor(seqs, device=query.device)
        tables = meta.block_tables.index_select(0, rows)
    # With only decode rows, token b is sequence b; otherwise map through the start offsets.
    token_rows = meta.query_start_loc.index_select(0, rows).long()
    lens = [meta.seq_lens_list[b] for b in seqs]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    tables = tables[:, :num_blocks].long()  # [n, num_blocks]
    n = len(seqs)
    keys = k_cache.index_select(0, tables.flatten()).view(n, num_blocks * block_size,
                                                         *k_cache.shape[2:])[:, :max_len]
    values = v_cache.index_select(0, tables.flatten()).view(n, num_blocks * block_size,
                                                           *v_cache.shape[2:])[:, :max_len]
    # keys: [n, max_len, kv_heads, dim] -> [n, kv_heads, max_len, dim]
    k = keys.transpose(1, 2)
    v = values.transpose(1, 2)
    q = query.index_select(0, token_rows).unsqueeze(2)  # [n, heads, 1, dim]
    seq_lens = torch.tensor(lens, device=query.device)
    mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=group > 1)
    out.index_copy_(0, token_rows, o.squeeze(2))
