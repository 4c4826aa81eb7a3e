"""Tenant-fair scheduling against oldest-first, on the demo model (float32), engine-driven.

(a) Noisy neighbour: a quiet tenant sends a short request every ``--quiet-every`` steps;
    alone, then beside a tenant that keeps the batch full (``max_num_seqs`` in flight) or
    holds a backlog (3x that), under ``fifo`` and ``fair``. The quiet tenant's TTFT in
    engine steps (1: its first token came in the first step after it arrived) and in
    seconds, and its TPOT.
(b) Weights 3:1 between two backlogged tenants: their weighted service over time.
(c) Throughput, fair over fifo, on an offline batch: one tenant, and 8 tenants.
(0) The cost of a decode token against a prefill token (the default of
    ``SchedulerConfig.decode_token_cost``): wall time per token of a full decode step at
    ``max_num_seqs`` over that of a prefill step of the same batch's prompts.

    python benchmarks/fairness.py --num-quiet 6 --out docs/benchmarks/fairness   # ~9 min, 2 cores
    python benchmarks/fairness.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, command_line, cpu_name, pyplot, save_figure, write_json  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.engine.share import Share  # noqa: E402


def _prompt(seed: int, length: int) -> list[int]:
    return [1 + (seed * 7919 + j * 31) % 2000 for j in range(length)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class _Driver:
    """Steps one engine, topping tenants up to their in-flight counts, and records each
    request's arrival, first token and end, in steps and seconds."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.ids = 0
        self.live: dict[str, str] = {}  # request id -> tenant
        self.records: dict[str, dict[str, Any]] = {}

    def add(self, tenant: str, prompt_len: int, max_tokens: int, weight: float = 1.0) -> str:
        self.ids += 1
        rid = f"{tenant}-{self.ids}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, _prompt(self.ids, prompt_len), params,
                                share=Share(tenant, weight))
        self.live[rid] = tenant
        self.records[rid] = {"tenant": tenant, "arrival_step": self.engine.num_steps,
                             "arrival_s": time.perf_counter(), "tokens": 0}
        return rid

    def in_flight(self, tenant: str) -> int:
        return sum(t == tenant for t in self.live.values())

    def step(self) -> float:
        start = time.perf_counter()
        deltas = self.engine.step()
        now = time.perf_counter()
        for delta in deltas:
            record = self.records.get(delta.request_id)
            if record is None:
                continue
            if delta.new_token_ids and "first_step" not in record:
                record["first_step"] = self.engine.num_steps
                record["first_s"] = now
            record["tokens"] += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                record["end_s"] = now
                self.live.pop(delta.request_id, None)
        return now - start

    def drain(self) -> None:
        for rid in list(self.live):
            self.engine.abort(rid)
        self.live.clear()


def noisy_neighbour(model: str, policy: str, noisy: int, args: argparse.Namespace) -> dict:
    llm = LLM(model, progress=False, max_num_seqs=args.max_num_seqs, scheduling_policy=policy)
    driver = _Driver(llm)
    quiet: list[str] = []
    step = 0
    while len(quiet) < args.num_quiet or any(r in driver.live for r in quiet):
        while driver.in_flight("noisy") < noisy:
            driver.add("noisy", args.noisy_prompt, args.noisy_tokens)
        if step % args.quiet_every == 0 and len(quiet) < args.num_quiet:
            quiet.append(driver.add("quiet", args.quiet_prompt, args.quiet_tokens))
        driver.step()
        step += 1
    noisy_tokens = sum(r["tokens"] for r in driver.records.values() if r["tenant"] == "noisy")
    driver.drain()
    llm.close()
    recs = [driver.records[r] for r in quiet]
    steps = [r["first_step"] - r["arrival_step"] for r in recs]
    ttft = [r["first_s"] - r["arrival_s"] for r in recs]
    tpot = [(r["end_s"] - r["first_s"]) / max(1, r["tokens"] - 1) for r in recs]
    row = {"policy": policy, "noisy_in_flight": noisy, "steps": step,
           "ttft_steps": steps, "ttft_steps_p50": statistics.median(steps),
           "ttft_steps_max": max(steps), "ttft_s_p50": statistics.median(ttft),
           "ttft_s_p99": _pct(ttft, 0.99), "tpot_s_p50": statistics.median(tpot),
           "tpot_s_p99": _pct(tpot, 0.99), "noisy_tokens": noisy_tokens}
    print(f"  {policy:>4} noisy={noisy:3d}: quiet TTFT {row['ttft_steps_p50']:.0f} steps "
          f"median, {row['ttft_steps_max']} worst; {row['ttft_s_p50']:.2f} s median; "
          f"TPOT {row['tpot_s_p50'] * 1000:.0f} ms", flush=True)
    return row


def weighted_service(model: str, args: argparse.Namespace) -> dict:
    llm = LLM(model, progress=False, max_num_seqs=args.max_num_seqs)
    driver = _Driver(llm)
    weights = {"heavy": 3.0, "light": 1.0}
    series: list[dict[str, float]] = []
    for _ in range(args.weight_steps):
        for tenant, weight in weights.items():
            while driver.in_flight(tenant) < args.max_num_seqs:
                driver.add(tenant, args.noisy_prompt, args.weight_tokens, weight)
        driver.step()
        stats = {t.tenant: t for t in llm.engine.scheduler.tenant_stats()}
        cfg = llm.engine.scheduler.config
        series.append({t: cfg.prefill_token_cost * stats[t].prefill_tokens
                       + cfg.decode_token_cost * stats[t].decode_tokens for t in weights})
    driver.drain()
    llm.close()
    last = series[-1]
    ratio = last["heavy"] / last["light"]
    print(f"  weights 3:1 -> service {ratio:.2f}:1 after {len(series)} steps", flush=True)
    return {"series": series, "final_ratio": ratio}


def offline_throughput(model: str, policy: str, tenants: int, args: argparse.Namespace) -> float:
    llm = LLM(model, progress=False, max_num_seqs=args.max_num_seqs, scheduling_policy=policy)
    n = args.offline_requests
    prompts = [_prompt(i, 16 + (i * 37) % 96) for i in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=16 + (i * 53) % 112, ignore_eos=True)
              for i in range(n)]
    shares = [Share(f"t{i % tenants}") for i in range(n)]
    warm = min(n, args.max_num_seqs)  # a full batch, so nothing is first-time below
    llm.generate(prompts[:warm], [SamplingParams(max_tokens=4)] * warm)
    preempted = llm.stats().num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, share=shares)
    elapsed = time.perf_counter() - start
    preempted = llm.stats().num_preemptions - preempted
    llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"  {policy:>4} {tenants} tenant(s): {tokens / elapsed:.1f} tokens/s, "
          f"{preempted} preemptions", flush=True)
    return tokens / elapsed


def decode_cost(model: str, args: argparse.Namespace) -> dict:
    llm = LLM(model, progress=False, max_num_seqs=args.max_num_seqs)
    # warm-up: a fresh engine's first full prefill also pays its allocations
    llm.generate([_prompt(i, args.noisy_prompt) for i in range(args.max_num_seqs)],
                 SamplingParams(max_tokens=2))
    driver = _Driver(llm)
    for _ in range(args.max_num_seqs):
        driver.add("t", args.noisy_prompt, 24)
    prefill_s = 0.0
    running = llm.engine.scheduler.running
    while not running or any(r.num_output_tokens == 0 for r in running):
        prefill_s += driver.step()  # the prompts, in chunks of the token budget
    prefill_tokens = args.max_num_seqs * args.noisy_prompt
    decode = [driver.step() for _ in range(16)]
    driver.drain()
    llm.close()
    per_prefill = prefill_s / max(1, prefill_tokens)
    per_decode = statistics.median(decode) / args.max_num_seqs
    print(f"  decode token {per_decode * 1000:.2f} ms, prefill token "
          f"{per_prefill * 1000:.2f} ms: ratio {per_decode / per_prefill:.2f}", flush=True)
    return {"decode_ms_per_token": per_decode * 1000, "prefill_ms_per_token": per_prefill * 1000,
            "ratio": per_decode / per_prefill}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-quiet", type=int, default=8)
    p.add_argument("--quiet-every", type=int, default=6, help="steps between quiet requests")
    p.add_argument("--quiet-prompt", type=int, default=24)
    p.add_argument("--quiet-tokens", type=int, default=8)
    p.add_argument("--noisy-prompt", type=int, default=64)
    p.add_argument("--noisy-tokens", type=int, default=64)
    p.add_argument("--weight-steps", type=int, default=60)
    p.add_argument("--weight-tokens", type=int, default=8)
    p.add_argument("--offline-requests", type=int, default=128)
    p.add_argument("--quick", action="store_true")
    add_out_argument(p, "fairness")
    args = p.parse_args()
    if args.quick:
        args.max_num_seqs, args.num_quiet, args.noisy_tokens = 8, 3, 16
        args.weight_steps, args.offline_requests = 20, 16
    from loraplex.cli_engine import model_arg

    model = model_arg(None)
    print("(0) decode vs prefill token cost", flush=True)
    cost = decode_cost(model, args)
    print("(a) noisy neighbour", flush=True)
    n = args.max_num_seqs
    noisy = [noisy_neighbour(model, "fair", 0, args)]
    for policy in ("fifo", "fair"):
        for inflight in (n, 3 * n):
            noisy.append(noisy_neighbour(model, policy, inflight, args))
    print("(b) weights", flush=True)
    weights = weighted_service(model, args)
    print("(c) offline throughput", flush=True)
    offline: dict[str, float] = {}
    for _ in range(2):  # alternated; each policy's best of two (these machines are noisy)
        for tenants in (1, 8):
            for policy in ("fifo", "fair"):
                key = f"{policy}-{tenants}"
                offline[key] = max(offline.get(key, 0.0),
                                   offline_throughput(model, policy, tenants, args))
    ratios = {t: offline[f"fair-{t}"] / offline[f"fifo-{t}"] for t in (1, 8)}
    print(f"  fair / fifo: {ratios[1]:.3f} (1 tenant), {ratios[8]:.3f} (8 tenants)")
    doc = {"command": command_line("fairness.py", args), "machine": cpu_name(),
           "date": time.strftime("%Y-%m-%d"), "model": "demo (SmolLM2-135M-Instruct, float32)",
           "args": vars(args), "decode_cost": cost, "noisy_neighbour": noisy,
           "weights": weights, "offline_tokens_per_s": offline,
           "offline_fair_over_fifo": ratios}
    out = Path(args.out)
    write_json(out, doc)
    _plot(doc, out.with_suffix(".png"))


def _plot(doc: dict, out: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = doc["noisy_neighbour"]
    labels = [("alone" if r["noisy_in_flight"] == 0 else
               f"{r['policy']}\n{r['noisy_in_flight']} noisy") for r in rows]
    left.bar(labels, [r["ttft_steps_p50"] for r in rows], label="median")
    left.scatter(labels, [r["ttft_steps_max"] for r in rows], color="black", zorder=3,
                 label="worst")
    left.set_ylabel("quiet tenant's TTFT (engine steps)")
    left.set_title("(a) noisy neighbour")
    left.legend()
    series = doc["weights"]["series"]
    right.plot([s["heavy"] / max(s["light"], 1e-9) for s in series])
    right.axhline(3.0, color="gray", linewidth=0.8)
    right.set_xlabel("engine step")
    right.set_ylabel("service heavy / light")
    right.set_title("(b) weights 3:1")
    save_figure(fig, out)


if __name__ == "__main__":
    main()
