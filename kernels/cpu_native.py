"""Native CPU kernels: built from ``csrc/`` on first use, called via ctypes.

The CPU fast path for what the PyTorch reference does with many small ops: decode
attention over the paged cache, and LoRA for many segments of one slot's tokens. The
reference stays the oracle and the fallback: when no C compiler is found, the build
fails, or ``LORAPLEX_CPU_KERNELS=0`` is set, ``available()`` is False and the dispatcher
uses the reference.

One source per kernel and dtype (``cpu_attention_f32.c``, ``cpu_lora_f32.c``, and the
``_bf16`` pair with float32 accumulation), one library. The bfloat16 kernels come in two
implementations (``bf16_impls``): AVX-512 BF16 dot products, compiled in only where the
CPU has ``avx512_bf16``, and a portable one that widens bf16 to float32. The best one
available runs; ``LORAPLEX_CPU_BF16=portable`` forces the portable one (tests run both).
Where the CPU has AMX, the bfloat16 skinny GEMM of decode batches runs on its tiles
(``skinny_amx``; ``LORAPLEX_CPU_AMX=0`` keeps it on AVX-512 BF16).

The library is compiled with ``-march=native``, so the cache key includes the compiler,
the flags and the CPU's feature flags: a cache directory shared between machines never
hands one machine another's instructions. One cache per user (``~/.cache/loraplex/kernels``,
whatever ``LORAPLEX_HOME`` is), so a second home or a test's fresh home reuses the build.
The sources compile in parallel, one object each, then link; a build is atomic (temporary
folder, rename) and one process builds a key while others wait on its lock.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

from loraplex_kernels.lora_slots import LoRASlots
from loraplex_kernels.meta import AttentionMeta

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [*(_CSRC / f"{kernel}_{dtype}.c" for kernel in ("cpu_attention", "cpu_lora")
              for dtype in ("f32", "bf16")), _CSRC / "cpu_layer_ops.c",
            _CSRC / "cpu_prefill_attention.c", _CSRC / "cpu_skinny_gemm.c",
            _CSRC / "cpu_skinny_amx.c", _CSRC / "cpu_decode_layers.c"]
_HEADERS = [_CSRC / "common.h", _CSRC / "bf16.h", _CSRC / "decode_attention.h",
            _CSRC / "lora.h", _CSRC / "kernels.h", _CSRC / "spin_barrier.h"]
# gnu11, not c11: ISO mode turns off FMA contraction (-ffp-contract=off), halving speed.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_ENV_SWITCH = "LORAPLEX_CPU_KERNELS"
_ENV_CACHE = "LORAPLEX_KERNEL_CACHE"
_ENV_BF16 = "LORAPLEX_CPU_BF16"
_ENV_AMX = "LORAPLEX_CPU_AMX"
_ENV_READ_AHEAD = "LORAPLEX_CPU_LORA_READ_AHEAD"
# implementation name -> the C kernels' `impl` (csrc/bf16.h), best first
BF16_IMPLS = {"avx512_bf16": 1, "portable": 0}

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def cache_dir() -> Path:
    """``$LORAPLEX_KERNEL_CACHE``, else the user's ``$XDG_CACHE_HOME/loraplex/kernels``
    (``~/.cache/...``): one per user, not per ``LORAPLEX_HOME``, since a build depends only
    on the sources, the compiler and the CPU."""
    explicit = os.environ.get(_ENV_CACHE)
    if explicit:
        return Path(explicit)
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                  ".cache")
    return Path(user_cache) / "loraplex" / "kernels"


def _cpuinfo(*keys: str) -> str | None:
    """The value of /proc/cpuinfo's first line starting with one of ``keys``, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_signature() -> str:
    flags = _cpuinfo("flags", "Features")
    if flags is not None:
        return flags
    import platform

    return platform.machine() + platform.processor()


@functools.cache
def native_lora_any_length() -> bool:
    """Whether float32 LoRA segments of every length go to the native kernel (else those
    past ``meta.SHORT_SEGMENT_LEN`` go to per-slot matmuls): where the kernel has AVX-512.
    On a Zen 4 EPYC the native kernel measured 1.37-1.82x the matmuls at 512 tokens,
    1.23-1.64x at 1,024 and 1.07-1.54x at a whole 2,048-token chunk (ranks 32 and 8;
    benchmarks/lora_decode.py --crossover, docs/benchmarks.md); on a Zen 5 1.74-1.95x at
    512 tokens and 1.51-1.70x at 2,048 (torch's float32 matmul there is MKL's sgemm on its
    AVX2 path); on a Xeon with AMX, where MKL runs its AVX-512 kernels, 1.37-1.43x at 512
    tokens, 1.28-1.36x at 1,024 and 1.23-1.45x at 2,048 (two runs)."""
    return "avx512f" in _cpu_signature().split() and available()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


Progress = Callable[[str], None]
# gcc's own flags for one object; -shared is the link's
_COMPILE_FLAGS = [f for f in _FLAGS if f != "-shared"]
# a build folder this old belongs to no running build (a killed one leaves it)
_ABANDONED_BUILD_S = 3600.0


def build(compiler: str | None = None, directory: Path | None = None,
          csrc: Path | None = None, flags: Sequence[str] = (),
          progress: Progress | None = None, jobs: int | None = None) -> Path:
    """Compiles the library if this machine has no build of the current source yet.
    ``csrc``: a folder holding every C source and header of another revision (benchmarks),
    compiled instead of this tree's. ``flags``: more compiler flags (tests: the AVX2
    kernels of a build with AVX-512 turned off, on a CPU that has it). ``progress`` is
    told each stage in one line (what is compiled where, each source with its time, the
    link), or that a cached build is used; ``jobs``: sources compiled at once (default:
    the CPUs this process may run on)."""
    sources = sorted(csrc.glob("*.c")) if csrc else _SOURCES
    headers = sorted(csrc.glob("*.h")) if csrc else _HEADERS
    cc = compiler or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    texts = [f.read_text(encoding="utf-8") for f in (*sources, *headers)]
    key = hashlib.sha256("\0".join([*texts, cc, *version, *_FLAGS, *flags,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"cpu_kernels-{key}.so"
    say = progress or (lambda _line: None)
    if target.exists():
        say(f"using the cached build {target}")
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory / f".cpu_kernels-{key}.lock", say):
        if target.exists():  # built by the process we waited for
            say(f"using the build another process just made, {target}")
            return target
        _remove_abandoned_builds(directory)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=directory) as work:
            _compile(cc, sources, [*_COMPILE_FLAGS, *flags], Path(work), target, csrc,
                     jobs or len(os.sched_getaffinity(0)), say)
    return target


def _compile(cc: str, sources: Sequence[Path], flags: Sequence[str], work: Path,
             target: Path, csrc: Path | None, jobs: int, say: Progress) -> None:
    """Each source to an object in ``work``, ``jobs`` at a time, then one link, renamed to
    ``target`` when complete."""
    started = time.monotonic()
    jobs = max(1, min(jobs, len(sources)))
    say(f"compiling the native CPU kernels ({len(sources)} sources, {jobs} at a time, with "
        f"{cc}) into {target.parent}; once per machine and source")

    def compile_one(source: Path) -> tuple[Path, float]:
        began = time.monotonic()
        proc = subprocess.run([cc, *flags, "-c", str(source), "-o",
                               str(work / f"{source.stem}.o")],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building the kernels in {csrc or _CSRC} failed: "
                               f"{proc.stderr.strip()[:2000]}")
        return source, time.monotonic() - began

    # The largest first: the longest compile (the skinny GEMM's, ~2/3 of all) starts at once
    # and the rest share the other cores meanwhile.
    by_size = sorted(sources, key=lambda source: source.stat().st_size, reverse=True)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compile_one, source) for source in by_size]
        for done, future in enumerate(as_completed(futures), start=1):
            source, seconds = future.result()
            say(f"compiled {source.name} in {seconds:.1f} s ({done}/{len(sources)})")
    began = time.monotonic()
    library = work / target.name
    proc = subprocess.run([cc, "-shared", "-fopenmp", *(str(work / f"{s.stem}.o")
                                                         for s in sources),
                           "-o", str(library), "-lm"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"linking the kernels of {csrc or _CSRC} failed: "
                           f"{proc.stderr.strip()[:2000]}")
    os.replace(library, target)
    say(f"linked in {time.monotonic() - began:.1f} s; the kernels took "
        f"{time.monotonic() - started:.1f} s")


@contextmanager
def _build_lock(path: Path, say: Progress) -> Iterator[None]:
    """One builder per key: the others wait for it (and then use its library)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("waiting for another process that is compiling the same kernels")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_abandoned_builds(directory: Path) -> None:
    cutoff = time.time() - _ABANDONED_BUILD_S
    for path in directory.glob(".build-*"):
        try:
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def prepare(progress: Progress | None = None) -> bool:
    """Builds the library now (unless cached or switched off), telling ``progress`` each
    stage, and says whether the native kernels are available. What a command that loads a
    model calls first, so a first build is seen rather than silent."""
    if os.environ.get(_ENV_SWITCH, "1") != "0":
        try:
            build(progress=progress)
        except (OSError, RuntimeError):
            pass  # _library logs it and falls back to the reference
    return available()


def load(path: Path) -> ctypes.CDLL:
    """The library built at ``path``, its functions declared (also how a benchmark loads a
    build of another revision's source beside this one)."""
    lib = ctypes.CDLL(str(path))
    # The attention kernels' last two arguments, the sliding window and the logit soft-cap,
    # come last so that a build of an older revision (benchmarks) ignores them.
    fn = lib.paged_decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                   _i64, _i64, _i64, ctypes.c_float, _ptr, _i64, _i64, ctypes.c_int,
                   _i64, ctypes.c_float]
    fn = lib.paged_decode_attention_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                   _i64, _i64, _i64, ctypes.c_float, _ptr, _i64, _i64, ctypes.c_int,
                   ctypes.c_int, _i64, ctypes.c_float]
    fn = lib.paged_prefill_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                   _i64, _i64, _i64, ctypes.c_float, _ptr, _i64, _i64, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, _i64, ctypes.c_float]
    for name, extra in (("lora_segments_f32", []), ("lora_segments_bf16", [ctypes.c_int])):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr,
                       _ptr, _ptr, _ptr, _ptr, _i64, ctypes.c_int, *extra]
    lib.loraplex_bf16_impls.restype = ctypes.c_int
    lib.loraplex_bf16_impls.argtypes = []
    if hasattr(lib, "loraplex_lora_tile"):  # a build of an older revision may lack it
        lib.loraplex_lora_tile.restype = ctypes.c_int
        lib.loraplex_lora_tile.argtypes = []
    if hasattr(lib, "loraplex_lora_rank_multiple"):  # older builds: 16 (lora_rank_multiple_of)
        lib.loraplex_lora_rank_multiple.restype = ctypes.c_int
        lib.loraplex_lora_rank_multiple.argtypes = [ctypes.c_int]
    for name in ("skinny_linear_f32", "skinny_linear_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_int]
    for name, extra in (("skinny_lora_f32", []), ("skinny_lora_bf16", [ctypes.c_int])):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr,
                       _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, ctypes.c_int, *extra]
    lib.loraplex_skinny_impls.restype = ctypes.c_int
    lib.loraplex_skinny_impls.argtypes = []
    if hasattr(lib, "loraplex_skinny_amx"):  # a build of an older revision may lack it
        lib.loraplex_skinny_amx.restype = ctypes.c_int
        lib.loraplex_skinny_amx.argtypes = [ctypes.c_int]
    if hasattr(lib, "loraplex_lora_read_ahead"):  # as above
        lib.loraplex_lora_read_ahead.restype = ctypes.c_int
        lib.loraplex_lora_read_ahead.argtypes = [ctypes.c_int]
    if hasattr(lib, "decode_layers"):  # a build of an older revision may lack it
        lib.decode_layers.restype = ctypes.c_int
        lib.decode_layers.argtypes = [_ptr, _i64, _ptr, _ptr, ctypes.c_float, ctypes.c_float]
        for name in ("decode_layer_fields", "decode_step_fields"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = []
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return None
    try:
        lib = load(build())
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU kernels unavailable, using the PyTorch reference: %s", exc)
        return None
    _set_skinny_amx(lib, amx_choice() == "auto")
    return lib


def available() -> bool:
    return _library() is not None


@functools.cache
def lora_tile(dtype: torch.dtype) -> int | None:
    """The width of the tiled layout's blocks that this machine's LoRA kernel reads for
    ``dtype`` (``lora_slots.tiled_layout``), or None when no native kernel takes it (the
    library unavailable, or a dtype it has no kernel for)."""
    lib = _library()
    return None if lib is None or dtype not in _NATIVE_DTYPES else lora_tile_of(lib)


def lora_tile_of(lib: ctypes.CDLL) -> int:
    """The tile width of a loaded build (benchmarks load another revision's beside it)."""
    if not hasattr(lib, "loraplex_lora_tile"):
        raise RuntimeError("this build's LoRA kernels read the untiled layout of an older "
                           "revision")
    return int(lib.loraplex_lora_tile())


@functools.cache
def lora_rank_multiple(dtype: torch.dtype) -> int | None:
    """The multiple this machine's LoRA kernel for ``dtype`` wants a slot's summed rank
    padded to in its tiled layout (``lora_slots.LoRASlots.prepare``); None where
    ``lora_tile`` is None."""
    lib = _library()
    if lib is None or dtype not in _NATIVE_DTYPES:
        return None
    return lora_rank_multiple_of(lib, dtype)


def lora_rank_multiple_of(lib: ctypes.CDLL, dtype: torch.dtype) -> int:
    """The rank multiple of a loaded build (16 for a revision from before it was asked)."""
    if not hasattr(lib, "loraplex_lora_rank_multiple"):
        return 16
    return int(lib.loraplex_lora_rank_multiple(int(dtype == torch.bfloat16)))


@functools.cache
def bf16_impls() -> tuple[str, ...]:
    """The bfloat16 implementations this machine can run, best first: ``"avx512_bf16"``
    where the library has it compiled in and the CPU reports the flag, and ``"portable"``
    always (empty when the library is unavailable)."""
    lib = _library()
    if lib is None:
        return ()
    compiled = lib.loraplex_bf16_impls()
    flags = _cpu_signature().split()
    return tuple(name for name, impl in BF16_IMPLS.items() if compiled & (1 << impl)
                 and (name != "avx512_bf16" or "avx512_bf16" in flags))


def bf16_impl() -> str:
    """The bfloat16 implementation the kernels run by default: the best of ``bf16_impls``,
    or ``"portable"`` when ``LORAPLEX_CPU_BF16=portable``; ValueError for another value."""
    choice = os.environ.get(_ENV_BF16, "auto")
    if choice not in ("auto", "portable"):
        raise ValueError(f"{_ENV_BF16} must be auto or portable, not {choice!r}")
    impls = bf16_impls()
    return "portable" if choice == "portable" or not impls else impls[0]


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def can_decode(query: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native decode kernel takes these tensors (float32 or bfloat16 alike, CPU,
    unit last stride, contiguous cache)."""
    return (query.device.type == "cpu" and query.dtype in _NATIVE_DTYPES
            and k_cache.dtype == query.dtype and out.dtype == query.dtype
            and query.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous())


def _impl_code(lib: ctypes.CDLL, impl: str | None) -> int:
    if impl is None:  # bf16_impl() only names what the library and the CPU both have
        return BF16_IMPLS[bf16_impl()]
    name = impl
    if name not in BF16_IMPLS or not lib.loraplex_bf16_impls() & (1 << BF16_IMPLS[name]):
        raise ValueError(f"bfloat16 kernel implementation {name!r} is not available here "
                         f"(available: {', '.join(bf16_impls())})")
    return BF16_IMPLS[name]


def _attention_shapes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor) -> tuple[ctypes.CDLL, int, int, int]:
    """The library and (num_heads, num_kv_heads, head_dim) of an attention call, its tensors
    checked for the native kernels."""
    lib = _library()
    assert lib is not None, "native CPU kernels are not available"
    assert can_decode(query, k_cache, out) and v_cache.is_contiguous()
    assert v_cache.shape == k_cache.shape and query.shape == out.shape
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    return lib, num_heads, num_kv_heads, head_dim


def _check_window_softcap(window: int, softcap: float) -> None:
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), not {window}")
    if not softcap >= 0.0:
        raise ValueError(f"softcap must be >= 0 (0: none), not {softcap}")


def paged_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    impl: str | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Attention of every decode row (one query token) over its sequence's cached keys.
    ``impl``: the bfloat16 implementation (default ``bf16_impl()``); float32 has one.
    ``window``: only the last ``window`` keys (the row's own included; 0: all), the
    blocks before them never read; ``softcap``: each score ``s`` becomes
    ``softcap * tanh(s / softcap)`` (0: as it is)."""
    _check_window_softcap(window, softcap)
    lib, num_heads, num_kv_heads, head_dim = _attention_shapes(query, k_cache, v_cache, out)
    seq_ids, rows = meta.decode_seq_ids, meta.decode_rows
    if seq_ids.numel() == 0:
        return
    tables, lens = meta.block_tables, meta.seq_lens
    assert tables.dtype == torch.int32 and tables.is_contiguous()
    assert lens.dtype == torch.int32 and seq_ids.dtype == rows.dtype == torch.int64
    args = (query.data_ptr(), query.stride(0), query.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), seq_ids.data_ptr(), rows.data_ptr(),
            seq_ids.numel(), num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale,
            out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    if query.dtype == torch.bfloat16:
        status = lib.paged_decode_attention_bf16(*args, _impl_code(lib, impl), window,
                                                 softcap)
    else:
        status = lib.paged_decode_attention_f32(*args, window, softcap)
    if status != 0:
        raise MemoryError("native decode attention could not allocate its scratch memory")


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    impl: str | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of every prefill chunk (several query tokens) over its sequence's
    cached keys, bottom-right aligned; decode rows are left alone. ``impl``: as for
    ``paged_decode_attention`` (bfloat16 ``avx512_bf16`` scores by bf16 dot products, an
    even head size; ``portable`` widens to float32 as float32 runs); ``window`` and
    ``softcap`` as there, each row's window ending at its own position."""
    seq_ids = meta.prefill_seq_ids
    if seq_ids.numel() == 0:  # a decode-only step: every layer of it calls this
        return
    _check_window_softcap(window, softcap)
    lib, num_heads, num_kv_heads, head_dim = _attention_shapes(query, k_cache, v_cache, out)
    tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
    assert tables.dtype == lens.dtype == starts.dtype == torch.int32
    assert tables.is_contiguous() and seq_ids.dtype == torch.int64
    status = lib.paged_prefill_attention(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(),
        v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        starts.data_ptr(), seq_ids.data_ptr(), seq_ids.numel(), num_heads, num_kv_heads,
        head_dim, k_cache.shape[1], scale, out.data_ptr(), out.stride(0), out.stride(1),
        int(query.dtype == torch.bfloat16), torch.get_num_threads(),
        _impl_code(lib, impl) if query.dtype == torch.bfloat16 else 0, window, softcap)
    if status != 0:
        raise MemoryError("native prefill attention could not allocate its scratch memory")


def can_lora(x: torch.Tensor, out: torch.Tensor, slots: LoRASlots) -> bool:
    """Whether the native LoRA kernel takes these tensors (float32 or bfloat16 alike, CPU,
    unit last stride, the per-slot layout)."""
    return (x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES
            and out.dtype == x.dtype and slots.dtype == x.dtype
            and slots.layout == "per_slot" and x.stride(1) == 1 and out.stride(1) == 1)


def _lora_args(x: torch.Tensor, out: torch.Tensor, segments: torch.Tensor,
               slots: LoRASlots) -> tuple[int, ...]:
    """The LoRA kernels' segment and slot arguments, the tensors checked."""
    assert can_lora(x, out, slots) and x.shape[0] == out.shape[0]
    assert x.shape[1] == slots.in_features and out.shape[1] == slots.slice_offsets[-1]
    assert segments.dtype == torch.int64 and segments.is_contiguous() and segments.shape[0] == 3
    return (segments[0].data_ptr(), segments[1].data_ptr(), segments[2].data_ptr(),
            segments.shape[1], slots.at_ptrs.data_ptr(), slots.bt_ptrs.data_ptr(),
            slots.ranks.data_ptr(), slots.slice_table.data_ptr(), slots.num_slices.data_ptr(),
            slots.slice_table.shape[1])


def add_lora(
    out: torch.Tensor,  # [num_tokens, out], accumulated into
    x: torch.Tensor,  # [num_tokens, in]
    segments: torch.Tensor,  # [3, num_segments] int64: first token, length, slot
    slots: LoRASlots,
    impl: str | None = None,
    lib: ctypes.CDLL | None = None,
) -> None:
    """``out[t] += x[t] @ A_s^T @ B_s^T`` (scale folded into B) for each segment's tokens;
    in bfloat16 with float32 sums, the shrink's output rounded to bfloat16 as in the
    reference. ``impl``: as for ``paged_decode_attention``; ``lib``: another build
    (``load``; benchmarks compare revisions), default this tree's."""
    lib = lib or _library()
    assert lib is not None, "native CPU kernels are not available"
    lora_args = _lora_args(x, out, segments, slots)
    if segments.shape[1] == 0:
        return
    args = (x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[1], out.shape[1],
            *lora_args, torch.get_num_threads())
    if x.dtype == torch.bfloat16:
        status = lib.lora_segments_bf16(*args, _impl_code(lib, impl))
    else:
        status = lib.lora_segments_f32(*args)
    if status != 0:
        raise MemoryError("native LoRA could not allocate its scratch memory")


# csrc/cpu_skinny_gemm.c's implementations: float32 (AVX-512, or AVX2 with FMA), bfloat16
# by AVX-512 BF16 dot products, bfloat16 widened to float32 (AVX2 with FMA)
_SKINNY_F32, _SKINNY_BF16, _SKINNY_BF16_WIDEN = 1, 2, 4


def can_skinny(dtype: torch.dtype) -> bool:
    """Whether the native skinny GEMM (``skinny_linear``) runs this dtype here: float32
    with AVX-512 or with AVX2 and FMA; bfloat16 with AVX512_BF16 (and ``LORAPLEX_CPU_BF16``
    not forcing the portable kernels, which stand for a CPU without it), or without
    AVX-512 on AVX2 and FMA (bf16 widened to float32 as it is read). An AVX-512 CPU
    without AVX512_BF16 keeps oneDNN's bf16 GEMMs."""
    impls = _skinny_impls()
    if dtype == torch.float32:
        return bool(impls & _SKINNY_F32)
    if dtype == torch.bfloat16:
        return bool(impls & _SKINNY_BF16_WIDEN) or (
            bool(impls & _SKINNY_BF16) and bf16_impl() == "avx512_bf16")
    return False


@functools.cache
def _skinny_impls() -> int:
    """The bits of the skinny GEMM's implementations the library holds and the CPU runs
    (the library is built for this CPU; the flags are checked for a build found in a
    shared cache directory all the same)."""
    lib = _library()
    if lib is None:
        return 0
    flags = set(_cpu_signature().split())
    if "avx512f" not in flags and not {"avx2", "fma"} <= flags:
        return 0
    impls = int(lib.loraplex_skinny_impls())
    return impls if "avx512_bf16" in flags else impls & ~_SKINNY_BF16


def amx_choice() -> str:
    """``LORAPLEX_CPU_AMX``: "auto" (the default: AMX where the CPU reports it) or "0"
    (never); ValueError else. Applied when the library loads and by each model runner
    (``skinny_amx``)."""
    choice = os.environ.get(_ENV_AMX, "auto")
    if choice not in ("auto", "0"):
        raise ValueError(f"{_ENV_AMX} must be auto or 0, not {choice!r}")
    return choice


def read_ahead_choice() -> Literal["auto", "0", "1"]:
    """``LORAPLEX_CPU_LORA_READ_AHEAD``: "auto" (the default: the CPU's, on for AMD's
    Zen 4), "0" (never) or "1" (on any AVX-512 build, to try it on another kind of
    machine); ValueError else. Applied by each model runner (``lora_read_ahead``)."""
    choice = os.environ.get(_ENV_READ_AHEAD, "auto")
    for allowed in ("auto", "0", "1"):
        if choice == allowed:
            return allowed
    raise ValueError(f"{_ENV_READ_AHEAD} must be auto, 0 or 1, not {choice!r}")


def _cpu_has_amx() -> bool:
    return {"amx_tile", "amx_bf16"} <= set(_cpu_signature().split())


# Whether the loaded library's bf16 skinny GEMM is on AMX tiles, as `_set_skinny_amx` last
# left it: read on every projection (``ops.skinny_max_rows``), so without a ctypes call.
_amx_on = False


def _set_skinny_amx(lib: ctypes.CDLL, enable: bool) -> bool:
    global _amx_on
    if not hasattr(lib, "loraplex_skinny_amx"):
        return False
    _amx_on = bool(lib.loraplex_skinny_amx(1 if enable and _cpu_has_amx() else 0))
    return _amx_on


def amx_on() -> bool:
    """``skinny_amx()`` without the library call (the state it was last set to)."""
    return _amx_on


def skinny_amx(enable: bool | None = None) -> bool:
    """Whether the bfloat16 skinny GEMM runs on AMX tiles (csrc/cpu_skinny_amx.c): where
    the library was built for a CPU with AMX-BF16, the CPU reports it and Linux granted
    the process its tile state. ``enable`` turns it on (where it can be) or off first, for
    the whole process: a model runner applies ``LORAPLEX_CPU_AMX``, benchmarks compare the
    two kernels in one process, and tests run both."""
    lib = _library()
    if lib is None:
        return False
    if enable is not None:
        return _set_skinny_amx(lib, enable)
    return bool(hasattr(lib, "loraplex_skinny_amx") and lib.loraplex_skinny_amx(-1))


def lora_read_ahead(enable: bool | Literal["auto"] | None = None,
                    lib: ctypes.CDLL | None = None) -> bool:
    """Whether a decode projection's skinny GEMM reads the LoRA weights that come after it
    into cache as it goes (csrc/lora.h, ``struct lora_prefetch``): by default where it
    measured faster, AMD's Zen 4 (csrc/cpu_skinny_gemm.c). ``enable`` True or False forces
    it, "auto" goes back to the CPU's default, for the whole process (``lib``: this
    tree's library, or another build a benchmark loaded); None only reports. A model
    runner applies ``LORAPLEX_CPU_LORA_READ_AHEAD`` (``read_ahead_choice``). Results are
    the same bit for bit either way: benchmarks time the two in one process, tests run
    both. False where the build has no AVX-512 (its GEMM leaves it out)."""
    lib = lib or _library()
    if lib is None or not hasattr(lib, "loraplex_lora_read_ahead"):
        return False
    mode = -1 if enable is None else 2 if enable == "auto" else int(bool(enable))
    return bool(lib.loraplex_lora_read_ahead(mode))


def _skinny_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
    """The skinny GEMM's x (unit column stride), output and arguments, the tensors
    checked."""
    assert x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and weight.dim() == 2
    assert weight.dtype == x.dtype and weight.is_contiguous() and x.shape[1] == weight.shape[1]
    assert x.is_cpu and weight.is_cpu
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        assert bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == (weight.shape[0],)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    return x, out, (x.data_ptr(), x.stride(0), weight.data_ptr(),
                    None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                    x.shape[0], weight.shape[0], weight.shape[1])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a few rows of ``x`` [rows, in] (a decode step's),
    streaming the plain ``weight`` [out, in] once (csrc/cpu_skinny_gemm.c); float32 sums,
    rounded once to the dtype. Where ``can_skinny(x.dtype)``."""
    lib = _library()
    assert lib is not None, "native CPU kernels are not available"
    x, out, args = _skinny_args(x, weight, bias)
    fn = lib.skinny_linear_f32 if x.dtype == torch.float32 else lib.skinny_linear_bf16
    if fn(*args, torch.get_num_threads()) != 0:
        raise RuntimeError(f"the native skinny GEMM is not compiled for {x.dtype} here")
    return out


def skinny_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                segments: torch.Tensor, slots: LoRASlots) -> torch.Tensor:
    """``skinny_linear`` and then ``add_lora`` of these segments into its output, in one
    native call and one parallel region (bfloat16's LoRA in ``bf16_impl()``)."""
    lib = _library()
    assert lib is not None, "native CPU kernels are not available"
    x, out, args = _skinny_args(x, weight, bias)
    args = (*args, *_lora_args(x, out, segments, slots), torch.get_num_threads())
    if x.dtype == torch.bfloat16:
        status = lib.skinny_lora_bf16(*args, _impl_code(lib, None))
    else:
        status = lib.skinny_lora_f32(*args)
    if status == -2:
        raise RuntimeError(f"the native skinny GEMM is not compiled for {x.dtype} here")
    if status != 0:
        raise MemoryError("native LoRA could not allocate its scratch memory")
    return out
