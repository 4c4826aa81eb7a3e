"""The base projections' GEMM: MKL's packed weights for small batches, plain above."""

from __future__ import annotations

import pytest
import torch

from loraplex_kernels import ops

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="no MKL")


@needs_mkl
@pytest.mark.parametrize("rows", [1, 7, 128, 129, 300])
def test_packed_linear_matches_plain(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(320, 272, generator=g)  # 87,040 elements: packed
    bias = torch.randn(320, generator=g)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None
    x = torch.randn(rows, 272, generator=g)
    expected = x.double() @ weight.double().T + bias.double()
    got = ops.linear(x, weight, bias, packed)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-6, atol=1e-5)


def test_packing_only_where_it_pays() -> None:
    assert ops.pack_linear_weight(torch.randn(64, 64)) is None  # too small to gain
    assert ops.pack_linear_weight(torch.randn(512, 512, dtype=torch.float16)) is None
    x, w = torch.randn(3, 64), torch.randn(64, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
