"""The model families loraplex serves and the facts about each that both the model loader
and the adapter validator need: which linear modules PEFT adapters target and how the
checkpoint names them. Imports neither torch nor transformers (the upload path reads
configs as JSON)."""

from __future__ import annotations

import re
from typing import Final

# config.json's model_type -> the architecture's name as users know it
FAMILIES: Final[dict[str, str]] = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3",
    "phi3": "Phi-3",
    "smollm3": "SmolLM3",
    "olmo2": "OLMo 2",
    "granite": "Granite",
}
SUPPORTED_MODEL_TYPES: Final[tuple[str, ...]] = tuple(FAMILIES)

# The layer's linear modules (PEFT's short names) -> their parent inside a decoder layer.
SPLIT_MODULES: Final[dict[str, str]] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Phi-3 keeps q/k/v and gate/up fused in its checkpoint, and PEFT targets the fused
# modules: an adapter's fused lora_B splits row-wise into its parts, which share lora_A.
FUSED_MODULES: Final[dict[str, str]] = {
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}
FUSED_PARTS: Final[dict[str, tuple[str, ...]]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_FUSED_FAMILIES: Final = frozenset({"phi3"})


def lora_modules(model_type: str) -> dict[str, str]:
    """The family's LoRA-able modules (PEFT short name -> parent), in the engine's order."""
    return dict(FUSED_MODULES if model_type in _FUSED_FAMILIES else SPLIT_MODULES)


def fused_checkpoint(model_type: str) -> bool:
    """Whether the checkpoint (and PEFT) name q/k/v and gate/up as fused modules."""
    return model_type in _FUSED_FAMILIES


def unsupported_model_type(model_type: object) -> str:
    """The one-line refusal of a model type loraplex does not serve."""
    return (f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")


# Words in a model's name that identify its family (checked on the name's last path
# component, lower-cased; "phi-4" is Phi-3's architecture, SmolLM2 a Llama).
_NAME_PATTERNS: Final[tuple[tuple[str, str], ...]] = (
    (r"gemma-?3", "gemma3_text"), (r"gemma-?2", "gemma2"), (r"qwen-?3", "qwen3"),
    (r"qwen-?2", "qwen2"), (r"phi-?[34]", "phi3"), (r"smollm-?3", "smollm3"),
    (r"smollm-?2?(?![0-9])", "llama"), (r"olmo-?2", "olmo2"), (r"granite", "granite"),
    (r"(?<![a-z])mistral|ministral", "mistral"), (r"llama", "llama"),
)


def family_named_by(name: str) -> str | None:
    """The model type a model name (hub id or path) clearly names, or None: no family
    word in its last component, or words of two families."""
    last = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    found = {family for pattern, family in _NAME_PATTERNS if re.search(pattern, last)}
    return found.pop() if len(found) == 1 else None
