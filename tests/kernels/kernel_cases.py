"""Shared kernel test cases: inputs, a dense float64 oracle, and the checks.

Used by the reference tests (CPU, in-process), the Triton interpreter cases (CPU, in a
subprocess with ``TRITON_INTERPRET=1``) and the ``gpu`` tests (CUDA). Every check poisons
what a kernel must not read (weights past a slot's rank, activations of base-model rows,
cache slots past a sequence's length) and what it must write (outputs start as NaN).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from loraplex_kernels import ops
from loraplex_kernels.lora_slots import Layout, LoRASlots, default_layout
from loraplex_kernels.meta import AttentionMeta, SGMVMeta

# (vs float64 oracle, vs reference) absolute/relative tolerance per dtype
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (4e-2, 4e-2),
}


@contextmanager
def torch_threads(num: int) -> Iterator[None]:
    """torch's (and the native kernels') thread count set to ``num`` for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(),
                               atol=tol[0], rtol=tol[1], msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- SGMV


# The cases' segments are short, so they split long from short at 32 tokens (the engine
# splits at short_segment_limit(dtype)) to reach both CPU LoRA paths.
CASE_SEGMENT_LEN = 32


@dataclass(frozen=True)
class SGMVCase:
    name: str
    token_slots: tuple[int, ...]
    slot_ranks: tuple[int, ...]
    hidden: int
    widths: tuple[int, ...]  # one entry per slice
    max_rank: int = 64

    def __str__(self) -> str:
        return self.name


def _scattered_slots(num_tokens: int, num_slots: int, seed: int) -> tuple[int, ...]:
    # Every slot and base-model rows, interleaved so no adapter's tokens are contiguous.
    rng = random.Random(seed)
    slots = [i % (num_slots + 1) - 1 for i in range(num_tokens)]
    rng.shuffle(slots)
    return tuple(slots)


MIXED_RANKS = (1, 8, 16, 64)

SGMV_CASES: list[SGMVCase] = [
    SGMVCase("mixed-1slice", _scattered_slots(23, 4, 1), MIXED_RANKS, 67, (67,)),
    SGMVCase("mixed-2slices", _scattered_slots(23, 4, 2), MIXED_RANKS, 67, (90, 41)),
    SGMVCase("mixed-3slices-gqa", _scattered_slots(29, 4, 3), MIXED_RANKS, 67, (48, 16, 16)),
    # One long prefill segment (several row tiles) beside single decode tokens.
    SGMVCase("prefill-and-decode", tuple([2] * 40 + [-1, 0, 3, -1, 1] + [2] * 30),
             MIXED_RANKS, 33, (40, 24, 24)),
    SGMVCase("all-base", (-1,) * 7, MIXED_RANKS, 33, (33,)),
    SGMVCase("rank-8-max", _scattered_slots(17, 2, 4), (8, 3), 50, (150, 19), max_rank=8),
]


def _runs(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Slot i's tokens ``counts[i]`` times in a row (the native path), a base row first."""
    return (-1, *(s for s, n in enumerate(counts) for _ in range(n)))


# Summed ranks past whole 64-rank tiles by every multiple of 8 (the native layout pads to
# 8, so a last tile has whole vectors and, with AVX-512, perhaps half of one), with 1-12
# tokens a slot (decode groups of one or two; a bfloat16 kernel's eight at once): one
# slice, and three whose ranks add up (1 + 1 + 1 = 3 -> 8, 33 x 3 = 99 -> 104).
PART_TILE_CASES = [
    SGMVCase("part-tiles-1slice", _runs((1, 2, 5, 8, 12, 3, 4, 9)),
             (8, 24, 40, 56, 72, 120, 16, 48), 70, (100,), max_rank=120),
    SGMVCase("part-tiles-3slices", _runs((2, 1, 8, 12, 5, 1, 9, 4)),
             (8, 16, 24, 40, 3, 5, 1, 33), 64, (48, 16, 16), max_rank=40),
]


@dataclass
class SGMVInputs:
    meta: SGMVMeta
    x: torch.Tensor  # [num_tokens, hidden]
    lora_a: list[torch.Tensor]  # per slice [num_slots, max_rank, hidden]
    lora_b: list[torch.Tensor]  # per slice [num_slots, width, max_rank]
    scales: torch.Tensor  # [num_slots] float32
    y: torch.Tensor  # [num_slices, num_tokens, max_rank], an expand input
    slice_offsets: list[int]
    out_width: int


def make_sgmv_inputs(case: SGMVCase, dtype: torch.dtype, device: str,
                     seed: int = 0, segment_len: int = CASE_SEGMENT_LEN) -> SGMVInputs:
    g = torch.Generator().manual_seed(seed)
    num_slots = len(case.slot_ranks)
    num_tokens = len(case.token_slots)
    r = case.max_rank
    x = torch.randn(num_tokens, case.hidden, generator=g)
    lora_a = [torch.randn(num_slots, r, case.hidden, generator=g) / math.sqrt(case.hidden)
              for _ in case.widths]
    lora_b = [torch.randn(num_slots, w, r, generator=g) / math.sqrt(r) for w in case.widths]
    y = torch.randn(len(case.widths), num_tokens, r, generator=g)
    for s, rank in enumerate(case.slot_ranks):
        # Padding past a slot's rank must never be read: NaN would spread into the result.
        for a in lora_a:
            a[s, rank:] = float("nan")
        for b in lora_b:
            b[s, :, rank:] = float("nan")
    for t, s in enumerate(case.token_slots):
        # Base-model rows are never read; other rows only up to their slot's rank.
        y[:, t, case.slot_ranks[s] if s >= 0 else 0:] = float("nan")
    scales = torch.rand(num_slots, generator=g) + 0.5
    offsets = [0]
    for w in case.widths:
        offsets.append(offsets[-1] + w)
    return SGMVInputs(
        meta=SGMVMeta.build(case.token_slots, case.slot_ranks, device=device,
                            short_segment_len=segment_len),
        x=x.to(dtype).to(device),
        lora_a=[a.to(dtype).to(device) for a in lora_a],
        lora_b=[b.to(dtype).to(device) for b in lora_b],
        scales=scales.to(device),
        y=y.to(dtype).to(device),
        slice_offsets=offsets,
        out_width=offsets[-1] + 3,  # 3 trailing columns no slice owns
    )


def dense_shrink(case: SGMVCase, inp: SGMVInputs) -> torch.Tensor:
    """float64 ``x @ A^T * scale`` per token; zeros past the rank, NaN on base rows."""
    x = inp.x.double().cpu()
    out = torch.full((len(case.widths), len(case.token_slots), case.max_rank), float("nan"),
                     dtype=torch.float64)
    for t, s in enumerate(case.token_slots):
        if s < 0:
            continue
        rank = case.slot_ranks[s]
        for k, a in enumerate(inp.lora_a):
            out[k, t] = 0.0
            out[k, t, :rank] = a[s, :rank].double().cpu() @ x[t] * float(inp.scales[s])
    return out


def dense_expand(case: SGMVCase, inp: SGMVInputs, out0: torch.Tensor) -> torch.Tensor:
    """float64 ``out0 + y @ B^T`` per token and slice."""
    out = out0.double().cpu().clone()
    for t, s in enumerate(case.token_slots):
        if s < 0:
            continue
        rank = case.slot_ranks[s]
        for k, b in enumerate(inp.lora_b):
            lo, hi = inp.slice_offsets[k], inp.slice_offsets[k + 1]
            out[t, lo:hi] += b[s, :, :rank].double().cpu() @ inp.y[k, t, :rank].double().cpu()
    return out


def check_shrink(case: SGMVCase, dtype: torch.dtype, device: str,
                 backend: ops.Backend) -> None:
    inp = make_sgmv_inputs(case, dtype, device)
    out = torch.full((len(case.widths), len(case.token_slots), case.max_rank), float("nan"),
                     dtype=dtype, device=device)
    ops.sgmv_shrink(inp.x, inp.lora_a, inp.scales, inp.meta, out, backend=backend)
    base = [t for t, s in enumerate(case.token_slots) if s < 0]
    lora = [t for t, s in enumerate(case.token_slots) if s >= 0]
    assert bool(out[:, base].isnan().all()), "a base-model row of the shrink output was written"
    expected = dense_shrink(case, inp)
    _close(out[:, lora], expected[:, lora], f"shrink {case} vs float64")
    if backend != "torch":
        ref = torch.full_like(out, float("nan"))
        ops.sgmv_shrink(inp.x, inp.lora_a, inp.scales, inp.meta, ref, backend="torch")
        _close(out[:, lora], ref[:, lora], f"shrink {case} vs reference")


def check_expand(case: SGMVCase, dtype: torch.dtype, device: str,
                 backend: ops.Backend) -> None:
    inp = make_sgmv_inputs(case, dtype, device)
    g = torch.Generator().manual_seed(1)
    out0 = torch.randn(len(case.token_slots), inp.out_width, generator=g).to(dtype).to(device)
    out = out0.clone()
    ops.sgmv_expand(inp.y, inp.lora_b, inp.meta, out, inp.slice_offsets, backend=backend)
    base = [t for t, s in enumerate(case.token_slots) if s < 0]
    assert torch.equal(out[base], out0[base]), "a base-model row of the expand output changed"
    end = inp.slice_offsets[-1]
    assert torch.equal(out[:, end:], out0[:, end:]), "columns outside every slice changed"
    _close(out, dense_expand(case, inp, out0), f"expand {case} vs float64")
    if backend != "torch":
        ref = out0.clone()
        ops.sgmv_expand(inp.y, inp.lora_b, inp.meta, ref, inp.slice_offsets, backend="torch")
        _close(out, ref, f"expand {case} vs reference")


def lora_slots(case: SGMVCase, inp: SGMVInputs, layout: Layout) -> LoRASlots:
    """The case's adapters as the model holds them: each slot's weights at its own rank."""
    slots = LoRASlots(case.hidden, case.widths, len(case.slot_ranks), case.max_rank,
                      inp.x.dtype, inp.x.device, layout)
    for s, rank in enumerate(case.slot_ranks):
        slots.set(s, [(a[s, :rank], b[s, :, :rank]) for a, b in
                      zip(inp.lora_a, inp.lora_b, strict=True)], float(inp.scales[s]))
    return slots


def check_add_lora(case: SGMVCase, dtype: torch.dtype, device: str,
                   backend: ops.Backend | None, layout: Layout | None = None,
                   segment_len: int = CASE_SEGMENT_LEN) -> None:
    """Shrink then expand through the public entry point, against float64, with the
    weights in ``layout`` (default: the one the backend reads), segments longer than
    ``segment_len`` taking the long path."""
    inp = make_sgmv_inputs(case, dtype, device, segment_len=segment_len)
    g = torch.Generator().manual_seed(2)
    # As in the model: the slices tile the whole output.
    width = inp.slice_offsets[-1]
    out0 = torch.randn(len(case.token_slots), width, generator=g).to(dtype).to(device)
    out = out0.clone()
    if layout is None:
        layout = "stacked" if backend == "triton" else default_layout(torch.device(device))
    ops.add_lora(out, inp.x, lora_slots(case, inp, layout), inp.scales, inp.meta,
                 backend=backend)
    expected = out0.double().cpu().clone()
    shrunk = dense_shrink(case, inp)
    for t, s in enumerate(case.token_slots):
        if s < 0:
            continue
        rank = case.slot_ranks[s]
        for k, b in enumerate(inp.lora_b):
            lo, hi = inp.slice_offsets[k], inp.slice_offsets[k + 1]
            expected[t, lo:hi] += b[s, :, :rank].double().cpu() @ shrunk[k, t, :rank]
    base = [t for t, s in enumerate(case.token_slots) if s < 0]
    assert torch.equal(out[base], out0[base]), "a base-model row changed"
    _close(out, expected, f"add_lora {case} vs float64")


def check_partial_targets(dtype: torch.dtype) -> None:
    """Adapters that target some slices of a packed projection only (q and v; k alone;
    all three), at odd ranks, so a slice's ranks start at an odd row of B (a bfloat16
    pair then spans two slices): the native kernel expands per slice, and the columns of
    a slice an adapter does not target must come out unchanged."""
    g = torch.Generator().manual_seed(5)
    hidden, widths = 70, (64, 24, 24)
    offsets = [0, 64, 88, 112]
    targets = [(0, 2), (1,), (0, 1, 2)]
    ranks = [3, 5, 7]
    slots = LoRASlots(hidden, widths, 3, 8, dtype, torch.device("cpu"), "per_slot")
    pairs_of = []
    for s, (chosen, rank) in enumerate(zip(targets, ranks, strict=True)):
        pairs = [((torch.randn(rank, hidden, generator=g) / hidden ** 0.5).to(dtype),
                  (torch.randn(w, rank, generator=g) / rank ** 0.5).to(dtype))
                 if k in chosen else None
                 for k, w in enumerate(widths)]
        pairs_of.append(pairs)
        slots.set(s, pairs, 0.5)
    token_slots = (0, 0, 0, 1, 1, 2, 2, 2, 2, 2)
    meta = SGMVMeta.build(token_slots, ranks)
    assert meta.short_segments is not None and not meta.long_segment_ids
    x = torch.randn(len(token_slots), hidden, generator=g).to(dtype)
    out0 = torch.randn(len(token_slots), offsets[-1], generator=g).to(dtype)
    out = out0.clone()
    ops.add_lora(out, x, slots, torch.ones(3), meta, backend="cpu")
    ref = out0.clone()
    ops.add_lora(ref, x, slots, torch.ones(3), meta, backend="torch")
    expected = out0.double().clone()
    for t, s in enumerate(token_slots):
        for k, pair in enumerate(pairs_of[s]):
            lo, hi = offsets[k], offsets[k + 1]
            if pair is None:
                assert torch.equal(out[t, lo:hi], out0[t, lo:hi]), "an untargeted slice changed"
                continue
            a, b = (w.double() for w in pair)
            expected[t, lo:hi] += 0.5 * (b @ (a @ x[t].double()))
    _close(out, expected, "partial targets vs float64")
    _close(out, ref, "partial targets vs reference")


# ---------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionCase:
    name: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_splits: int | None = None  # forced decode KV splits (Triton only)
    strided: bool = False  # query/out are column views of a wider buffer
    window: int = 0  # sliding window in keys (0: none)
    softcap: float = 0.0  # attention-logit soft-cap (0: none)
    q_scale: float = 1.0  # queries times this: large scores, which the soft-cap bends most

    def __str__(self) -> str:
        return self.name

    def first_key(self, b: int) -> int:
        """The earliest key sequence ``b``'s queries see (its first query's window start):
        the positions before it may have been overwritten, their blocks released."""
        if not self.window:
            return 0
        return max(0, self.seq_lens[b] - self.query_lens[b] - self.window + 1)


# Sliding windows and soft-capped scores (Gemma 2/3, Mistral): windows shorter than the
# sequences, not multiples of the block size, starting inside a block and crossing block
# boundaries, of one key, and longer than some sequences; decode rows beside prefill chunks
# after cached prefixes, GQA; each alone and both together. The positions before each
# sequence's earliest window start hold NaN and its table's blocks wholly before it name a
# NaN block, as after the engine released and reused them.
WINDOW_CASES: list[AttentionCase] = [
    AttentionCase("window21-decode-gqa", (1, 16, 17, 32, 63, 100), (1,) * 6, 8, 2, 32, 16,
                  window=21),
    AttentionCase("window13-prefill-prefix-mixed", (40, 33, 1, 16, 48, 70),
                  (7, 33, 1, 1, 16, 40), 4, 2, 32, 16, window=13),
    AttentionCase("window7-block5-gqa3-dim24", (9, 31, 64, 26, 53), (9, 1, 20, 1, 17), 6, 2,
                  24, 5, window=7),
    AttentionCase("window1-mixed", (12, 30, 45), (1, 12, 20), 4, 1, 16, 4, window=1),
    AttentionCase("window50-decode-split3", (1, 16, 30, 63, 200, 333), (1,) * 6, 8, 2, 32, 16,
                  num_splits=3, window=50),
    AttentionCase("softcap-mixed", (40, 33, 1, 16, 48, 70), (7, 33, 1, 1, 16, 40), 4, 2, 32,
                  16, softcap=2.5, q_scale=3.0),
    AttentionCase("softcap-decode-split2", (5, 90, 130), (1, 1, 1), 6, 3, 40, 8, num_splits=2,
                  softcap=1.5, q_scale=4.0),
    AttentionCase("window19-softcap-strided", (24, 9, 50, 77), (24, 1, 35, 1), 8, 2, 40, 8,
                  num_splits=2, strided=True, window=19, softcap=4.0, q_scale=2.0),
    AttentionCase("window40-softcap-mha-long", (130, 300, 97), (1, 70, 33), 3, 3, 64, 16,
                  window=40, softcap=3.0, q_scale=2.0),
]


ATTENTION_CASES: list[AttentionCase] = [
    # Lengths of 1, on block boundaries (16, 32) and just past them.
    AttentionCase("decode-gqa", (1, 16, 17, 32, 63, 100), (1,) * 6, 8, 2, 32, 16),
    AttentionCase("decode-gqa-split3", (1, 16, 17, 32, 63, 200), (1,) * 6, 8, 2, 32, 16,
                  num_splits=3),
    AttentionCase("decode-mha-split5-dim24", (5, 8, 64, 130), (1,) * 4, 2, 2, 24, 8,
                  num_splits=5),
    AttentionCase("prefill-prefix-mixed", (40, 33, 1, 16, 48, 70), (7, 33, 1, 1, 16, 40),
                  4, 2, 32, 16),
    AttentionCase("prefill-gqa4-dim40-strided", (24, 9, 50), (24, 1, 35), 8, 2, 40, 8,
                  num_splits=2, strided=True),
    *WINDOW_CASES,
]


# Decode batches with fewer sequences than threads, so the native kernels split each long
# enough sequence (8 blocks or more) over threads and merge the parts' softmax states:
# (threads, case). Lengths off block boundaries, group sizes 1 to 8 (the vector scores
# take query heads 4 at a time), head sizes the AVX-512 paths take (16 / 32 multiples)
# and ones they do not.
DECODE_SPLIT_CASES: list[tuple[int, AttentionCase]] = [
    (2, AttentionCase("demo-heads-1seq", (700,), (1,), 9, 3, 64, 16)),
    (2, AttentionCase("gqa8-dim32", (140,), (1,), 8, 1, 32, 16)),
    (3, AttentionCase("gqa4-dim128-2seqs", (129, 5), (1, 1), 8, 2, 128, 8)),
    (4, AttentionCase("mha-dim24-4parts", (257,), (1,), 2, 2, 24, 4)),
    (2, AttentionCase("gqa5-dim48", (130,), (1,), 10, 2, 48, 16)),
    (2, AttentionCase("gqa3-dim17-block3", (101,), (1,), 3, 1, 17, 3)),
    # sliding windows: the parts cover the window only, the first from its start inside a
    # block (399 = 24 x 16 + 15), so its part has a part block
    (2, AttentionCase("demo-heads-window301", (700,), (1,), 9, 3, 64, 16, window=301)),
    (3, AttentionCase("gqa4-dim128-window97-softcap", (229, 5), (1, 1), 8, 2, 128, 8,
                      window=97, softcap=3.0, q_scale=2.0)),
    (4, AttentionCase("mha-dim24-window130-4parts", (257,), (1,), 2, 2, 24, 4, window=130)),
]

@dataclass
class AttentionInputs:
    meta: AttentionMeta
    query: torch.Tensor  # [num_tokens, num_heads, head_dim], maybe a strided view
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim], logical order
    values: list[torch.Tensor]


def make_attention_inputs(case: AttentionCase, dtype: torch.dtype, device: str,
                          garbage: float, seed: int = 0) -> AttentionInputs:
    """Scatters logical K/V into shuffled blocks; every unowned cache row holds ``garbage``.
    With a window, the positions before each sequence's ``first_key`` hold NaN whatever
    ``garbage`` is (every implementation must leave them unread), and its blocks wholly
    before it are named in its table by a block of NaN, as a released block may be."""
    g = torch.Generator().manual_seed(seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [-(-s // bs) for s in case.seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    stale = perm.pop()  # the block a released block's table entry names
    tables: list[list[int]] = []
    for n in needed:
        tables.append(perm[:n])
        perm = perm[n:]
    k_cache = torch.full((num_blocks, bs, kvh, d), garbage)
    v_cache = torch.full((num_blocks, bs, kvh, d), garbage)
    keys, values = [], []
    for b, (table, seq_len) in enumerate(zip(tables, case.seq_lens, strict=True)):
        k = torch.randn(seq_len, kvh, d, generator=g)
        v = torch.randn(seq_len, kvh, d, generator=g)
        first = case.first_key(b)
        for p in range(seq_len):
            k_cache[table[p // bs], p % bs] = k[p] if p >= first else float("nan")
            v_cache[table[p // bs], p % bs] = v[p] if p >= first else float("nan")
        for j in range(first // bs):
            table[j] = stale
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    if case.window:
        k_cache[stale] = v_cache[stale] = float("nan")
    num_tokens = sum(case.query_lens)
    q = (torch.randn(num_tokens, case.num_heads, d, generator=g) * case.q_scale).to(dtype)
    if case.strided:
        wide = torch.zeros(num_tokens, case.num_heads, d + 8, dtype=dtype)
        wide[:, :, :d] = q
        q = wide.to(device)[:, :, :d]
    else:
        q = q.to(device)
    return AttentionInputs(
        meta=AttentionMeta.build(tables, case.seq_lens, case.query_lens, bs, device=device),
        query=q,
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        keys=keys,
        values=values,
    )


def dense_attention(case: AttentionCase, inp: AttentionInputs, scale: float) -> torch.Tensor:
    """float64 causal attention from the logical K/V, bottom-right aligned, from the
    definitions: query position p sees keys max(0, p - window + 1) .. p (a window of
    ``window`` keys, HuggingFace's ``kv_idx > q_idx - sliding_window``), a score s is
    softcap * tanh(s / softcap) with a soft-cap."""
    group = case.num_heads // case.num_kv_heads
    q_all = inp.query.double().cpu()
    out = torch.empty(q_all.shape, dtype=torch.float64)
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(case.seq_lens, case.query_lens, strict=True)):
        k = inp.keys[b].double().repeat_interleave(group, 1)  # [seq_len, heads, dim]
        v = inp.values[b].double().repeat_interleave(group, 1)
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = max(0, p - case.window + 1) if case.window else 0
            s = torch.einsum("hd,khd->hk", q_all[row], k[lo:p + 1]) * scale
            if case.softcap:
                s = torch.tanh(s / case.softcap) * case.softcap
            out[row] = torch.einsum("hk,khd->hd", s.softmax(-1), v[lo:p + 1])
            row += 1
    return out


def _new_out(case: AttentionCase, query: torch.Tensor) -> torch.Tensor:
    if not case.strided:
        return torch.full_like(query, float("nan"))
    wide = torch.full((*query.shape[:2], query.shape[2] + 8), float("nan"),
                      dtype=query.dtype, device=query.device)
    return wide[:, :, :query.shape[2]]


def check_attention(case: AttentionCase, dtype: torch.dtype, device: str,
                    backend: ops.Backend) -> None:
    scale = case.head_dim ** -0.5
    # The reference gathers whole blocks and masks, so it needs finite garbage; the Triton
    # and native CPU kernels must never load an unowned row, so NaN garbage proves it.
    # ("cpu" runs float16 on the reference.)
    exact_reads = backend == "triton" or (backend == "cpu"
                                          and dtype in (torch.float32, torch.bfloat16))
    inp = make_attention_inputs(case, dtype, device,
                                garbage=float("nan") if exact_reads else 30.0)
    out = _new_out(case, inp.query)
    if backend == "triton" and case.num_splits is not None:
        from loraplex_kernels.attention_triton import paged_attention_triton
        paged_attention_triton(inp.query, inp.k_cache, inp.v_cache, inp.meta, scale, out,
                               num_splits=case.num_splits, window=case.window,
                               softcap=case.softcap)
    else:
        ops.paged_attention(inp.query, inp.k_cache, inp.v_cache, inp.meta, scale, out,
                            backend=backend, window=case.window, softcap=case.softcap)
    _close(out, dense_attention(case, inp, scale), f"attention {case} vs float64")
    if backend != "torch":
        ref_inp = make_attention_inputs(case, dtype, device, garbage=30.0)
        ref = _new_out(case, ref_inp.query)
        ops.paged_attention(ref_inp.query, ref_inp.k_cache, ref_inp.v_cache, ref_inp.meta,
                            scale, ref, backend="torch", window=case.window,
                            softcap=case.softcap)
        _close(out, ref, f"attention {case} vs reference")


def check_store_kv(dtype: torch.dtype, device: str, backend: ops.Backend) -> None:
    """Writes at shuffled slots, some -1; key/value are strided views; nothing else changes."""
    g = torch.Generator().manual_seed(3)
    num_blocks, bs, kvh, d = 5, 8, 2, 24
    slots = torch.randperm(num_blocks * bs, generator=g)[:13].tolist()
    slots[2] = slots[7] = slots[12] = -1
    num_tokens = len(slots)
    # key and value are column views of one fused buffer, as after a qkv projection
    kv = torch.randn(num_tokens, 2 * kvh * d + 5, generator=g).to(dtype).to(device)
    key = kv[:, :kvh * d].view(num_tokens, kvh, d)
    value = kv[:, kvh * d:2 * kvh * d].view(num_tokens, kvh, d)
    k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    ops.store_kv(key, value, k_cache, v_cache, slot_mapping, backend=backend)
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        written[s] = True
        assert torch.equal(k_cache[s // bs, s % bs], key[t]), f"key of token {t} not stored"
        assert torch.equal(v_cache[s // bs, s % bs], value[t]), f"value of token {t} not stored"
    rest = ~written.to(device)
    assert bool(k_cache.view(-1, kvh, d)[rest].isnan().all()), "a skipped K slot was written"
    assert bool(v_cache.view(-1, kvh, d)[rest].isnan().all()), "a skipped V slot was written"
