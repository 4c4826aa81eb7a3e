"""A Llama-family decoder written for serving: flat token batches over a paged KV cache.

Covers Llama, Mistral and Qwen2 (q/k/v bias): grouped-query attention, RoPE (default,
linear, llama3), RMSNorm, tied embeddings, packed q/k/v and gate/up projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.model.args import ModelArgs, rope_inv_freq
from loraplex.model.lora import LoRALinear, LoRAStep
from loraplex_kernels.meta import AttentionMeta
from loraplex_kernels.ops import (
    Backend,
    PackedWeight,
    linear,
    pack_linear_weight,
    paged_attention,
    store_kv,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, kv_heads, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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


Rope = tuple[torch.Tensor, torch.Tensor]


def _rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


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
        # q and k sit side by side in qkv: rotate both in one pass.
        qk = _rotate(qkv[:, :a.q_size + a.kv_size].view(n, a.num_heads + a.num_kv_heads,
                                                          a.head_dim), rope)
        q, k = qk[:, :a.num_heads], qk[:, a.num_heads:]  # [num_tokens, heads | kv_heads, dim]
        v = qkv[:, a.q_size + a.kv_size:].reshape(n, a.num_kv_heads, a.head_dim).contiguous()
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend)
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, head_dim]
        paged_attention(q, k_cache, v_cache, meta, self.scale, out, backend)
        return self.o_proj(out.reshape(n, a.q_size), lora)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = LoRALinear(h, [i, i], args.mlp_bias, num_slots, max_rank, dtype,
                                       device)
        self.down_proj = LoRALinear(i, [h], args.mlp_bias, num_slots, max_rank, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [num_tokens, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.self_attn = Attention(args, num_slots, max_rank, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype,
                                                device)
        self.mlp = MLP(args, num_slots, max_rank, dtype, device)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMeta,
                lora: LoRAStep | None, backend: Backend | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, lora, backend)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


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

    def pack_weights(self) -> None:
        """GEMM-packed copies of the base weights where faster (float32 or bfloat16 on
        CPU); call once the weights are loaded."""
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.pack_weight()
        self.packed_lm_head = pack_linear_weight(
            self.lm_head, shared=self.args.tie_word_embeddings)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMeta, lora: LoRAStep | None,
                backend: Backend | None = None, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of a flat batch of tokens, after the final
        norm; ``num_layers``: only the first that many layers (a layer-skip draft)."""
        x = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        rope = self.rotary(positions)
        for layer, kv in list(zip(self.layers, kv_caches, strict=True))[:num_layers]:
            x = layer(x, rope, kv, meta, lora, backend)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head, None,
                      self.packed_lm_head).float()  # [num_rows, vocab]
