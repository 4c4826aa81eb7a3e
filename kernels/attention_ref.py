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


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache [num_blocks, block_size, kv_heads, head_dim] -> [length, kv_heads, head_dim]
    num_blocks = -(-length // cache.shape[1])
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:length]


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    """Causal attention of each sequence's new queries over its cached keys.

    Decode rows (one query each) are done in one padded batch; each prefill chunk is done
    on its own with a bottom-right aligned causal mask.
    """
    group = query.shape[1] // k_cache.shape[2]
    decode = [b for b, q in enumerate(meta.query_lens_list) if q == 1]
    if decode:
        _decode_batch(query, k_cache, v_cache, meta, decode, scale, group, out)
    prefill_attention_ref(query, k_cache, v_cache, meta, scale, out)


def prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    """The sequences with more than one new query token (prefill chunks), one at a time,
    with a bottom-right aligned causal mask; decode rows are left alone."""
    group = query.shape[1] // k_cache.shape[2]
    prefill = [b for b, q in enumerate(meta.query_lens_list) if q > 1]
    starts = meta.query_start_loc.tolist() if prefill else []
    for b in prefill:
        lo, hi = starts[b], starts[b + 1]
        seq_len = meta.seq_lens_list[b]
        q_len = hi - lo
        keys = _gather(k_cache, meta.block_tables[b], seq_len)  # [seq_len, kv_heads, dim]
        values = _gather(v_cache, meta.block_tables[b], seq_len)
        # 4-D [1, heads, len, dim]: SDPA's fused CPU kernel takes 4-D inputs only (the 3-D
        # call falls back to the unfused path, ~3x slower here).
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        k = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq_len, dim]
        v = values.transpose(0, 1).unsqueeze(0)
        if q_len == seq_len:  # nothing cached: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
        else:
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril(
                seq_len - q_len)  # [q_len, seq_len], causal aligned bottom-right
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=group > 1)
        out[lo:hi] = o[0].transpose(0, 1)


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
