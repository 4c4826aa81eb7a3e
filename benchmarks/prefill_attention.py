"""Prefill attention on CPU: the native kernel against the PyTorch reference (SDPA per
chunk over the gathered K/V), side by side in one process, float32 and bfloat16.

In bfloat16 the native kernel's scores and values run on AVX-512 BF16 dot products where
the CPU has them; its portable path (bf16 widened to float32, as float32 runs) is timed
beside it there.

Shapes are the demo model's (9 query heads, 3 KV heads, head size 64, blocks of 16) at the
offline workload's prompt lengths, whole prompts and chunks after a cached prefix. Each
cell is the best of ``--repeats`` rounds of ``--calls`` calls, the two implementations
alternated within a round; GFLOP/s counts q.k and p.v over the causal triangle only.

    python benchmarks/prefill_attention.py          # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loraplex.openmp import apply_defaults  # noqa: E402

apply_defaults()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _output import add_out_argument, cpu_name, pyplot, save_figure, write_json  # noqa: E402

from loraplex_kernels import cpu_native  # noqa: E402
from loraplex_kernels.attention_ref import prefill_attention_ref  # noqa: E402
from loraplex_kernels.meta import AttentionMeta  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (name, sequence lengths, new query tokens of each)
SHAPES = [
    ("1 x 32", (32,), (32,)),
    ("1 x 128", (128,), (128,)),
    ("1 x 512", (512,), (512,)),
    ("4 x 300", (300,) * 4, (300,) * 4),
    ("8 x 64", (64,) * 8, (64,) * 8),
    ("200 after 500 cached", (700,), (200,)),
]


def _inputs(lens: tuple[int, ...], qlens: tuple[int, ...], dtype: torch.dtype,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMeta]:
    g = torch.Generator().manual_seed(0)
    tables, first = [], 0
    for n in lens:
        blocks = -(-n // BLOCK)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    shape = (first, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(qlens), HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, k, v, AttentionMeta.build(tables, lens, qlens, BLOCK)


def measure(dtype: torch.dtype, calls: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, lens, qlens in SHAPES:
        q, k, v, meta = _inputs(lens, qlens, dtype)
        fns = {"native": cpu_native.paged_prefill_attention,
               "reference": prefill_attention_ref}
        if dtype == torch.bfloat16 and cpu_native.bf16_impl() != "portable":
            # the kernel's float32 path for bfloat16, against its bf16 dot products
            fns["portable"] = partial(cpu_native.paged_prefill_attention, impl="portable")
        outs = {key: torch.empty_like(q) for key in fns}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(repeats):
            for key, fn in fns.items():
                fn(q, k, v, meta, HEAD_DIM ** -0.5, outs[key])
                start = time.perf_counter()
                for _ in range(calls):
                    fn(q, k, v, meta, HEAD_DIM ** -0.5, outs[key])
                best[key] = min(best[key], (time.perf_counter() - start) / calls)
        flop = sum(4 * HEADS * HEAD_DIM * (ql * (n - ql) + ql * (ql + 1) / 2)
                   for n, ql in zip(lens, qlens, strict=True))
        diff = (outs["native"].double() - outs["reference"].double()).abs().max().item()
        row = {"dtype": str(dtype).removeprefix("torch."), "shape": name,
               "native_ms": round(best["native"] * 1e3, 3),
               "reference_ms": round(best["reference"] * 1e3, 3),
               "native_gflops": round(flop / best["native"] / 1e9, 1),
               "reference_gflops": round(flop / best["reference"] / 1e9, 1),
               "speedup": round(best["reference"] / best["native"], 2),
               "max_abs_diff": diff}
        if "portable" in fns:
            row["native_impl"] = cpu_native.bf16_impl()
            row["portable_ms"] = round(best["portable"] * 1e3, 3)
            row["portable_gflops"] = round(flop / best["portable"] / 1e9, 1)
            row["native_over_portable"] = round(best["portable"] / best["native"], 2)
        rows.append(row)
        print(f"{row['dtype']:9s} {name:22s} native {row['native_ms']:8.3f} ms "
              f"({row['native_gflops']:5.1f} GFLOP/s)  reference {row['reference_ms']:8.3f} ms "
              f"({row['reference_gflops']:5.1f})  {row['speedup']:.2f}x  max diff {diff:.1e}"
              + (f"  portable {row['portable_ms']:8.3f} ms ({row['portable_gflops']:5.1f}): "
                 f"{row['native_over_portable']:.2f}x" if "portable" in fns else ""),
              flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, dtype in zip(axes, ("float32", "bfloat16"), strict=True):
        sel = [r for r in rows if r["dtype"] == dtype]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["reference_gflops"] for r in sel], 0.4,
               label="reference (SDPA per chunk)")
        ax.bar([i + 0.2 for i in x], [r["native_gflops"] for r in sel], 0.4, label="native")
        if any("portable_gflops" in r for r in sel):
            ax.plot(list(x), [r.get("portable_gflops", 0) for r in sel], "k_", markersize=18,
                    mew=2, label="native, bf16 widened to float32 (portable)")
        ax.set_xticks(list(x), [r["shape"] for r in sel], rotation=20, ha="right")
        ax.set_title(f"prefill attention, {dtype}")
        ax.set_ylabel("GFLOP/s (causal)")
        ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser, "benchmarks/results/prefill_attention")
    args = parser.parse_args(argv)
    if not cpu_native.available():
        raise SystemExit("the native CPU kernels are not available (no C compiler?)")
    torch.set_num_threads(args.threads)
    rows = [r for dtype in (torch.float32, torch.bfloat16)
            for r in measure(dtype, args.calls, args.repeats)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpu": cpu_name(), "threads": args.threads,
                          "load_avg_1m": round(os.getloadavg()[0], 2)},
              "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                         "block_size": BLOCK}, "rows": rows}
    written = write_json(out, report)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {written} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
