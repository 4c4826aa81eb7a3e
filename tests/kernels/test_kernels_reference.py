"""PyTorch references against float64, the dispatch point, and the launchers' checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    ATTENTION_CASES,
    SGMV_CASES,
    AttentionCase,
    SGMVCase,
    SGMVInputs,
    check_add_lora,
    check_attention,
    check_expand,
    check_shrink,
    check_store_kv,
    make_attention_inputs,
    make_sgmv_inputs,
)

from loraplex_kernels import ops
from loraplex_kernels.lora_slots import Layout
from loraplex_kernels.meta import SGMVMeta

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_shrink_reference(case: SGMVCase, dtype: torch.dtype) -> None:
    check_shrink(case, dtype, "cpu", "torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_expand_reference(case: SGMVCase, dtype: torch.dtype) -> None:
    check_expand(case, dtype, "cpu", "torch")


@pytest.mark.parametrize("layout", ["per_slot", "stacked"])
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_add_lora_reference(case: SGMVCase, layout: Layout) -> None:
    check_add_lora(case, torch.float32, "cpu", "torch", layout)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    slots=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
    ranks=st.lists(st.sampled_from([1, 2, 8, 16, 33, 64]), min_size=4, max_size=4),
    hidden=st.integers(1, 80),
    widths=st.lists(st.integers(1, 70), min_size=1, max_size=3),
)
def test_sgmv_reference_random_batches(slots: list[int], ranks: list[int], hidden: int,
                                       widths: list[int]) -> None:
    case = SGMVCase("random", tuple(slots), tuple(ranks), hidden, tuple(widths))
    check_shrink(case, torch.float32, "cpu", "torch")
    check_expand(case, torch.float32, "cpu", "torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_reference(dtype: torch.dtype) -> None:
    check_store_kv(dtype, "cpu", "torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention_reference(case: AttentionCase, dtype: torch.dtype) -> None:
    check_attention(case, dtype, "cpu", "torch")


def test_dispatch_picks_triton_on_cuda_only() -> None:
    assert ops.resolve_backend(torch.device("cpu")) in ("torch", "cpu")
    assert ops.resolve_backend(torch.device("cuda", 0)) == "triton"
    assert ops.resolve_backend(torch.device("cpu"), "triton") == "triton"
    assert ops.resolve_backend(torch.device("cuda"), "torch") == "torch"


# The launchers check their inputs before any kernel is defined for a device, so these run
# in-process without the interpreter.


def _sgmv() -> tuple[SGMVCase, SGMVInputs]:
    case = SGMV_CASES[2]
    return case, make_sgmv_inputs(case, torch.float32, "cpu")


def test_shrink_launcher_rejects_bad_inputs() -> None:
    from loraplex_kernels.sgmv_triton import sgmv_shrink_triton

    case, inp = _sgmv()
    n = len(case.token_slots)
    out = torch.zeros(len(case.widths), n, case.max_rank)
    with pytest.raises(AssertionError, match="out must be"):
        sgmv_shrink_triton(inp.x, inp.lora_a, inp.scales, inp.meta, out[:, :, :8])
    with pytest.raises(AssertionError, match="differs from x dtype"):
        sgmv_shrink_triton(inp.x.half(), inp.lora_a, inp.scales, inp.meta, out)
    with pytest.raises(AssertionError, match="meta built for"):
        sgmv_shrink_triton(inp.x[:-1], inp.lora_a, inp.scales, inp.meta, out[:, :-1])
    with pytest.raises(AssertionError, match="innermost dimension must be contiguous"):
        sgmv_shrink_triton(inp.x, [a.transpose(1, 2).contiguous().transpose(1, 2)
                                   for a in inp.lora_a], inp.scales, inp.meta, out)
    with pytest.raises(AssertionError, match="slices supported"):
        sgmv_shrink_triton(inp.x, inp.lora_a * 2, inp.scales, inp.meta, out)


def test_expand_launcher_rejects_bad_inputs() -> None:
    from loraplex_kernels.sgmv_triton import sgmv_expand_triton

    case, inp = _sgmv()
    out = torch.zeros(len(case.token_slots), inp.out_width)
    with pytest.raises(AssertionError, match="slice_offsets span"):
        sgmv_expand_triton(inp.y, inp.lora_b, inp.meta, out, [0, 10, 20, 30])
    with pytest.raises(AssertionError, match="slice_offsets needs"):
        sgmv_expand_triton(inp.y, inp.lora_b, inp.meta, out, inp.slice_offsets[:-1])
    with pytest.raises(AssertionError, match="exceed out width"):
        sgmv_expand_triton(inp.y, inp.lora_b, inp.meta, out[:, :10], inp.slice_offsets)
    with pytest.raises(AssertionError, match="!= y dtype"):
        sgmv_expand_triton(inp.y.half(), inp.lora_b, inp.meta, out, inp.slice_offsets)


def test_sgmv_launchers_reject_rank_above_storage() -> None:
    from loraplex_kernels.sgmv_triton import sgmv_shrink_triton

    case, inp = _sgmv()
    meta = SGMVMeta.build(case.token_slots, (1, 8, 16, 65))
    out = torch.zeros(len(case.widths), len(case.token_slots), case.max_rank)
    with pytest.raises(AssertionError, match="stored max rank"):
        sgmv_shrink_triton(inp.x, inp.lora_a, inp.scales, meta, out)


def test_attention_launchers_reject_bad_inputs() -> None:
    from loraplex_kernels.attention_triton import paged_attention_triton, store_kv_triton

    case = ATTENTION_CASES[3]
    inp = make_attention_inputs(case, torch.float32, "cpu", garbage=0.0)
    out = torch.empty_like(inp.query)
    scale = case.head_dim ** -0.5
    with pytest.raises(AssertionError, match="out dtype"):
        paged_attention_triton(inp.query, inp.k_cache, inp.v_cache, inp.meta, scale,
                               out.half())
    with pytest.raises(AssertionError, match="cache dtype"):
        paged_attention_triton(inp.query, inp.k_cache.int(), inp.v_cache.int(), inp.meta,
                               scale, out)
    with pytest.raises(AssertionError, match="not a multiple of num_kv_heads"):
        paged_attention_triton(inp.query[:, :3], inp.k_cache, inp.v_cache, inp.meta, scale,
                               out[:, :3])
    with pytest.raises(AssertionError, match="meta covers"):
        paged_attention_triton(inp.query[:-1], inp.k_cache, inp.v_cache, inp.meta, scale,
                               out[:-1])
    with pytest.raises(AssertionError, match="block size"):
        paged_attention_triton(inp.query, inp.k_cache.view(-1, 8, *inp.k_cache.shape[2:]),
                               inp.v_cache.view(-1, 8, *inp.v_cache.shape[2:]), inp.meta,
                               scale, out)
    key = torch.zeros(3, case.num_kv_heads, case.head_dim)
    with pytest.raises(AssertionError, match="slot_mapping must be int64"):
        store_kv_triton(key, key, inp.k_cache, inp.v_cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(AssertionError, match="dtypes differ"):
        store_kv_triton(key.half(), key.half(), inp.k_cache, inp.v_cache,
                        torch.zeros(3, dtype=torch.int64))
