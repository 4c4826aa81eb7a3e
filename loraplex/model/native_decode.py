"""The decoder layers of a CPU step in one native call (``loraplex_kernels.cpu_decode``),
where every projection runs the skinny GEMM: decode steps, and steps of decode rows and
prefill chunks (a prompt admitted while others decode) up to ``skinny_max_rows`` rows, for
every family the decoder serves (each layer's row says its q/k norms, norm layout,
activation, residual multiplier, rotation, window and soft-cap).

The layer-by-layer code (``decoder.DecoderLayer``) calls the same kernels in the same order;
what this saves is the Python between them, per layer and step. A step it does not take
(more rows than ``skinny_max_rows``, LoRA segments the native kernel does not run, another
backend) goes layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.model.args import ModelArgs
from loraplex.model.lora import LoRALinear, LoRAStep
from loraplex_kernels import cpu_decode, cpu_native
from loraplex_kernels.lora_slots import LoRASlots
from loraplex_kernels.meta import AttentionMeta
from loraplex_kernels.ops import Backend, Rope, skinny_max_rows

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (key, value) per layer


Norm = tuple[torch.Tensor, float]  # (weight, eps)


@dataclass(frozen=True)
class LayerParts:
    """What the native layer table takes of one decoder layer (the model hands them over,
    so this module needs nothing of the model's classes). The defaults are a Llama layer's;
    the fields mean what ``cpu_decode.layer_row``'s arguments of the same names do."""

    input_norm: Norm | None  # None in the "post" layout
    post_attention_norm: Norm
    projections: tuple[LoRALinear, LoRALinear, LoRALinear, LoRALinear]  # qkv, o, gate_up, down
    window: int = 0  # the attention's sliding window (0: none)
    softcap: float = 0.0  # its logit soft-capping (0: none)
    qk_norm: str = ""  # "", "head" or "proj"
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    norm_layout: str = "pre"  # "pre", "sandwich" or "post"
    pre_feedforward_norm: Norm | None = None  # "sandwich"
    post_feedforward_norm: Norm | None = None  # "sandwich" and "post"
    activation: str = "silu"  # or "gelu_pytorch_tanh"
    residual_scale: float = 1.0
    rope: int = 0  # the index of its rotation in the step's list (``forward``'s ``ropes``)

    def norms(self) -> list[Norm]:
        return [n for n in (self.input_norm, self.post_attention_norm, self.q_norm,
                            self.k_norm, self.pre_feedforward_norm,
                            self.post_feedforward_norm) if n is not None]


def _weight(norm: Norm | None) -> torch.Tensor | None:
    return None if norm is None else norm[0]


def _projection(module: LoRALinear,
                ) -> tuple[torch.Tensor, torch.Tensor | None, LoRASlots] | None:
    packed = module.packed_weight
    if packed is None or packed.kind != "skinny" or packed.data is not module.weight:
        return None
    if not cpu_decode.can_project(module.weight, module.bias, module.lora):
        return None
    return module.weight, module.bias, module.lora


class NativeDecode:
    """One model's layer table, built once its weights are packed (``for_layers``)."""

    def __init__(self, args: ModelArgs, eps: float, dtype: torch.dtype,
                 layers: torch.Tensor, num_ropes: int, needs_tmp: bool) -> None:
        self.args = args
        self.eps = eps
        self.scale = args.scale
        self.dtype = dtype
        self.layers = layers  # [num_layers, len(LAYER_FIELDS)] int64
        self.num_ropes = num_ropes  # the rotations the rows index (forward's ``ropes``)
        self.needs_tmp = needs_tmp  # a row's layout writes the sublayer outputs apart
        # KV-cache pointer tables by the caches' addresses (a layer-skip draft's steps
        # use its first layers' caches, the target's all of them: one table each)
        self._kv_tables: dict[tuple[int, ...], torch.Tensor] = {}

    @classmethod
    def for_layers(cls, args: ModelArgs, eps: float, embed_tokens: torch.Tensor,
                   layers: Sequence[LayerParts]) -> NativeDecode | None:
        """The native path for a model's ``layers`` (``eps``: its final norm's), or None
        where it cannot run: the library or the switch, a projection not on the skinny
        GEMM (``LORAPLEX_CPU_GEMM``, dtype, CPU)."""
        if not cpu_decode.available() or embed_tokens.device.type != "cpu":
            return None
        rows = []
        for layer in layers:
            projections = [_projection(m) for m in layer.projections]
            present = [p for p in projections if p is not None]
            if len(present) != len(projections):
                return None
            if any(norm_eps != eps or not weight.is_contiguous()
                   for weight, norm_eps in layer.norms()):
                return None
            rows.append(cpu_decode.layer_row(
                _weight(layer.input_norm), layer.post_attention_norm[0], present,
                window=layer.window, softcap=layer.softcap, qk_norm=layer.qk_norm,
                q_norm=_weight(layer.q_norm), k_norm=_weight(layer.k_norm),
                norm_layout=layer.norm_layout,
                pre_feedforward_norm=_weight(layer.pre_feedforward_norm),
                post_feedforward_norm=_weight(layer.post_feedforward_norm),
                activation=layer.activation, residual_scale=layer.residual_scale,
                rope=layer.rope))
        num_ropes = 1 + max((layer.rope for layer in layers), default=0)
        needs_tmp = any(layer.norm_layout != "pre" for layer in layers)
        return cls(args, eps, embed_tokens.dtype, torch.tensor(rows, dtype=torch.int64),
                   num_ropes, needs_tmp)

    def takes(self, x: torch.Tensor, meta: AttentionMeta, lora: LoRAStep | None,
              backend: Backend | None) -> bool:
        """Whether this step runs natively: CPU, rows (decode rows and prefill chunks' tokens)
        few enough for the skinny GEMM, and LoRA (if any) all in short segments."""
        if not (x.is_cpu if backend is None else backend == "cpu"):
            return False
        if not 0 < x.shape[0] <= skinny_max_rows(x.dtype):
            return False
        if lora is None or not lora.meta.has_lora:
            return True
        return (lora.backend in (None, "cpu") and lora.meta.short_segments is not None
                and not lora.meta.long_segment_ids)

    def _kv_caches(self, kv_caches: KVCaches, num_layers: int) -> torch.Tensor:
        key = tuple(t.data_ptr() for kv in kv_caches[:num_layers] for t in kv)
        table = self._kv_tables.get(key)
        if table is None:
            shape = kv_caches[0][0].shape
            a = self.args
            for k, v in kv_caches[:num_layers]:
                if not (k.shape == v.shape == shape and k.dtype == v.dtype == self.dtype
                        and k.is_contiguous() and v.is_contiguous() and k.is_cpu
                        and v.is_cpu and shape[2:] == (a.num_kv_heads, a.head_dim)):
                    raise ValueError("the KV caches do not fit the native decode layers")
            if len(self._kv_tables) >= 4:  # caches reallocated: the old tables go
                self._kv_tables.clear()
            table = torch.tensor(key, dtype=torch.int64).reshape(num_layers, 2)
            self._kv_tables[key] = table
        return table

    def forward(self, x: torch.Tensor, ropes: Sequence[Rope], kv_caches: KVCaches,
                meta: AttentionMeta, lora: LoRAStep | None, num_layers: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over embeddings ``x`` [rows, hidden] (consumed: it becomes the
        residual stream), ``ropes``: the step's (cos, sin) of each distinct rotation (a
        layer's ``LayerParts.rope`` indexes it); returns the last MLP output and the stream
        before it, as the layer loop does. Call where ``takes`` is true."""
        a = self.args
        n = x.shape[0]
        assert x.dtype == self.dtype and x.is_contiguous() and x.shape[1] == a.hidden_size
        assert len(ropes) >= self.num_ropes
        cos, sin = ropes[0]
        for c, s in ropes:
            assert c.dtype == s.dtype == torch.float32
            assert c.stride() == s.stride() == cos.stride() and c.stride(2) == 1
            assert c.shape == s.shape == (n, 1, a.head_dim)
        # each rotation's cos and sin pointers, where the rows take more than the first
        rope_table = (torch.tensor([[c.data_ptr(), s.data_ptr()] for c, s in ropes],
                                   dtype=torch.int64) if self.num_ropes > 1 else None)
        slots = meta.slot_mapping
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (n,)
        tables, lens = meta.block_tables, meta.seq_lens
        assert tables.dtype == lens.dtype == torch.int32 and tables.is_contiguous()
        seq_ids, seq_rows = meta.decode_seq_ids, meta.decode_rows
        prefill_ids, starts = meta.prefill_seq_ids, meta.query_start_loc
        assert seq_ids.dtype == seq_rows.dtype == prefill_ids.dtype == torch.int64
        assert starts.dtype == torch.int32 and starts.is_contiguous()
        assert seq_ids.is_contiguous() and seq_rows.is_contiguous()
        assert prefill_ids.is_contiguous()
        kv = self._kv_caches(kv_caches, num_layers)
        k_cache = kv_caches[0][0]
        segments = lora.meta.short_segments if lora is not None and lora.meta.has_lora \
            else None
        if segments is not None:
            assert segments.dtype == torch.int64 and segments.is_contiguous()
        num_segs = 0 if segments is None else segments.shape[1]
        out = torch.empty_like(x)
        buffers = {"qkv": a.q_size + 2 * a.kv_size, "attn": a.q_size,
                   "gate_up": 2 * a.intermediate_size, "act": a.intermediate_size,
                   **({"tmp": a.hidden_size} if self.needs_tmp else {})}
        scratch = {k: torch.empty(n, w, dtype=x.dtype) for k, w in buffers.items()}
        bf16 = x.dtype == torch.bfloat16
        seg_ptr = 0 if segments is None else segments.data_ptr()
        step = {
            "rows": n, "hidden": a.hidden_size, "q_size": a.q_size, "kv_size": a.kv_size,
            "inter": a.intermediate_size, "num_heads": a.num_heads,
            "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
            "block_size": k_cache.shape[1], "num_cache_slots": k_cache.shape[0] * k_cache.shape[1],
            "x": out.data_ptr(), "residual": x.data_ptr(),
            **{k: t.data_ptr() for k, t in scratch.items()},
            "cos": cos.data_ptr(), "sin": sin.data_ptr(), "cs_stride": cos.stride(0),
            "slot_mapping": slots.data_ptr(), "block_tables": tables.data_ptr(),
            "table_stride": tables.stride(0), "seq_lens": lens.data_ptr(),
            "seq_ids": seq_ids.data_ptr(), "seq_rows": seq_rows.data_ptr(),
            "num_seqs": seq_ids.numel(), "query_start_loc": starts.data_ptr(),
            "prefill_ids": prefill_ids.data_ptr(), "num_prefill": prefill_ids.numel(),
            "seg_first": seg_ptr, "seg_len": seg_ptr + 8 * num_segs,
            "seg_slot": seg_ptr + 16 * num_segs, "num_segs": num_segs,
            "first": 1, "bf16": int(bf16),
            "impl": cpu_native.BF16_IMPLS[cpu_native.bf16_impl()] if bf16 else 0,
            "num_threads": torch.get_num_threads(),
            "ropes": 0 if rope_table is None else rope_table.data_ptr(),
            "num_ropes": 0 if rope_table is None else len(ropes),
        }
        step.setdefault("tmp", 0)
        cpu_decode.run(self.layers, num_layers, kv, step, self.eps, self.scale)
        return out, x
