"""PyTorch reference of the decoder's small per-layer ops: RMSNorm (alone and fused with
the residual add), RoPE on q and k with the KV store, SiLU-and-mul and GELU(tanh)-and-mul.
The CPU fallback, the CUDA path, and the oracle of the native kernels
(``cpu_layer_ops.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim] float32 each


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)``, normalised in float32 and cast back before the weight
    multiply (as HF's LlamaRMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum in the tensors' dtype."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rotate_ref(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Neox RoPE of ``x`` [num_tokens, heads, head_dim]: ``x * cos + rotate_half(x) * sin``
    in float32, cast back."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the q, k and v heads of ``qkv`` [num_tokens, (heads + 2 kv_heads) * dim]."""
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].view(n, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(n, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(n, num_kv_heads, head_dim))


def rotate_qkv_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotated q [num_tokens, num_heads, head_dim] and k [num_tokens, kv_heads,
    head_dim] of ``qkv``, and its v (contiguous, for the KV store); ``qkv`` is not changed."""
    n = qkv.shape[0]
    # q and k sit side by side in qkv: rotate both in one pass.
    qk = rotate_ref(qkv[:, :(num_heads + num_kv_heads) * head_dim].view(
        n, num_heads + num_kv_heads, head_dim), rope)  # [num_tokens, heads + kv_heads, dim]
    v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)[2].contiguous()
    return qk[:, :num_heads], qk[:, num_heads:], v


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [num_tokens, 2 * inter] -> [num_tokens, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of ``gate_up`` [num_tokens, 2 * inter] ->
    [num_tokens, inter] (Gemma's GeGLU, ``gelu_pytorch_tanh``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
