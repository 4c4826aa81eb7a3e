"""Where a benchmark's results go: a JSON document and a PNG plot beside it (same path,
two suffixes), and the machine they were measured on."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any


def add_out_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--out", default=default,
                        help="output path without extension: writes .json and .png")


def write_json(out: Path, doc: Any, indent: int = 2) -> Path:
    """``doc`` as ``out``.json (``out`` is the output path without extension)."""
    path = out.with_suffix(".json")
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: the benchmarks write files, never a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lays ``fig`` out, writes it and closes it (a benchmark that plots after every cell
    would otherwise keep every figure it made)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def command_line(script: str, args: argparse.Namespace) -> str:
    """The command that reproduces a run: ``script`` with every option it was given but
    ``--out`` (unset ones and flags not given left out), for the JSON document."""
    return f"python benchmarks/{script} " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items() if v is not None and v is not False and k != "out")


def save_loglog(fig: Any, ax: Any, out: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Finishes a plot of cost against a doubling size (x in powers of two, y on a log
    scale) and writes it as ``out``.png."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    save_figure(fig, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` is often empty)
    and the vector instruction set torch runs there, e.g. "AMD EPYC (AVX2)": the same
    model name has come with and without AVX-512, which moves every result. ", AMX" where
    the CPU has AMX-BF16 tiles (torch does not say; the bf16 GEMMs run on them), and the
    CPU's family and model numbers where it gives them: "AMD EPYC" with AVX-512 has been
    a Zen 4 (family 25) and a Zen 5 (family 26), whose GEMM rates differ twofold."""
    import torch

    cpu, fields, flags = platform.processor(), dict[str, str](), set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f.read().split("\n\n", 1)[0].splitlines():  # the first CPU's block
                key, _, value = ln.partition(":")
                fields.setdefault(key.strip(), value.strip())
        cpu = fields.get("model name", cpu)
        flags = set(fields.get("flags", "").split())
    except OSError:
        pass
    amx = ", AMX" if "amx_bf16" in flags else ""
    family = (f", family {fields['cpu family']} model {fields['model']}"
              if "cpu family" in fields and "model" in fields else "")
    return f"{cpu} ({torch.backends.cpu.get_cpu_capability()}{amx}{family})"
