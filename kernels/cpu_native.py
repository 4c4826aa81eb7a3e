"""Native CPU kernels: built from ``csrc/cpu_kernels.c`` on first use, called via ctypes.

The CPU fast path for what the PyTorch reference does with many small ops: decode
attention over the paged cache, and LoRA for many short (decode) segments. The reference stays the oracle and the fallback: when no
C compiler is found, the build fails, or ``LORAPLEX_CPU_KERNELS=0`` is set, ``available()``
is False and the dispatcher uses the reference.

The library is compiled with ``-march=native``, so the cache key includes the compiler,
the flags and the CPU's feature flags: a cache directory shared between machines never
hands one machine another's instructions. Builds are atomic (temporary file, rename).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from loraplex_kernels.lora_slots import LoRASlots
from loraplex_kernels.meta import AttentionMeta

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# gnu11, not c11: ISO mode turns off FMA contraction (-ffp-contract=off), halving speed.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_ENV_SWITCH = "LORAPLEX_CPU_KERNELS"
_ENV_CACHE = "LORAPLEX_KERNEL_CACHE"

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def cache_dir() -> Path:
    explicit = os.environ.get(_ENV_CACHE)
    if explicit:
        return Path(explicit)
    home = os.environ.get("LORAPLEX_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "loraplex")
    return Path(home) / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def build(compiler: str | None = None, directory: Path | None = None) -> Path:
    """Compiles the library if this machine has no build of the current source yet."""
    cc = compiler or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([_SOURCE.read_text(encoding="utf-8"), cc, *version,
                                    *_FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building {_SOURCE.name} failed: {proc.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU kernels unavailable, using the PyTorch reference: %s", exc)
        return None
    fn = lib.paged_decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                   _i64, _i64, _i64, ctypes.c_float, _ptr, _i64, _i64, ctypes.c_int]
    fn = lib.lora_segments_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr,
                   _ptr, ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def can_decode(query: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native decode kernel takes these tensors (float32 CPU, unit last stride,
    contiguous cache)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and k_cache.dtype == torch.float32 and out.dtype == torch.float32
            and query.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous())


def paged_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    """Attention of every decode row (one query token) over its sequence's cached keys."""
    lib = _library()
    assert lib is not None, "native CPU kernels are not available"
    assert can_decode(query, k_cache, out) and v_cache.is_contiguous()
    assert v_cache.shape == k_cache.shape and query.shape == out.shape
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    seq_ids, rows = meta.decode_seq_ids, meta.decode_rows
    if seq_ids.numel() == 0:
        return
    tables, lens = meta.block_tables, meta.seq_lens
    assert tables.dtype == torch.int32 and tables.is_contiguous()
    assert lens.dtype == torch.int32 and seq_ids.dtype == rows.dtype == torch.int64
    status = lib.paged_decode_attention_f32(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), seq_ids.data_ptr(), rows.data_ptr(),
        seq_ids.numel(), num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale,
        out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    if status != 0:
        raise MemoryError("native decode attention could not allocate its scratch memory")


def can_lora(x: torch.Tensor, out: torch.Tensor, slots: LoRASlots) -> bool:
    """Whether the native LoRA kernel takes these tensors (float32 CPU, unit last stride,
    the per-slot layout)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and out.dtype == torch.float32 and slots.dtype == torch.float32
            and slots.layout == "per_slot" and x.stride(1) == 1 and out.stride(1) == 1)


def add_lora(
    out: torch.Tensor,  # [num_tokens, out], accumulated into
    x: torch.Tensor,  # [num_tokens, in]
    segments: torch.Tensor,  # [3, num_segments] int64: first token, length, slot
    slots: LoRASlots,
) -> None:
    """``out[t] += x[t] @ A_s^T @ B_s^T`` (scale folded into B) for each segment's tokens."""
    lib = _library()
    assert lib is not None, "native CPU kernels are not available"
    assert can_lora(x, out, slots) and x.shape[0] == out.shape[0]
    assert x.shape[1] == slots.in_features and out.shape[1] == slots.slice_offsets[-1]
    assert segments.dtype == torch.int64 and segments.is_contiguous() and segments.shape[0] == 3
    num_segments = segments.shape[1]
    if num_segments == 0:
        return
    status = lib.lora_segments_f32(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[1], out.shape[1],
        segments[0].data_ptr(), segments[1].data_ptr(), segments[2].data_ptr(), num_segments,
        slots.at_ptrs.data_ptr(), slots.bt_ptrs.data_ptr(), slots.ranks.data_ptr(),
        torch.get_num_threads())
    if status != 0:
        raise MemoryError("native LoRA could not allocate its scratch memory")
