"""Prefill LoRA on CPU: one expand per slot (block-diagonal B) vs one expand per slice.

One prefill batch in the demo model's (SmolLM2-135M) projection shapes: segments of mixed
adapter slots and ranks (8/16/32, every module targeted) plus base-model tokens, all
segments long enough for the matmul path. Per projection and dtype it times, in the same
run and interleaved, ``add_lora_ref`` on the long segments (the one shrink and one
block-diagonal expand per slot the CPU backend ran before) and ``add_lora_sliced`` (one
shrink per slot, one expand per slice: what ``ops.add_lora`` runs now where it measured
faster), checks that both give the same result, and prints a table. Writes JSON and a PNG.

``--baseline REV`` also times the native kernel, which takes every bfloat16 prefill segment
(and float32 ones up to 512 tokens), on the same chunk: another revision's build (compiled
beside this tree's, ``_baseline.py``) against this tree's, per projection, interleaved.
Each call comes right after the chunk's output was written anew, as the base GEMM writes
it just before the LoRA in the engine (only the LoRA call is timed); the chunk's time is
the sum over the four projections times the model's layers, the fastest of the repeats.

    python benchmarks/lora_prefill.py [--repeats 40] [--threads 2] [--baseline REV]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time
from pathlib import Path
from typing import Any

# As offline_throughput.py: idle OpenMP threads must not spin on the cores they share.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from _baseline import build_baseline  # noqa: E402
from _lora_paths import (  # noqa: E402
    DTYPES,
    LAYERS,
    PROJECTIONS,
    add_speedups,
    as_build_reads,
    plot_paths,
    time_interleaved,
)
from _output import add_out_argument, pyplot, save_figure, write_json  # noqa: E402

from loraplex_kernels import cpu_native  # noqa: E402
from loraplex_kernels.lora_prefill import add_lora_sliced  # noqa: E402
from loraplex_kernels.lora_slots import LoRASlots  # noqa: E402
from loraplex_kernels.meta import SGMVMeta  # noqa: E402
from loraplex_kernels.sgmv_ref import add_lora_ref  # noqa: E402

# (rank, tokens) per adapter segment, then base-model tokens: a 2,048-token prefill chunk
SEGMENTS = [(8, 300), (16, 180), (32, 250), (8, 120), (16, 400), (32, 90), (16, 310),
            (8, 200)]
BASE_TOKENS = 198


def _chunk_meta(short_segment_len: int) -> SGMVMeta:
    """The chunk's tokens: each segment's in order, then the base model's."""
    token_slots = [s for s, (_, n) in enumerate(SEGMENTS) for _ in range(n)]
    return SGMVMeta.build(token_slots + [-1] * BASE_TOKENS, [r for r, _ in SEGMENTS],
                          short_segment_len=short_segment_len)


def _case(in_features: int, widths: list[int], dtype: torch.dtype,
          seed: int) -> tuple[LoRASlots, SGMVMeta, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ranks = [r for r, _ in SEGMENTS]
    slots = LoRASlots(in_features, widths, len(ranks), 64, dtype, torch.device("cpu"),
                      "per_slot")
    for s, r in enumerate(ranks):
        slots.set(s, [(torch.randn(r, in_features, generator=g) / in_features ** 0.5,
                       torch.randn(w, r, generator=g) / r ** 0.5) for w in widths], 2.0)
    # every segment long: the two matmul paths are what is compared (the engine sends
    # segments of up to 512 float32 tokens, and all bfloat16 ones, to the native kernel)
    meta = _chunk_meta(short_segment_len=0)
    tokens = sum(n for _, n in SEGMENTS) + BASE_TOKENS
    x = torch.randn(tokens, in_features, generator=g).to(dtype)  # [tokens, in]
    out = torch.randn(tokens, sum(widths), generator=g).to(dtype)  # [tokens, out]
    return slots, meta, x, out


def measure(name: str, dtype_name: str, repeats: int) -> dict[str, Any]:
    in_features, widths = PROJECTIONS[name]
    slots, meta, x, out0 = _case(in_features, widths, DTYPES[dtype_name], seed=0)
    ids = meta.long_segment_ids
    assert len(ids) == len(SEGMENTS), "every segment should take the matmul path"
    ref, new = out0.clone(), out0.clone()
    add_lora_ref(ref, x, slots.weights, meta, ids)
    add_lora_sliced(new, x, slots, meta, ids)
    max_diff = (new.double() - ref.double()).abs().max().item()
    base = meta.num_tokens - BASE_TOKENS
    assert torch.equal(new[base:], out0[base:]), "a base-model row changed"
    paths = {"block_diagonal": lambda: add_lora_ref(ref, x, slots.weights, meta, ids),
             "per_slice": lambda: add_lora_sliced(new, x, slots, meta, ids)}
    times = time_interleaved(paths, repeats)
    return add_speedups({"projection": name, "dtype": dtype_name, "max_abs_diff": max_diff},
                        times)


def versus_baseline(old: ctypes.CDLL, dtype_name: str, repeats: int) -> dict[str, Any]:
    """The chunk's LoRA on the native kernel, ``old``'s build against this tree's: per
    projection, the output rewritten before each call, only the call timed."""
    per_projection = []
    # every segment short: all of them to the native kernel
    segments = _chunk_meta(short_segment_len=sum(n for _, n in SEGMENTS)).short_segments
    assert segments is not None
    for name, (in_features, widths) in PROJECTIONS.items():
        slots, _, x, out0 = _case(in_features, widths, DTYPES[dtype_name], seed=0)
        reads = {"old": (as_build_reads(slots, old), old), "new": (slots, None)}
        out = out0.clone()
        results = {}
        for key, (read, lib) in reads.items():
            out.copy_(out0)
            cpu_native.add_lora(out, x, segments, read, lib=lib)
            results[key] = out.clone()
        times: dict[str, list[float]] = {key: [] for key in reads}
        for _ in range(repeats):
            for key, (read, lib) in reads.items():
                out.copy_(out0)
                t0 = time.perf_counter()
                cpu_native.add_lora(out, x, segments, read, lib=lib)
                times[key].append(time.perf_counter() - t0)
        diff = (results["old"].double() - results["new"].double()).abs().max().item()
        per_projection.append({"projection": name, "max_abs_diff": diff,
                               **{f"{k}_min_ms": min(ts) * 1e3 for k, ts in times.items()}})
    row: dict[str, Any] = {"dtype": dtype_name, "projections": per_projection}
    for key in ("old", "new"):
        row[f"{key}_chunk_ms"] = sum(p[f"{key}_min_ms"] for p in per_projection) * LAYERS
    row["speedup"] = row["old_chunk_ms"] / row["new_chunk_ms"]
    row["max_abs_diff"] = max(p["max_abs_diff"] for p in per_projection)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", metavar="REV",
                        help="also time git revision REV's native kernel against this tree's")
    add_out_argument(parser, "benchmarks/results/lora_prefill")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    rows = [measure(name, dt, args.repeats) for dt in DTYPES for name in PROJECTIONS]
    print(f"{sum(n for _, n in SEGMENTS) + BASE_TOKENS} tokens, {len(SEGMENTS)} adapter "
          f"segments, {args.threads} threads, {args.repeats} interleaved repeats")
    print(f"{'dtype':9} {'projection':13} {'block-diag ms':>14} {'per-slice ms':>13} "
          f"{'speedup':>8} {'(median)':>9} {'max diff':>9}")
    for r in rows:
        print(f"{r['dtype']:9} {r['projection']:13} {r['block_diagonal_min_ms']:14.3f} "
              f"{r['per_slice_min_ms']:13.3f} {r['speedup_min']:8.2f} "
              f"{r['speedup_median']:9.2f} {r['max_abs_diff']:9.1e}")
    totals = {}
    for dt in DTYPES:
        old = sum(r["block_diagonal_min_ms"] for r in rows if r["dtype"] == dt) * LAYERS
        new = sum(r["per_slice_min_ms"] for r in rows if r["dtype"] == dt) * LAYERS
        totals[dt] = {"block_diagonal_ms": old, "per_slice_ms": new, "speedup": old / new}
        print(f"{dt}: all {LAYERS} layers, one chunk: {old:.1f} ms -> {new:.1f} ms "
              f"({old / new:.2f}x)")
    versus = []
    if args.baseline:
        if not cpu_native.available():
            raise SystemExit("the native CPU kernels are not available (no C compiler?)")
        print(f"native kernel, against {args.baseline}'s (ms per chunk, all {LAYERS} layers):")
        with tempfile.TemporaryDirectory() as tmp:
            old = build_baseline(args.baseline, Path(tmp))
            for dt in DTYPES:
                v = versus_baseline(old, dt, args.repeats)
                versus.append(v)
                print(f"{dt:9} {v['old_chunk_ms']:8.1f} -> {v['new_chunk_ms']:8.1f} "
                      f"({v['speedup']:.2f}x), max diff {v['max_abs_diff']:.1e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": args.threads, "repeats": args.repeats, "segments": SEGMENTS,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "base_tokens": BASE_TOKENS, "rows": rows, "per_chunk_totals": totals,
              "baseline": args.baseline, "versus_baseline": versus}
    write_json(out, report)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    if versus:
        path = out.with_name(f"{out.name}_baseline.png")
        plot_versus(versus, args.baseline, path)
        print(f"wrote {path}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plot_paths(rows, path, "projection", ("one expand per slot (block-diagonal B)",
                                          "one expand per slice"),
               "ms per prefill chunk, one layer (min)", "Prefill LoRA on CPU, demo model shapes")


def plot_versus(versus: list[dict[str, Any]], baseline: str, path: Path) -> None:
    """The native kernel's ms per chunk and projection, ``baseline``'s build and this tree's."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(versus), figsize=(4 * len(versus), 3.5), squeeze=False)
    for ax, v in zip(axes[0], versus, strict=True):
        names = [p["projection"] for p in v["projections"]]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [p["old_min_ms"] * LAYERS for p in v["projections"]],
               0.4, color="#9e9e9e", label=f"{baseline} ({v['old_chunk_ms']:.0f} ms)")
        ax.bar([x + 0.2 for x in xs], [p["new_min_ms"] * LAYERS for p in v["projections"]],
               0.4, color="#e0702a", label=f"this tree ({v['new_chunk_ms']:.0f} ms)")
        ax.set_xticks(list(xs), names, fontsize=7)
        ax.set_ylabel("ms per 2,048-token chunk, all layers")
        ax.set_title(f"native prefill LoRA, {v['dtype']}", fontsize=9)
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
