"""Native CPU paged decode attention: this tree's kernels against a build of another
revision's source (default ``main``), compiled side by side and timed in the same run.

Shapes are the demo model's (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, blocks
of 16 positions), decode batches of 1-64 sequences at one context length each. The K/V
read comes from DRAM as in a model's layer loop, where every other layer's cache passes
through the caches between two calls of one layer: each call reads a different slice of a
pool far larger than the last-level cache, through shuffled block tables.

Reported: achieved GB/s (bytes of K and V read / seconds) next to the streaming bandwidth
measured in the same run (``_floor``'s large copy, read + write bytes, and a read-only sum),
and the ratio old / new time per shape (old and new timed alternately; best and median of
the repeats).

    python benchmarks/decode_attention.py [--baseline REV] [--threads 2] [--out PATH]

(``--baseline 9c44b7f``: the last revision with the two-pass kernel.) Writes PATH.json and
PATH.png.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# As offline_throughput.py: idle OpenMP threads must not spin on the cores they share.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baseline import build_baseline  # noqa: E402
from _floor import _stream_rate  # noqa: E402
from _output import add_out_argument, pyplot, save_figure, write_json  # noqa: E402

from loraplex_kernels import cpu_native  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_pool(dtype: torch.dtype, pool_mib: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    elem = torch.empty((), dtype=dtype).element_size()
    num_blocks = (pool_mib << 20) // (2 * BLOCK * KV_HEADS * HEAD_DIM * elem)
    # [num_blocks, block_size, num_kv_heads, head_dim] each
    return (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
            torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype))


class Shape:
    """One batch at one context length, with `sets` disjoint block-table sets over the pool."""

    def __init__(self, pool: tuple[torch.Tensor, torch.Tensor], batch: int, context: int,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k, self.v = pool
        dtype, elem, num_blocks = self.k.dtype, self.k.element_size(), self.k.shape[0]
        per_seq = -(-context // BLOCK)
        self.sets = max(1, num_blocks // (batch * per_seq))
        # a pool smaller than one set (in-cache runs) repeats blocks across sequences
        reps = -(-batch * per_seq // num_blocks)
        perm = torch.cat([torch.randperm(num_blocks, generator=g)
                          for _ in range(reps)])[:self.sets * batch * per_seq]
        # [sets, batch, blocks per sequence] int32, each set's own blocks
        self.tables = perm.view(self.sets, batch, per_seq).to(torch.int32).contiguous()
        self.lens = torch.full((batch,), context, dtype=torch.int32)
        self.ids = torch.arange(batch, dtype=torch.int64)
        self.q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)  # [batch, h, d]
        self.out = torch.empty_like(self.q)
        self.kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * elem
        self.batch = batch

    def call(self, lib: ctypes.CDLL, s: int, threads: int, impl: int | None) -> None:
        t = self.tables[s]
        args = (self.q.data_ptr(), self.q.stride(0), self.q.stride(1), self.k.data_ptr(),
                self.v.data_ptr(), t.data_ptr(), t.stride(0), self.lens.data_ptr(),
                self.ids.data_ptr(), self.ids.data_ptr(), self.batch, HEADS, KV_HEADS,
                HEAD_DIM, BLOCK, HEAD_DIM ** -0.5, self.out.data_ptr(), self.out.stride(0),
                self.out.stride(1), threads)
        # no sliding window, no soft-cap (a baseline revision's build ignores the two)
        if impl is None:
            status = lib.paged_decode_attention_f32(*args, 0, 0.0)
        else:
            status = lib.paged_decode_attention_bf16(*args, impl, 0, 0.0)
        assert status == 0


def read_rate(repeats: int, megabytes: int = 512) -> float:
    """GB/s of summing a buffer far larger than the caches: a read-only stream, as the
    kernel's K/V traffic is."""
    src = torch.ones(megabytes << 18, dtype=torch.float32)  # megabytes MiB
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best / 1e9


def time_calls(shape: Shape, lib: ctypes.CDLL, threads: int, impl: int | None,
               budget_s: float) -> float:
    """Seconds per call, averaged over enough calls (each on the next table set) to fill
    ``budget_s``."""
    shape.call(lib, 0, threads, impl)
    calls, start = 0, time.perf_counter()
    while True:
        shape.call(lib, calls % shape.sets, threads, impl)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision to compare against")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per timing")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 768])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--pool-mib", type=int, default=512,
                    help="K + V pool size: far past the last-level cache reads from DRAM, "
                    "a few MiB measures the in-cache (compute) rate")
    add_out_argument(ap, "benchmarks/results/decode_attention")
    args = ap.parse_args()

    new = cpu_native._library()
    assert new is not None, "native kernels unavailable"
    with tempfile.TemporaryDirectory() as tmp:
        old = build_baseline(args.baseline, Path(tmp))
    torch.set_num_threads(args.threads)
    streams = {"copy": [_stream_rate(3)], "read": [read_rate(3)]}
    impls: list[tuple[str, int | None]] = []
    for name in args.dtypes:
        if name == "float32":
            impls.append(("float32", None))
        else:
            impls += [(f"bf16/{i}", cpu_native.BF16_IMPLS[i]) for i in cpu_native.bf16_impls()]
    rows = []
    print(f"{'kernel':<18}{'batch':>6}{'ctx':>6}{'old us':>10}{'new us':>10}"
          f"{'old GB/s':>10}{'new GB/s':>10}{'old/new':>9}{'(median)':>9}")
    pools: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
    for label, impl in impls:
        dtype = torch.float32 if impl is None else torch.bfloat16
        if dtype not in pools:
            pools = {dtype: make_pool(dtype, args.pool_mib)}
        pool = pools[dtype]
        for context in args.contexts:
            for batch in args.batches:
                shape = Shape(pool, batch, context)
                times: dict[str, list[float]] = {"old": [], "new": []}
                for r in range(args.repeats):  # alternate the order: drift hits both
                    order = [("old", old), ("new", new)]
                    for key, lib in order if r % 2 == 0 else order[::-1]:
                        times[key].append(time_calls(shape, lib, args.threads, impl,
                                                     args.budget))
                best = {k: min(v) for k, v in times.items()}
                med = {k: statistics.median(v) for k, v in times.items()}
                row = {"kernel": label, "batch": batch, "context": context,
                       "kv_bytes": shape.kv_bytes,
                       "old_s_best": best["old"], "new_s_best": best["new"],
                       "old_s_median": med["old"], "new_s_median": med["new"],
                       "old_gbps": shape.kv_bytes / best["old"] / 1e9,
                       "new_gbps": shape.kv_bytes / best["new"] / 1e9,
                       "ratio_best": best["old"] / best["new"],
                       "ratio_median": med["old"] / med["new"]}
                rows.append(row)
                print(f"{label:<18}{batch:>6}{context:>6}{best['old'] * 1e6:>10.1f}"
                      f"{best['new'] * 1e6:>10.1f}{row['old_gbps']:>10.2f}"
                      f"{row['new_gbps']:>10.2f}{row['ratio_best']:>9.2f}"
                      f"{row['ratio_median']:>9.2f}")
        streams["copy"].append(_stream_rate(3))
        streams["read"].append(read_rate(3))
    copy, read = max(streams["copy"]), max(streams["read"])
    print(f"streaming, best of the run: copy {copy:.2f} GB/s (read + write bytes), "
          f"read-only {read:.2f} GB/s; each: copy "
          f"{', '.join(f'{s:.1f}' for s in streams['copy'])}; read "
          f"{', '.join(f'{s:.1f}' for s in streams['read'])}")
    summary = {}
    for label, _ in impls:
        sel = [r for r in rows if r["kernel"] == label]
        big = [r for r in sel if r["batch"] >= 8]
        summary[label] = {
            "old_gbps_median_batch8plus": statistics.median(r["old_gbps"] for r in big),
            "new_gbps_median_batch8plus": statistics.median(r["new_gbps"] for r in big),
            "ratio_best_geomean": statistics.geometric_mean(r["ratio_best"] for r in sel),
            "ratio_median_geomean": statistics.geometric_mean(r["ratio_median"] for r in sel)}
        s = summary[label]
        print(f"{label}: batch >= 8 median GB/s old {s['old_gbps_median_batch8plus']:.2f} "
              f"({s['old_gbps_median_batch8plus'] / copy:.0%} of copy, "
              f"{s['old_gbps_median_batch8plus'] / read:.0%} of read), new "
              f"{s['new_gbps_median_batch8plus']:.2f} "
              f"({s['new_gbps_median_batch8plus'] / copy:.0%}, "
              f"{s['new_gbps_median_batch8plus'] / read:.0%}); old/new over all shapes "
              f"(geomean): best {s['ratio_best_geomean']:.2f}, "
              f"median {s['ratio_median_geomean']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = write_json(out, {
        "baseline": args.baseline, "threads": args.threads, "heads": HEADS,
        "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK,
        "pool_mib": args.pool_mib, "stream_copy_gbps": streams["copy"],
        "stream_read_gbps": streams["read"], "summary": summary, "rows": rows}, indent=1)
    plot(rows, read, args.baseline, out.with_suffix(".png"))
    print(f"wrote {written} and {out.with_suffix('.png')}")


def plot(rows: list[dict[str, Any]], read_gbps: float, baseline: str, path: Path) -> None:
    """Achieved GB/s per shape, old and new side by side, the read-only streaming rate as a
    line: how far each kernel is from the memory's roof."""
    plt = pyplot()
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    fig, axes = plt.subplots(1, len(kernels), figsize=(4.5 * len(kernels), 4), sharey=True,
                             squeeze=False)
    for ax, kernel in zip(axes[0], kernels, strict=True):
        sel = [r for r in rows if r["kernel"] == kernel]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r["old_gbps"] for r in sel], 0.4, color="#9e9e9e",
               label=f"baseline ({baseline})")
        ax.bar([x + 0.2 for x in xs], [r["new_gbps"] for r in sel], 0.4, color="#e0702a",
               label="this tree")
        ax.axhline(read_gbps, color="black", lw=0.8, ls="--", label="read-only streaming")
        ax.set_xticks(list(xs), [f"b{r['batch']}\nctx {r['context']}" for r in sel],
                      fontsize=6)
        ax.set_title(kernel, fontsize=9)
    axes[0][0].set_ylabel("GB/s of K + V read (best)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Native paged decode attention on CPU, demo model heads", fontsize=10)
    save_figure(fig, path, dpi=120)

if __name__ == "__main__":
    main()
