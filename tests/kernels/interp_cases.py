"""Triton kernels under the CPU interpreter, against the reference and float64.

Not collected by the main pytest run (the file name does not match ``test_*.py``): the
interpreter must be switched on before Triton compiles anything, so
``test_kernels_interpreter.py`` runs this file in a subprocess with ``TRITON_INTERPRET=1``.
bf16 is left out: the interpreter's bf16 arithmetic is not faithful.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    ATTENTION_CASES,
    SGMV_CASES,
    AttentionCase,
    SGMVCase,
    check_add_lora,
    check_attention,
    check_expand,
    check_shrink,
    check_store_kv,
)

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_kernels_interpreter.py (needs TRITON_INTERPRET=1)",
                allow_module_level=True)

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_shrink(case: SGMVCase, dtype: torch.dtype) -> None:
    check_shrink(case, dtype, "cpu", "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_expand(case: SGMVCase, dtype: torch.dtype) -> None:
    check_expand(case, dtype, "cpu", "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_add_lora(dtype: torch.dtype) -> None:
    check_add_lora(SGMV_CASES[2], dtype, "cpu", "triton")


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    slots=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
    ranks=st.lists(st.sampled_from([1, 2, 8, 16, 33, 64]), min_size=4, max_size=4),
    hidden=st.integers(1, 80),
    widths=st.lists(st.integers(1, 70), min_size=1, max_size=3),
)
def test_sgmv_random_batches(slots: list[int], ranks: list[int], hidden: int,
                                      widths: list[int]) -> None:
    case = SGMVCase("random", tuple(slots), tuple(ranks), hidden, tuple(widths))
    check_shrink(case, torch.float32, "cpu", "triton")
    check_expand(case, torch.float32, "cpu", "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv(dtype: torch.dtype) -> None:
    check_store_kv(dtype, "cpu", "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention(case: AttentionCase, dtype: torch.dtype) -> None:
    check_attention(case, dtype, "cpu", "triton")
