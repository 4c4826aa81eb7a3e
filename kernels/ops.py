"""The one dispatch point: Triton on CUDA, native kernels on CPU, the PyTorch reference
for the rest.

Ops: LoRA (``add_lora``, ``sgmv_shrink``/``sgmv_expand``), base projections (``linear``,
``linear_lora``, with ``pack_linear_weight``), the paged KV store and attention, RMSNorm,
RoPE + KV store, SiLU-and-mul, GELU(tanh)-and-mul and the greedy ``argmax_rows``; paged attention with a
sliding window and attention-logit soft-capping (``window``, ``softcap``) in every
backend. The ops that dispatch take ``backend=None`` (pick by device), ``"torch"``,
``"cpu"`` or ``"triton"``:

- ``"triton"``: the Triton kernels for LoRA and attention (CUDA; tests run them under
  ``TRITON_INTERPRET=1``); the per-layer ops run the PyTorch reference there.
- ``"cpu"``: the native CPU kernels where they apply (float32 and bfloat16 decode and
  prefill attention, LoRA segments, the per-layer ops and argmax, and the skinny GEMM of
  decode batches fused with their LoRA; built from ``csrc/`` on first use), oneDNN's
  GEMMs on packed or plain weights for larger batches, the PyTorch reference for the
  rest. The default on CPU when the native library is available.
- ``"torch"``: the PyTorch reference only (the tests' oracle).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from loraplex_kernels import cpu_layer_ops, cpu_native
from loraplex_kernels.attention_ref import (
    paged_attention_ref,
    store_kv_ref,
)
from loraplex_kernels.layer_ops_ref import (
    Rope,
    fused_add_rms_norm_ref,
    gelu_and_mul_ref,
    rms_norm_ref,
    rotate_qkv_ref,
    silu_and_mul_ref,
    split_qkv,
)
from loraplex_kernels.lora_prefill import add_lora_sliced
from loraplex_kernels.lora_slots import LoRASlots
from loraplex_kernels.meta import AttentionMeta, SGMVMeta
from loraplex_kernels.sgmv_ref import (
    add_lora_ref,
    sgmv_expand_ref,
    sgmv_shrink_ref,
)

Backend = Literal["torch", "cpu", "triton"]


def resolve_backend(device: torch.device, backend: Backend | None = None) -> Backend:
    if backend is not None:
        return backend
    if device.type == "cuda":
        return "triton"
    return "cpu" if cpu_native.available() else "torch"


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


def add_lora(out: torch.Tensor, x: torch.Tensor, slots: LoRASlots, scales: torch.Tensor,
             meta: SGMVMeta, backend: Backend | None = None) -> None:
    """``out += LoRA delta`` of every token's slot, ``out``'s columns being the slices of
    ``slots`` side by side; ``scales`` [num_slots] is read by the stacked layout only (the
    per-slot layout has it folded in).

    The per-slot layout (CPU): with the ``"cpu"`` backend, the segments ``meta`` calls
    short (``meta.short_segment_limit``: in float32 up to 512 tokens, all of them where
    ``cpu_native.native_lora_any_length``; in bfloat16 all) go
    to the native kernel in one call and long ones to per-slot matmuls, in float32 one
    expand per slice (``add_lora_sliced``; benchmarks/lora_prefill.py: no faster in
    bfloat16, so bfloat16 keeps the block-diagonal expand); the reference does all by
    per-slot matmuls. The stacked layout: shrink then expand.
    """
    if not meta.has_lora:
        return
    chosen = resolve_backend(x.device, backend)
    if slots.layout == "per_slot":
        if chosen == "triton":
            raise ValueError("the Triton kernels read the stacked LoRA layout")
        if chosen == "cpu" and meta.short_segments is not None and cpu_native.available() \
                and cpu_native.can_lora(x, out, slots):
            cpu_native.add_lora(out, x, meta.short_segments, slots)
            if meta.long_segment_ids and x.dtype == torch.float32:
                add_lora_sliced(out, x, slots, meta, meta.long_segment_ids)
            elif meta.long_segment_ids:
                add_lora_ref(out, x, slots.weights, meta, meta.long_segment_ids)
            return
        add_lora_ref(out, x, slots.weights, meta)
        return
    y = torch.zeros(len(slots.lora_a), x.shape[0], slots.lora_a[0].shape[1],
                    dtype=torch.float32 if x.dtype == torch.float32 else x.dtype,
                    device=x.device)  # [num_slices, num_tokens, max_rank]
    sgmv_shrink(x, slots.lora_a, scales, meta, y, backend)
    sgmv_expand(y, slots.lora_b, meta, out, slots.slice_offsets, backend)


# Packed base weights for the CPU GEMMs. oneDNN's packed weight runs every batch size
# through its own AVX-512 / AMX kernels, which do not depend on the CPU's vendor (MKL's
# sgemm takes its AVX2 path on AMD: measured 2.2-2.5x slower on an AVX-512 EPYC, prefill
# and decode shapes alike). On a CPU without AVX-512 (an AVX2 EPYC, Zen 3) both run AVX2
# kernels: there oneDNN's packed weight was 1.3-1.6x faster than MKL's sgemm at decode
# sizes (21-64 rows) but MKL's 10-17 % faster at prefill chunks (2,048 rows), and oneDNN
# reading a tied LM head's plain layout 1.1-1.4x slower than a packed copy. "onednn-mkl"
# takes both: the plain weight is kept for batches of _LARGE_ROWS rows or more and a tied
# head gets a packed copy of its own, for 5-7 % of the offline workload's time there at
# the cost of holding the base weights twice (so not the default: the engine is held to
# 1.5x its model's weights). MKL's packed weight is the fallback for torch builds without
# oneDNN; it pays for small batches (decode) only. Weights smaller than this gain nothing.
_PACK_MIN_ELEMENTS = 1 << 16
_MKL_PACK_MAX_ROWS = 128
_LARGE_ROWS = 512
# Batches of up to this many rows go to the native skinny GEMM where a weight takes it
# (kind "skinny"), more to oneDNN reading the same plain weight. In bfloat16 the skinny
# GEMM ran the demo model's 30 layers 1.6-2.4x faster than oneDNN's packed copy up to 16
# rows and 1.1-1.3x at 32-64 (benchmarks/skinny_gemm.py), where oneDNN on the plain layout
# was 0.7-0.9x its packed copy; from 128 rows oneDNN's packed copy leads, on the plain
# layout 4-14 % behind it. In float32 the skinny GEMM alone led by less (0.9-1.5x); it is
# the default there too because with every projection on it a decode step's layers run in
# one native call (loraplex/model/native_decode.py). On a CPU with AMX the bf16 kernel runs
# on its tiles, 1.75-1.87x oneDNN's packed AMX GEMM up to 32 rows, 1.24x at 64 and 1.09x at
# 128 (a 2-core Xeon); the limit stays where the vector kernels set it.
SKINNY_MAX_ROWS = 64
# The most rows the bfloat16 skinny GEMM takes where it runs on AMX tiles. There, with 2 x 2
# tiles of C past 32 rows, it leads oneDNN on the plain layout (what larger batches take)
# up to about 768 rows: on a 2-core Xeon with AMX the demo model's 30 layers took 22.3 ms
# against 38.7 at 128 rows, 38.5 against 55.0 at 256, 63.4 against 67.7 at 512, 97.7
# against 101.8 at 768, and 135 against 122 at 1,024 (benchmarks/skinny_gemm.py; its
# float32 kernel falls behind past 64 rows). A step that mixes a prompt's chunk with the
# running decodes has such sizes, and so does a decode step of many sequences; up to
# here such a step runs in one native call (loraplex/model/native_decode.py).
SKINNY_AMX_MAX_ROWS = 512


def skinny_max_rows(dtype: torch.dtype) -> int:
    """The most rows of ``dtype`` that ``linear`` sends through a "skinny" packed weight's
    native GEMM (more go to oneDNN)."""
    return SKINNY_AMX_MAX_ROWS if dtype == torch.bfloat16 and cpu_native.amx_on() \
        else SKINNY_MAX_ROWS


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight ready for ``linear`` (``pack_linear_weight``).

    ``kind`` "skinny": ``data`` is the plain weight itself, which batches of up to
    ``skinny_max_rows`` rows multiply through the native skinny GEMM and larger ones
    through oneDNN's GEMM on the plain layout, or, for a bfloat16 weight on a CPU without
    bf16 GEMMs (``widen``), through ``large``, its float32 packed copy. ``kind``
    "onednn": ``data`` is oneDNN's packed copy (or, for a shared weight, by default the
    plain tensor itself); ``widen``:
    a bfloat16 layer whose weight was packed as float32, for CPUs without bf16 GEMM
    instructions; ``large``: a plain float32 weight that batches of ``_LARGE_ROWS`` rows
    or more multiply through ``F.linear`` (MKL) instead. ``kind`` "mkl": MKL's packed
    copy, for batches of up to ``_MKL_PACK_MAX_ROWS``."""

    kind: str
    data: torch.Tensor
    widen: bool = False
    large: torch.Tensor | None = None


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16_gemm() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs natively here (AVX-512 BW/VL/DQ, AVX-NE-CONVERT
    or AMX); without them it refuses to pack bf16 weights."""
    return _onednn_linear_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


_GEMM_CHOICES = ("auto", "onednn", "onednn-mkl", "onednn-f32", "skinny", "mkl", "plain")


def cpu_gemm_choice() -> str:
    """``LORAPLEX_CPU_GEMM``, one of ``_GEMM_CHOICES``; ValueError else.

    - "auto" (the default): "skinny" where the CPU runs the native skinny GEMM for the
      weights' dtype (AVX-512, AVX512_BF16 for bfloat16; or AVX2 with FMA, bf16 widened
      as it is read), "onednn" for the rest. In
      float32 the skinny GEMM alone led oneDNN's packed copy by less than in bfloat16
      (0.9-1.5x, and oneDNN on the plain layout it takes for prefill is 5-14 % slower
      than that copy), but with it every projection is native and a decode step's layers
      run in one native call (``loraplex.model.native_decode``): the offline workload
      went from 39 s to 26 s in float32.
    - "skinny": the plain weight kept, the native skinny GEMM for batches of up to
      ``skinny_max_rows`` rows and oneDNN on the plain layout for more; "onednn" where
      the CPU lacks the skinny GEMM's instructions.
    - "onednn": oneDNN's packed weights only (plain weights released, a tied
      LM head read in place).
    - "onednn-mkl": also the plain float32 weights, for batches of ``_LARGE_ROWS`` or more
      through MKL, and a packed copy of a tied head: faster without AVX-512, twice the
      base weights' memory (see above).
    - "onednn-f32": bfloat16 weights packed as float32 on any CPU, as where the CPU has no
      bf16 GEMM.
    - "mkl", "plain": MKL's packing or none (comparisons).
    """
    choice = os.environ.get("LORAPLEX_CPU_GEMM", "auto")
    if choice not in _GEMM_CHOICES:
        raise ValueError(f"LORAPLEX_CPU_GEMM must be one of {', '.join(_GEMM_CHOICES)}, "
                         f"not {choice!r}")
    return choice


_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack_linear_weight(weight: torch.Tensor, shared: bool = False) -> PackedWeight | None:
    """A packed copy of a float32 or bfloat16 CPU linear weight ``[out, in]`` for
    ``linear``; None where packing does not apply (another device or dtype, a small weight,
    a torch build with neither oneDNN nor MKL; MKL packs float32 only). In bfloat16 oneDNN
    runs its AVX-512 BF16 (or AMX) kernels with float32 accumulation where the CPU has
    them. Where it has not (AVX2 only), a bf16 weight is packed as float32 (``widen``):
    bf16 products are exact in float32 and the sums are float32 either way, so the result
    is the bf16 GEMM's, at the float32 GEMM's speed, several times the bf16 one's there.

    Where ``cpu_gemm_choice`` picks the skinny GEMM ("auto" on CPUs with AVX-512, and
    AVX512_BF16 for bfloat16, or AVX2 with FMA), no copy is made: the weight itself is
    what both of its GEMMs read; but for a bfloat16 weight on a CPU without bf16 GEMMs
    (AVX2), whose batches past ``skinny_max_rows`` rows take the widened float32 packed
    copy (``large``): the plain bf16 weight and that copy are 1.5x the float32 weights.

    ``shared``: the plain weight stays in use elsewhere (an LM head tied to the token
    embedding). In float32 no copy is made by default: oneDNN's GEMM reads the plain layout
    itself, well ahead of ``F.linear`` at decode (docs/engine.md, "Memory"), where a copy
    would cost the whole embedding's memory again (the engine is held to 1.5x its float32
    weights). A bfloat16 head gets its packed copy, at half that cost: oneDNN's bf16 GEMM
    on the plain layout ran at 0.54x the packed copy's speed (the demo model's head, 21
    rows: 9.9 ms against 5.3). A packed copy is also made with "onednn-mkl" (see above)
    and for a widened weight (float32 GEMMs cannot read bf16)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES:
        return None
    choice = cpu_gemm_choice()
    if choice in ("auto", "skinny"):
        if cpu_native.can_skinny(weight.dtype) and _onednn_linear_available():
            if weight.dtype == torch.bfloat16 and not onednn_bf16_gemm():
                # AVX2: decode batches stream the bf16 weight (half the float32 bytes),
                # larger ones take the float32 GEMM on a widened packed copy, as below
                return PackedWeight("skinny", weight, True, torch.ops.mkldnn.
                                    _reorder_linear_weight(weight.float().contiguous(), None))
            return PackedWeight("skinny", weight)  # no copy, so any size
        choice = "onednn"
    if weight.numel() < _PACK_MIN_ELEMENTS:
        return None
    if choice.startswith("onednn") and _onednn_linear_available():
        widen = weight.dtype == torch.bfloat16 and (choice == "onednn-f32"
                                                    or not onednn_bf16_gemm())
        if shared and weight.dtype == torch.float32 and choice != "onednn-mkl":
            return PackedWeight("onednn", weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(
            (weight.float() if widen else weight).contiguous(), None)
        large = (weight if choice == "onednn-mkl" and weight.dtype == torch.float32
                 and not shared else None)
        return PackedWeight("onednn", packed, widen, large)
    if (choice != "plain" and not shared and weight.dtype == torch.float32
            and torch.backends.mkl.is_available()):
        return PackedWeight("mkl", torch.ops.mkl._mkl_reorder_linear_weight(
            weight, _MKL_PACK_MAX_ROWS))
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear``, through the packed weight (``pack_linear_weight``) where it applies.
    With a oneDNN-packed weight ``weight`` is not read, so its owner may release it."""
    if packed is not None and packed.kind in ("onednn", "skinny"):
        flat = x.reshape(-1, x.shape[-1])
        if packed.kind == "skinny" and flat.shape[0] <= skinny_max_rows(flat.dtype):
            out = cpu_native.skinny_linear(flat, packed.data, bias)
        elif packed.widen:  # a bf16 layer on a CPU without bf16 GEMMs
            out = torch.ops.mkldnn._linear_pointwise(
                flat.float(), packed.large if packed.kind == "skinny" else packed.data,
                None if bias is None else bias.float(), "none", [], "").to(x.dtype)
        elif packed.large is not None and flat.shape[0] >= _LARGE_ROWS:
            out = torch.nn.functional.linear(flat, packed.large, bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, packed.data, bias, "none", [], "")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
    if packed is not None and x.dim() == 2 and x.shape[0] <= _MKL_PACK_MAX_ROWS:
        return torch.ops.mkl._mkl_linear(x, packed.data, weight, bias, _MKL_PACK_MAX_ROWS)
    return torch.nn.functional.linear(x, weight, bias)


def linear_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: PackedWeight | None, slots: LoRASlots, scales: torch.Tensor,
                meta: SGMVMeta, backend: Backend | None = None) -> torch.Tensor:
    """``linear`` and then ``add_lora`` into its output. A decode batch through the skinny
    GEMM whose segments all go to the native LoRA kernel runs both in one native call
    (``cpu_native.skinny_lora``: one parallel region instead of two). Runs per projection
    of every step, so the backend check reads ``is_cpu``, not a device object."""
    if (meta.has_lora and packed is not None and packed.kind == "skinny"
            and x.dim() == 2 and x.shape[0] <= skinny_max_rows(x.dtype)
            and slots.layout == "per_slot" and slots.dtype == x.dtype
            and meta.short_segments is not None and not meta.long_segment_ids
            and (x.is_cpu if backend is None else backend == "cpu")):
        return cpu_native.skinny_lora(x, packed.data, bias, meta.short_segments, slots)
    out = linear(x, weight, bias, packed)
    add_lora(out, x, slots, scales, meta, backend)
    return out


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
                    backend: Backend | None = None, *, window: int = 0,
                    softcap: float = 0.0) -> None:
    """Causal attention of each sequence's new queries ``query`` [num_tokens, heads, dim]
    over its cached keys (``meta``), into ``out``; scores ``(q . k) * scale``.

    ``window`` > 0: a sliding window, the query at position ``p`` sees the keys at
    ``p - window < k <= p`` only (HuggingFace's ``sliding_window``); the blocks wholly
    before a sequence's earliest window start are never read, so the engine may release
    them (their table entries may hold any block). ``softcap`` > 0: each score ``s``
    becomes ``softcap * tanh(s / softcap)`` before the mask and the softmax (Gemma 2).
    0 turns either off."""
    if window < 0 or not softcap >= 0.0:
        raise ValueError(f"window and softcap must be >= 0 (0: off), not {window} and "
                         f"{softcap}")
    chosen = resolve_backend(query.device, backend)
    if chosen == "triton":
        from loraplex_kernels.attention_triton import paged_attention_triton
        paged_attention_triton(query, k_cache, v_cache, meta, scale, out, window=window,
                               softcap=softcap)
    elif chosen == "cpu" and cpu_native.available() and cpu_native.can_decode(
            query, k_cache, out):
        cpu_native.paged_decode_attention(query, k_cache, v_cache, meta, scale, out,
                                          window=window, softcap=softcap)
        cpu_native.paged_prefill_attention(query, k_cache, v_cache, meta, scale, out,
                                           window=window, softcap=softcap)
    else:
        paged_attention_ref(query, k_cache, v_cache, meta, scale, out, window=window,
                            softcap=softcap)


def _native_layer_ops(x: torch.Tensor, backend: Backend | None) -> bool:
    """``resolve_backend(x.device, backend) == "cpu"`` with native layer ops, without the
    device object (~1.5 us, and these run several times per layer); the ``can_*`` checks
    then see that the tensors are on the CPU."""
    return (x.is_cpu if backend is None else backend == "cpu") and cpu_layer_ops.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             backend: Backend | None = None) -> torch.Tensor:
    """``weight * x / rms(x)`` of ``x`` [num_tokens, hidden] (normalised in float32)."""
    if _native_layer_ops(x, backend) and cpu_layer_ops.can_norm(x, weight):
        return cpu_layer_ops.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, backend: Backend | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum in the tensors' dtype. ``x`` and
    ``residual`` are consumed: the native kernel writes the two results into them."""
    if _native_layer_ops(x, backend) and cpu_layer_ops.can_add_norm(x, residual, weight):
        cpu_layer_ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rope_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """Neox RoPE of the q and k heads of ``qkv`` [num_tokens, (heads + 2 kv_heads) * dim],
    the rotated k and the v stored at ``slot_mapping`` (-1 = not stored); returns the
    rotated q [num_tokens, num_heads, head_dim]. ``qkv`` is consumed (the native kernel
    rotates it in place)."""
    cos, sin = rope
    if _native_layer_ops(qkv, backend) and cpu_layer_ops.can_rope_store_kv(
            qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache, slot_mapping):
        cpu_layer_ops.rope_store_kv(qkv, num_heads, num_kv_heads, head_dim, cos, sin,
                                    k_cache, v_cache, slot_mapping)
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)[0]
    q, k, v = rotate_qkv_ref(qkv, num_heads, num_kv_heads, head_dim, rope)
    store_kv(k, v, k_cache, v_cache, slot_mapping, backend)
    return q


def silu_and_mul(gate_up: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [num_tokens, 2 * inter] -> [num_tokens, inter]."""
    if _native_layer_ops(gate_up, backend) and cpu_layer_ops.can_silu_and_mul(gate_up):
        return cpu_layer_ops.silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)


def gelu_and_mul(gate_up: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of ``gate_up`` [num_tokens, 2 * inter] ->
    [num_tokens, inter]."""
    if _native_layer_ops(gate_up, backend) and cpu_layer_ops.can_silu_and_mul(gate_up):
        return cpu_layer_ops.gelu_and_mul(gate_up)
    return gelu_and_mul_ref(gate_up)


def argmax_rows(logits: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """Each row's index of its first maximum (a NaN counts as the maximum), int64
    [num_rows], of ``logits`` [num_rows, vocab] in any float dtype: greedy sampling."""
    if _native_layer_ops(logits, backend) and cpu_layer_ops.can_argmax(logits):
        return cpu_layer_ops.argmax_rows(logits)
    # max's indices are argmax's, 3-5x faster than argmax on CPU (its reduction is scalar)
    return logits.max(dim=-1).indices


__all__ = ["AttentionMeta", "Backend", "LoRASlots", "PackedWeight", "Rope", "SGMVMeta",
           "add_lora", "argmax_rows", "cpu_gemm_choice", "fused_add_rms_norm", "gelu_and_mul",
           "linear", "linear_lora",
           "pack_linear_weight", "paged_attention", "resolve_backend", "rms_norm",
           "rope_store_kv", "sgmv_expand", "sgmv_shrink", "silu_and_mul", "store_kv"]
