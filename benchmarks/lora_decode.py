"""Decode LoRA on CPU (the native kernel): one expand over the block-diagonal B vs one
expand per slice.

A decode step in the demo model's (SmolLM2-135M) projection shapes through all 30 layers,
each layer's four projections with weights of their own (so the adapters' weights stream
from memory as in a real step, rather than sitting in cache): 16 adapter slots of ranks
8/16/32 targeting every module, and two token layouts: 64 decode tokens spread over the 16
slots (4 each, as a 20-adapter batch runs) and 64 on one slot. Per dtype it times, in the
same run and interleaved, the native kernel reading each slot's B as one block-diagonal
matrix (what it did before: every slice's ranks against every slice's columns, for q/k/v
2/3 zeros, for gate/up 1/2) and per slice (each slice's ranks against its own columns
only), checks that both give the same result, and prints a table. Writes JSON and a PNG.

``--crossover`` also times, for one slot's segment of 32 to 2,048 tokens (ranks 8 and 32,
10 layers), the native kernel against the per-slot matmuls (``add_lora_sliced`` in
float32, ``add_lora_ref`` in bfloat16) that longer segments take: where the GEMM overtakes
the native kernel is what ``meta.short_segment_limit`` is set from.

``--baseline REV`` also times, per layout, another revision's native kernel (compiled
beside this tree's, ``_baseline.py``) against this tree's, both per slice, plus one slot's
256-token segment (rank 32) and the rank-8 slots alone: old / new time and the largest
difference of their outputs. Each build reads the weights in its own layout, at its own
rank padding (a revision from before the tiled layout reads A^T and B^T in place).

    python benchmarks/lora_decode.py [--repeats 20] [--threads 2] [--crossover]
        [--baseline REV] [--out PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
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
    read_as,
    time_interleaved,
)
from _output import add_out_argument, write_json  # noqa: E402

from loraplex_kernels import cpu_native  # noqa: E402
from loraplex_kernels.lora_prefill import add_lora_sliced  # noqa: E402
from loraplex_kernels.lora_slots import (  # noqa: E402
    LoRASlots,
    tiled_layout,
)
from loraplex_kernels.meta import SGMVMeta  # noqa: E402
from loraplex_kernels.sgmv_ref import add_lora_ref  # noqa: E402

RANKS = [8, 16, 32] * 5 + [8]  # 16 slots
LAYOUTS = {"16 slots x 4 tokens": [s for s in range(16) for _ in range(4)],
           "1 slot x 32 tokens": [2] * 32}  # slot 2: rank 32; longer runs take the matmul path


def _slots(in_features: int, widths: list[int], dtype: torch.dtype,
           g: torch.Generator) -> LoRASlots:
    slots = LoRASlots(in_features, widths, len(RANKS), 32, dtype, torch.device("cpu"),
                      "per_slot")
    for s, r in enumerate(RANKS):
        slots.set(s, [(torch.randn(r, in_features, generator=g) / in_features ** 0.5,
                       torch.randn(w, r, generator=g) / r ** 0.5) for w in widths], 2.0)
    return slots


def block_diagonal(slots: LoRASlots) -> LoRASlots:
    """The same weights, described to the kernel as one slice per slot covering all of B
    (every rank against every column): the kernel's work before it expanded per slice."""
    tile, pairs = cpu_native.lora_tile(slots.dtype), slots.dtype == torch.bfloat16
    multiple = cpu_native.lora_rank_multiple(slots.dtype)
    assert tile is not None and multiple is not None
    whole = read_as(slots, lambda at, bt, _: tiled_layout(
        at, bt, [(0, at.shape[1], 0, bt.shape[1])], tile, pairs=pairs), multiple)
    whole.slice_table = torch.zeros_like(slots.slice_table)
    whole.slice_table[:, 0, 1] = whole.ranks
    whole.slice_table[:, 0, 3] = slots.slice_offsets[-1]
    whole.num_slices = (whole.ranks > 0).to(torch.int64)
    return whole


def measure(dtype_name: str, layout: str, repeats: int) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    token_slots = LAYOUTS[layout]
    meta = SGMVMeta.build(token_slots, RANKS)
    segments = meta.short_segments
    assert segments is not None and not meta.long_segment_ids
    n = len(token_slots)
    layers = []
    for _ in range(LAYERS):
        for in_features, widths in PROJECTIONS.values():
            slots = _slots(in_features, widths, dtype, g)
            x = torch.randn(n, in_features, generator=g).to(dtype)  # [tokens, in]
            out = torch.randn(n, sum(widths), generator=g).to(dtype)  # [tokens, out]
            layers.append((slots, block_diagonal(slots), x, out))
    max_diff = 0.0
    for slots, whole, x, out0 in layers[:4]:
        a, b = out0.clone(), out0.clone()
        cpu_native.add_lora(a, x, segments, whole)
        cpu_native.add_lora(b, x, segments, slots)
        max_diff = max(max_diff, (a.double() - b.double()).abs().max().item())
    outs = [out.clone() for *_, out in layers]

    def step(which: int) -> None:
        for (slots, whole, x, _), out in zip(layers, outs, strict=True):
            cpu_native.add_lora(out, x, segments, (whole, slots)[which])

    times = time_interleaved({"block_diagonal": lambda: step(0),
                              "per_slice": lambda: step(1)}, repeats)
    return add_speedups({"dtype": dtype_name, "layout": layout, "tokens": n,
                         "max_abs_diff": max_diff}, times)


# A decode step of the offline workload has one or two tokens per adapter (about 20 rows
# over 15 adapters): the shapes where the kernel's sums have the fewest independent chains.
# The rank-8 slots alone (one token each, and one prefill-sized segment): what the padding
# of a slot's ranks changes most.
BASELINE_LAYOUTS = {"16 slots x 1 token": list(range(16)),
                    "16 slots x 2 tokens": [s for s in range(16) for _ in range(2)],
                    **LAYOUTS, "1 slot x 256 tokens": [2] * 256,
                    "6 rank-8 slots x 1 token": [s for s, r in enumerate(RANKS) if r == 8],
                    "1 rank-8 slot x 256 tokens": [0] * 256}


def versus_baseline(old: ctypes.CDLL, dtype_name: str, layout: str,
                    repeats: int) -> dict[str, Any]:
    """One decode step's LoRA (the 256-token segment: 6 layers) through ``old``'s kernel
    and this tree's, per slice, interleaved."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(2)
    token_slots = BASELINE_LAYOUTS[layout]
    segments = SGMVMeta.build(token_slots, RANKS, short_segment_len=len(token_slots)
                              ).short_segments
    assert segments is not None
    n = len(token_slots)
    layers = [(_slots(in_features, widths, dtype, g),
               torch.randn(n, in_features, generator=g).to(dtype),
               torch.zeros(n, sum(widths), dtype=dtype))
              for _ in range(LAYERS if n <= 64 else 6)
              for in_features, widths in PROJECTIONS.values()]
    old_slots = [as_build_reads(slots, old) for slots, _, _ in layers]
    results = []
    for lib in (old, None):
        for _, _, out in layers:
            out.zero_()
        for (slots, x, out), old_read in zip(layers, old_slots, strict=True):
            cpu_native.add_lora(out, x, segments, old_read if lib else slots, lib=lib)
        results.append([out.clone() for *_, out in layers])
    max_diff = max((a.double() - b.double()).abs().max().item()
                   for a, b in zip(*results, strict=True))

    def step(lib: ctypes.CDLL | None) -> None:
        for (slots, x, out), old_read in zip(layers, old_slots, strict=True):
            cpu_native.add_lora(out, x, segments, old_read if lib else slots, lib=lib)

    times = time_interleaved({"old": lambda: step(old), "new": lambda: step(None)}, repeats)
    row: dict[str, Any] = {"dtype": dtype_name, "layout": layout, "tokens": n,
                           "layers": len(layers) // len(PROJECTIONS), "max_abs_diff": max_diff}
    for key, ts in times.items():
        row[f"{key}_min_ms"] = min(ts) * 1e3
    row["speedup"] = row["old_min_ms"] / row["new_min_ms"]
    return row


CROSSOVER_LENS = [32, 64, 128, 256, 512, 1024, 2048]


def crossover(dtype_name: str, slot: int, length: int, repeats: int) -> dict[str, Any]:
    """One slot's segment of ``length`` tokens through 10 layers' projections: the native
    kernel against the matmul path of long segments."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(1)
    token_slots = [slot] * length
    as_short = SGMVMeta.build(token_slots, RANKS, short_segment_len=length)
    as_long = SGMVMeta.build(token_slots, RANKS, short_segment_len=0)
    segments, ids = as_short.short_segments, as_long.long_segment_ids
    assert segments is not None and ids
    layers = []
    for _ in range(10):
        for in_features, widths in PROJECTIONS.values():
            layers.append((_slots(in_features, widths, dtype, g),
                           torch.randn(length, in_features, generator=g).to(dtype),
                           torch.randn(length, sum(widths), generator=g).to(dtype)))

    def native() -> None:
        for slots, x, out in layers:
            cpu_native.add_lora(out, x, segments, slots)

    def matmul() -> None:
        for slots, x, out in layers:
            if dtype == torch.float32:
                add_lora_sliced(out, x, slots, as_long, ids)
            else:
                add_lora_ref(out, x, slots.weights, as_long, ids)

    times = time_interleaved({"native": native, "matmul": matmul}, repeats)
    row: dict[str, Any] = {"dtype": dtype_name, "rank": RANKS[slot], "tokens": length}
    for key, ts in times.items():
        row[f"{key}_min_ms"] = min(ts) * 1e3
    row["native_speedup"] = row["matmul_min_ms"] / row["native_min_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--crossover", action="store_true",
                        help="also time native vs matmul for one slot's long segments")
    parser.add_argument("--baseline", metavar="REV",
                        help="also time git revision REV's kernel against this tree's")
    add_out_argument(parser, "benchmarks/results/lora_decode")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    if not cpu_native.available():
        raise SystemExit("the native CPU kernels are not available (no C compiler?)")
    torch.set_num_threads(args.threads)
    rows = [measure(dt, layout, args.repeats) for dt in DTYPES for layout in LAYOUTS]
    impl = cpu_native.bf16_impl()
    print(f"one decode step's LoRA, {LAYERS} layers x {len(PROJECTIONS)} projections, "
          f"ranks {sorted(set(RANKS))}, {args.threads} threads, {args.repeats} interleaved "
          f"repeats; bfloat16 kernels: {impl}")
    print(f"{'dtype':9} {'tokens':20} {'block-diag ms':>14} {'per-slice ms':>13} "
          f"{'speedup':>8} {'(median)':>9} {'max diff':>9}")
    for r in rows:
        print(f"{r['dtype']:9} {r['layout']:20} {r['block_diagonal_min_ms']:14.2f} "
              f"{r['per_slice_min_ms']:13.2f} {r['speedup_min']:8.2f} "
              f"{r['speedup_median']:9.2f} {r['max_abs_diff']:9.1e}")
    cross = []
    if args.crossover:
        print(f"{'dtype':9} {'rank':>4} {'tokens':>6} {'native ms':>10} {'matmul ms':>10} "
              f"{'native speedup':>15}")
        for dt in DTYPES:
            for slot in (0, 2):  # ranks 8 and 32
                for length in CROSSOVER_LENS:
                    c = crossover(dt, slot, length, max(3, args.repeats // 4))
                    cross.append(c)
                    print(f"{dt:9} {c['rank']:4} {length:6} {c['native_min_ms']:10.2f} "
                          f"{c['matmul_min_ms']:10.2f} {c['native_speedup']:15.2f}", flush=True)
    versus = []
    if args.baseline:
        print(f"against {args.baseline}'s kernel (per slice both):")
        print(f"{'dtype':9} {'tokens':26} {'layers':>6} {'old ms':>8} {'new ms':>8} "
              f"{'old/new':>8} {'max diff':>9}")
        with tempfile.TemporaryDirectory() as tmp:
            old = build_baseline(args.baseline, Path(tmp))
            for dt in DTYPES:
                for layout in BASELINE_LAYOUTS:
                    v = versus_baseline(old, dt, layout, args.repeats)
                    versus.append(v)
                    print(f"{dt:9} {layout:26} {v['layers']:6} {v['old_min_ms']:8.2f} "
                          f"{v['new_min_ms']:8.2f} {v['speedup']:8.2f} "
                          f"{v['max_abs_diff']:9.1e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": args.threads, "repeats": args.repeats, "ranks": RANKS,
              "layers": LAYERS, "bf16_impl": impl,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rows": rows,
              "crossover": cross, "baseline": args.baseline, "versus_baseline": versus}
    write_json(out, report)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plot_paths(rows, path, "layout", ("block-diagonal B (before)", "per slice"),
               "ms per decode step, all layers (min)",
               "Decode LoRA on CPU (native kernel), demo model shapes")


if __name__ == "__main__":
    main()
