"""Prefix-aware vs adapter-only routing on two Ray replicas (issue 57, item 5).

Two engine replicas of the demo model (float32) on a loopback Ray cluster behind one
gateway (PostgreSQL registry, Redis), first with ``--no-prefix-routing`` (Serve's own
routing: base-model requests go to the less loaded of two random replicas), then with
prefix-aware routing, each on a fresh cluster. ``--tenants`` tenants each have
``--prompts`` long system prompts; every request is one tenant's system prompt plus its own
question (streamed, ``--concurrency`` in flight, the same seeded sequence in both runs).
Each replica's pool holds ``--kv-blocks`` blocks: about half of the system prompts, so
sending every prompt to every replica evicts them, while a partition keeps them.

Reported: the prefix-cache hit rate (hit / queried prompt tokens, from the replicas' own
counters) and TTFT at the client: mean, p50 and p99.

    python benchmarks/prefix_routing_ray.py --out docs/benchmarks/prefix_routing_ray
    python benchmarks/prefix_routing_ray.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

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
from _scaleout import ray_gateway, settled_replica_stats, summed  # noqa: E402

from loraplex.testing import redis_url_for_tests  # noqa: E402

MODES = ("adapter-only", "prefix-aware")
WORDS = ("invoice ledger refund policy customer shipping warranty account balance order "
         "support ticket escalation region currency discount audit compliance report").split()


def _system_prompt(tenant: int, prompt: int, words: int) -> str:
    rng = random.Random(tenant * 1000 + prompt)
    return (f"You are assistant {prompt} of company {tenant}. Follow these rules: "
            + " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n")


def _workload(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(tenant, prompt) of every request, in order: the same in both runs."""
    rng = random.Random(7)
    prompts = {(t, p): _system_prompt(t, p, args.prompt_words)
               for t in range(args.tenants) for p in range(args.prompts)}
    out = []
    for i in range(args.requests):
        tenant, prompt = rng.randrange(args.tenants), rng.randrange(args.prompts)
        out.append((tenant, f"{prompts[tenant, prompt]}Question {i}: what is {rng.random():.6f}?"))
    return out


async def _drive(url: str, keys: list[str], work: list[tuple[int, str]],
                 concurrency: int) -> list[float]:
    """Every request, ``concurrency`` at a time; each one's TTFT at the client (s)."""
    queue = list(enumerate(work))
    ttfts: dict[int, float] = {}

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            i, (tenant, prompt) = queue.pop(0)
            body = {"model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "stream": True}
            start = time.perf_counter()
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {keys[tenant]}"}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if i not in ttfts and line.startswith("data: {"):
                        ttfts[i] = time.perf_counter() - start

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return [ttfts[i] for i in sorted(ttfts)]


def run_mode(args: argparse.Namespace, mode: str, model: str, work: list[tuple[int, str]],
             logs: Path) -> dict[str, Any]:
    serve_args = ["--replicas", "2", "--replica-cpus", "0.5", "--max-num-seqs",
                  str(args.max_num_seqs), "--num-kv-blocks", str(args.kv_blocks),
                  *(["--no-prefix-routing"] if mode == "adapter-only" else [])]
    with ray_gateway(f"prefixray{mode.replace('-', '')}", serve_args, model, logs,
                     args.tenants, "prefix-routing-bench") as (gateway, keys, prefix):
        before = summed(settled_replica_stats(redis_url_for_tests(), prefix, 2))
        ttfts = asyncio.run(_drive(gateway.url, keys, work, args.concurrency))
        after = summed(settled_replica_stats(redis_url_for_tests(), prefix, 2))
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    result = {"hit_rate": hit / queried if queried else 0.0, "hit_tokens": hit,
              "queried_tokens": queried, "client_ttft_s": ttfts,
              "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts),
              "ttft_p99_s": statistics.quantiles(ttfts, n=100)[98]}
    print(f"  {mode}: hit rate {result['hit_rate']:.1%}, TTFT p50 "
          f"{result['ttft_p50_s']:.3f} s, p99 {result['ttft_p99_s']:.3f} s", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="system prompts per tenant")
    p.add_argument("--prompt-words", type=int, default=300,
                   help="words of each system prompt (~1.3 tokens each)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=160,
                   help="blocks in each replica's pool (16 tokens each)")
    p.add_argument("--quick", action="store_true")
    add_out_argument(p, "prefix_routing_ray")
    args = p.parse_args()
    if args.quick:
        args.requests = 16
    from loraplex.cli_engine import model_arg

    model = model_arg(None)
    work = _workload(args)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="prefixray-") as tmp:
        for mode in MODES:
            print(f"{mode}:", flush=True)
            results[mode] = run_mode(args, mode, model, work, Path(tmp))
    print(f"\n{'routing':>13}  hit rate  TTFT mean    p50    p99")
    for mode in MODES:
        r = results[mode]
        print(f"{mode:>13}  {r['hit_rate']:7.1%}  {r['ttft_mean_s']:8.3f} {r['ttft_p50_s']:7.3f}"
              f" {r['ttft_p99_s']:7.3f} s")
    out = Path(args.out)
    write_json(out, {"command": command_line("prefix_routing_ray.py", args),
                     "model": "demo (SmolLM2-135M-Instruct), float32",
                     "machine": {"cpu": cpu_name()}, "replicas": 2, "results": results})
    _plot(results, out.with_suffix(".png"))


def _plot(results: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.bar(MODES, [results[m]["hit_rate"] * 100 for m in MODES], color=["grey", "C0"])
    left.set_ylabel("prefix-cache hit rate (%)")
    width = 0.27
    for k, stat in enumerate(("ttft_mean_s", "ttft_p50_s", "ttft_p99_s")):
        right.bar([i + (k - 1) * width for i in range(len(MODES))],
                  [results[m][stat] for m in MODES], width, label=stat[5:-2])
    right.set_xticks(range(len(MODES)), MODES)
    right.set_ylabel("TTFT at the client (s)")
    right.legend()
    fig.suptitle("Two Ray replicas, tenants' long system prompts, base model")
    save_figure(fig, out)


if __name__ == "__main__":
    main()
