"""Decode-sized GEMMs on CPU: the native skinny GEMM against oneDNN (its packed copy and the
plain layout), side by side in one process, float32 and bfloat16 (in bfloat16 on a CPU
with AMX, the skinny GEMM on AMX tiles and on AVX-512 BF16 dot products both).

One pass multiplies a batch of rows through every base projection of the demo model's 30
layers (q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536: 106 M weights, each
layer its own, so that the weights come from memory as in a decode step, not from cache).
Each cell is the best of ``--repeats`` rounds, the three GEMMs alternated within a round;
GB/s counts the weights read once per pass, against the streaming rate of a plain
``sum`` over as many bytes measured in the same run.

    python benchmarks/skinny_gemm.py          # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loraplex.openmp import apply_defaults  # noqa: E402

apply_defaults()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _floor import pack_as  # noqa: E402
from _output import add_out_argument, cpu_name, pyplot, save_figure, write_json  # noqa: E402

from loraplex_kernels import cpu_native, ops  # noqa: E402

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] per layer
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768)
Gemm = Callable[[torch.Tensor, torch.Tensor, ops.PackedWeight | None], torch.Tensor]


def _onednn_plain(x: torch.Tensor, w: torch.Tensor, _: ops.PackedWeight | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


GEMMS: dict[str, Gemm] = {
    "oneDNN packed": lambda x, w, p: ops.linear(x, w, None, p),
    "oneDNN plain": _onednn_plain,
    "skinny": lambda x, w, _: cpu_native.skinny_linear(x, w),
    "skinny AMX": lambda x, w, _: cpu_native.skinny_linear(x, w),  # the same, AMX on
}


def _stream_gbps(nbytes: int, dtype: torch.dtype, repeats: int) -> float:
    big = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def measure(dtype: torch.dtype, repeats: int) -> tuple[list[dict[str, Any]], float]:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g).to(dtype) for _ in range(LAYERS) for o, i in SHAPES]
    packed = [pack_as(w, "onednn") for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    stream = _stream_gbps(nbytes, dtype, repeats)
    name = str(dtype).removeprefix("torch.")
    print(f"{name}: {nbytes / 1e6:.0f} MB of weights; streaming sum {stream:.1f} GB/s",
          flush=True)
    # oneDNN has no bf16 GEMM without AVX-512 (AVX2): its packed copy is then float32
    gemms = {k: f for k, f in GEMMS.items()
             if k != "oneDNN plain" or dtype == torch.float32 or ops.onednn_bf16_gemm()}
    amx = dtype == torch.bfloat16 and cpu_native.skinny_amx(True)
    if not amx:
        del gemms["skinny AMX"]
    rows_out = []
    for rows in ROWS:
        xs = {i: torch.randn(rows, i, generator=g).to(dtype) for _, i in SHAPES}
        best = dict.fromkeys(gemms, float("inf"))
        for _ in range(repeats):
            for key, fn in gemms.items():
                if amx and key.startswith("skinny"):
                    cpu_native.skinny_amx(key == "skinny AMX")
                start = time.perf_counter()
                for w, p in zip(weights, packed, strict=True):
                    fn(xs[w.shape[1]], w, p)
                best[key] = min(best[key], time.perf_counter() - start)
        row: dict[str, Any] = {"dtype": name, "rows": rows}
        for key, secs in best.items():
            row[key] = {"ms": round(secs * 1e3, 2), "gbps": round(nbytes / secs / 1e9, 1),
                        "gflops": round(2 * rows * nbytes / w.element_size() / secs / 1e9, 1)}
        fastest = "skinny AMX" if amx else "skinny"
        row["skinny_vs_packed"] = round(best["oneDNN packed"] / best[fastest], 2)
        rows_out.append(row)
        print(f"{name:9s} {rows:4d} rows: " + "  ".join(
            f"{k} {row[k]['ms']:6.1f} ms ({row[k]['gbps']:4.1f} GB/s)" for k in gemms)
            + f"  {fastest}/packed speed {row['skinny_vs_packed']:.2f}x", flush=True)
    cpu_native.skinny_amx(True)  # back to the default where it applies
    return rows_out, stream


def plot(rows: list[dict[str, Any]], streams: dict[str, float], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, dtype in zip(axes, ("float32", "bfloat16"), strict=True):
        sel = [r for r in rows if r["dtype"] == dtype]
        for key in (k for k in GEMMS if sel and k in sel[0]):
            ax.plot([r["rows"] for r in sel], [r[key]["gbps"] for r in sel], marker="o",
                    label=key)
        ax.axhline(streams[dtype], color="grey", linestyle="--", label="streaming sum")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per GEMM")
        ax.set_ylabel("weights read, GB/s")
        ax.set_title(f"decode GEMMs, demo model's 30 layers, {dtype}")
        ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    add_out_argument(parser, "benchmarks/results/skinny_gemm")
    args = parser.parse_args(argv)
    dtypes = [d for d in (torch.float32, torch.bfloat16) if cpu_native.can_skinny(d)]
    if not dtypes:
        raise SystemExit("no native skinny GEMM on this CPU (it needs AVX-512 or AVX2 + FMA)")
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    streams: dict[str, float] = {}
    for dtype in dtypes:
        got, stream = measure(dtype, args.repeats)
        rows += got
        streams[str(dtype).removeprefix("torch.")] = round(stream, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpu": cpu_name(), "threads": args.threads,
                          "load_avg_1m": round(os.getloadavg()[0], 2)},
              "layers": LAYERS, "shapes": SHAPES, "streaming_gbps": streams, "rows": rows}
    written = write_json(out, report)
    plot(rows, streams, out.with_suffix(".png"))
    print(f"wrote {written} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
