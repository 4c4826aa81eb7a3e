"""Prefill/decode disaggregation on this machine (issue 57, item 5): what one block costs to
move, and PD against co-located replicas.

Part 1, per block, in this process, on the demo model (float32 and bfloat16): a prompt of
``--blocks`` full blocks is computed by one engine; then, each ``--repeats`` times:
``export`` (read the blocks from the pool, encode them with their identity and sha256),
``object store`` (the blocks through Ray's object store to an actor of a local cluster and
back to here: a put and a get, less an empty call's round trip), ``import`` (a second
engine verifies each block: checksum, fingerprint, layout, hash chain, the request's
tokens and keys; places it in its pool and writes its KV), and ``recompute`` (the same
prompt prefilled from scratch, per block). Medians, per block.

Part 2, serving: two replicas of the demo model (float32) on a loopback Ray cluster behind
one gateway, co-located (``--replicas 2``) and disaggregated (``--prefill-replicas 1
--decode-replicas 1``), each on a fresh cluster, the same seeded requests: ``--requests``
prompts of ~``--prompt-words`` words that share nothing (no prefix-cache hit), ``--max-tokens``
each, ``--concurrency`` in flight, streamed. TTFT and TPOT at the client (mean, p50, p99),
output tokens per second. Two shared cores run both pools here, so PD is expected to lose:
it adds a transfer and a second prompt pass (the tail) and splits the cores it had.

    python benchmarks/pd_ray.py --out docs/benchmarks/pd_ray
    python benchmarks/pd_ray.py --quick
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
from _scaleout import ray_gateway  # noqa: E402

MODES = {"co-located": ["--replicas", "2"],
         "disaggregated": ["--prefill-replicas", "1", "--decode-replicas", "1"]}
STAGES = ("export", "object store", "import", "recompute")
WORDS = ("invoice ledger refund policy customer shipping warranty account balance order "
         "support ticket escalation region currency discount audit compliance report").split()


# --- part 1: one block's cost ----------------------------------------------------------------


def _median_ms(samples: list[float], per: int) -> float:
    return statistics.median(samples) / per * 1e3


def block_costs(model: str, dtype: str, num_blocks: int, repeats: int) -> dict[str, Any]:
    import ray

    from loraplex import LLM
    from loraplex.engine.kv_transfer import prefill_params

    @ray.remote
    class Sink:
        def take(self, blocks: list[bytes]) -> int:
            return sum(map(len, blocks))

    block = 16
    rng = random.Random(1)
    prefill = LLM(model, dtype=dtype, progress=False, block_size=block)
    decode = LLM(model, dtype=dtype, progress=False, block_size=block)
    sink = Sink.remote()  # type: ignore[attr-defined]
    ray.get(sink.take.remote([]))
    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    raw_bytes = 0
    for _ in range(repeats):
        prompt = [rng.randrange(3, 40_000) for _ in range(num_blocks * block + 1)]
        t0 = time.perf_counter()
        prefill.generate([prompt], prefill_params())
        times["recompute"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        blocks = prefill.engine.export_prompt_blocks(prompt, None, None)
        times["export"].append(time.perf_counter() - t0)
        assert len(blocks) == num_blocks
        raw_bytes = sum(map(len, blocks)) // num_blocks
        t0 = time.perf_counter()
        ray.get(sink.take.remote([]))
        empty = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert ray.get(sink.take.remote(ray.put(blocks))) == sum(map(len, blocks))
        times["object store"].append(max(0.0, time.perf_counter() - t0 - empty))
        decode.engine.kv.drop_cached(lambda keys: True)
        t0 = time.perf_counter()
        assert decode.engine.import_prompt_blocks(blocks, prompt, None, None) == num_blocks
        times["import"].append(time.perf_counter() - t0)
    prefill.close()
    decode.close()
    ms = {stage: _median_ms(times[stage], num_blocks) for stage in STAGES}
    print(f"  {dtype}: " + ", ".join(f"{s} {v:.3f} ms" for s, v in ms.items())
          + f" per block of {raw_bytes / 1024:.0f} KiB", flush=True)
    return {"ms_per_block": ms, "block_bytes": raw_bytes, "num_blocks": num_blocks,
            "seconds": times}


# --- part 2: serving --------------------------------------------------------------------------


def _workload(args: argparse.Namespace) -> list[str]:
    rng = random.Random(7)
    return [f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            + f"\nSummarise request {i}." for i in range(args.requests)]


async def _drive(url: str, key: str, prompts: list[str], max_tokens: int,
                 concurrency: int) -> list[dict[str, float]]:
    """Every request, ``concurrency`` at a time: TTFT, TPOT and tokens of each."""
    queue = list(enumerate(prompts))
    out: dict[int, dict[str, float]] = {}

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            i, prompt = queue.pop(0)
            body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            start = time.perf_counter()
            first = last = 0.0
            chunks = 0
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = time.perf_counter() - start
                        first = first or last
                        chunks += 1
            out[i] = {"ttft_s": first, "tpot_s": (last - first) / max(1, max_tokens - 1),
                      "e2e_s": last, "tokens": max_tokens, "chunks": chunks}

    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return [out[i] for i in sorted(out)]


def _summary(rows: list[dict[str, float]], wall_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": rows, "wall_s": wall_s,
                           "output_tokens_per_s": sum(r["tokens"] for r in rows) / wall_s}
    for name in ("ttft_s", "tpot_s"):
        values = [r[name] for r in rows]
        out[name] = {"mean": statistics.mean(values), "p50": statistics.median(values),
                     "p99": statistics.quantiles(values, n=100)[98]}
    return out


def run_mode(args: argparse.Namespace, mode: str, model: str, prompts: list[str],
             logs: Path) -> dict[str, Any]:
    serve_args = [*MODES[mode], "--replica-cpus", "0.5", "--max-num-seqs",
                  str(args.max_num_seqs)]
    with ray_gateway(f"pdray{mode.replace('-', '')}", serve_args, model, logs, 1,
                     "pd-bench") as (gateway, [key], _):
        asyncio.run(_drive(gateway.url, key, prompts[:2], 2, 2))  # warm both pools
        t0 = time.perf_counter()
        rows = asyncio.run(_drive(gateway.url, key, prompts, args.max_tokens,
                                  args.concurrency))
        result = _summary(rows, time.perf_counter() - t0)
    print(f"  {mode}: TTFT p50 {result['ttft_s']['p50']:.3f} s, p99 "
          f"{result['ttft_s']['p99']:.3f} s, TPOT p50 {result['tpot_s']['p50'] * 1e3:.1f}"
          f" ms, {result['output_tokens_per_s']:.1f} tok/s", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=32, help="blocks of part 1's prompt")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=300,
                   help="words of each prompt (~1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    add_out_argument(p, "pd_ray")
    args = p.parse_args()
    if args.quick:
        args.requests, args.repeats, args.blocks = 8, 2, 8
    import ray

    from loraplex.cli_engine import model_arg

    model = model_arg(None)
    print("per block:", flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)
    try:
        blocks = {dtype: block_costs(model, dtype, args.blocks, args.repeats)
                  for dtype in ("float32", "bfloat16")}
    finally:
        ray.shutdown()
    prompts = _workload(args)
    serving: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pdray-") as tmp:
        for mode in MODES:
            print(f"{mode}:", flush=True)
            serving[mode] = run_mode(args, mode, model, prompts, Path(tmp))
    print(f"\n{'':>14} TTFT p50    p99   TPOT p50  tok/s")
    for mode, r in serving.items():
        print(f"{mode:>14} {r['ttft_s']['p50']:7.3f} {r['ttft_s']['p99']:7.3f} s "
              f"{r['tpot_s']['p50'] * 1e3:7.1f} ms {r['output_tokens_per_s']:6.1f}")
    out = Path(args.out)
    write_json(out, {"command": command_line("pd_ray.py", args),
                     "model": "demo (SmolLM2-135M-Instruct)", "machine": {"cpu": cpu_name()},
                     "block_costs": blocks, "serving": serving})
    _plot(blocks, serving, out.with_suffix(".png"))


def _plot(blocks: dict[str, Any], serving: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.38
    for k, dtype in enumerate(blocks):
        left.bar([i + (k - 0.5) * width for i in range(len(STAGES))],
                 [blocks[dtype]["ms_per_block"][s] for s in STAGES], width, label=dtype)
    left.set_xticks(range(len(STAGES)), STAGES)
    left.set_ylabel("ms per 16-token block")
    left.legend()
    modes = list(serving)
    for k, stat in enumerate(("p50", "p99")):
        right.bar([i + (k - 0.5) * width for i in range(len(modes))],
                  [serving[m]["ttft_s"][stat] for m in modes], width, label=f"TTFT {stat}")
    right.set_xticks(range(len(modes)), modes)
    right.set_ylabel("TTFT at the client (s)")
    right.legend()
    fig.suptitle("PD on 2 shared CPU cores: block transfer cost, and serving")
    save_figure(fig, out)


if __name__ == "__main__":
    main()
