"""Native bfloat16 CPU kernels (``csrc/cpu_*_bf16.c``), every implementation this machine
runs (the AVX-512 BF16 one where the CPU has it, and the portable one, forced with
``LORAPLEX_CPU_BF16=portable``), against float64 and the PyTorch reference.

As for float32, unowned cache rows hold NaN and outputs start as NaN, so a kernel that
reads outside a sequence's blocks, or leaves an output unwritten, fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    ATTENTION_CASES,
    DECODE_SPLIT_CASES,
    PART_TILE_CASES,
    SGMV_CASES,
    AttentionCase,
    SGMVCase,
    check_add_lora,
    check_attention,
    check_partial_targets,
    lora_slots,
    make_attention_inputs,
    make_sgmv_inputs,
    torch_threads,
)

from loraplex_kernels import cpu_native, ops

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="no C compiler: the native CPU kernels are not built")

BF16 = torch.bfloat16
IMPLS = cpu_native.bf16_impls()


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each implementation in turn, as the dispatcher picks it (the environment switch)."""
    name: str = request.param
    monkeypatch.setenv("LORAPLEX_CPU_BF16", "portable" if name == "portable" else "auto")
    assert cpu_native.bf16_impl() == name
    return name


def _cpu_flags() -> list[str]:
    return cpu_native._cpu_signature().split()


def test_implementations_follow_the_cpu_flags() -> None:
    assert IMPLS[-1] == "portable"
    assert ("avx512_bf16" in IMPLS) == ("avx512_bf16" in _cpu_flags())


def test_bad_switch_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_BF16", "fast")
    with pytest.raises(ValueError, match="LORAPLEX_CPU_BF16 must be auto or portable"):
        cpu_native.bf16_impl()


def test_an_implementation_this_machine_lacks_is_refused() -> None:
    case = ATTENTION_CASES[0]
    inp = make_attention_inputs(case, BF16, "cpu", garbage=0.0)
    out = torch.empty_like(inp.query)
    with pytest.raises(ValueError, match="'sse2' is not available"):
        cpu_native.paged_decode_attention(inp.query, inp.k_cache, inp.v_cache, inp.meta,
                                          0.1, out, impl="sse2")


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention(case: AttentionCase, impl: str) -> None:
    check_attention(case, BF16, "cpu", "cpu")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    prefill=st.lists(st.integers(1, 12), min_size=0, max_size=2),
    kv_heads=st.sampled_from([1, 3]),
    group=st.sampled_from([1, 3, 4, 8]),
    head_dim=st.sampled_from([8, 17, 32, 64, 96]),
    block_size=st.sampled_from([1, 3, 16]),
)
def test_decode_random_batches(lens: list[int], prefill: list[int], kv_heads: int,
                               group: int, head_dim: int, block_size: int) -> None:
    """Odd lengths and block sizes (a V pass pairs positions: odd ones pair with zeros),
    head sizes the vector path does not take (not a multiple of 32), every implementation."""
    seq_lens = tuple(lens) + tuple(q + 5 for q in prefill)
    query_lens = (1,) * len(lens) + tuple(prefill)
    _check_every_impl(AttentionCase("random", seq_lens, query_lens, kv_heads * group,
                                     kv_heads, head_dim, block_size))


def _check_every_impl(case: AttentionCase) -> None:
    """check_attention with each implementation in turn (the environment switch)."""
    for name in IMPLS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LORAPLEX_CPU_BF16", "portable" if name == "portable" else "auto")
            check_attention(case, BF16, "cpu", "cpu")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    chunks=st.lists(st.tuples(st.integers(2, 40), st.integers(0, 60)), min_size=1,
                    max_size=3),
    kv_heads=st.sampled_from([1, 3]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([8, 17, 64]),
    block_size=st.sampled_from([1, 5, 16]),
)
def test_prefill_random_batches(chunks: list[tuple[int, int]], kv_heads: int, group: int,
                                head_dim: int, block_size: int) -> None:
    """Prefill chunks after cached prefixes, every implementation: odd key counts (the dot
    products take keys in pairs, the last one of an odd chunk beside a zero row), odd head
    sizes (which the dot-product path leaves to the portable one), NaN in every cache row
    a sequence does not own."""
    seq_lens = tuple(q + cached for q, cached in chunks)
    query_lens = tuple(q for q, _ in chunks)
    _check_every_impl(AttentionCase("random-prefill", seq_lens, query_lens, kv_heads * group,
                                     kv_heads, head_dim, block_size))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    chunks=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 80)), min_size=1,
                    max_size=4),
    window=st.integers(1, 60),
    softcap=st.sampled_from([0.0, 2.0]),
    kv_heads=st.sampled_from([1, 3]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([8, 17, 32, 64]),
    block_size=st.sampled_from([1, 3, 16]),
)
def test_window_softcap_random_batches(chunks: list[tuple[int, int]], window: int,
                                       softcap: float, kv_heads: int, group: int,
                                       head_dim: int, block_size: int) -> None:
    """Sliding windows starting anywhere in a block (a V pass pairs positions from the
    window's start) and soft-capped scores, decode rows and prefill chunks, every
    implementation, NaN before each sequence's earliest window start."""
    _check_every_impl(AttentionCase("random-window", tuple(q + c for q, c in chunks),
                                     tuple(q for q, _ in chunks), kv_heads * group,
                                     kv_heads, head_dim, block_size, window=window,
                                     softcap=softcap))


@pytest.mark.parametrize(("threads", "case"), DECODE_SPLIT_CASES, ids=str)
def test_decode_split_over_threads(threads: int, case: AttentionCase, impl: str) -> None:
    """Fewer sequences than threads: a sequence's parts run on different threads and their
    softmax states are merged."""
    with torch_threads(threads):
        check_attention(case, BF16, "cpu", "cpu")


AGREEMENT_CASES = [
    # decode: both round the same values to bf16, so they differ by fp32 summation order
    # only, far closer to each other than either is to float64
    (cpu_native.paged_decode_attention,
     replace(ATTENTION_CASES[0], name="long", seq_lens=(300, 7, 129), query_lens=(1, 1, 1),
             head_dim=64), 8e-3),
    # prefill: the AVX-512 BF16 path's scores are the portable path's products (bf16 times
    # bf16, exact in float32) summed in another order; its values weigh by the softmax
    # weights rounded to bf16, so it stays within a bf16 step or two
    (cpu_native.paged_prefill_attention,
     AttentionCase("long-prefill", (300, 77, 129), (300, 45, 64), 9, 3, 64, 16), 2e-2),
]


@pytest.mark.skipif(len(IMPLS) < 2, reason="one bfloat16 implementation on this CPU")
@pytest.mark.parametrize(("kernel", "case", "tol"), AGREEMENT_CASES, ids=["decode", "prefill"])
def test_implementations_agree_on_attention(kernel: Callable[..., None], case: AttentionCase,
                                            tol: float) -> None:
    inp = make_attention_inputs(case, BF16, "cpu", garbage=float("nan"))
    outs = []
    for name in IMPLS:
        out = torch.full_like(inp.query, float("nan"))
        kernel(inp.query, inp.k_cache, inp.v_cache, inp.meta, case.head_dim ** -0.5, out,
               impl=name)
        outs.append(out.double())
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=tol, rtol=tol)


def _sorted(case: SGMVCase) -> SGMVCase:
    return replace(case, name=case.name + "-sorted", token_slots=tuple(sorted(case.token_slots)))


@pytest.mark.parametrize("case", [_sorted(c) for c in SGMV_CASES], ids=str)
def test_add_lora(case: SGMVCase, impl: str) -> None:
    check_add_lora(case, BF16, "cpu", "cpu")


@pytest.mark.parametrize("case", PART_TILE_CASES, ids=str)
def test_add_lora_part_tiles(case: SGMVCase, impl: str) -> None:
    """Ranks padded only to 8 (16 where AMX takes bfloat16): every size of a last, part
    tile, half vectors included, in every implementation."""
    slots = lora_slots(case, make_sgmv_inputs(case, BF16, "cpu"), "per_slot")
    if cpu_native.lora_rank_multiple(BF16) == 8:
        assert any(int(r) % 16 == 8 for r in slots.ranks), "no slot pads to a half vector"
    check_add_lora(case, BF16, "cpu", "cpu")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    runs=st.lists(st.tuples(st.integers(-1, 3), st.integers(1, 45)), min_size=1, max_size=6),
    ranks=st.lists(st.sampled_from([1, 2, 8, 16, 33, 64]), min_size=4, max_size=4),
    hidden=st.integers(1, 80),
    widths=st.lists(st.integers(1, 150), min_size=1, max_size=3),
)
def test_add_lora_random_runs(runs: list[tuple[int, int]], ranks: list[int], hidden: int,
                              widths: list[int]) -> None:
    """Odd input sizes (the pair layout pads a zero row), outputs past and short of whole
    64-column tiles, short and long runs mixed with base-model tokens."""
    slots = sorted(s for s, n in runs for _ in range(n))
    case = SGMVCase("random", tuple(slots), tuple(ranks), hidden, tuple(widths))
    for name in IMPLS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LORAPLEX_CPU_BF16", "portable" if name == "portable" else "auto")
            check_add_lora(case, BF16, "cpu", "cpu")


def test_implementations_agree_on_lora() -> None:
    case = SGMVCase("decode", (0, 0, 1, 1, 1, 2, 3, 3), (8, 16, 33, 64), 576, (576, 192, 192))
    inp = make_sgmv_inputs(case, BF16, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    segments = ops.SGMVMeta.build(case.token_slots, case.slot_ranks).short_segments
    assert segments is not None
    out0 = torch.randn(len(case.token_slots), 960).to(BF16)
    outs = []
    for name in IMPLS:
        out = out0.clone()
        cpu_native.add_lora(out, inp.x, segments, slots, impl=name)
        outs.append(out.double())
    assert not torch.equal(outs[0], out0.double())
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("hidden", [70, 71])
def test_lora_reads_x_rows_at_their_stride(hidden: int, impl: str) -> None:
    """x and out as column slices of wider buffers, NaN outside them: the AVX-512 kernel
    reads x's rows in place at an even width (an odd one is copied and padded); the result
    is the contiguous one's bit for bit, and nothing outside the slices is read or
    written. Groups of 1-4 tokens and a 32-token item."""
    runs = [(0, 1), (1, 2), (2, 3), (3, 32), (0, 5)]
    slots_of = tuple(sorted(s for s, n in runs for _ in range(n)))
    case = SGMVCase("strided", slots_of, (8, 16, 32, 64), hidden, (64, 24, 24))
    inp = make_sgmv_inputs(case, BF16, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    segments = ops.SGMVMeta.build(case.token_slots, case.slot_ranks,
                                  short_segment_len=len(slots_of)).short_segments
    assert segments is not None
    n, width = len(slots_of), sum(case.widths)
    out0 = torch.randn(n, width, generator=torch.Generator().manual_seed(4)).to(BF16)
    plain = out0.clone()
    cpu_native.add_lora(plain, inp.x.contiguous(), segments, slots)
    x_wide = torch.full((n, hidden + 9), float("nan"), dtype=BF16)
    out_wide = torch.full((n, width + 5), float("nan"), dtype=BF16)
    x_wide[:, 3:3 + hidden] = inp.x
    out_wide[:, 2:2 + width] = out0
    with torch_threads(2):
        cpu_native.add_lora(out_wide[:, 2:2 + width], x_wide[:, 3:3 + hidden], segments, slots)
    assert torch.equal(out_wide[:, 2:2 + width], plain)
    assert out_wide[:, :2].isnan().all() and out_wide[:, 2 + width:].isnan().all()
    assert not torch.equal(plain, out0)


def test_add_lora_partial_targets(impl: str) -> None:
    check_partial_targets(BF16)


@pytest.mark.usefixtures("amx_restored")
@pytest.mark.parametrize("ranks", [(8, 64), (16, 40)], ids=["ranks-8-64", "ranks-16-40"])
def test_a_tokens_lora_does_not_depend_on_its_segment(ranks: tuple[int, int],
                                                      impl: str) -> None:
    """A prefill's long segment is shrunk 8 tokens at a time where the ranks are few, a
    decode step's tokens one to four at a time: each token's sums run in the same order
    either way, so its output is the same bit for bit as when it is a segment of its own.
    The vector kernels' property: with AMX on, a segment's blocks of 16 take tiles, whose
    order of additions is the hardware's (test_long_segments_on_amx_tiles)."""
    cpu_native.skinny_amx(False)
    runs = [0] * 21 + [1] * 13  # whole pairs of groups, a part group; both slots' ranks
    case = SGMVCase("segments", tuple(runs), ranks, 96, (96, 48, 80))
    inp = make_sgmv_inputs(case, BF16, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    whole = ops.SGMVMeta.build(case.token_slots, case.slot_ranks).short_segments
    assert whole is not None and whole.shape[1] == 2
    alone = torch.tensor([list(range(len(runs))), [1] * len(runs), runs], dtype=torch.int64)
    out0 = torch.randn(len(runs), 224).to(BF16)
    outs = []
    for segments in (whole, alone):
        out = out0.clone()
        cpu_native.add_lora(out, inp.x, segments, slots)
        outs.append(out)
    assert not torch.equal(outs[0], out0)
    assert torch.equal(outs[0], outs[1])


needs_amx = pytest.mark.skipif(not cpu_native.skinny_amx(),
                               reason="no AMX tiles here (AMX-BF16 absent or turned off)")


@needs_amx
@pytest.mark.usefixtures("amx_restored")
@pytest.mark.parametrize(("hidden", "widths"), [(96, (64, 24, 130)), (576, (576, 192, 192)),
                                                (80, (64, 64))],
                         ids=["tiles-tail-columns", "tiles-demo-qkv", "vectors-in-80"])
def test_long_segments_on_amx_tiles(hidden: int, widths: tuple[int, ...]) -> None:
    """Segments of 16 tokens or more take AMX tiles in whole blocks of 16 (the rest of a
    segment vectors): part blocks (17, 31, 33 tokens), one block, ranks 8-32 (one tile
    step of pairs in the expand) and 64 (more: vectors), output columns past whole
    64-column tiles, inputs not a multiple of 32 (vectors), against float64 like every
    implementation; against the vector kernel (AMX off) equal but for rare last bits."""
    runs = [(0, 17), (1, 16), (-1, 3), (2, 33), (3, 31), (1, 5)]
    slots = tuple(sorted(s for s, n in runs for _ in range(n)))
    case = SGMVCase("amx", slots, (8, 16, 32, 64), hidden, widths)
    check_add_lora(case, BF16, "cpu", "cpu")
    inp = make_sgmv_inputs(case, BF16, "cpu")
    weights = lora_slots(case, inp, "per_slot")
    segments = ops.SGMVMeta.build(case.token_slots, case.slot_ranks).short_segments
    assert segments is not None
    out0 = torch.randn(len(slots), sum(widths)).to(BF16)
    outs = []
    for amx in (True, False):
        cpu_native.skinny_amx(amx)
        out = out0.clone()
        cpu_native.add_lora(out, inp.x, segments, weights)
        outs.append(out)
    assert (outs[0] == outs[1]).double().mean().item() > 0.99
    if hidden == 576:  # long sums: the tiles' order of additions shows in some last bit
        assert not torch.equal(outs[0], outs[1])


@needs_amx
@pytest.mark.usefixtures("amx_restored")
def test_fused_gemm_and_lora_with_segments_on_amx_tiles() -> None:
    """A small prefill beside decode rows (under 64 rows: the skinny GEMM and the LoRA in
    one native call): the GEMM's tiles, then the LoRA's for the 16-token blocks, in one
    parallel region, as the two calls apart give, and against float64 like every LoRA."""
    runs = [(0, 21), (1, 2), (-1, 3), (2, 17), (3, 1)]
    slots_of = tuple(s for s, n in runs for _ in range(n))
    case = SGMVCase("mixed-step", slots_of, (8, 16, 32, 16), 64, (64, 32, 32))
    check_add_lora(case, BF16, "cpu", "cpu")
    inp = make_sgmv_inputs(case, BF16, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(128, 64, generator=g).to(BF16)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == "skinny"
    meta = ops.SGMVMeta.build(case.token_slots, case.slot_ranks)
    assert meta.short_segments is not None
    with torch_threads(2):
        apart = cpu_native.skinny_linear(inp.x, weight)
        cpu_native.add_lora(apart, inp.x, meta.short_segments, slots)
        fused = ops.linear_lora(inp.x, torch.empty(0), None, packed, slots, inp.scales, meta)
    assert torch.equal(fused, apart)
    cpu_native.skinny_amx(False)
    vectors = cpu_native.skinny_linear(inp.x, weight)
    cpu_native.add_lora(vectors, inp.x, meta.short_segments, slots)
    assert (fused == vectors).double().mean().item() > 0.99
