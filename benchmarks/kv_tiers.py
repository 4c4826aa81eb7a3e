"""TTFT of a long shared prefix served from each tier of the prefix cache: a pool hit, a
disk hit (the disk tier, ``--kv-disk-dir``), and recompute.

One engine per dtype and prefix length on the demo model (loraplex's offline ``LLM``), its
pool just big enough for one request (prefix + a 16-token suffix), its disk tier in a fresh
folder. ``--repeats`` prefixes of random tokens: each is first seen cold (recompute: the
whole prompt prefilled), later found on disk (after at least two other prompts pushed it out of
the pool: every block loaded from its file, checksum and identity verified), then at once
again in the pool (a pool hit). Each request is alone in the engine, a new 16-token suffix
behind the prefix, ``max_tokens`` 1: its time in ``generate`` is its TTFT. The disk
writer is drained before each timed request (its files are in the OS page cache, as a
recently evicted prefix's are), and every request's hit counters are checked: a disk hit
loaded the whole prefix from disk, a pool hit found it all in the pool, a recompute
neither. Medians per case; the JSON keeps every request.

    python benchmarks/kv_tiers.py --out docs/benchmarks/kv_tiers   # ~2 min, 2 cores
    python benchmarks/kv_tiers.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import (  # noqa: E402
    add_out_argument,
    command_line,
    cpu_name,
    pyplot,
    save_figure,
    write_json,
)

from loraplex import LLM, SamplingParams  # noqa: E402

BLOCK = 16
SUFFIX = 16
TIERS = ("pool", "disk", "recompute")
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _counters(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.prefix_cache_hit_tokens, stats.kv_disk_hit_tokens


def _timed(llm: LLM, prompt: list[int]) -> dict[str, Any]:
    """One request alone: its TTFT and the prefix tokens the pool and the disk gave it."""
    assert llm.engine.disk is not None
    llm.engine.disk.flush()  # no file write of an earlier request runs beside this one
    pool0, disk0 = _counters(llm)
    start = time.perf_counter()
    llm.generate([prompt], PARAMS)
    ttft = time.perf_counter() - start
    pool1, disk1 = _counters(llm)
    return {"ttft_ms": 1000 * ttft, "pool_hit_tokens": pool1 - pool0,
            "disk_hit_tokens": disk1 - disk0}


def run_case(model: str, dtype: str, length: int, repeats: int,
             folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Every request of one dtype and prefix length, by tier."""
    llm = LLM(model, dtype=dtype, progress=False, block_size=BLOCK,
              num_kv_blocks=length // BLOCK + 3,
              kv_disk_dir=str(folder), kv_disk_gib=4.0)
    rng = random.Random(length)
    vocab = llm.engine.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    # warm-up (allocator, threads, a full-length forward), then prefixes never seen before
    llm.generate([tokens(length + SUFFIX)], PARAMS)
    llm.generate([tokens(SUFFIX)], PARAMS)
    prefixes = [tokens(length) for _ in range(repeats)]
    runs: dict[str, list[dict[str, Any]]] = {tier: [] for tier in TIERS}
    for prefix in prefixes:
        runs["recompute"].append(_timed(llm, prefix + tokens(SUFFIX)))
    for prefix in prefixes:  # two other prompts ran since: out of the pool, on disk
        runs["disk"].append(_timed(llm, prefix + tokens(SUFFIX)))
        runs["pool"].append(_timed(llm, prefix + tokens(SUFFIX)))
    llm.engine.close()
    want = {"recompute": (0, 0), "disk": (0, length), "pool": (length, 0)}
    for tier, rows in runs.items():
        for row in rows:
            got = (row["pool_hit_tokens"], row["disk_hit_tokens"])
            if got != want[tier]:
                raise SystemExit(f"{dtype} {length}: a {tier} request got {got} "
                                 f"(pool, disk) hit tokens, not {want[tier]}")
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,512,1024", help="prefix lengths, in tokens")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=5, help="prefixes per case (at least 3)")
    p.add_argument("--quick", action="store_true")
    add_out_argument(p, "kv_tiers")
    args = p.parse_args()
    if args.quick:
        args.lengths, args.repeats = "64,128", 3
    lengths = [int(n) for n in args.lengths.split(",")]
    dtypes = args.dtypes.split(",")
    if args.repeats < 3 or any(n % BLOCK for n in lengths):
        p.error(f"--repeats is at least 3, and every length a multiple of {BLOCK}")
    from loraplex.cli_engine import model_arg

    model = model_arg(None)
    results: list[dict[str, Any]] = []
    print(f"{'dtype':>9} {'prefix':>6}  " + "  ".join(f"{t + ' ms':>12}" for t in TIERS)
          + "  recompute/disk  disk/pool", flush=True)
    with tempfile.TemporaryDirectory(prefix="loraplex-kv-tiers-") as root:
        for dtype in dtypes:
            for length in lengths:
                runs = run_case(model, dtype, length, args.repeats,
                                Path(root) / f"{dtype}-{length}")
                med = {t: statistics.median(r["ttft_ms"] for r in runs[t]) for t in TIERS}
                results.append({"dtype": dtype, "prefix_tokens": length,
                                "median_ttft_ms": med, "requests": runs})
                print(f"{dtype:>9} {length:>6}  "
                      + "  ".join(f"{med[t]:12.1f}" for t in TIERS)
                      + f"  {med['recompute'] / med['disk']:14.2f}"
                      + f"  {med['disk'] / med['pool']:9.2f}", flush=True)
    doc = {"command": command_line("kv_tiers.py", args),
           "model": "demo (SmolLM2-135M-Instruct)", "machine": {"cpu": cpu_name()},
           "block_size": BLOCK, "suffix_tokens": SUFFIX, "repeats": args.repeats,
           "results": results}
    out = Path(args.out)
    write_json(out, doc)
    _plot(results, dtypes, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def _plot(results: list[dict[str, Any]], dtypes: list[str], out: Path) -> None:
    plt = pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(dtypes), figsize=(4.5 * len(dtypes), 3.6), sharey=True,
                             squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        rows = [r for r in results if r["dtype"] == dtype]
        xs = [r["prefix_tokens"] for r in rows]
        for tier, marker in zip(TIERS, "o^s", strict=True):
            ax.plot(xs, [r["median_ttft_ms"][tier] for r in rows], marker=marker,
                    label=f"{tier} hit" if tier != "recompute" else tier)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("shared prefix, tokens")
        ax.set_title(f"demo model, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("TTFT, ms (median)")
    axes[0][0].legend()
    save_figure(fig, out)


if __name__ == "__main__":
    main()
