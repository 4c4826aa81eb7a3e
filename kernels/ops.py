"""The one dispatch point: Triton on CUDA, the PyTorch reference elsewhere.

Every op takes ``backend=None`` (pick by device), ``"torch"`` or ``"triton"``; tests use the
override to run the Triton kernels under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

from typing import Literal

import torch

from loraplex_kernels.attention_ref import paged_attention_ref, store_kv_ref
from loraplex_kernels.meta import AttentionMeta, SGMVMeta
from loraplex_kernels.sgmv_ref import (
    PackedSlots,
    add_lora_ref,
    sgmv_expand_ref,
    sgmv_shrink_ref,
)

Backend = Literal["torch", "triton"]


def resolve_backend(device: torch.device, backend: Backend | None = None) -> Backend:
    if backend is not None:
        return backend
    return "triton" if device.type == "cuda" else "torch"


def sgmv_shrink(x: torch.Tensor, lora_a: list[torch.Tensor], scales: torch.Tensor,
                meta: SGMVMeta, out: torch.Tensor, backend: Backend | None = None) -> None:
    if resolve_backend(x.device, backend) == "triton":
        from loraplex_kernels.sgmv_triton import sgmv_shrink_triton
        sgmv_shrink_triton(x, lora_a, scales, meta, out)
    else:
        sgmv_shrink_ref(x, lora_a, scales, meta, out)


def sgmv_expand(y: torch.Tensor, lora_b: list[torch.Tensor], meta: SGMVMeta,
                out: torch.Tensor, slice_offsets: list[int],
                backend: Backend | None = None) -> None:
    if resolve_backend(y.device, backend) == "triton":
        from loraplex_kernels.sgmv_triton import sgmv_expand_triton
        sgmv_expand_triton(y, lora_b, meta, out, slice_offsets)
    else:
        sgmv_expand_ref(y, lora_b, meta, out, slice_offsets)


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
             lora_b: list[torch.Tensor], scales: torch.Tensor, meta: SGMVMeta,
             slice_offsets: list[int], backend: Backend | None = None,
             packed: PackedSlots | None = None) -> None:
    """``out += LoRA delta`` of every token's slot (shrink then expand).

    ``packed`` (optional, per slot): every slice's A stacked ``[slices * rank, in]`` and a
    block-diagonal B ``[out, slices * rank]`` with the slot's scale folded in; the CPU
    path uses them when each slot's tokens are contiguous.
    """
    if not meta.has_lora:
        return
    if resolve_backend(x.device, backend) == "torch":
        add_lora_ref(out, x, lora_a, lora_b, scales, meta, slice_offsets, packed)
        return
    y = torch.zeros(len(lora_a), x.shape[0], lora_a[0].shape[1], dtype=torch.float32
                    if x.dtype == torch.float32 else x.dtype, device=x.device)
    sgmv_shrink(x, lora_a, scales, meta, y, backend)
    sgmv_expand(y, lora_b, meta, out, slice_offsets, backend)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             backend: Backend | None = None) -> None:
    if resolve_backend(key.device, backend) == "triton":
        from loraplex_kernels.attention_triton import store_kv_triton
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, scale: float, out: torch.Tensor,
                    backend: Backend | None = None) -> None:
    if resolve_backend(query.device, backend) == "triton":
        from loraplex_kernels.attention_triton import paged_attention_triton
        paged_attention_triton(query, k_cache, v_cache, meta, scale, out)
    else:
        paged_attention_ref(query, k_cache, v_cache, meta, scale, out)


__all__ = ["AttentionMeta", "Backend", "SGMVMeta", "add_lora", "paged_attention",
           "resolve_backend", "sgmv_expand", "sgmv_shrink", "store_kv"]
