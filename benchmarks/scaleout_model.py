"""How throughput and the adapter hit rate scale with N replicas: a model fitted to, and
checked against, what ``benchmarks/serving.py --backend ray`` measured.

The inputs are that run's JSON (``docs/benchmarks/serving_ray.json``):

- Throughput: ``T(N) = T1 x (1 + s x (N - 1))``, where ``T1`` is the output throughput
  one Ray replica reached at the run's highest offered rate (on all of the machine's
  cores), and ``s`` the share of ``T1`` each further replica adds on hardware of its own.
  ``s`` is stated, not measured: a 2-core machine cannot show it (two replicas split the
  same two cores). The default ``s = 1``: Serve's router runs in each gateway and replicas
  share no state but Redis, so nothing in loraplex serialises them. The Ray path's own cost
  is in ``T1`` already; against the in-process engine it is ``r``, the median ratio of
  end-to-end latency, Ray x1 over in-process, of the run's paired one-at-a-time requests
  (both servers up, same background load), so one in-process engine on the same hardware
  would give about ``T1 x r``. (The two servers' throughputs at the top rate ran minutes
  apart on a shared machine and are not compared.) Misses cost ``t_load`` each, the
  replicas' measured mean adapter load time (``adapter_load_seconds`` per disk load, slot
  installs included).
- Hit rate: N replicas, each an LRU of ``C`` adapters (``--max-cpu-loras``: host cache,
  and the size of Serve's per-replica model list); requests draw adapters with Zipf
  popularity over a working set of ``W``. *Affinity* (Serve multiplexing, modelled): a
  request goes to a replica that holds its adapter, else to a random one (which then
  loads it). *Random*: a uniformly random replica. The model is replayed on the exact
  request sequences the benchmark sent and printed next to the measured hit rates.

    python benchmarks/scaleout_model.py                      # reads the default JSON
    python benchmarks/scaleout_model.py --scaling 0.9        # another stated s

Writes ``docs/benchmarks/scaleout_model.json`` and ``.png`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, pyplot, save_figure, write_json  # noqa: E402
from _workload import zipf_weights  # noqa: E402


def simulate(sequence: Sequence[int | str], replicas: int, capacity: int, affinity: bool,
             seed: int = 0, skip: int = 0) -> float:
    """Hit rate over ``sequence[skip:]`` (the first ``skip`` requests warm the caches)."""
    rng = random.Random(seed)
    caches: list[OrderedDict[int | str, None]] = [OrderedDict() for _ in range(replicas)]
    hits = counted = 0
    for i, adapter in enumerate(sequence):
        holders = [r for r, c in enumerate(caches) if adapter in c] if affinity else []
        r = rng.choice(holders) if holders else rng.randrange(replicas)
        cache = caches[r]
        hit = adapter in cache
        if hit:
            cache.move_to_end(adapter)
        else:
            cache[adapter] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        if i >= skip:
            counted += 1
            hits += hit
    return hits / counted if counted else 0.0


def zipf_sequence(num_adapters: int, exponent: float, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return rng.choices(range(num_adapters), zipf_weights(num_adapters, exponent), k=n)


def measured_inputs(doc: dict[str, Any]) -> dict[str, Any]:
    settings = doc["settings"]
    top = max(settings["rates"])
    thr = {r["config"]: r["summary"]["throughput_tok_s"] for r in doc["results"]
           if r["rate"] == top}
    loads = [(r["disk_loads"], r) for r in doc.get("adapter_sets", [])]
    return {"rate": top, "throughput": thr, "capacity": settings["max_cpu_loras"],
            "zipf": settings["zipf"], "sets": [r for _, r in loads]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", default="docs/benchmarks/serving_ray.json")
    p.add_argument("--scaling", type=float, default=1.0,
                   help="s, the share of T1 each replica beyond the first adds (stated)")
    p.add_argument("--replicas", default="1,2,4,8,16")
    p.add_argument("--working-sets", default="20,100,500")
    p.add_argument("--requests", type=int, default=20000, help="simulated requests per cell")
    add_out_argument(p, "docs/benchmarks/scaleout_model")
    args = p.parse_args(argv)
    doc = json.loads(Path(args.measured).read_text())
    m = measured_inputs(doc)
    t1 = m["throughput"].get("ray x1")
    local = m["throughput"].get("in-process")
    if t1 is None or local is None:
        p.error("the measured run has no 'ray x1' and 'in-process' throughput")
    paired = doc.get("probes", {}).get("ray x1", {}).get("paired_e2e_ratio_p50")
    e = args.scaling
    two = m["throughput"].get("ray x2")
    load_s = doc.get("adapter_load_s_per_load")
    capacity, zipf = int(m["capacity"]), float(m["zipf"])

    # 1. the model replayed on the benchmark's own request sequences
    check = []
    for r in m["sets"]:
        seq = [name.split("/")[-1] for name in r["sequence"]]
        warm = len(seq) - r["adapter_requests"]
        sims = [simulate(seq, r["replicas"], capacity, r["affinity"], seed=s, skip=warm)
                for s in range(20)]
        check.append({"config": r["config"], "replicas": r["replicas"],
                      "affinity": r["affinity"], "num_adapters": r["num_adapters"],
                      "measured": r["hit_rate"], "model": sum(sims) / len(sims)})

    # 2. the model's table
    replicas = [int(x) for x in args.replicas.split(",")]
    sets = [int(x) for x in args.working_sets.split(",")]
    rows = []
    for w in sets:
        seq = zipf_sequence(w, zipf, args.requests, seed=w)
        for n in replicas:
            aff = simulate(seq, n, capacity, True, skip=args.requests // 4)
            rnd = simulate(seq, n, capacity, False, skip=args.requests // 4)
            rows.append({"num_adapters": w, "replicas": n, "hit_affinity": aff,
                         "hit_random": rnd, "throughput_tok_s": t1 * (1 + e * (n - 1))})

    out = Path(args.out)
    result = {"measured_from": args.measured, "command": "python benchmarks/scaleout_model.py "
              + " ".join(sys.argv[1:]), "T1_tok_s": t1, "in_process_tok_s": local,
              "ray_x2_tok_s_on_this_machine": two, "scaling": e,
              "paired_e2e_ratio_ray_x1": paired,
              "capacity_per_replica": capacity, "zipf": zipf, "adapter_load_s": load_s,
              "check": check, "table": rows}
    write_json(out, result, indent=1)
    plot(result, out.with_suffix(".png"), sets, replicas)

    ray_cost = (f"; paired e2e ratio ray x1 / in-process {paired:.3f}, so one in-process "
                f"engine ~ {t1 * paired:.1f} tok/s" if paired else "")
    there = f"; ray x2 on this machine {two:.1f} tok/s ({two / t1:.2f} x T1)" if two else ""
    print(f"T1 = {t1:.1f} tok/s (ray x1 at {m['rate']:g} req/s), in-process {local:.1f}, "
          f"s = {e:.2f}{ray_cost}{there}")
    print()
    print("| measured run | replicas | adapters | hit rate measured | model (same sequence) |")
    print("|---|---|---|---|---|")
    for c in check:
        print(f"| {c['config']} | {c['replicas']} | {c['num_adapters']} "
              f"| {100 * c['measured']:.1f}% | {100 * c['model']:.1f}% |")
    print()
    print(f"| adapters (working set) | replicas | throughput (tok/s, T1 x (1 + {e:g}(N-1))) "
          f"| hit rate, affinity | hit rate, random | loads/request affinity / random "
          f"| load s per 1000 requests affinity / random |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cost = "-" if not load_s else (f"{1000 * (1 - r['hit_affinity']) * load_s:.1f} / "
                                       f"{1000 * (1 - r['hit_random']) * load_s:.1f}")
        print(f"| {r['num_adapters']} | {r['replicas']} | {r['throughput_tok_s']:.0f} "
              f"| {100 * r['hit_affinity']:.1f}% | {100 * r['hit_random']:.1f}% "
              f"| {1 - r['hit_affinity']:.3f} / {1 - r['hit_random']:.3f} | {cost} |")
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def plot(result: dict[str, Any], path: Path, sets: Sequence[int],
         replicas: Sequence[int]) -> None:
    plt = pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, w in enumerate(sets):
        rows = [r for r in result["table"] if r["num_adapters"] == w]
        ns = [r["replicas"] for r in rows]
        ax0.plot(ns, [100 * r["hit_affinity"] for r in rows], "-o", color=colors[i],
                 label=f"W={w}, affinity")
        ax0.plot(ns, [100 * r["hit_random"] for r in rows], "--x", color=colors[i],
                 label=f"W={w}, random")
    for c in result["check"]:
        if c["num_adapters"] in sets:
            color = colors[list(sets).index(c["num_adapters"])]
            ax0.plot([c["replicas"]], [100 * c["measured"]], "s" if c["affinity"] else "D",
                     color=color, mfc="none", ms=9)
    ax0.set_xscale("log", base=2)
    ax0.set_xticks(list(replicas), [str(n) for n in replicas])
    ax0.set_xlabel("replicas N")
    ax0.set_ylabel("adapter hit rate (%)")
    ax0.set_ylim(0, 100)
    ax0.set_title(f"LRU model, {result['capacity_per_replica']} adapters per replica, Zipf "
                  f"{result['zipf']:g}; hollow markers: measured", fontsize=9)
    ax0.legend(fontsize=6, ncol=2, loc="lower right")
    ax0.grid(alpha=0.3)
    rows = [r for r in result["table"] if r["num_adapters"] == sets[0]]
    ax1.plot([r["replicas"] for r in rows], [r["throughput_tok_s"] for r in rows], "-o",
             label=f"model: T1 x (1 + {result['scaling']:g} (N - 1))")
    ax1.plot([1], [result["T1_tok_s"]], "s", mfc="none", ms=9, color="k",
             label="measured ray x1 (T1)")
    if result["ray_x2_tok_s_on_this_machine"]:
        ax1.plot([2], [result["ray_x2_tok_s_on_this_machine"]], "D", mfc="none", ms=9,
                 color="r", label="measured ray x2 on the same 2 cores")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(list(replicas), [str(n) for n in replicas])
    ax1.set_xlabel("replicas N (each on cores of its own)")
    ax1.set_ylabel("output throughput (tok/s)")
    ax1.set_title("throughput, modelled from the one-replica measurement", fontsize=9)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
