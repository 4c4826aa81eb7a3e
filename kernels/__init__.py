"""loraplex kernels: SGMV LoRA shrink/expand, paged attention and KV store.

Installed as ``loraplex_kernels``. Each op has a PyTorch reference (the tests' oracle and
the CPU fallback) and a Triton kernel (used on CUDA); on CPU, native C kernels
(``csrc/``, built on first use) take float32 decode attention and LoRA. ``loraplex_kernels.ops``
is the single dispatch point.
"""

from loraplex_kernels.meta import AttentionMeta, SGMVMeta

__all__ = ["AttentionMeta", "SGMVMeta"]
