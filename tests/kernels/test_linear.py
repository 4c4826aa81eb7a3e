"""The base projections' GEMM through packed weights (oneDNN, or MKL's for small batches),
against float64 and the plain ``F.linear``."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from loraplex.model.lora import LoRALinear
from loraplex_kernels import cpu_native, ops

KINDS = {
    "onednn": torch.backends.mkldnn.is_available(),
    "mkl": torch.backends.mkl.is_available(),
    "skinny": torch.backends.mkldnn.is_available() and cpu_native.can_skinny(torch.float32),
}
needs_skinny_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and cpu_native.can_skinny(torch.bfloat16)),
    reason="the skinny GEMM does not run bfloat16 here (neither AVX512_BF16 nor AVX2)")


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("rows", [1, 7, 128, 129, 300, 600])
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


@pytest.mark.skipif(not KINDS["onednn"], reason="torch built without onednn")
def test_onednn_packed_weight_is_all_linear_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn")  # the default where AVX-512 is absent
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(320, 272, generator=g)
    bias = torch.randn(320, generator=g)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == "onednn"
    x = torch.randn(2, 3, 272, generator=g)  # any leading dims
    expected = x.double() @ weight.double().T + bias.double()
    got = ops.linear(x, torch.empty(0), bias, packed)  # the plain weight released
    assert got.shape == (2, 3, 320)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_lora_linear_releases_the_plain_weight_once_packed() -> None:
    """The base projection computes the same after packing, holding only the packed copy
    (oneDNN) or both (MKL, whose GEMM reads the plain weight too)."""
    layer = LoRALinear(272, [192, 128], bias=True, num_slots=1, max_rank=8,
                       dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(6)
    layer.weight.copy_(torch.randn(320, 272, generator=g))
    assert layer.bias is not None
    layer.bias.copy_(torch.randn(320, generator=g))
    x = torch.randn(9, 272, generator=g)
    expected = x.double() @ layer.weight.double().T + layer.bias.double()
    layer.pack_weight()
    assert layer.packed_weight is not None
    assert layer.weight.numel() == (0 if layer.packed_weight.kind == "onednn" else 320 * 272)
    layer.pack_weight()  # a no-op the second time
    torch.testing.assert_close(layer(x, None).double(), expected, rtol=1e-5, atol=1e-4)


def test_packing_only_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    # a copy (the skinny GEMM, the default with AVX-512, reads any weight in place)
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn")
    assert ops.pack_linear_weight(torch.randn(64, 64)) is None  # too small to gain
    assert ops.pack_linear_weight(torch.randn(512, 512, dtype=torch.float16)) is None
    x, w = torch.randn(3, 64), torch.randn(64, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "plain")
    assert ops.pack_linear_weight(torch.randn(512, 512)) is None
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="LORAPLEX_CPU_GEMM must be one of auto, onednn, onednn-mkl, "):
        ops.pack_linear_weight(torch.randn(512, 512))


@pytest.mark.skipif(not KINDS["onednn"], reason="torch built without oneDNN")
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_bfloat16_weights_are_packed_by_onednn(rows: int, shared: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 x bf16 with float32 sums: within bf16 rounding of the output of float64. A
    shared (tied LM head) bf16 weight gets a packed copy too: the plain one is not read."""
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(320, 272, generator=g).bfloat16()
    bias = torch.randn(320, generator=g).bfloat16()
    x = torch.randn(rows, 272, generator=g).bfloat16()
    packed = ops.pack_linear_weight(weight, shared=shared)
    # bf16 natively where oneDNN can; as float32 on CPUs without bf16 GEMMs (AVX2)
    assert packed is not None and packed.kind == "onednn" and packed.data is not weight
    assert packed.widen == (not ops.onednn_bf16_gemm())
    plain = weight.clone()
    weight.zero_()
    got = ops.linear(x, torch.empty(0), bias, packed)
    weight.copy_(plain)
    assert got.dtype == torch.bfloat16
    expected = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=5e-2)
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "mkl")  # MKL packs float32 only
    assert ops.pack_linear_weight(weight) is None


@pytest.mark.skipif(not KINDS["onednn"], reason="torch built without oneDNN")
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_bfloat16_weights_through_the_float32_gemm(rows: int, shared: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback for CPUs without bf16 GEMMs, on any CPU: a float32 packed copy of the
    bf16 weight (also of a shared one, whose plain bf16 layout that GEMM cannot read), the
    output rounded back to bf16: the float64 product of the same bf16 values, rounded once."""
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn-f32")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(320, 272, generator=g).bfloat16()
    bias = torch.randn(320, generator=g).bfloat16()
    x = torch.randn(rows, 272, generator=g).bfloat16()
    packed = ops.pack_linear_weight(weight, shared=shared)
    assert packed is not None and packed.kind == "onednn" and packed.widen
    expected = x.double() @ weight.double().T + bias.double()
    weight.zero_()  # a copy: the plain weight is not read, shared or not
    got = ops.linear(x, torch.empty(0), bias, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 320)
    # float32 sums of exact products: off from float64 by far less than bf16's half ulp,
    # so the result is float64's rounded to bf16 but for rare ties
    torch.testing.assert_close(got.double(), expected.bfloat16().double(), rtol=8e-3,
                               atol=1e-5)
    close = (got.double() == expected.bfloat16().double()).double().mean().item()
    assert close > 0.99
    fp32 = ops.pack_linear_weight(weight.float())  # float32 weights are not widened
    assert fp32 is not None and fp32.kind == "onednn" and not fp32.widen


@pytest.mark.skipif(not KINDS["onednn"], reason="torch built without oneDNN")
def test_large_batches_take_the_kept_plain_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """"onednn-mkl" (for CPUs without AVX-512): batches of 512 rows or more multiply the
    kept plain weight through F.linear, smaller ones oneDNN's packed copy; a tied head
    gets a packed copy of its own. Doubling the plain weight after packing shows which
    one each batch read."""
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn-mkl")
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(320, 272, generator=g)
    bias = torch.randn(320, generator=g)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == "onednn" and packed.large is weight
    for rows in (1, 511, 512, 700):
        x = torch.randn(rows, 272, generator=g)
        expected = x.double() @ weight.double().T + bias.double()
        torch.testing.assert_close(ops.linear(x, torch.empty(0), bias, packed).double(),
                                   expected, rtol=1e-5, atol=1e-4)
    weight.mul_(2.0)
    for rows, factor in ((511, 1.0), (512, 2.0)):
        x = torch.randn(rows, 272, generator=g)
        expected = factor * (x.double() @ weight.double().T / 2.0) + bias.double()
        torch.testing.assert_close(ops.linear(x, torch.empty(0), bias, packed).double(),
                                   expected, rtol=1e-5, atol=1e-4)
    tied = ops.pack_linear_weight(weight, shared=True)
    assert tied is not None and tied.large is None
    x = torch.randn(3, 272, generator=g)
    expected = x.double() @ weight.double().T
    weight.zero_()  # a copy: the tied weight itself is not read
    torch.testing.assert_close(ops.linear(x, torch.empty(0), None, tied).double(), expected,
                               rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn")  # the least memory: nothing kept
    plain = ops.pack_linear_weight(torch.randn(320, 272, generator=g))
    assert plain is not None and plain.large is None
    w = torch.randn(320, 272, generator=g)
    shared = ops.pack_linear_weight(w, shared=True)
    assert shared is not None and shared.data is w  # read in place


def _rounded_product(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """float64's ``x @ weight.T + bias`` rounded to x's dtype: what float32 sums of the
    (exact) products give but for rare ties and float32's own last bits."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)


def _check_skinny(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> None:
    expected = _rounded_product(x, weight, bias)
    assert got.dtype == x.dtype and got.shape == expected.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        return
    torch.testing.assert_close(got.double(), expected.double(), rtol=8e-3, atol=1e-5)
    assert (got == expected).double().mean().item() > 0.99


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.float32, marks=pytest.mark.skipif(
        not KINDS["skinny"], reason="no skinny GEMM here (neither AVX-512 nor AVX2 with FMA)")),
    pytest.param(torch.bfloat16, marks=needs_skinny_bf16)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 21, 29, 64, 65, 300])
def test_skinny_gemm_reads_the_plain_weight(dtype: torch.dtype, rows: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``LORAPLEX_CPU_GEMM=skinny``: no copy; batches of up to 64 rows (256 in bf16 on AMX
    tiles) through the native skinny GEMM, more through oneDNN on the same plain weight (a bf16 weight on a CPU
    without bf16 GEMMs: on a float32 packed copy). 331 output columns (not a multiple of
    its 4-row groups), 272 inputs (not of its 32-value bf16 vectors), a strided input;
    scaling the weight after packing shows that the paths without a copy read it."""
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "skinny")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(331, 272, generator=g).to(dtype)
    bias = torch.randn(331, generator=g).to(dtype)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == "skinny" and packed.data is weight
    assert packed.widen == (dtype == torch.bfloat16 and not ops.onednn_bf16_gemm())
    for x in (torch.randn(rows, 272, generator=g).to(dtype),
              torch.randn(rows, 544, generator=g).to(dtype)[:, ::2]):
        _check_skinny(ops.linear(x, torch.empty(0), bias, packed), x, weight, bias)
        _check_skinny(ops.linear(x, torch.empty(0), None, packed), x, weight, None)
    if packed.widen and rows > ops.SKINNY_MAX_ROWS // 2:
        return  # the flattened batch below would read the copy
    weight.mul_(2.0)  # exact in either dtype
    x = torch.randn(2, rows, 272, generator=g).to(dtype)  # leading dims are flattened
    got = ops.linear(x, torch.empty(0), bias, packed)
    assert got.shape == (2, rows, 331)
    _check_skinny(got.reshape(-1, 331), x.reshape(-1, 272), weight, bias)


@needs_skinny_bf16
@pytest.mark.parametrize("shared", [False, True])
def test_bfloat16_weights_default_to_the_skinny_gemm(shared: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ("auto") where the skinny GEMM runs bf16: bf16 weights, a tied head's
    too, stay plain and in place for the skinny GEMM, and so do float32 ones. With
    AVX512_BF16, forcing the portable bf16 kernels (a CPU without the instructions) gives
    oneDNN's packed copy in bf16; on AVX2 (no bf16 GEMMs) the skinny GEMM widens bf16
    whatever the other kernels run, and batches past its rows read a float32 copy."""
    monkeypatch.delenv("LORAPLEX_CPU_GEMM", raising=False)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(320, 272, generator=g).bfloat16()
    packed = ops.pack_linear_weight(weight, shared=shared)
    assert packed is not None and packed.kind == "skinny" and packed.data is weight
    fp32_weight = torch.randn(320, 272, generator=g)
    fp32 = ops.pack_linear_weight(fp32_weight)
    assert fp32 is not None and fp32.kind == "skinny" and fp32.data is fp32_weight
    layer = LoRALinear(272, [320], bias=False, num_slots=1, max_rank=8,
                       dtype=torch.bfloat16, device=torch.device("cpu"))
    layer.weight.copy_(weight)
    layer.pack_weight()  # the plain weight is what it reads: kept
    assert layer.packed_weight is not None and layer.packed_weight.kind == "skinny"
    assert layer.weight.numel() == 320 * 272
    x = torch.randn(3, 272, generator=g).bfloat16()
    _check_skinny(layer(x, None), x, weight, None)
    assert packed.widen == (not ops.onednn_bf16_gemm())
    assert (packed.large is not None and packed.large.dtype == torch.float32) == packed.widen
    monkeypatch.setenv("LORAPLEX_CPU_BF16", "portable")
    portable = ops.pack_linear_weight(weight, shared=shared)
    assert portable is not None
    assert portable.kind == ("skinny" if packed.widen else "onednn")


@pytest.mark.skipif(not KINDS["skinny"], reason="no skinny GEMM here (neither AVX-512 nor AVX2 with FMA)")
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 70), n=st.integers(1, 70), k=st.integers(0, 100),
       bf16=st.booleans(), with_bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
@example(rows=0, n=5, k=7, bf16=False, with_bias=True, seed=0)  # a step sampling nothing
@example(rows=0, n=5, k=7, bf16=True, with_bias=False, seed=0)
@example(rows=3, n=5, k=0, bf16=False, with_bias=True, seed=0)
def test_skinny_gemm_random_shapes(rows: int, n: int, k: int, bf16: bool, with_bias: bool,
                                   seed: int) -> None:
    """Any shape: partial groups of output columns, partial chunks of rows, inputs shorter
    than one vector or ending in a partial one, no rows at all (an LM head over a step
    that samples nothing: it once divided by zero) and empty inputs."""
    dtype = torch.bfloat16 if bf16 and cpu_native.can_skinny(torch.bfloat16) else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got = cpu_native.skinny_linear(x, weight, bias)
    expected = _rounded_product(x, weight, bias)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(got.double(), expected.double(), **tol)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [
    (1, 331, 272), (2, 9, 17), (3, 5, 7), (7, 64, 100), (13, 4, 8), (64, 70, 33),
    (0, 5, 7), (3, 5, 0), (7, 5, 0)])
def test_skinny_gemm_avx2_kernels(avx2_library: ctypes.CDLL, dtype: torch.dtype, rows: int,
                                  n: int, k: int) -> None:
    """The AVX2 build's skinny GEMM: float32, and bfloat16 widened as it is read (no
    AVX-512 BF16 dot products: `loraplex_skinny_impls` says so), against float64 rounded
    to the dtype; odd widths (a partial last vector of 8), partial groups of outputs, odd
    row counts, no rows, empty inputs, a bias."""
    assert avx2_library.loraplex_skinny_impls() == 1 | 4  # float32, bf16 widened
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = torch.randn(n, k, generator=g).to(dtype)
    for bias in (None, torch.randn(n, generator=g).to(dtype)):
        out = torch.full((rows, n), float("nan"), dtype=dtype)
        fn = (avx2_library.skinny_linear_f32 if dtype == torch.float32
              else avx2_library.skinny_linear_bf16)
        status = fn(x.data_ptr(), x.stride(0) if rows else k, weight.data_ptr(),
                    None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k, 2)
        assert status == 0
        if rows:
            _check_skinny(out, x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_gemm_avx2_rows_in_lanes(avx2_library: ctypes.CDLL, dtype: torch.dtype) -> None:
    """The AVX2 build from 16 rows (float32) or 8 (bfloat16): x transposed so that rows
    lie in vector lanes, passes of up to 3 vectors of rows (24), a last part vector of 5-7
    rows, 1-4 rows past whole vectors through the dot-product groups. Every row count up
    to the skinny GEMM's 64, outputs not a multiple of the 12 a group takes, inputs not of
    8, a row stride wider than the row, with and without a bias."""
    g = torch.Generator().manual_seed(7)
    n, k = 29, 37
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    fn = avx2_library.skinny_linear_f32 if dtype == torch.float32 \
        else avx2_library.skinny_linear_bf16
    for rows in range(1, ops.SKINNY_MAX_ROWS + 1):
        x = torch.randn(rows, k + 3, generator=g).to(dtype)[:, :k]  # row stride k + 3
        for b in (None, bias):
            out = torch.full((rows, n), float("nan"), dtype=dtype)
            assert fn(x.data_ptr(), x.stride(0), weight.data_ptr(),
                      None if b is None else b.data_ptr(), out.data_ptr(), n, rows, n, k,
                      2) == 0
            _check_skinny(out, x, weight, b)


needs_amx = pytest.mark.skipif(
    not (cpu_native.can_skinny(torch.bfloat16) and cpu_native.skinny_amx()),
    reason="the bfloat16 skinny GEMM does not run on AMX tiles here (no AMX-BF16)")


@needs_amx
@pytest.mark.usefixtures("amx_restored")
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 48, 64, 65, 130])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 64), (70, 96), (331, 576), (1000, 64)])
def test_skinny_gemm_on_amx_tiles(rows: int, n: int, k: int) -> None:
    """The bf16 skinny GEMM on AMX tiles against float64 rounded to bf16, and against the
    AVX-512 BF16 kernel (the same float32 sums in another order: equal but for rare last
    bits): one to nine blocks of 16 rows of x (every tile arrangement: 4 weight blocks per
    block of x; 2 x 2, two weight blocks against two blocks of x, with one of either at
    the edges: an odd number of blocks of x, of weight rows), weight rows past the last
    whole 16 (the AVX-512 kernel's), a bias and none, a strided input."""
    g = torch.Generator().manual_seed(rows * 7919 + n + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    for x in (torch.randn(rows, k, generator=g).bfloat16(),
              torch.randn(rows, 2 * k + 2, generator=g).bfloat16()[:, 2:k + 2]):
        for b in (bias, None):
            assert cpu_native.skinny_amx(True)
            tiles = cpu_native.skinny_linear(x, weight, b)
            _check_skinny(tiles, x, weight, b)
            assert not cpu_native.skinny_amx(False)
            vectors = cpu_native.skinny_linear(x, weight, b)
            assert (tiles == vectors).double().mean().item() > 0.99


@needs_amx
@pytest.mark.usefixtures("amx_restored")
def test_skinny_gemm_takes_vectors_where_tiles_do_not_fit() -> None:
    """k not a multiple of 32, fewer than 16 weight rows, an odd row stride (pairs not
    32-bit aligned), no rows: the AVX-512 BF16 kernel, bit for bit, with AMX on."""
    g = torch.Generator().manual_seed(5)
    cases = [(torch.randn(9, 48, generator=g), torch.randn(40, 48, generator=g)),
             (torch.randn(9, 64, generator=g), torch.randn(15, 64, generator=g)),
             (torch.randn(9, 65, generator=g)[:, 1:], torch.randn(40, 64, generator=g)),
             (torch.randn(0, 64, generator=g), torch.randn(40, 64, generator=g))]
    for x, w in cases:
        x, w = x.bfloat16(), w.bfloat16()
        cpu_native.skinny_amx(True)
        tiles = cpu_native.skinny_linear(x, w)
        cpu_native.skinny_amx(False)
        assert torch.equal(tiles, cpu_native.skinny_linear(x, w))
        if x.shape[0]:
            _check_skinny(tiles, x, w, None)


@needs_amx
@pytest.mark.usefixtures("amx_restored")
@pytest.mark.parametrize("rows", [65, 200, 512, 513])
def test_bfloat16_batches_take_the_amx_tiles_up_to_their_rows(
        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX on, ``linear`` sends a bf16 batch of up to ``SKINNY_AMX_MAX_ROWS`` rows
    through the skinny GEMM (its tiles lead oneDNN on the plain layout there), a larger one
    to oneDNN; with AMX off, past ``SKINNY_MAX_ROWS`` to oneDNN. Told apart by their
    outputs: the same float32 sums added in other orders differ in some last bits."""
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "skinny")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(331, 576, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == "skinny"
    onednn = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    for amx in (True, False):
        assert cpu_native.skinny_amx(amx) == amx == cpu_native.amx_on()
        skinny = cpu_native.skinny_linear(x, weight)
        assert not torch.equal(skinny, onednn)
        takes_skinny = rows <= (ops.SKINNY_AMX_MAX_ROWS if amx else ops.SKINNY_MAX_ROWS)
        assert (rows <= ops.skinny_max_rows(torch.bfloat16)) == takes_skinny
        got = ops.linear(x, torch.empty(0), None, packed)
        assert torch.equal(got, skinny if takes_skinny else onednn), amx
    assert ops.skinny_max_rows(torch.float32) == ops.SKINNY_MAX_ROWS


def test_amx_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LORAPLEX_CPU_AMX``: auto (AMX where the CPU reports it) or 0; anything else is
    refused with the variable's name."""
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "0")
    assert cpu_native.amx_choice() == "0"
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "auto")
    assert cpu_native.amx_choice() == "auto"
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "yes")
    with pytest.raises(ValueError, match="LORAPLEX_CPU_AMX"):
        cpu_native.amx_choice()
