"""loraplex's kernels: LoRA for batches that mix adapters, paged attention, the decoder's
per-layer ops and, on CPU, the base projections' decode GEMMs.

The folder ``kernels/`` installs as ``loraplex_kernels`` (PyPI already has ``kernels``).
``loraplex_kernels.ops`` is the one dispatch point: Triton kernels on CUDA; on CPU native
C kernels (``csrc/``, built on first use; float32 and bfloat16) where they apply; the
PyTorch references (``*_ref.py``), the tests' oracle, for the rest. See kernels/README.md.
"""

from loraplex_kernels.meta import AttentionMeta, SGMVMeta

__all__ = ["AttentionMeta", "SGMVMeta"]
