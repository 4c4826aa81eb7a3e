"""Native per-layer CPU ops (``csrc/cpu_layer_ops.c``: RMSNorm, fused add + RMSNorm,
RoPE + KV store, SiLU-and-mul, GELU(tanh)-and-mul, greedy argmax), float32 and bfloat16,
against the PyTorch reference (``layer_ops_ref.py``) and a float64 computation on the same inputs; greedy argmax
against torch's ``max(dim=-1).indices``.

bfloat16 outputs are rounded where the reference rounds, so they match it to the bit
except where a float32 result sits at a rounding boundary and the kernel's float32 sum
or exp differs from torch's in the last place: at most one bf16 step, in few elements.
RoPE has no sum to reorder and is compared bit for bit. Inputs are strided views, as the
model passes them (column slices of a projection's output).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex_kernels import cpu_layer_ops, ops
from loraplex_kernels.layer_ops_ref import gelu_and_mul_ref, rms_norm_ref, silu_and_mul_ref

pytestmark = pytest.mark.skipif(not cpu_layer_ops.available(),
                                reason="no C compiler: the native CPU kernels are not built")

F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [F32, BF16]
EPS = 1e-5
# rows x hidden: one row, odd widths, and enough work (>= GRAIN) to split over threads
NORM_SHAPES = [(1, 576), (3, 37), (17, 100), (130, 300)]


def _strided(rows: int, cols: int, dtype: torch.dtype, seed: int,
             scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] column slice of a wider buffer (row stride cols + 7), NaN outside it."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((rows, cols + 7), float("nan"), dtype=dtype)
    buf[:, 3:cols + 3] = (torch.randn(rows, cols, generator=g) * scale).to(dtype)
    return buf[:, 3:cols + 3]


def _weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return (1.0 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)  # [hidden]


def _near_reference(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """float32: within a few ulps; bfloat16: equal but for rare one-step roundings."""
    if actual.dtype == F32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6,
                                   msg=lambda m: f"{what}: {m}")
        return
    a, e = actual.double(), expected.double()
    torch.testing.assert_close(a, e, rtol=2 ** -7, atol=1e-30, msg=lambda m: f"{what}: {m}")
    differ = (a != e).double().mean().item()
    assert differ < 0.01, f"{what}: {differ:.2%} of bf16 elements differ from the reference"


def _near_float64(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    rtol, atol = (1e-5, 1e-6) if actual.dtype == F32 else (2 ** -7, 2 ** -10)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def _rms_norm64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm(shape: tuple[int, int], dtype: torch.dtype) -> None:
    rows, hidden = shape
    x = _strided(rows, hidden, dtype, seed=hidden, scale=3.0)
    weight = _weight(hidden, dtype)
    before = x.clone()
    out = ops.rms_norm(x, weight, EPS, backend="cpu")
    assert out.shape == x.shape and torch.equal(x, before), "the input changed"
    _near_reference(out, rms_norm_ref(x, weight, EPS), "rms_norm vs reference")
    _near_float64(out, _rms_norm64(x, weight), "rms_norm vs float64")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_fused_add_rms_norm(shape: tuple[int, int], dtype: torch.dtype) -> None:
    rows, hidden = shape
    x = _strided(rows, hidden, dtype, seed=hidden)
    residual = _strided(rows, hidden, dtype, seed=hidden + 1, scale=4.0)
    weight = _weight(hidden, dtype)
    ref_out, ref_res = ops.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS,
                                              backend="torch")
    sum64 = x.double() + residual.double()
    x_buf, res_buf = x._base.clone(), residual._base.clone()
    x_in, res_in = x_buf[:, 3:hidden + 3], res_buf[:, 3:hidden + 3]
    out, res = ops.fused_add_rms_norm(x_in, res_in, weight, EPS, backend="cpu")
    # the native kernel writes in place, into the views and nothing around them
    assert out.data_ptr() == x_in.data_ptr() and res.data_ptr() == res_in.data_ptr()
    for buf in (x_buf, res_buf):
        assert buf[:, :3].isnan().all() and buf[:, hidden + 3:].isnan().all()
    # the residual sum is rounded once, as the reference's add: equal to the bit
    assert torch.equal(res, ref_res), "residual differs from the reference's sum"
    _near_float64(res, sum64, "residual vs float64")
    _near_reference(out, ref_out, "fused_add_rms_norm vs reference")
    _near_float64(out, _rms_norm64(res, weight), "fused_add_rms_norm vs float64")


def test_bf16_norm_rounds_before_the_weight() -> None:
    """With the weight 1 + 2^-7 (one bf16 step above 1), rounding the normalised value to
    bf16 before the multiply gives a different bf16 result than one rounding at the end for
    some elements; the kernel must take the reference's double rounding everywhere."""
    x = _strided(64, 96, BF16, seed=5)
    weight = torch.full((96,), 1 + 2 ** -7, dtype=BF16)
    out = ops.rms_norm(x, weight, EPS, backend="cpu")
    once = (weight.float() * x.float() * torch.rsqrt(
        x.float().pow(2).mean(-1, keepdim=True) + EPS)).to(BF16)
    ref = rms_norm_ref(x, weight, EPS)
    telling = ref != once  # where the two roundings differ
    assert telling.double().mean().item() > 0.05, "the case does not tell them apart"
    assert (out[telling] == ref[telling]).double().mean().item() > 0.95


# --------------------------------------------------------------------------- RoPE + KV


def _rope_tables(positions: torch.Tensor, head_dim: int) -> ops.Rope:
    """cos, sin [num_tokens, 1, head_dim] float32, neox layout, as Rotary makes them."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(positions.double(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)  # [num_tokens, head_dim]
    return emb.cos().float().unsqueeze(1), emb.sin().float().unsqueeze(1)


def _rotate64(x: torch.Tensor, rope: ops.Rope) -> torch.Tensor:
    half = x.shape[-1] // 2
    x64 = x.double()
    rotated = torch.cat([-x64[..., half:], x64[..., :half]], dim=-1)
    return x64 * rope[0].double() + rotated * rope[1].double()


# (num_heads, num_kv_heads, head_dim, num_tokens): the demo model's heads, an odd half,
# one token, and enough tokens to split over threads
ROPE_CASES = [(9, 3, 64, 5), (4, 2, 24, 1), (3, 1, 10, 13), (9, 3, 64, 200)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE_CASES, ids=str)
def test_rope_store_kv(case: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    heads, kv_heads, dim, n = case
    num_blocks, block_size = 40, 8
    width = (heads + 2 * kv_heads) * dim
    q_size, kv_size = heads * dim, kv_heads * dim
    g = torch.Generator().manual_seed(n)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[::3] = -1  # every third token not stored
    positions = torch.randint(0, 4096, (n,), generator=g)
    rope = _rope_tables(positions, dim)
    qkv = _strided(n, width, dtype, seed=width + n)
    original = qkv.clone()

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, block_size, kv_heads, dim)
        return (torch.full(shape, float("nan"), dtype=dtype),
                torch.full(shape, float("nan"), dtype=dtype))

    ref_k, ref_v = caches()
    ref_q = ops.rope_store_kv(original.clone(), heads, kv_heads, dim, rope, ref_k, ref_v,
                              slots, backend="torch")
    k_cache, v_cache = caches()
    q = ops.rope_store_kv(qkv, heads, kv_heads, dim, rope, k_cache, v_cache, slots,
                          backend="cpu")
    assert q.shape == (n, heads, dim)
    assert torch.equal(q, ref_q), "rotated q differs from the reference"
    assert torch.equal(k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0)), "k cache differs"
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0)), "v cache differs"
    # v and the buffer around the view are left alone
    assert torch.equal(qkv[:, q_size + kv_size:], original[:, q_size + kv_size:])
    assert qkv._base[:, :3].isnan().all() and qkv._base[:, width + 3:].isnan().all()
    expected = _rotate64(original[:, :q_size + kv_size].view(n, heads + kv_heads, dim), rope)
    _near_float64(qkv[:, :q_size + kv_size].view(n, heads + kv_heads, dim), expected,
                  "rotated q and k vs float64")
    stored = slots >= 0
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots[stored]],
                       qkv[stored, q_size:q_size + kv_size].view(-1, kv_heads, dim))
    assert torch.equal(flat_v[slots[stored]],
                       original[stored, q_size + kv_size:].view(-1, kv_heads, dim))
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool)
    unwritten[slots[stored]] = False
    assert flat_k[unwritten].isnan().all() and flat_v[unwritten].isnan().all()


@pytest.mark.parametrize("bad_slot", [-2, 40 * 8], ids=str)
def test_rope_store_kv_refuses_a_slot_outside_the_cache(bad_slot: int) -> None:
    heads, kv_heads, dim, n = 4, 2, 16, 6
    qkv = _strided(n, (heads + 2 * kv_heads) * dim, F32, seed=1)
    before = qkv.clone()
    k_cache = torch.zeros(40, 8, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(n)
    slots[4] = bad_slot
    cos, sin = _rope_tables(torch.arange(n), dim)
    with pytest.raises(IndexError, match=r"outside \[-1, 320\)"):
        cpu_layer_ops.rope_store_kv(qkv, heads, kv_heads, dim, cos, sin, k_cache, v_cache,
                                    slots)
    assert torch.equal(qkv, before), "qkv changed although the call was refused"
    assert not k_cache.any() and not v_cache.any(), "the cache changed"


# --------------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1536), (5, 37), (40, 1000)], ids=str)
def test_silu_and_mul(shape: tuple[int, int], dtype: torch.dtype) -> None:
    rows, inter = shape
    # wide range: large negative gates (exp near its clamp) and large positive ones
    gate_up = _strided(rows, 2 * inter, dtype, seed=inter, scale=6.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    out = ops.silu_and_mul(gate_up, backend="cpu")
    assert out.shape == (rows, inter)
    _near_reference(out, silu_and_mul_ref(gate_up), "silu_and_mul vs reference")
    g64, u64 = gate_up.double().chunk(2, dim=-1)
    _near_float64(out, g64 * torch.sigmoid(g64) * u64, "silu_and_mul vs float64")


def _near_gelu(actual: torch.Tensor, expected: torch.Tensor, gate_up: torch.Tensor,
               what: str) -> None:
    """Within two float32 ulps of ``0.5 |g|`` times ``|u|`` (where ``1 + tanh`` cancels,
    g below about -3, two tanh implementations' last-place differences grow to that), plus
    a few ulps (float32) or one rounding step (bfloat16) of the output."""
    g, u = gate_up.double().chunk(2, dim=-1)
    rtol = 4e-6 if actual.dtype == F32 else 2 ** -7
    bound = rtol * expected.double().abs() + 2 * 2 ** -24 * (g * u).abs() + 1e-30
    excess = ((actual.double() - expected.double()).abs() - bound).max().item()
    assert excess <= 0, f"{what}: beyond the bound by {excess}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1536), (5, 37), (40, 1000)], ids=str)
def test_gelu_and_mul(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """GELU's tanh form as PyTorch writes it, ``0.5 g (1 + tanh(u))``, with Cephes' tanh:
    PyTorch's result and float64's to the bound of ``_near_gelu``; bit for bit where no
    cancellation (most bf16 elements)."""
    rows, inter = shape
    gate_up = _strided(rows, 2 * inter, dtype, seed=inter + 1, scale=4.0)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -9.0, 9.0]).to(dtype)
    out = ops.gelu_and_mul(gate_up, backend="cpu")
    assert out.shape == (rows, inter)
    ref = gelu_and_mul_ref(gate_up)
    _near_gelu(out, ref, gate_up, "gelu_and_mul vs reference")
    if dtype == BF16:
        differ = (out != ref).double().mean().item()
        assert differ < 0.05, f"{differ:.2%} of bf16 elements differ from the reference"
    g64, u64 = gate_up.double().chunk(2, dim=-1)
    gelu64 = 0.5 * g64 * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g64 + 0.044715 * g64 ** 3)))
    _near_gelu(out, gelu64 * u64, gate_up, "gelu_and_mul vs float64")
    assert out[0, :4].tolist() == ref[0, :4].tolist()  # the extremes and zeros exactly
    assert torch.equal(ops.gelu_and_mul(gate_up, backend="torch"), ref)


# --------------------------------------------------------------------------- argmax

# Few distinct values, so rows tie often; NaN, the infinities and both zeros among them.
_ARGMAX_VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e30, -1e30, float("inf"),
                                  float("-inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 200), dtype=st.sampled_from(DTYPES),
       cells=st.lists(st.tuples(st.integers(0, 10 ** 6), _ARGMAX_VALUES), max_size=12),
       seed=st.integers(0, 2 ** 16))
def test_argmax_rows_is_torchs_first_maximum(rows: int, vocab: int, dtype: torch.dtype,
                                            cells: list[tuple[int, float]],
                                            seed: int) -> None:
    """Ties give the first maximum, a NaN counts as the maximum (its first), a row of -inf
    gives 0: torch's ``max(dim=-1).indices``, on strided rows of either dtype."""
    x = _strided(rows, vocab, dtype, seed=seed)
    for at, value in cells:
        x[at % rows, (at // rows) % vocab] = value
    if cells and cells[0][0] % 3 == 0:
        x[0] = cells[0][1]  # a whole row of one value
    out = ops.argmax_rows(x, backend="cpu")
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert torch.equal(out, x.max(dim=-1).indices)
    assert torch.equal(out, x.float().max(dim=-1).indices)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.integers(33000, 50000), dtype=st.sampled_from(DTYPES),
       cells=st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0, 1, 2, 3, 4, 5, 6]),
                                st.sampled_from([1e30, float("inf"), float("nan")])),
                      max_size=8))
def test_argmax_rows_split_over_threads(rows: int, vocab: int, dtype: torch.dtype,
                                        cells: list[tuple[int, int, float]]) -> None:
    """Rows wide enough that each thread takes a share of every row's columns: maxima,
    ties and NaNs at the shares' edges (a row's start, middle and end) combine to the
    first one, as torch's ``max(dim=-1).indices``."""
    x = _strided(rows, vocab, dtype, seed=vocab)
    edges = [0, vocab // 2 - 1, vocab // 2, vocab // 2 + 1, vocab // 3, 2 * vocab // 3,
             vocab - 1]
    for row, edge, value in cells:
        x[row % rows, edges[edge]] = value
    assert torch.equal(ops.argmax_rows(x, backend="cpu"), x.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 49152), (7, 49152), (64, 1000), (2, 40000)], ids=str)
def test_argmax_rows_large(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Rows of a vocabulary's width, split over threads (>= GRAIN elements), the maximum
    in the last block, the first, or in a tie between blocks."""
    rows, vocab = shape
    x = _strided(rows, vocab, dtype, seed=vocab + rows, scale=3.0)
    x[0, -1] = 50.0
    if rows > 1:
        x[1, 0] = 50.0
    if rows > 2:
        x[2, 70] = x[2, vocab - 3] = 60.0
        x[3, 5] = float("-inf")
        x[4, vocab // 2] = float("nan")
    expected = x.max(dim=-1).indices
    assert torch.equal(ops.argmax_rows(x, backend="cpu"), expected)
    assert torch.equal(ops.argmax_rows(x, backend="torch"), expected)


# --------------------------------------------------------------------------- dispatch


def test_reference_backend_leaves_inputs_alone() -> None:
    """The "torch" backend is the reference: it never writes into its inputs (the native
    kernels consume theirs), so the model works with either."""
    x, residual = _strided(3, 40, F32, seed=1), _strided(3, 40, F32, seed=2)
    x0, r0 = x.clone(), residual.clone()
    out, res = ops.fused_add_rms_norm(x, residual, _weight(40, F32), EPS, backend="torch")
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    assert out.data_ptr() != x.data_ptr() and res.data_ptr() != residual.data_ptr()


def test_switch_off_gives_the_reference() -> None:
    """``LORAPLEX_CPU_KERNELS=0``: no native layer op, even with the "cpu" backend asked."""
    code = ("import torch; from loraplex_kernels import cpu_layer_ops, ops; "
            "from loraplex_kernels.layer_ops_ref import silu_and_mul_ref; "
            "x = torch.randn(3, 8); "
            "print(cpu_layer_ops.available(), ops.resolve_backend(x.device), "
            "torch.equal(ops.silu_and_mul(x, 'cpu'), silu_and_mul_ref(x)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "LORAPLEX_CPU_KERNELS": "0"},
                          cwd=Path(__file__).resolve().parents[2], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False torch True"


def test_tensors_the_kernels_do_not_take_go_to_the_reference() -> None:
    """float16, a column-strided view, a weight of the wrong length: the reference runs
    (and gives its result, or its own error), never the kernel on a wrong layout."""
    weight = _weight(40, F32)
    half = _strided(3, 40, torch.float16, seed=1)
    assert torch.equal(ops.rms_norm(half, weight.half(), EPS, backend="cpu"),
                       rms_norm_ref(half, weight.half(), EPS))
    transposed = _strided(40, 3, F32, seed=2).t()  # [3, 40], column stride 47
    assert not cpu_layer_ops.can_norm(transposed, weight)
    assert torch.equal(ops.rms_norm(transposed, weight, EPS, backend="cpu"),
                       rms_norm_ref(transposed, weight, EPS))
    assert not cpu_layer_ops.can_norm(_strided(3, 41, F32, seed=3), weight)
    with pytest.raises(RuntimeError, match="size of tensor"):
        ops.rms_norm(_strided(3, 41, F32, seed=3), weight, EPS, backend="cpu")
    qkv = _strided(2, 8 * 16, F32, seed=4)  # one column short of 4 + 2 * 2 heads of 16
    k_cache = torch.zeros(4, 8, 2, 16)
    cos, sin = _rope_tables(torch.arange(2), 16)
    assert not cpu_layer_ops.can_rope_store_kv(qkv[:, :-1], 4, 2, 16, cos, sin, k_cache,
                                               k_cache.clone(), torch.arange(2))
    assert cpu_layer_ops.can_rope_store_kv(qkv, 4, 2, 16, cos, sin, k_cache,
                                           k_cache.clone(), torch.arange(2))
