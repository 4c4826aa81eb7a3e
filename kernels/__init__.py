"""loraplex kernels: SGMV LoRA shrink/expand, paged attention and KV store.

Installed as ``loraplex_kernels``. Each op has a PyTorch reference (used on CPU and as the
tests' oracle) and a Triton kernel (used on CUDA). ``loraplex_kernels.ops`` is the single
dispatch point.
"""

from loraplex_kernels.meta import AttentionMeta, SGMVMeta

__all__ = ["AttentionMeta", "SGMVMeta"]
