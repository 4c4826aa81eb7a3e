"""OpenMP wait policy: offline generation on a quiet and on a busy machine, before/after.

Each cell is a fresh child process that loads the demo model with ``loraplex.LLM``, warms
up, then times ``generate`` (one prompt, greedy, ``--tokens`` tokens, ``--repeats`` times,
median) on the main thread or on a worker thread. Policies:

- ``spin``: libgomp's own default (``GOMP_SPINCOUNT=300000``), what loraplex ran with before;
- ``brief``: loraplex's default now (``GOMP_SPINCOUNT=1000``, set by ``import loraplex``), the
  spin libgomp itself uses when it sees more of its threads than cores;
- ``passive``: no spin at all (``OMP_WAIT_POLICY=PASSIVE``);
- ``medium``: ``GOMP_SPINCOUNT=30000``, long enough to bridge the Python between a step's
  parallel regions (``--policies brief,medium`` compares it with the default).

"busy" runs one pure-Python busy loop per core beside the child for the whole cell, the
shape of a machine shared with other work (the case where the main thread took 40 s for
what took 3 s elsewhere). Prints a table; writes JSON and a PNG.

    python benchmarks/openmp_wait.py [--tokens 32] [--repeats 3] [--policies spin,brief,passive]
                                     [--out PATH] [--replot JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, pyplot, save_figure, write_json  # noqa: E402

POLICIES = {"spin": {"GOMP_SPINCOUNT": "300000"}, "brief": {"GOMP_SPINCOUNT": "1000"},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "medium": {"GOMP_SPINCOUNT": "30000"}}
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

CHILD = r"""
import json, statistics, sys, threading, time
import loraplex
from loraplex.model.demo import default_demo_dir, prepare_demo_model
model = str(prepare_demo_model(default_demo_dir(), progress=False))
llm = loraplex.LLM(model, progress=False)
params = loraplex.SamplingParams(max_tokens=int(sys.argv[1]), temperature=0.0, ignore_eos=True)
prompt = "Write a short note about the sea."
llm.generate([prompt], params)
times = []
def run():
    for _ in range(int(sys.argv[2])):
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
if sys.argv[3] == "main":
    run()
else:
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
print(json.dumps({"seconds": statistics.median(times), "all": times}))
"""

SPINNER = "import time, sys\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"


def run_cell(policy: str, load: str, caller: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    env.update(POLICIES[policy])
    spinners = []
    if load == "busy":
        spinners = [subprocess.Popen([sys.executable, "-c", SPINNER, "1200"])
                    for _ in range(os.cpu_count() or 2)]
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.tokens), str(args.repeats),
                              caller], env=env, capture_output=True, text=True, check=True,
                             timeout=1800)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"policy": policy, "load": load, "caller": caller, **result}


def replot(json_path: Path) -> None:
    """Draws the PNG again from a run's JSON."""
    report = json.loads(json_path.read_text())
    by = {(c["load"], c["caller"], c["policy"]): c["seconds"] for c in report["cells"]}
    policies = list(dict.fromkeys(c["policy"] for c in report["cells"]))
    plot(by, json_path.with_suffix(".png"), report["tokens"], policies)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser, "docs/benchmarks/openmp_wait")
    parser.add_argument("--replot", metavar="JSON", help="only draw the PNG of a past run")
    parser.add_argument("--policies", default="spin,brief,passive",
                        help=f"comma-separated, from {', '.join(POLICIES)}; brief is always run")
    args = parser.parse_args(argv)
    policies = list(dict.fromkeys(["brief", *(p.strip() for p in args.policies.split(",")
                                              if p.strip())]))
    if not set(policies) <= set(POLICIES):
        parser.error(f"--policies must be drawn from {', '.join(POLICIES)}")
    if args.replot:
        replot(Path(args.replot))
        return
    started = time.time()
    load_before = os.getloadavg()[0]
    cells = []
    for load in ("quiet", "busy"):
        for caller in ("main", "worker"):
            for policy in policies:
                cell = run_cell(policy, load, caller, args)
                cells.append(cell)
                print(f"{load:5} {caller:6} {policy:7} {cell['seconds']:8.2f} s", flush=True)
    by = {(c["load"], c["caller"], c["policy"]): c["seconds"] for c in cells}
    others = [p for p in policies if p != "brief"]
    print(f"\n{'machine':7} {'thread':6} " + " ".join(f"{p + ' s':>10}" for p in policies)
          + " " + " ".join(f"{p + '/brief':>14}" for p in others))
    ratios = {}
    for load in ("quiet", "busy"):
        for caller in ("main", "worker"):
            secs = {p: by[(load, caller, p)] for p in policies}
            ratios[f"{load}/{caller}"] = {f"{p}/brief": secs[p] / secs["brief"] for p in others}
            print(f"{load:7} {caller:6} " + " ".join(f"{secs[p]:10.2f}" for p in policies)
                  + " " + " ".join(f"{secs[p] / secs['brief']:13.2f}x" for p in others))
    report = {"command": "python benchmarks/openmp_wait.py " + " ".join(argv or sys.argv[1:]),
              "tokens": args.tokens, "repeats": args.repeats, "cpus": os.cpu_count(),
              "load_average_at_start": load_before,
              "elapsed_s": time.time() - started, "cells": cells,
              "ratios": ratios}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    plot(by, out.with_suffix(".png"), args.tokens, policies)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(by: dict[tuple[str, str, str], float], path: Path, tokens: int,
         policies: list[str]) -> None:
    plt = pyplot()
    groups = [(load, caller) for load in ("quiet", "busy") for caller in ("main", "worker")]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.27
    labels = {"spin": "libgomp default (spin 300,000)", "brief": "loraplex default (spin 1,000)",
              "passive": "passive (no spin)", "medium": "spin 30,000"}
    colors = {"spin": "#9e9e9e", "brief": "#e0702a", "passive": "#5b8bd0",
              "medium": "#4caf50"}
    for i, policy in enumerate(policies):
        xs = [g + (i - (len(policies) - 1) / 2) * width for g in range(len(groups))]
        values = [by[(load, caller, policy)] for load, caller in groups]
        bars = ax.bar(xs, values, width, color=colors[policy], label=labels[policy])
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=8)
    names = {"quiet": "no added load", "busy": "+1 busy loop per core"}
    ax.set_xticks(range(len(groups)), [f"{names[load]}\n{caller} thread"
                                       for load, caller in groups])
    ax.set_ylabel(f"seconds for {tokens} tokens (median)")
    ax.set_yscale("log")
    ax.set_title("LLM.generate, demo model, 2 torch threads", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
