"""loraplex: multi-tenant LoRA serving over one resident base model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loraplex import openmp

# Before anything of ours imports torch: libgomp reads its wait policy once, when loaded.
openmp.apply_defaults()

if TYPE_CHECKING:
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.llm import LLM, LoRARequest

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import loraplex` (and the CLI's --help) does not pay for torch.
    if name in ("LLM", "LoRARequest"):
        from loraplex import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from loraplex.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
