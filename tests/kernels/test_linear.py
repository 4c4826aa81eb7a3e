"""The base projections' GEMM through packed weights (oneDNN, or MKL's for small batches),
against float64 and the plain ``F.linear``."""

from __future__ import annotations

import pytest
import torch

from loraplex_kernels import ops

KINDS = {
    "onednn": torch.backends.mkldnn.is_available(),
    "mkl": torch.backends.mkl.is_available(),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("rows", [1, 7, 128, 129, 300])
def test_packed_linear_matches_plain(kind: str, rows: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if not KINDS[kind]:
        pytest.skip(f"torch built without {kind}")
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", kind)
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(320, 272, generator=g)  # 87,040 elements: packed
    bias = torch.randn(320, generator=g)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == kind
    # A strided input (every other column) as well as a contiguous one.
    for x in (torch.randn(rows, 272, generator=g),
              torch.randn(rows, 544, generator=g)[:, ::2]):
        expected = x.double() @ weight.double().T + bias.double()
        got = ops.linear(x, weight, bias, packed)
        assert got.shape == (rows, 320) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ops.linear(x, weight, None, packed).double(),
                                   expected - bias.double(), rtol=1e-5, atol=1e-4)


def test_packing_only_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ops.pack_linear_weight(torch.randn(64, 64)) is None  # too small to gain
    assert ops.pack_linear_weight(torch.randn(512, 512, dtype=torch.float16)) is None
    x, w = torch.randn(3, 64), torch.randn(64, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "plain")
    assert ops.pack_linear_weight(torch.randn(512, 512)) is None
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="LORAPLEX_CPU_GEMM must be onednn, mkl or plain"):
        ops.pack_linear_weight(torch.randn(512, 512))
