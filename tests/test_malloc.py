"""glibc's malloc keeps the CPU engine's freed activations: read back from where the
allocator puts a block and whether the heap keeps it once freed, in a fresh process each."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.malloc import USER_VARIABLES, keep_freed_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

# Allocates 20 MiB, touches it, frees it; prints whether it came from the heap (brk) rather
# than a mapping of its own, and whether the heap still holds 20 MiB after the free.
_PROBE = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def heap():
    for line in open('/proc/self/maps'):
        if line.rstrip().endswith('[heap]'):
            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
            return lo, hi
    return 0, 0
size = 20 << 20
p = libc.malloc(size)
ctypes.memset(p, 1, size)
lo, hi = heap()
in_heap = lo <= p < hi
libc.free(p)
lo, hi = heap()
print('PROBE', in_heap, hi - lo >= size)
"""


def _probe(setup: str, **env: str) -> tuple[bool, bool]:
    clean = {k: v for k, v in os.environ.items() if k not in USER_VARIABLES}
    result = subprocess.run([sys.executable, "-c", setup + "\n" + _PROBE],
                            capture_output=True, text=True, env={**clean, **env}, timeout=300)
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("PROBE"))
    in_heap, kept = line.split()[1:]
    return in_heap == "True", kept == "True"


def test_glibc_defaults_map_and_return_a_large_block() -> None:
    """What the engine's steps met before: a block of 20 MiB is mapped for itself and
    unmapped at free, so the next step's pages are new (one fault per 4 KiB)."""
    assert _probe("") == (False, False)


def test_freed_memory_is_kept() -> None:
    assert _probe("from loraplex.malloc import keep_freed_memory\n"
                  "assert keep_freed_memory()") == (True, True)


def test_the_cpu_engine_keeps_freed_memory(tiny_llama_dir: Path) -> None:
    setup = ("from loraplex.config import CacheConfig, LoRAConfig, ModelConfig\n"
             "from loraplex.model.runner import ModelRunner\n"
             f"ModelRunner(ModelConfig(model={str(tiny_llama_dir)!r}, device='cpu'),\n"
             "            CacheConfig(num_kv_blocks=8), LoRAConfig(), progress=False)\n")
    assert _probe(setup) == (True, True)


def test_a_setting_the_user_chose_is_kept() -> None:
    for name in USER_VARIABLES:
        assert keep_freed_memory({name: "1"}) is False
    assert _probe("from loraplex.malloc import keep_freed_memory\n"
                  "assert not keep_freed_memory()",
                  MALLOC_TRIM_THRESHOLD_="131072") == (False, False)
