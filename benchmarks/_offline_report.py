"""The offline benchmark's output: the JSON report, the plot (the peer subset's systems
side by side; loraplex's adapter sweep) and the table printed at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _log import log_clock as log
from _offline_results import RunResult, sweep_passes, sweep_runs
from _output import pyplot, save_figure, write_json


def write_outputs(report: dict[str, Any], results: list[RunResult], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    plot(results, report, out.with_suffix(".png"))
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(results: list[RunResult], report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rounds: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        if r.workload == "peer subset":
            rounds.setdefault((r.system, r.dtype), []).append(r)
    # one bar per system and dtype: its median round (the faster middle one for an even
    # count), the other rounds as a range; the report's ratios are medians of per-round
    # ratios, so they can differ a little from the bars' quotients
    subset = [sorted(rs, key=lambda r: r.seconds)[(len(rs) - 1) // 2] for rs in rounds.values()]
    sweep_dtype = next((r.dtype for r in results if r.workload == "full"), "float32")
    # per adapter count, its median pass over the sweep (--sweep-rounds)
    passes = sweep_passes(results, sweep_dtype)
    by_count: dict[int, list[RunResult]] = {}
    for k in passes:
        for n, r in sweep_runs(results, sweep_dtype, k).items():
            by_count.setdefault(n, []).append(r)
    full = [sorted(rs, key=lambda r: r.seconds)[(len(rs) - 1) // 2]
            for _, rs in sorted(by_count.items())]
    if len(full) < 2:
        full = []  # no sweep: the full-workload run alone is not one
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[max(1, len(subset)),
                                                                    max(1, len(full))])
    colors = {"a": "#9e9e9e", "b": "#5b8bd0", "c": "#e0702a", "v": "#6a3d9a"}
    if subset:
        ax = axes[0]
        base = next((r.tokens_per_s for r in subset if r.system == "a"), None)
        labels = [r.name.rsplit(" #", 1)[0].replace(" ", "\n", 1).replace(", ", "\n")
                  for r in subset]  # a round's number dropped: the bar is the median
        spread = [[r.tokens_per_s - min(x.tokens_per_s for x in rs) for r, rs in
                   zip(subset, rounds.values(), strict=True)],
                  [max(x.tokens_per_s for x in rs) - r.tokens_per_s for r, rs in
                   zip(subset, rounds.values(), strict=True)]]
        bars = ax.bar(labels, [r.tokens_per_s for r in subset],
                      color=[colors[r.system] for r in subset],
                      yerr=spread if report.get("rounds", 1) > 1 else None, capsize=3)
        for bar, r in zip(bars, subset, strict=True):
            bar.set_hatch("//" if r.dtype == "bfloat16" else "")
        for bar, r in zip(bars, subset, strict=True):
            note = f"{r.tokens_per_s:.0f}" + (f"\n{r.tokens_per_s / base:.1f}x (a)" if base else "")
            # beside the range bar when there is one
            at = 0.25 if report.get("rounds", 1) > 1 else 0.5
            ax.annotate(note, (bar.get_x() + bar.get_width() * at, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("output tokens/s")
        rounds_note = (f", median of {report['rounds']} rounds (range: bars)"
                       if report.get("rounds", 1) > 1 else "")
        ax.set_title(f"same {subset[0].num_requests} requests, "
                     f"{subset[0].num_adapters} adapters{rounds_note}", fontsize=10)
        ax.margins(y=0.25)
        ax.tick_params(axis="x", labelsize=8)
    else:
        axes[0].axis("off")
    if full:
        ax = axes[1]
        labels = ["base only" if r.num_adapters == 0 else f"{r.num_adapters} adapter"
                  + ("s" if r.num_adapters > 1 else "") for r in full]
        bars = ax.bar(labels, [r.tokens_per_s for r in full], color=colors["c"])
        for bar, r in zip(bars, full, strict=True):
            ax.annotate(f"{r.tokens_per_s:.0f}", (bar.get_x() + bar.get_width() / 2,
                                                  bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        median = f", median of {len(passes)} passes" if len(passes) > 1 else ""
        ax.set_title(f"loraplex {sweep_dtype}, adapter sweep (first {full[0].num_requests} "
                     f"requests{median})",
                     fontsize=10)
        ax.margins(y=0.15)
        ax.tick_params(axis="x", labelsize=8)
    else:
        axes[1].axis("off")
    m = report["machine"]
    dtypes = ", ".join(dict.fromkeys(r.dtype for r in results))
    fig.suptitle(f"Offline throughput, {Path(report['model']).name}, {dtypes}, "
                 f"{m['torch_threads']} CPU threads ({report['date'][:10]})", fontsize=11)
    save_figure(fig, path)


def print_table(report: dict[str, Any]) -> None:
    runs = report["runs"]
    base = next((r["tokens_per_s"] for r in runs if r["system"] == "a"), None)
    head = f"{'system':<58} {'workload':<12} {'reqs':>5} {'adapt':>5} {'out tok':>8} " \
           f"{'secs':>8} {'tok/s':>8} {'vs (a)':>7} {'floor':>6}"
    print()
    print(head)
    print("-" * len(head))
    for r in runs:
        vs = f"{r['tokens_per_s'] / base:.1f}x" if base else "-"
        print(f"{r['name']:<58} {r['workload']:<12} {r['num_requests']:>5} "
              f"{r['num_adapters']:>5} {r['num_output_tokens']:>8} {r['seconds']:>8.1f} "
              f"{r['tokens_per_s']:>8.1f} {vs:>7} "
              f"{r['extra'].get('fraction_of_compute_floor', 0):>6.0%}")
    for f in report["floors"].values():
        start = report.get("floors_start", {}).get(f["dtype"])
        end = report.get("floors_end", {}).get(f["dtype"])
        when = (f" (the higher of the start's {start['gemm_gflops_prefill']:.0f} and the "
                f"end's {end['gemm_gflops_prefill']:.0f} at 256 rows)" if start and end else "")
        print(f"floors ({f['dtype']}, {f['threads']} threads): GEMM "
              f"{f['gemm_gflops_prefill']:.0f} GFLOP/s at 256 rows, "
              f"{f['gemm_gflops_decode']:.0f} at 16 (a decoder layer's shapes), LM head "
              f"{f['gemm_gflops_head']:.0f}; streaming {f['stream_gbps']:.1f} GB/s"
              + when)
    print("'floor': the fraction of the compute floor (in the run's own dtype) reached")
    print()
    by_round = report.get("ratios_by_round", {})
    for k, v in report["ratios"].items():
        each = by_round.get(k, [])
        rounds = f"  (median of {', '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else ""
        print(f"{k:<36} {v:6.2f}{rounds}")
    for k, v in report.get("median_fraction_of_compute_floor", {}).items():
        print(f"fraction of compute floor, {k:<20} {v:6.0%}")
    for k, v in report.get("repeat_agreement", {}).items():
        print(f"same tokens in every round, {k:<19} {v:6.0%}")
    for k, v in report["greedy_prefix16_agreement"].items():
        what = "whole outputs" if k.endswith("_whole") else "first 16 tokens"
        print(f"greedy agreement {k.removesuffix('_whole'):<36} {v:6.0%} ({what})")
    print(f"total wall time {report['total_seconds']:.0f}s")
