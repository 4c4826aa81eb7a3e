"""The decoder of every supported family, written for serving: flat token batches over a
paged KV cache.

One layer covers them all (``args.ModelArgs`` says which parts a family has): grouped-query
attention with optional q/k norms, a scale and logit soft-capping of the family's own,
a sliding window per layer; rotary embeddings per layer (global, local or none); RMSNorm
before (Llama), around (Gemma) or after (OLMo 2) each sublayer; SiLU or tanh-GELU gated
MLPs; packed q/k/v and gate/up projections; multipliers on embeddings, residuals and
logits (Gemma, Granite) and final logit soft-capping.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.model.args import ModelArgs
from loraplex.model.lora import LoRALinear, LoRAStep
from loraplex.model.native_decode import LayerParts, NativeDecode
from loraplex.model.rope import RopeSpec, cos_sin_table
from loraplex_kernels import cpu_decode
from loraplex_kernels.meta import AttentionMeta
from loraplex_kernels.ops import (
    Backend,
    PackedWeight,
    fused_add_rms_norm,
    gelu_and_mul,
    linear,
    pack_linear_weight,
    paged_attention,
    rms_norm,
    rope_store_kv,
    silu_and_mul,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, kv_heads, head_dim]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim] float32 each


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, backend)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, backend: Backend | None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; consumes ``x`` and ``residual``."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps, backend)


class Rotary(nn.Module):
    """cos/sin tables of each distinct rotation the layers use (a NoPE layer's: none)."""

    def __init__(self, args: ModelArgs, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.specs: list[RopeSpec | None] = list(dict.fromkeys(args.layer_ropes))
        self.layer_table = [self.specs.index(s) for s in args.layer_ropes]
        self.tables = [tuple(t.to(device) for t in cos_sin_table(
            spec, args.head_dim, max_positions, args.max_position_embeddings))
            for spec in self.specs]

    def forward(self, positions: torch.Tensor) -> list[Rope]:
        """Per distinct rotation, cos and sin at each token's position, ``[num_tokens, 1,
        head_dim]`` each: looked up once per forward and shared by the layers using it."""
        return [(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                for cos, sin in self.tables]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.qkv_proj = LoRALinear(h, [args.q_size, args.kv_size, args.kv_size], args.qkv_bias,
                                   num_slots, max_rank, dtype, device)
        self.o_proj = LoRALinear(args.q_size, [h], args.o_bias, num_slots, max_rank, dtype,
                                 device)
        q_norm, k_norm = {"head": (args.head_dim, args.head_dim),
                          "proj": (args.q_size, args.kv_size)}.get(args.qk_norm, (0, 0))
        self.q_norm = RMSNorm(q_norm, args.rms_norm_eps, dtype, device) if q_norm else None
        self.k_norm = RMSNorm(k_norm, args.rms_norm_eps, dtype, device) if k_norm else None
        self.window = args.layer_windows[layer] if args.layer_windows else 0

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMeta,
                lora: LoRAStep | None, backend: Backend | None) -> torch.Tensor:
        a = self.args
        n = x.shape[0]
        qkv = self.qkv_proj(x, lora)  # [num_tokens, q_size + 2 * kv_size]
        if self.q_norm is not None and self.k_norm is not None:
            self._qk_norm(qkv, self.q_norm, self.k_norm, backend)
        k_cache, v_cache = kv_cache
        q = rope_store_kv(qkv, a.num_heads, a.num_kv_heads, a.head_dim, rope, k_cache,
                          v_cache, meta.slot_mapping, backend)  # [num_tokens, heads, dim]
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, head_dim]
        paged_attention(q, k_cache, v_cache, meta, a.scale, out, backend,
                        window=self.window, softcap=a.attn_softcap)
        return self.o_proj(out.reshape(n, a.q_size), lora)

    def _qk_norm(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                 backend: Backend | None) -> None:
        """RMSNorm of q and k in place in ``qkv``, per head or over each whole projection."""
        a = self.args
        n = qkv.shape[0]
        for lo, hi, norm in ((0, a.q_size, q_norm), (a.q_size, a.q_size + a.kv_size, k_norm)):
            part = qkv[:, lo:hi].reshape(-1, norm.weight.shape[0])  # [rows, normed width]
            qkv[:, lo:hi] = norm(part, backend).view(n, hi - lo)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_up_proj = LoRALinear(h, [i, i], args.mlp_bias, num_slots, max_rank, dtype,
                                       device)
        self.down_proj = LoRALinear(i, [h], args.mlp_bias, num_slots, max_rank, dtype, device)
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, lora: LoRAStep | None,
                backend: Backend | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [num_tokens, 2 * intermediate]
        act = gelu_and_mul if self.gelu else silu_and_mul
        return self.down_proj(act(gate_up, backend), lora)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.layout = args.norm_layout
        self.residual_scale = args.residual_scale
        self.input_layernorm = (RMSNorm(h, eps, dtype, device) if self.layout != "post"
                                else None)
        self.self_attn = Attention(args, layer, num_slots, max_rank, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.mlp = MLP(args, num_slots, max_rank, dtype, device)
        sandwich = self.layout == "sandwich"
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype, device) if sandwich else None
        self.post_feedforward_layernorm = (RMSNorm(h, eps, dtype, device)
                                           if self.layout != "pre" else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: KVCache, meta: AttentionMeta, lora: LoRAStep | None,
                backend: Backend | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from the sublayer output (as vLLM does) so
        that each residual add fuses with the norm after it: takes the previous layer's
        MLP output ``x`` and the stream before it (None: ``x`` is the stream, first layer),
        returns this layer's MLP output and the stream before it."""
        if self.input_layernorm is None:  # "post": the stream itself goes in
            residual = x if residual is None else x + residual
            x = residual
        elif residual is None:
            residual = x
            x = self.input_layernorm(x, backend)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, backend)
        x = self.self_attn(x, rope, kv_cache, meta, lora, backend)
        if self.layout == "pre":
            if self.residual_scale != 1.0:
                x = x * self.residual_scale
            x, residual = self.post_attention_layernorm.add_forward(x, residual, backend)
        else:
            x = self.post_attention_layernorm(x, backend)
            if self.residual_scale != 1.0:
                x = x * self.residual_scale
            if self.pre_feedforward_layernorm is not None:
                x, residual = self.pre_feedforward_layernorm.add_forward(x, residual, backend)
            else:
                residual = x + residual
                x = residual
        x = self.mlp(x, lora, backend)
        if self.post_feedforward_layernorm is not None:
            x = self.post_feedforward_layernorm(x, backend)
        if self.residual_scale != 1.0:
            x = x * self.residual_scale
        return x, residual

    def native_parts(self, rope: int) -> LayerParts:
        """This layer as the native decode layers take it (``rope``: its rotation's index
        in the model's per-step list)."""
        def norm(n: RMSNorm | None) -> tuple[torch.Tensor, float] | None:
            return None if n is None else (n.weight, n.eps)

        attn, mlp = self.self_attn, self.mlp
        return LayerParts(
            norm(self.input_layernorm), (self.post_attention_layernorm.weight,
                                         self.post_attention_layernorm.eps),
            (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
            window=attn.window, softcap=attn.args.attn_softcap, qk_norm=attn.args.qk_norm,
            q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm), norm_layout=self.layout,
            pre_feedforward_norm=norm(self.pre_feedforward_layernorm),
            post_feedforward_norm=norm(self.post_feedforward_layernorm),
            activation=attn.args.hidden_act, residual_scale=self.residual_scale, rope=rope)


class DecoderModel(nn.Module):
    """The decoder plus LM head. Weights start uninitialised; the loader fills them."""

    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Parameter(
            torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(args, i, num_slots, max_rank, dtype, device)
                                    for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.lm_head = (self.embed_tokens if args.tie_word_embeddings else nn.Parameter(
            torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=device),
            requires_grad=False))
        self.rotary = Rotary(args, max_positions, device)
        # as HF multiplies: Gemma by its normaliser in the weights' dtype, Granite by a
        # Python float (computed in float32, then rounded)
        self.embed_scale: torch.Tensor | float | None = (
            None if args.embed_scale == 1.0 else
            torch.tensor(args.embed_scale, dtype=dtype, device=device)
            if args.norm_offset else args.embed_scale)
        self.packed_lm_head: PackedWeight | None = None
        self.native_decode: NativeDecode | None = None  # see pack_weights
        self.native_decode_gap = self._native_decode_gap()

    def _native_decode_gap(self) -> str:
        """What of this family the native decode layers do not run ("" when they run it):
        its steps then go layer by layer, each op still native where one exists. Every
        family ``ModelArgs`` admits runs there now (q/k norms, the three norm layouts,
        SiLU and GELU-tanh, residual multipliers, a rotation per layer are fields of a
        layer's row); what is listed here is what a new family would add."""
        a = self.args
        gaps = [what for what, present in (
            (f"the norm layout {a.norm_layout!r}", a.norm_layout not in cpu_decode.NORM_LAYOUTS),
            (f"q/k norms {a.qk_norm!r}", a.qk_norm not in cpu_decode.QK_NORMS),
            (f"the activation {a.hidden_act!r}", a.hidden_act not in cpu_decode.ACTIVATIONS),
        ) if present]
        return ", ".join(gaps)

    def describe(self) -> str:
        """One line for the load banner: the family and which CPU path its steps take."""
        a = self.args
        windows = sorted({w for w in a.layer_windows if w})
        shape = (f"{a.family}, {a.num_layers} layers"
                 + (f", sliding window {'/'.join(map(str, windows))}" if windows else ""))
        if self.embed_tokens.device.type != "cpu":
            return shape
        if self.native_decode is not None:
            return f"{shape}; decode steps in one native call per step"
        if self.native_decode_gap:
            return (f"{shape}; decode steps run layer by layer (native ops, one call per "
                    f"op): the native decode layers lack {self.native_decode_gap}")
        why = ("not every projection runs the skinny GEMM here (dtype, CPU, "
               "LORAPLEX_CPU_GEMM)" if cpu_decode.available() else
               "the native decode layers are off (LORAPLEX_CPU_DECODE_LAYERS=0) or not built")
        return f"{shape}; decode steps run layer by layer (native ops, one call per op): {why}"

    def pack_weights(self) -> None:
        """GEMM-packed copies of the base weights where faster (float32 or bfloat16 on
        CPU), and, where every projection then runs the skinny GEMM and the family has
        nothing they lack, the native decode layers (``NativeDecode``); call once the
        weights are loaded."""
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.pack_weight()
        self.packed_lm_head = pack_linear_weight(
            self.lm_head, shared=self.args.tie_word_embeddings)
        if self.native_decode_gap:
            return
        layers = cast("list[DecoderLayer]", list(self.layers))
        self.native_decode = NativeDecode.for_layers(
            self.args, self.norm.eps, self.embed_tokens,
            [layer.native_parts(self.rotary.layer_table[i]) for i, layer in enumerate(layers)])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMeta, lora: LoRAStep | None,
                backend: Backend | None = None, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of a flat batch of tokens, after the final
        norm; ``num_layers``: only the first that many layers (a layer-skip draft)."""
        x = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        ropes = self.rotary(positions)
        residual = None
        count = len(range(len(self.layers))[:num_layers])
        native = self.native_decode
        if (native is not None and count > 0 and len(kv_caches) == len(self.layers)
                and native.takes(x, meta, lora, backend)):
            x, residual = native.forward(x, ropes, kv_caches, meta, lora, count)
            return self.norm.add_forward(x, residual, backend)[0]
        table = self.rotary.layer_table
        for i, (layer, kv) in enumerate(list(zip(self.layers, kv_caches,
                                                 strict=True))[:num_layers]):
            x, residual = layer(x, residual, ropes[table[i]], kv, meta, lora, backend)
        if residual is None:
            return self.norm(x, backend)
        return self.norm.add_forward(x, residual, backend)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[num_rows, vocab]: float32, or with ``float32=False`` the model's dtype (for a
        sampler that widens them only where it needs to)."""
        a = self.args
        logits = linear(hidden, self.lm_head, None, self.packed_lm_head)
        if a.logits_divisor != 1.0:
            logits = logits / a.logits_divisor
        if a.final_softcap > 0:  # as HF: divide, tanh, multiply, in the logits' dtype
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits.float() if float32 else logits
