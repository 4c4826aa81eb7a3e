"""A step's decoder layers in one native call (``csrc/cpu_decode_layers.c``): a decode
step's, or a step of decode rows and prefill chunks few enough for the skinny GEMM.

The C side runs, per layer, the kernels the Python layer code would call one by one
(norms, the skinny GEMM with each segment's LoRA, RoPE + KV store, paged decode attention
for the decode rows and paged prefill attention for the chunks, SiLU-and-mul), in the same
order on the same values, so the result is bit for bit that of the layer-by-layer path. Its tables are int64 tensors laid out as the C structs; the
field names below are their order, checked against the library's sizes when it loads.

``LORAPLEX_CPU_DECODE_LAYERS=0`` turns the path off (the layer-by-layer one runs).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from loraplex_kernels import cpu_native
from loraplex_kernels.lora_slots import LoRASlots

ENV_SWITCH = "LORAPLEX_CPU_DECODE_LAYERS"

PROJECTIONS = ("qkv", "o", "gate_up", "down")
PROJ_FIELDS = ("weight", "bias", "at_ptrs", "bt_ptrs", "ranks", "slice_table", "num_slices",
               "max_slices")
LAYER_FIELDS = ("input_norm", "post_attention_norm",
                *(f"{p}.{f}" for p in PROJECTIONS for f in PROJ_FIELDS))
STEP_FIELDS = ("rows", "hidden", "q_size", "kv_size", "inter",
               "num_heads", "num_kv_heads", "head_dim", "block_size", "num_cache_slots",
               "x", "residual", "qkv", "attn", "gate_up", "act",
               "cos", "sin", "cs_stride", "slot_mapping",
               "block_tables", "table_stride", "seq_lens", "seq_ids", "seq_rows", "num_seqs",
               "query_start_loc", "prefill_ids", "num_prefill",
               "seg_first", "seg_len", "seg_slot", "num_segs",
               "first", "bf16", "impl", "num_threads")


@functools.cache
def _lib() -> Any:
    """The native library when it has the decode-layers entry point laid out as above."""
    lib = cpu_native._library()
    if lib is None or not hasattr(lib, "decode_layers"):
        return None
    if (lib.decode_layer_fields() != len(LAYER_FIELDS)
            or lib.decode_step_fields() != len(STEP_FIELDS)):
        raise RuntimeError("csrc/cpu_decode_layers.c's tables differ from cpu_decode.py's")
    return lib


def available() -> bool:
    """Whether the path may run: the library has it and the switch does not turn it off."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and _lib() is not None


def can_project(weight: torch.Tensor, bias: torch.Tensor | None, slots: LoRASlots) -> bool:
    """Whether a projection goes through the native layers: a plain contiguous weight of a
    dtype the skinny GEMM runs here, a bias of its dtype, LoRA slots in the per-slot layout."""
    return (weight.is_cpu and weight.dim() == 2 and weight.is_contiguous()
            and cpu_native.can_skinny(weight.dtype)
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
            and slots.layout == "per_slot" and slots.dtype == weight.dtype
            and slots.in_features == weight.shape[1]
            and slots.slice_offsets[-1] == weight.shape[0])


def layer_row(input_norm: torch.Tensor, post_attention_norm: torch.Tensor,
              projections: Sequence[tuple[torch.Tensor, torch.Tensor | None, LoRASlots]],
              ) -> list[int]:
    """One layer's table row: its norms and its four projections (q/k/v, o, gate/up, down)
    as (weight, bias, LoRA slots), each checked with ``can_project``. The tensors must
    outlive the table (the model's own weights and slot tables do)."""
    assert len(projections) == len(PROJECTIONS)
    row = [input_norm.data_ptr(), post_attention_norm.data_ptr()]
    for weight, bias, slots in projections:
        assert can_project(weight, bias, slots)
        row += [weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                slots.at_ptrs.data_ptr(), slots.bt_ptrs.data_ptr(), slots.ranks.data_ptr(),
                slots.slice_table.data_ptr(), slots.num_slices.data_ptr(),
                slots.slice_table.shape[1]]
    return row


def run(layers: torch.Tensor, num_layers: int, kv_caches: torch.Tensor,
        step: dict[str, int], eps: float, scale: float) -> None:
    """The first ``num_layers`` rows of ``layers`` (``layer_row``s) over one step:
    ``kv_caches`` [num_layers, 2] int64 (each layer's K and V cache), ``step`` every
    ``STEP_FIELDS`` entry (pointers as integers). IndexError for a KV slot outside the
    cache, MemoryError when a kernel's scratch memory could not be allocated."""
    lib = _lib()
    assert lib is not None, "the native decode layers are not available"
    assert layers.dtype == torch.int64 and layers.is_contiguous()
    assert layers.shape[1] == len(LAYER_FIELDS) and 0 <= num_layers <= layers.shape[0]
    assert kv_caches.dtype == torch.int64 and kv_caches.is_contiguous()
    assert kv_caches.shape == (num_layers, 2)
    table = torch.tensor([step[f] for f in STEP_FIELDS], dtype=torch.int64)
    status = lib.decode_layers(layers.data_ptr(), num_layers, kv_caches.data_ptr(),
                               table.data_ptr(), eps, scale)
    if status == -3:
        raise IndexError(f"a KV cache slot is outside [-1, {step['num_cache_slots']})")
    if status == -2:
        raise RuntimeError("a native decode kernel (skinny GEMM, or a bfloat16 kernel "
                           "implementation) is not compiled for this dtype here")
    if status != 0:
        raise MemoryError("a native decode kernel could not allocate its scratch memory")
