"""The architecture facts the model needs, read once from a HuggingFace config: the shapes,
and for each supported family (``families.py``) its norms, activation, attention variant
(scale, soft-capping, sliding windows per layer), rotary embeddings per layer and the
multipliers some families put on embeddings, residuals and logits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from loraplex.errors import ModelLoadError
from loraplex.model.families import FAMILIES, fused_checkpoint, unsupported_model_type
from loraplex.model.rope import RopeSpec, longrope_limit

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
NormLayout = Literal["pre", "sandwich", "post"]
QKNorm = Literal["", "head", "proj"]
_GEMMA = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    # "pre": a norm before attention and before the MLP (Llama); "sandwich": also one
    # after each (Gemma); "post": only after each, on the sublayer's output (OLMo 2)
    norm_layout: NormLayout = "pre"
    norm_offset: float = 0.0  # Gemma's norms multiply by (1 + weight): folded at load
    qk_norm: QKNorm = ""  # "head": RMSNorm over each q/k head; "proj": over all of q / k
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0  # 0: none
    final_softcap: float = 0.0
    embed_scale: float = 1.0
    residual_scale: float = 1.0  # each sublayer's output, before the residual add
    logits_divisor: float = 1.0
    layer_windows: tuple[int, ...] = ()  # per layer, 0: full attention
    layer_ropes: tuple[RopeSpec | None, ...] = ()  # per layer, None: no rotation (NoPE)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def fused_checkpoint(self) -> bool:
        return fused_checkpoint(self.model_type)

    @property
    def max_window(self) -> int:
        """The widest sliding window, 0 where any layer attends to the whole context."""
        return 0 if not self.layer_windows or 0 in self.layer_windows else max(
            self.layer_windows)

    @property
    def max_served_positions(self) -> int:
        """The longest context served exactly: the config's, or for longrope the original
        context (``rope.longrope_limit``)."""
        limits = [lim for spec in self.layer_ropes if spec is not None
                  for lim in [longrope_limit(spec)] if lim is not None]
        return min([self.max_position_embeddings, *limits])

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArgs:
        model_type = getattr(config, "model_type", None)
        if model_type not in FAMILIES:
            raise ModelLoadError(unsupported_model_type(model_type))
        act_field = "hidden_activation" if model_type in _GEMMA else "hidden_act"
        act = getattr(config, act_field, None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"{act_field} {act!r} is not supported; supported: "
                                 f"{', '.join(ACTIVATIONS)}")
        if getattr(config, "use_bidirectional_attention", None):
            raise ModelLoadError("use_bidirectional_attention is not supported; supported: "
                                 "causal attention (false)")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_layers = config.num_hidden_layers
        eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        bias = bool(getattr(config, "attention_bias", False))
        gemma = model_type in _GEMMA
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=bias and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            eos_token_ids=eos_ids,
            hidden_act=act,
            norm_layout="sandwich" if gemma else "post" if model_type == "olmo2" else "pre",
            norm_offset=1.0 if gemma else 0.0,
            qk_norm=("head" if model_type in ("qwen3", "gemma3_text")
                     else "proj" if model_type == "olmo2" else ""),
            attn_scale=(float(config.query_pre_attn_scalar) ** -0.5 if gemma
                        else float(config.attention_multiplier) if model_type == "granite"
                        else None),
            attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
            embed_scale=(config.hidden_size ** 0.5 if gemma else
                         float(config.embedding_multiplier) if model_type == "granite" else 1.0),
            residual_scale=(float(config.residual_multiplier) if model_type == "granite"
                            else 1.0),
            logits_divisor=float(config.logits_scaling) if model_type == "granite" else 1.0,
            layer_windows=_layer_windows(config, model_type, num_layers),
            layer_ropes=_layer_ropes(config, model_type, num_layers, head_dim),
        )


def _layer_types(config: Any, num_layers: int) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        return ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(f"layer_types must list one type per layer ({num_layers})")
    for t in types:
        if t not in LAYER_TYPES:
            raise ModelLoadError(f"layer_types entry {t!r} is not supported; supported: "
                                 f"{', '.join(LAYER_TYPES)}")
    return list(types)


def _layer_windows(config: Any, model_type: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window as HF's model applies it (0: full attention)."""
    window = getattr(config, "sliding_window", None) or 0
    if not isinstance(window, int) or window < 0:
        raise ModelLoadError(f"sliding_window must be a positive integer or null, "
                             f"not {window!r}")
    types = _layer_types(config, num_layers)
    if model_type in ("mistral", "phi3"):  # one window for every layer, when set
        return (window,) * num_layers
    if model_type == "smollm3" and not getattr(config, "use_sliding_window", False):
        return (0,) * num_layers
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _layer_ropes(config: Any, model_type: str, num_layers: int,
                 head_dim: int) -> tuple[RopeSpec | None, ...]:
    params = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
              or {"rope_theta": getattr(config, "rope_theta", 10000.0)})
    if not isinstance(params, Mapping):
        raise ModelLoadError("rope_parameters must be an object")
    types = _layer_types(config, num_layers)
    partial = getattr(config, "partial_rotary_factor", None)
    by_type: dict[str, RopeSpec] = {}
    for layer_type in set(types):
        nested = params.get(layer_type)  # Gemma 3: one set per layer type
        p = dict(nested if isinstance(nested, Mapping) else params)
        if partial is not None:
            p.setdefault("partial_rotary_factor", partial)
        where = f"rope_parameters.{layer_type}" if isinstance(nested, Mapping) \
            else "rope_parameters"
        by_type[layer_type] = RopeSpec.from_parameters(p, head_dim, where)
    ropes: list[RopeSpec | None] = [by_type[t] for t in types]
    if model_type == "smollm3":
        flags = getattr(config, "no_rope_layers", None) or [1] * num_layers
        if len(flags) != num_layers:
            raise ModelLoadError(f"no_rope_layers must have one flag per layer ({num_layers})")
        ropes = [spec if flag else None for spec, flag in zip(ropes, flags, strict=True)]
    return tuple(ropes)
