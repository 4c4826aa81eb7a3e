"""A Llama-family decoder written for serving: flat token batches over a paged KV cache.

Covers Llama, Mistral and Qwen2 (q/k/v bias): grouped-query attention, RoPE (default,
linear, llama3), RMSNorm, tied embeddings, packed q/k/v and gate/up projections.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.model.args import ModelArgs, rope_inv_freq
from loraplex.model.lora import LoRALinear, LoRAStep
from loraplex.model.native_decode import LayerParts, NativeDecode
from loraplex_kernels.meta import AttentionMeta
from loraplex_kernels.ops import (
    Backend,
    PackedWeight,
    Rope,
    fused_add_rms_norm,
    linear,
    pack_linear_weight,
    paged_attention,
    rms_norm,
    rope_store_kv,
    silu_and_mul,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, kv_heads, head_dim]


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
    def __init__(self, args: ModelArgs, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv = rope_inv_freq(args)  # [head_dim // 2] float64
        pos = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(pos, inv)  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().float().to(device)
        self.sin = emb.sin().float().to(device)

    def forward(self, positions: torch.Tensor) -> Rope:
        """cos and sin at each token's position, ``[num_tokens, 1, head_dim]`` each: looked up
        once per forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.qkv_proj = LoRALinear(h, [args.q_size, args.kv_size, args.kv_size], args.qkv_bias,
                                   num_slots, max_rank, dtype, device)
        self.o_proj = LoRALinear(args.q_size, [h], args.o_bias, num_slots, max_rank, dtype,
                                 device)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMeta,
                lora: LoRAStep | None, backend: Backend | None) -> torch.Tensor:
        a = self.args
        n = x.shape[0]
        qkv = self.qkv_proj(x, lora)  # [num_tokens, q_size + 2 * kv_size]
        k_cache, v_cache = kv_cache
        q = rope_store_kv(qkv, a.num_heads, a.num_kv_heads, a.head_dim, rope, k_cache,
                          v_cache, meta.slot_mapping, backend)  # [num_tokens, heads, dim]
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, head_dim]
        paged_attention(q, k_cache, v_cache, meta, self.scale, out, backend)
        return self.o_proj(out.reshape(n, a.q_size), lora)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_up_proj = LoRALinear(h, [i, i], args.mlp_bias, num_slots, max_rank, dtype,
                                       device)
        self.down_proj = LoRALinear(i, [h], args.mlp_bias, num_slots, max_rank, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoRAStep | None,
                backend: Backend | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [num_tokens, 2 * intermediate]
        return self.down_proj(silu_and_mul(gate_up, backend), lora)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.self_attn = Attention(args, num_slots, max_rank, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype,
                                                device)
        self.mlp = MLP(args, num_slots, max_rank, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: KVCache, meta: AttentionMeta, lora: LoRAStep | None,
                backend: Backend | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from the sublayer output (as vLLM does) so
        that each residual add fuses with the norm after it: takes the previous layer's
        MLP output ``x`` and the stream before it (None: ``x`` is the stream, first layer),
        returns this layer's MLP output and the stream before it."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x, backend)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, backend)
        x = self.self_attn(x, rope, kv_cache, meta, lora, backend)
        x, residual = self.post_attention_layernorm.add_forward(x, residual, backend)
        return self.mlp(x, lora, backend), residual


class LlamaModel(nn.Module):
    """The decoder plus LM head. Weights start uninitialised; the loader fills them."""

    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Parameter(
            torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(args, num_slots, max_rank, dtype, device)
                                    for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.lm_head = (self.embed_tokens if args.tie_word_embeddings else nn.Parameter(
            torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=device),
            requires_grad=False))
        self.rotary = Rotary(args, max_positions, device)
        self.packed_lm_head: PackedWeight | None = None
        self.native_decode: NativeDecode | None = None  # see pack_weights

    def pack_weights(self) -> None:
        """GEMM-packed copies of the base weights where faster (float32 or bfloat16 on
        CPU), and, where every projection then runs the skinny GEMM, the native decode
        layers (``NativeDecode``); call once the weights are loaded."""
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.pack_weight()
        self.packed_lm_head = pack_linear_weight(
            self.lm_head, shared=self.args.tie_word_embeddings)
        parts = [LayerParts((layer.input_layernorm.weight, layer.input_layernorm.eps),
                            (layer.post_attention_layernorm.weight,
                             layer.post_attention_layernorm.eps),
                            (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                             layer.mlp.gate_up_proj, layer.mlp.down_proj))
                 for layer in cast("list[DecoderLayer]", list(self.layers))]
        self.native_decode = NativeDecode.for_layers(self.args, self.norm.eps,
                                                     self.embed_tokens, parts)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMeta, lora: LoRAStep | None,
                backend: Backend | None = None, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of a flat batch of tokens, after the final
        norm; ``num_layers``: only the first that many layers (a layer-skip draft)."""
        x = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        rope = self.rotary(positions)
        residual = None
        count = len(range(len(self.layers))[:num_layers])
        native = self.native_decode
        if (native is not None and count > 0 and len(kv_caches) == len(self.layers)
                and native.takes(x, meta, lora, backend)):
            x, residual = native.forward(x, rope, kv_caches, meta, lora, count)
            return self.norm.add_forward(x, residual, backend)[0]
        for layer, kv in list(zip(self.layers, kv_caches, strict=True))[:num_layers]:
            x, residual = layer(x, residual, rope, kv, meta, lora, backend)
        if residual is None:
            return self.norm(x, backend)
        return self.norm.add_forward(x, residual, backend)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[num_rows, vocab]: float32, or with ``float32=False`` the model's dtype (for a
        sampler that widens them only where it needs to)."""
        logits = linear(hidden, self.lm_head, None, self.packed_lm_head)
        return logits.float() if float32 else logits
