"""A step's decoder layers in one native call (``csrc/cpu_decode_layers.c``): a decode
step's, or a step of decode rows and prefill chunks few enough for the skinny GEMM.

The C side runs, per layer, the kernels the Python layer code would call one by one
(norms, the skinny GEMM with each segment's LoRA, RoPE + KV store, paged decode attention
for the decode rows and paged prefill attention for the chunks, SiLU- or GELU-and-mul), in
the same order on the same values, so the result is bit for bit that of the layer-by-layer
path. Its tables are int64 tensors laid out as the C structs; the field names below are
their order, checked against the library's sizes when it loads.

Each layer row carries what differs between the families' layers (``layer_row``): its
attention's sliding window and logit soft-cap (Gemma 2/3 alternate windowed and global
layers), q/k norms (per head: Qwen3, Gemma 3; over each projection: OLMo 2), the norm
layout ("pre": Llama; "sandwich": Gemma; "post": OLMo 2) with its extra norms, the
activation (SiLU or GELU-tanh), the residual multiplier (Granite) and which of the step's
rotations it takes (Gemma 3's local and global bases, SmolLM3's layers without RoPE). The
defaults are a Llama layer's. The softmax scale and the norms' epsilon are the step's.

``LORAPLEX_CPU_DECODE_LAYERS=0`` turns the path off (the layer-by-layer one runs).
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch

from loraplex_kernels import cpu_native
from loraplex_kernels.lora_slots import LoRASlots

ENV_SWITCH = "LORAPLEX_CPU_DECODE_LAYERS"

PROJECTIONS = ("qkv", "o", "gate_up", "down")
PROJ_FIELDS = ("weight", "bias", "at_ptrs", "bt_ptrs", "ranks", "slice_table", "num_slices",
               "max_slices")
# "softcap" and "residual_scale" hold a float64's bits (the C struct's doubles), every
# other field an int64; fields are only added at the end (benchmarks/decode_replay.py
# runs an older library's rows as the first fields of these)
LAYER_FIELDS = ("input_norm", "post_attention_norm",
                *(f"{p}.{f}" for p in PROJECTIONS for f in PROJ_FIELDS), "window", "softcap",
                "qk_norm", "q_norm", "k_norm", "norm_layout", "pre_feedforward_norm",
                "post_feedforward_norm", "activation", "residual_scale", "rope")
QK_NORMS = ("", "head", "proj")  # the C enum's order
NORM_LAYOUTS = ("pre", "sandwich", "post")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
STEP_FIELDS = ("rows", "hidden", "q_size", "kv_size", "inter",
               "num_heads", "num_kv_heads", "head_dim", "block_size", "num_cache_slots",
               "x", "residual", "qkv", "attn", "gate_up", "act",
               "cos", "sin", "cs_stride", "slot_mapping",
               "block_tables", "table_stride", "seq_lens", "seq_ids", "seq_rows", "num_seqs",
               "query_start_loc", "prefill_ids", "num_prefill",
               "seg_first", "seg_len", "seg_slot", "num_segs",
               "first", "bf16", "impl", "num_threads", "ropes", "num_ropes", "tmp")


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


def _double_bits(value: float) -> int:
    """A float64's bits as an int64, as the C struct's double holds them."""
    return int(struct.unpack("<q", struct.pack("<d", float(value)))[0])


def layer_row(input_norm: torch.Tensor | None, post_attention_norm: torch.Tensor,
              projections: Sequence[tuple[torch.Tensor, torch.Tensor | None, LoRASlots]],
              *, window: int = 0, softcap: float = 0.0, qk_norm: str = "",
              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
              norm_layout: str = "pre", pre_feedforward_norm: torch.Tensor | None = None,
              post_feedforward_norm: torch.Tensor | None = None, activation: str = "silu",
              residual_scale: float = 1.0, rope: int = 0) -> list[int]:
    """One layer's table row: its norms and its four projections (q/k/v, o, gate/up, down)
    as (weight, bias, LoRA slots), each checked with ``can_project``, and

    - ``window``, ``softcap``: its attention's sliding window (keys, the row's own
      included; 0: none) and logit soft-cap (0: none), as ``ops.paged_attention`` takes
      them;
    - ``qk_norm``: "" (none), "head" (``q_norm``, ``k_norm`` [head_dim] each, RMSNorm of
      every q and k head) or "proj" ([q_size] and [kv_size], of the whole projections),
      after the q/k/v projection, before RoPE;
    - ``norm_layout``: "pre" (Llama: ``input_norm`` before attention,
      ``post_attention_norm`` before the MLP, each fused with the residual add),
      "sandwich" (Gemma: also ``post_attention_norm`` on the attention's output before its
      add, ``pre_feedforward_norm`` before the MLP and ``post_feedforward_norm`` on its
      output) or "post" (OLMo 2: no ``input_norm``, None; ``post_attention_norm`` and
      ``post_feedforward_norm`` on the sublayers' outputs, plain adds);
    - ``activation``: "silu" or "gelu_pytorch_tanh" (of the gate, times up);
    - ``residual_scale``: each sublayer's output times it before its residual add;
    - ``rope``: the index of its rotation in the step's list of (cos, sin) tables.

    Every norm is RMSNorm with the step's epsilon (Gemma's ``1 + w`` folded into ``w``).
    The tensors must outlive the table (the model's own weights and slot tables do)."""
    assert len(projections) == len(PROJECTIONS)
    if window < 0 or not softcap >= 0.0:
        raise ValueError(f"window and softcap must be >= 0, not {window} and {softcap}")
    if qk_norm not in QK_NORMS or norm_layout not in NORM_LAYOUTS \
            or activation not in ACTIVATIONS:
        raise ValueError(f"unknown qk_norm {qk_norm!r}, norm_layout {norm_layout!r} or "
                         f"activation {activation!r}")
    if not (math.isfinite(residual_scale) and rope >= 0):
        raise ValueError(f"residual_scale must be finite and rope >= 0, not "
                         f"{residual_scale} and {rope}")
    missing = [name for name, absent in (
        ("input_norm", norm_layout != "post" and input_norm is None),
        ("q_norm", bool(qk_norm) and q_norm is None),
        ("k_norm", bool(qk_norm) and k_norm is None),
        ("pre_feedforward_norm", norm_layout == "sandwich" and pre_feedforward_norm is None),
        ("post_feedforward_norm", norm_layout != "pre" and post_feedforward_norm is None),
    ) if absent]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing for qk_norm {qk_norm!r} and "
                         f"norm_layout {norm_layout!r}")
    for norm in (input_norm, post_attention_norm, q_norm, k_norm, pre_feedforward_norm,
                 post_feedforward_norm):
        assert norm is None or (norm.is_contiguous() and norm.dim() == 1)

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    row = [ptr(input_norm if norm_layout != "post" else None), post_attention_norm.data_ptr()]
    for weight, bias, slots in projections:
        assert can_project(weight, bias, slots)
        row += [weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                slots.at_ptrs.data_ptr(), slots.bt_ptrs.data_ptr(), slots.ranks.data_ptr(),
                slots.slice_table.data_ptr(), slots.num_slices.data_ptr(),
                slots.slice_table.shape[1]]
    row += [int(window), _double_bits(softcap), QK_NORMS.index(qk_norm),
            ptr(q_norm) if qk_norm else 0, ptr(k_norm) if qk_norm else 0,
            NORM_LAYOUTS.index(norm_layout),
            ptr(pre_feedforward_norm) if norm_layout == "sandwich" else 0,
            ptr(post_feedforward_norm) if norm_layout != "pre" else 0,
            ACTIVATIONS.index(activation), _double_bits(residual_scale), int(rope)]
    assert len(row) == len(LAYER_FIELDS)
    return row


def run(layers: torch.Tensor, num_layers: int, kv_caches: torch.Tensor,
        step: dict[str, int], eps: float, scale: float) -> None:
    """The first ``num_layers`` rows of ``layers`` (``layer_row``s) over one step:
    ``kv_caches`` [num_layers, 2] int64 (each layer's K and V cache), ``step`` every
    ``STEP_FIELDS`` entry (pointers as integers; ``ropes``: an int64 [num_ropes, 2] table
    of each rotation's cos and sin pointers, rows ``cs_stride`` apart as ``cos``'s, or 0
    where every row takes ``cos`` and ``sin``; ``tmp``: [rows, hidden] scratch, needed
    where a row's norm layout is not "pre"). IndexError for a KV slot outside the cache,
    ValueError for a row the step cannot run (its rope index past ``num_ropes``, a norm
    its layout needs missing, no ``tmp``), MemoryError when a kernel's scratch memory could
    not be allocated."""
    lib = _lib()
    assert lib is not None, "the native decode layers are not available"
    assert layers.dtype == torch.int64 and layers.is_contiguous()
    assert layers.shape[1] == len(LAYER_FIELDS) and 0 <= num_layers <= layers.shape[0]
    assert kv_caches.dtype == torch.int64 and kv_caches.is_contiguous()
    assert kv_caches.shape == (num_layers, 2)
    table = torch.tensor([step[f] for f in STEP_FIELDS], dtype=torch.int64)
    status = lib.decode_layers(layers.data_ptr(), num_layers, kv_caches.data_ptr(),
                               table.data_ptr(), eps, scale)
    if status == -4:
        raise ValueError("a layer row does not fit the step: its rope index past the step's "
                         "tables, or a norm its layout needs (or the step's tmp) missing")
    if status == -3:
        raise IndexError(f"a KV cache slot is outside [-1, {step['num_cache_slots']})")
    if status == -2:
        raise RuntimeError("a native decode kernel (skinny GEMM, or a bfloat16 kernel "
                           "implementation) is not compiled for this dtype here")
    if status != 0:
        raise MemoryError("a native decode kernel could not allocate its scratch memory")
