"""Another tenant's stream while one tenant sends grammars that cost minutes to compile.

The demo model (float32) behind loraplex's in-process ``EngineClient``, as ``loraplex
serve`` runs it. Tenant A streams one greedy request (``--max-tokens`` tokens,
``ignore_eos``); its inter-token gaps are timed. In the hostile phase tenant B sends,
back to back for as long as A's stream runs, the specs that once took the server down
(issue 58: ``multipleOf: 2**30``, ``.*`` 20,000 times, an ``allOf`` of 29 ``(.*a.*){i}``
patterns) and a generated family of the same shapes, each one new (no cache hit), each as
a fresh tenant. Each is refused at the grammar sandbox's CPU budget; its refusal latency
is timed from the request to the error. Alone and hostile phases alternate ``--repeats``
times; the result is A's median gap hostile over alone, and B's slowest refusal.

    python benchmarks/hostile_grammar.py --out docs/benchmarks/hostile_grammar   # ~2 min
    python benchmarks/hostile_grammar.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, write_json  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.engine.client import EngineClient  # noqa: E402
from loraplex.engine.sampling_params import GrammarSpec  # noqa: E402
from loraplex.errors import InvalidRequestError  # noqa: E402


def hostile_specs() -> Iterator[tuple[str, GrammarSpec]]:
    """The three reported specs, then an endless family of new ones of the costly shapes
    (``multipleOf`` variants are refused at once as unsatisfiable, so they are not here)."""
    yield "multipleOf 2**30", GrammarSpec.json_schema({"type": "integer",
                                                       "multipleOf": 1 << 30})
    yield ".* x 20000", GrammarSpec("regex", ".*" * 20000, "guided_regex")
    yield "allOf 29 (.*a.*){i}", GrammarSpec.json_schema({"allOf": [
        {"type": "string", "pattern": f"^(.*a.*){{{i}}}$"} for i in range(1, 30)]})
    for k in itertools.count(1):
        letter = "abcdefghij"[k % 10]
        yield f"family {k}", GrammarSpec.json_schema({"allOf": [
            {"type": "string", "pattern": f"^(.*{letter}.*){{{i + k % 7}}}$"}
            for i in range(1, 24 + k % 8)]})
        yield f"family {k} .*", GrammarSpec("regex", ".*" * (20000 + k), "guided_regex")


async def stream_gaps(client: EngineClient, max_tokens: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times = []
    async for _ in client.generate([1 + (7 * j) % 500 for j in range(24)], params,
                                   cache_salt="tenant-a"):
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # from the 2nd token


async def hostile(client: EngineClient, specs: Iterator[tuple[str, GrammarSpec]],
                  stop: asyncio.Event, log: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        name, spec = next(specs)
        start = time.perf_counter()
        outcome = "compiled"
        try:
            async for _ in client.generate([8, 9], SamplingParams(max_tokens=1, grammar=spec),
                                           cache_salt=f"tenant-b-{len(log)}"):
                pass
        except InvalidRequestError as exc:
            outcome = "refused" if "took more than" in str(exc) else f"error: {exc}"
        log.append({"spec": name, "outcome": outcome,
                    "seconds": time.perf_counter() - start})


async def run(client: EngineClient, max_tokens: int, repeats: int) -> dict[str, Any]:
    specs = hostile_specs()
    # One warm-up of each phase: the sandbox's worker starts, the step loop warms.
    await stream_gaps(client, 8)
    async for _ in client.generate([5, 6], SamplingParams(
            max_tokens=2, grammar=GrammarSpec("regex", "[a-c]+", "guided_regex"))):
        pass
    alone: list[float] = []
    beside: list[float] = []
    log: list[dict[str, Any]] = []
    for r in range(repeats):
        gaps = await stream_gaps(client, max_tokens)
        alone += gaps
        stop = asyncio.Event()
        attack = asyncio.create_task(hostile(client, specs, stop, log))
        gaps_h = await stream_gaps(client, max_tokens)
        stop.set()
        await attack
        beside += gaps_h
        print(f"repeat {r + 1}: median gap alone {1000 * statistics.median(gaps):.1f} ms, "
              f"beside the hostile tenant {1000 * statistics.median(gaps_h):.1f} ms; "
              f"{len(log)} hostile specs so far", flush=True)
    return {"gap_ms_alone": 1000 * statistics.median(alone),
            "gap_ms_hostile": 1000 * statistics.median(beside),
            "ratio": statistics.median(beside) / statistics.median(alone),
            "gap_ms_p90_alone": 1000 * statistics.quantiles(alone, n=10)[-1],
            "gap_ms_p90_hostile": 1000 * statistics.quantiles(beside, n=10)[-1],
            "specs": len(log), "refused": sum(e["outcome"] == "refused" for e in log),
            "refusal_s_max": max((e["seconds"] for e in log if e["outcome"] == "refused"),
                                 default=None),
            "refusal_s_median": statistics.median(
                [e["seconds"] for e in log if e["outcome"] == "refused"] or [0.0]),
            "log": log}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    add_out_argument(p, "hostile_grammar")
    args = p.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 40, 1
    from loraplex.cli_engine import model_arg

    llm = LLM(model_arg(None), progress=False)
    client = EngineClient(llm.engine)
    client.start()
    try:
        result = asyncio.run(run(client, args.max_tokens, args.repeats))
    finally:
        client.close()
    print(f"\nA's median inter-token gap: {result['gap_ms_alone']:.1f} ms alone, "
          f"{result['gap_ms_hostile']:.1f} ms beside B ({result['ratio']:.2f}x); "
          f"B: {result['refused']} of {result['specs']} specs refused, slowest refusal "
          f"{result['refusal_s_max']:.2f} s")
    others = [e for e in result["log"] if e["outcome"] != "refused"]
    if others:
        print("not refused at the budget:", others)
    write_json(Path(args.out), {"model": "demo (SmolLM2-135M-Instruct, float32)",
                                "max_tokens": args.max_tokens, "repeats": args.repeats,
                                **result})


if __name__ == "__main__":
    main()
