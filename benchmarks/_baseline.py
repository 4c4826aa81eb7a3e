"""Another revision's native kernels, compiled with this tree's flags beside this tree's
build, so that a micro-benchmark times both in one run (``decode_attention.py``,
``lora_decode.py --baseline``)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from loraplex_kernels import cpu_native

ROOT = Path(__file__).resolve().parents[1]


def build_baseline(ref: str, directory: Path) -> ctypes.CDLL:
    """``ref``'s kernel sources compiled with this tree's flags."""
    csrc = directory / "csrc"
    csrc.mkdir(parents=True, exist_ok=True)
    folder = "kernels/csrc"
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", ref,
                            f"{folder}/"], capture_output=True, text=True, check=True)
    for rel in names.stdout.split():  # that revision's own files, whatever their names
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{rel}"],
                              capture_output=True, text=True, check=True).stdout
        (csrc / Path(rel).name).write_text(text, encoding="utf-8")
    lib = cpu_native.load(cpu_native.build(directory=directory, csrc=csrc))
    # AMX as this tree's library has it (each library asks for the tiles itself; without
    # this, the other revision's long bf16 LoRA segments ran on vectors)
    if hasattr(lib, "loraplex_skinny_amx"):
        lib.loraplex_skinny_amx(int(cpu_native.skinny_amx()))
    return lib
