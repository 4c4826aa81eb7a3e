"""The kernel cases again, compiled for CUDA, in the serving dtypes."""

from __future__ import annotations

import pytest
import torch
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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.bfloat16, torch.float16]
# Long contexts with few sequences, where the launcher picks a KV split by itself.
GPU_ATTENTION_CASES = [
    *ATTENTION_CASES,
    AttentionCase("decode-long-auto-split", (4096, 3001, 512), (1, 1, 1), 32, 8, 128, 16),
    AttentionCase("prefill-long-prefix", (1500, 700), (300, 1), 32, 8, 128, 16),
    # Gemma-like: a 1,000-key window (the decode splits cover it alone) and a cap of 50
    AttentionCase("decode-long-window-auto-split", (4096, 3001, 512), (1, 1, 1), 32, 8, 128,
                  16, window=1000),
    AttentionCase("prefill-long-window-softcap", (1500, 700), (300, 1), 32, 8, 128, 16,
                  window=333, softcap=50.0, q_scale=8.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_shrink_cuda(case: SGMVCase, dtype: torch.dtype) -> None:
    check_shrink(case, dtype, "cuda", "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_expand_cuda(case: SGMVCase, dtype: torch.dtype) -> None:
    check_expand(case, dtype, "cuda", "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SGMV_CASES, ids=str)
def test_add_lora_cuda(case: SGMVCase, dtype: torch.dtype) -> None:
    check_add_lora(case, dtype, "cuda", None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_cuda(dtype: torch.dtype) -> None:
    check_store_kv(dtype, "cuda", "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_ATTENTION_CASES, ids=str)
def test_attention_cuda(case: AttentionCase, dtype: torch.dtype) -> None:
    check_attention(case, dtype, "cuda", "triton")
