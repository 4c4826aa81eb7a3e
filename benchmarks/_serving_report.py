"""The serving benchmark's output: the JSON document, the plots, and the tables printed at
the end (per configuration and rate; loraplex against vLLM; Ray mode's probes and adapter
working sets)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _log import log
from _output import cpu_name, pyplot, save_figure, write_json
from _serving_metrics import fmt_ms, slo_label


def table(results: Sequence[dict[str, Any]], slos: Sequence[tuple[float, float]]) -> str:
    good = " | ".join(f"goodput {i + 1} (req/s)" for i in range(len(slos)))
    head = ("| config | rate (req/s) | done/sent | out tok/s | TTFT p50 / p99 (ms) "
            f"| TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | {good} | prefix hit | preempt |")
    lines = [head, "|" + "---|" * (9 + len(slos))]
    for r in results:
        s = r["summary"]
        goodput = " | ".join(f"{g:.3f} ({100 * f:.0f}%)"
                             for g, f in zip(s["goodput_req_s"], s["slo_met_fraction"],
                                             strict=True))
        lines.append(
            f"| {r['config']} | {r['rate']:g} | {s['completed']}/{s['requests']} "
            f"| {s['throughput_tok_s']:.1f} | {fmt_ms(s['ttft_p50'])} / {fmt_ms(s['ttft_p99'])} "
            f"| {fmt_ms(s['tpot_p50'])} / {fmt_ms(s['tpot_p99'])} "
            f"| {fmt_ms(s['itl_p50'])} / {fmt_ms(s['itl_p99'])} "
            f"| {goodput} | {100 * r['engine']['prefix_cache_hit_rate']:.0f}% "
            f"| {r['engine']['preemptions']:.0f} |")
    lines.append("")
    lines.append("; ".join(f"SLO {i + 1}: {slo_label(slo)}" for i, slo in enumerate(slos))
                 + ". Goodput = requests meeting the SLO / span (first send to last "
                 "completion); in brackets, the share of sent requests meeting it.")
    return "\n".join(lines)


def comparison_table(results: Sequence[dict[str, Any]], names: Sequence[str],
                     slos: Sequence[tuple[float, float]],
                     agreements: Sequence[dict[str, Any]]) -> str:
    """Per rate: loraplex against vLLM on TTFT and TPOT p99 (ratio vLLM / loraplex: above 1,
    loraplex is lower), goodput under each SLO (ratio loraplex / vLLM) and greedy
    agreement (and, where they disagree, which one HF transformers + PEFT agrees with)."""
    lp, v = names
    by = {(r["config"], r["rate"]): r["summary"] for r in results}
    good = " | ".join(f"goodput SLO {i + 1} (req/s) | ratio" for i in range(len(slos)))
    lines = [f"| rate (req/s) | TTFT p99 (ms) {lp} / {v} | ratio | TPOT p99 (ms) | ratio "
             f"| {good} | same first {agreements[0]['first_tokens'] if agreements else 16} "
             "tokens | same whole output | of those that differ, equal to HF: loraplex / vLLM |",
             "|" + "---|" * (8 + 2 * len(slos))]
    agree = {a["rate"]: a for a in agreements}
    for rate in sorted({r["rate"] for r in results}):
        a, b = by.get((lp, rate)), by.get((v, rate))
        if a is None or b is None:
            continue
        cells = [f"{rate:g}"]
        for key in ("ttft_p99", "tpot_p99"):
            cells += [f"{fmt_ms(a[key])} / {fmt_ms(b[key])}", _ratio(b[key], a[key])]
        for i in range(len(slos)):
            ga, gb = a["goodput_req_s"][i], b["goodput_req_s"][i]
            cells += [f"{ga:.3f} / {gb:.3f}", _ratio(ga, gb)]
        ag = agree.get(rate)
        if ag is None:
            cells += ["-", "-", "-"]
        else:
            judged = ag.get("oracle", [])
            cells += [f"{100 * ag['first_agree']:.0f}% of {ag['compared']}",
                      f"{100 * ag['whole_agree']:.0f}%",
                      "-" if not judged else
                      f"{sum(j['loraplex_is_oracle'] for j in judged)} / "
                      f"{sum(j['vllm_is_oracle'] for j in judged)} of {len(judged)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None:
        return "-"
    if den == 0:
        return "-" if num == 0 else "inf"
    return f"{num / den:.2f}x"


def machine_info(load_start: tuple[float, float, float]) -> dict[str, Any]:
    return {"cpu": cpu_name(), "os_cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg_at_start": [round(x, 2) for x in load_start],
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def write_outputs(args: argparse.Namespace, out: Path, results: Sequence[dict[str, Any]],
                  servers: Sequence[dict[str, Any]],
                  load_start: tuple[float, float, float],
                  extra: dict[str, Any] | None = None) -> None:
    machine = machine_info(load_start)
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    doc = {"benchmark": "serving", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "command": "python benchmarks/serving.py " + " ".join(sys.argv[1:]),
           "machine": machine, "settings": settings, "servers": servers,
           "results": results, **(extra or {})}
    write_json(out, doc, indent=1)
    scope = (f"{args.num_tenants} tenants, {args.num_adapters} adapters, "
             f"{args.system_prompt_tokens}-token shared system prompt")
    what = ("loraplex serve vs vllm serve" if (extra or {}).get("compared")
            else "loraplex serve")
    title = (f"{what} over HTTP, CPU ({machine['os_cpus']} cores, load "
             f"{machine['load_avg_at_start'][0]:.1f}-{machine['load_avg_at_end'][0]:.1f}), "
             f"{args.dtype}; "
             + (f"in-process vs Ray Serve replicas; {scope}" if args.backend == "ray"
                else scope))
    if results:
        plot(results, out.with_suffix(".png"), title, args.slos)
        log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    ray = args.backend == "ray" and bool(extra)
    if ray:
        assert extra is not None
        path = out.parent / f"{out.name}_adapters.png"
        plot_ray(extra, path, title)
        log(f"wrote {path}")
    print()
    if results:
        print(table(results, args.slos))
    if ray:
        assert extra is not None
        print()
        print(ray_tables(extra))
    if extra and extra.get("compared"):
        print()
        print(comparison_table(results, extra["compared"], args.slos, extra["agreement"]))


def plot(results: Sequence[dict[str, Any]], path: Path, title: str,
         slos: Sequence[tuple[float, float]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    configs = list(dict.fromkeys(r["config"] for r in results))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = [
        (axes[0][0], ("ttft_p50", "ttft_p99"), 1000, "TTFT (ms)", [s[0] * 1000 for s in slos]),
        (axes[0][1], ("tpot_p50", "tpot_p99"), 1000, "TPOT (ms)", [s[1] * 1000 for s in slos]),
        (axes[1][0], ("goodput_req_s",), 1, "goodput (req/s meeting the SLO)", []),
        (axes[1][1], ("throughput_tok_s",), 1, "output throughput (tok/s)", []),
    ]
    for ax, keys, scale, ylabel, slo_lines in panels:
        for ci, config in enumerate(configs):
            rows = [r for r in results if r["config"] == config]
            rates = [r["rate"] for r in rows]
            if keys == ("goodput_req_s",):
                for si, style in zip(range(len(slos)), ("-o", "--x", ":s"), strict=False):
                    ys = [r["summary"]["goodput_req_s"][si] for r in rows]
                    ax.plot(rates, ys, style, color=colors[ci % len(colors)],
                            label=f"{config}, SLO {si + 1}")
                continue
            for key, style in zip(keys, ("-o", "--x"), strict=False):
                ys = [(r["summary"][key] or float("nan")) * scale for r in rows]
                label = config if len(keys) == 1 else f"{config} {key.split('_')[1]}"
                ax.plot(rates, ys, style, color=colors[ci % len(colors)], label=label)
        for si, slo in enumerate(slo_lines):
            ax.axhline(slo, color="grey", lw=0.8, ls=":")
            ax.annotate(f"SLO {si + 1}", (0, slo), xycoords=("axes fraction", "data"),
                        fontsize=7, color="grey")
        if slo_lines:
            ax.set_yscale("log")
        if keys == ("goodput_req_s",):
            ax.set_title("; ".join(f"SLO {i + 1}: {slo_label(x)}" for i, x in enumerate(slos)),
                         fontsize=8)
        if keys == ("goodput_req_s",):
            rates = sorted({r["rate"] for r in results})
            ax.plot(rates, rates, color="grey", lw=0.8, ls=":", label="offered rate")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def ray_tables(extra: dict[str, Any]) -> str:
    probes = extra.get("probes", {})
    lines = ["| deployment (one request at a time) | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
             "| e2e p50 (ms) | paired vs in-process: TTFT | e2e | TPOT |",
             "|---|---|---|---|---|---|---|"]

    def paired(p: dict[str, Any], key: str) -> str:
        diff, ratio = p.get(f"paired_{key}_diff_p50"), p.get(f"paired_{key}_ratio_p50")
        if diff is None or ratio is None:
            return "-"
        return f"{diff * 1000:+.0f} ms ({ratio:.2f}x)"

    for name, p in probes.items():
        lines.append(f"| {name} | {fmt_ms(p['ttft_p50'])} / {fmt_ms(p['ttft_p99'])} "
                     f"| {fmt_ms(p['tpot_p50'])} / {fmt_ms(p['tpot_p99'])} "
                     f"| {fmt_ms(p['e2e_p50'])} | {paired(p, 'ttft')} | {paired(p, 'e2e')} "
                     f"| {paired(p, 'tpot')} |")
    lines += ["", "| deployment | adapters | requests | disk loads (per replica) "
              "| loads / request | hit rate (1 - loads/request) | TTFT p50 / p99 (ms) |",
              "|---|---|---|---|---|---|---|"]
    for r in extra.get("adapter_sets", []):
        per = ", ".join(str(v) for v in r["disk_loads_per_replica"].values())
        lines.append(f"| {r['config']} | {r['num_adapters']} | {r['adapter_requests']} "
                     f"| {r['disk_loads']} ({per}) | {r['loads_per_request']:.3f} "
                     f"| {100 * r['hit_rate']:.1f}% | {fmt_ms(r['ttft_p50'])} / "
                     f"{fmt_ms(r['ttft_p99'])} |")
    return "\n".join(lines)


def plot_ray(extra: dict[str, Any], path: Path, title: str) -> None:
    plt = pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    probes = extra.get("probes", {})
    names = [n for n in probes if "paired_e2e_diff_p50" in probes[n]]
    for i, (key, label) in enumerate((("ttft", "TTFT"), ("e2e", "end to end"),
                                      ("tpot", "TPOT"))):
        ys = [(probes[n][f"paired_{key}_diff_p50"] or float("nan")) * 1000 for n in names]
        ax0.bar([x + 0.27 * i for x in range(len(names))], ys, width=0.27, label=label)
    ax0.axhline(0, color="grey", lw=0.8)
    ax0.set_xticks([x + 0.27 for x in range(len(names))], names, fontsize=8)
    ax0.set_ylabel("ms, Ray minus in-process (p50 of paired requests)")
    ax0.set_title("per-request cost of the Ray path (idle servers, 32-token prompt, "
                  "16 tokens out)", fontsize=9)
    ax0.legend(fontsize=8)
    ax0.grid(alpha=0.3, axis="y")
    sets = extra.get("adapter_sets", [])
    configs = list(dict.fromkeys(r["config"] for r in sets))
    sizes = sorted({r["num_adapters"] for r in sets})
    width = 0.8 / max(1, len(configs))
    for ci, config in enumerate(configs):
        ys = [next((100 * r["hit_rate"] for r in sets
                    if r["config"] == config and r["num_adapters"] == n), float("nan"))
              for n in sizes]
        ax1.bar([x + width * ci for x in range(len(sizes))], ys, width=width, label=config)
    ax1.set_xticks([x + 0.4 - width / 2 for x in range(len(sizes))],
                   [f"{n} adapters" for n in sizes])
    cap = sets[0]["capacity_per_replica"] if sets else "?"
    ax1.set_ylabel("adapter hit rate (%)")
    ax1.set_title(f"requests served without a disk load (host cache {cap} adapters/replica)",
                  fontsize=9)
    ax1.set_ylim(min(0.0, *[100 * r["hit_rate"] for r in sets], 0.0) - 5, 100)
    ax1.axhline(0, color="grey", lw=0.8)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
