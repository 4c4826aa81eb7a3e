"""Native CPU kernels of the decoder's small per-layer ops (``csrc/cpu_layer_ops.c``),
float32 and bfloat16, called via ctypes from the library ``cpu_native`` builds.

Each replaces several PyTorch ops and their temporaries with one pass per row, and
matches ``layer_ops_ref.py`` (float32 math, bfloat16 rounded where the reference rounds).
The ``can_*`` checks say which tensors a kernel takes; the dispatcher (``ops.py``) falls
back to the reference for the rest.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

from loraplex_kernels import cpu_native

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_int = ctypes.c_int
_f32 = ctypes.c_float
_F32, _BF16 = torch.float32, torch.bfloat16
_SUFFIX = {_F32: "f32", _BF16: "bf16"}


@functools.cache
def _kernels() -> dict[tuple[str, torch.dtype], Callable[..., Any]] | None:
    """(op, dtype) -> its C function, from cpu_native's library; None when unavailable."""
    lib = cpu_native._library()
    if lib is None:
        return None
    norm = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int]
    signatures = {
        "rms_norm": (norm, None),
        "fused_add_rms_norm": (norm, None),
        "rope_store_kv": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr,
                           _ptr, _i64, _int], _int),
        "silu_and_mul": ([_ptr, _i64, _ptr, _i64, _i64, _i64, _int], None),
        "gelu_and_mul": ([_ptr, _i64, _ptr, _i64, _i64, _i64, _int], None),
        "argmax_rows": ([_ptr, _i64, _ptr, _i64, _i64, _int], None),
    }
    kernels = {}
    for op, (argtypes, restype) in signatures.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"{op}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = restype
            kernels[op, dtype] = fn
    return kernels


def available() -> bool:
    return _kernels() is not None


def _kernel(op: str, dtype: torch.dtype) -> Callable[..., Any]:
    kernels = _kernels()
    assert kernels is not None, "native CPU kernels are not available"
    return kernels[op, dtype]


# The checks run once per call of each op in every layer, so they stay cheap: ``is_cpu``
# and identity of dtypes, not ``device.type`` (a device object each time, ~1.5 us).
def _rows(x: torch.Tensor) -> bool:
    """A CPU float32/bfloat16 matrix with unit column stride (any row stride)."""
    return x.is_cpu and (x.dtype is _F32 or x.dtype is _BF16) and x.dim() == 2 \
        and x.stride(1) == 1


def can_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_rows(x) and weight.dtype is x.dtype and weight.is_contiguous()
            and weight.dim() == 1 and weight.size(0) == x.size(1))


def can_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (can_norm(x, weight) and residual.dtype is x.dtype and _rows(residual)
            and residual.shape == x.shape and x.data_ptr() != residual.data_ptr())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` of ``x`` [num_rows, hidden] into a new tensor. Takes what
    ``can_norm`` accepts: the dispatcher checks once, as for each op below."""
    out = torch.empty(x.shape, dtype=x.dtype)  # [num_rows, hidden]
    _kernel("rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
        x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: ``residual += x``, then ``x = weight * residual / rms(residual)``; takes
    what ``can_add_norm`` accepts."""
    _kernel("fused_add_rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
        weight.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())


def can_rope_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """qkv [num_tokens, (heads + 2 kv_heads) * head_dim] with unit column stride; caches
    [blocks, block_size, kv_heads, head_dim] of its dtype, contiguous; cos and sin
    [num_tokens, 1, head_dim] float32, rows one stride apart; int64 contiguous slots."""
    n = qkv.size(0) if qkv.dim() == 2 else -1
    return (_rows(qkv) and head_dim % 2 == 0
            and qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim
            and k_cache.dtype is qkv.dtype and v_cache.dtype is qkv.dtype
            and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.size(2) == num_kv_heads and k_cache.size(3) == head_dim
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cos.dtype is _F32 and sin.dtype is _F32
            and cos.shape == sin.shape == (n, 1, head_dim)
            and cos.stride(2) == sin.stride(2) == 1 and cos.stride(0) == sin.stride(0)
            and slot_mapping.dtype is torch.int64 and slot_mapping.shape == (n,)
            and slot_mapping.is_contiguous())


def rope_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place on ``qkv`` [num_tokens, (heads + 2 kv_heads) * head_dim]: neox RoPE of its
    q and k heads by ``cos``/``sin`` [num_tokens, 1, head_dim]; each token's rotated k and
    its v written to ``k_cache``/``v_cache`` [num_blocks, block_size, kv_heads, head_dim]
    at its flat slot (-1 = not stored). Takes what ``can_rope_store_kv`` accepts;
    IndexError (nothing changed) for a slot outside the cache."""
    num_cache_slots = k_cache.size(0) * k_cache.size(1)
    status = _kernel("rope_store_kv", qkv.dtype)(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        slot_mapping.data_ptr(), qkv.size(0), num_heads, num_kv_heads, head_dim,
        k_cache.data_ptr(), v_cache.data_ptr(), num_cache_slots, torch.get_num_threads())
    if status != 0:
        raise IndexError(f"a KV cache slot is outside [-1, {num_cache_slots})")


def can_silu_and_mul(gate_up: torch.Tensor) -> bool:
    return _rows(gate_up) and gate_up.size(1) % 2 == 0


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [num_tokens, 2 * inter], a new [num_tokens,
    inter] tensor; takes what ``can_silu_and_mul`` accepts."""
    n, inter = gate_up.size(0), gate_up.size(1) // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype)  # [num_tokens, inter]
    _kernel("silu_and_mul", gate_up.dtype)(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, n, inter,
        torch.get_num_threads())
    return out


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of ``gate_up`` [num_tokens, 2 * inter], a
    new [num_tokens, inter] tensor (GELU as ``g / (1 + exp(-2u))``, ``0.5 g (1 + tanh(u))``
    rewritten: within a few float32 ulps of PyTorch's); takes what ``can_silu_and_mul``
    accepts."""
    n, inter = gate_up.size(0), gate_up.size(1) // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype)  # [num_tokens, inter]
    _kernel("gelu_and_mul", gate_up.dtype)(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, n, inter,
        torch.get_num_threads())
    return out


def can_argmax(x: torch.Tensor) -> bool:
    return _rows(x) and x.size(1) > 0


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum, int64 [rows], as ``x.max(dim=-1).indices``
    (a NaN counts as the maximum); takes what ``can_argmax`` accepts."""
    out = torch.empty(x.size(0), dtype=torch.int64)
    _kernel("argmax_rows", x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), x.size(0),
                                    x.size(1), torch.get_num_threads())
    return out
