"""Structured outputs: what constraining half a batch costs, and what a schema costs to compile.

One run, side by side, on the demo model (loraplex's offline ``LLM``, greedy, one warm-up):

- batch A: ``--requests`` chat requests, none constrained;
- batch B: the same requests, every other one constrained to a JSON schema.

Output tokens per second of the whole batch, A and B alternated ``--repeats`` times (the
median of each); the ratio B / A is the cost (goal: >= 0.90). Constrained requests stop when
their JSON closes, so B generates fewer tokens: tokens per second, not wall time, is
compared. Then the compile time of a schema: cold (a new schema each time: llguidance's
grammar built and checked) and cached (the same schema again: a new matcher only).

    python benchmarks/structured_outputs.py            # ~5 minutes on 2 cores
    python benchmarks/structured_outputs.py --quick    # ~1 minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import pyplot, save_figure  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.engine.sampling_params import GrammarSpec  # noqa: E402

SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
    "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "sci-fi"]},
               "maxItems": 3},
    "rating": {"type": "number", "minimum": 0, "maximum": 10}},
    "required": ["title", "year", "genres", "rating"], "additionalProperties": False}


def _batch(llm: LLM, prompts: list[str], constrained: bool,
           max_tokens: int) -> tuple[float, int]:
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                             grammar=GrammarSpec.json_schema(SCHEMA)
                             if constrained and i % 2 == 0 else None)
              for i in range(len(prompts))]
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=False)
             for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(chats, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the model's dtype")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 8, 32, 1
    from loraplex.cli_engine import model_arg

    llm = LLM(model_arg(None), dtype=args.dtype, progress=False)
    prompts = [f"Describe film number {i} as JSON with title, year, genres and rating."
               for i in range(args.requests)]
    _batch(llm, prompts[:4], True, 8)  # warm-up: the compiler's tokenizer, first steps
    rates: dict[str, list[float]] = {"none": [], "half": []}
    for _ in range(args.repeats):
        for name, constrained in (("none", False), ("half", True)):
            elapsed, tokens = _batch(llm, prompts, constrained, args.max_tokens)
            rates[name].append(tokens / elapsed)
            print(f"{name:>5}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} "
                  "tokens/s", flush=True)
    none, half = statistics.median(rates["none"]), statistics.median(rates["half"])
    compiler = llm.engine.grammar_compiler()
    cold = []
    for i in range(20):
        schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], **{f"extra{i}": {
            "type": "string"}}))
        start = time.perf_counter()
        compiler.constraint(GrammarSpec.json_schema(schema))
        cold.append(time.perf_counter() - start)
    cached = []
    spec = GrammarSpec.json_schema(SCHEMA)
    for _ in range(20):
        start = time.perf_counter()
        compiler.constraint(spec)
        cached.append(time.perf_counter() - start)
    result = {"dtype": args.dtype, "requests": args.requests, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "tokens_per_s_none": none,
              "tokens_per_s_half_constrained": half, "ratio": half / none,
              "compile_ms_cold_median": 1000 * statistics.median(cold),
              "compile_ms_cached_median": 1000 * statistics.median(cached)}
    result["tokens_per_s_by_repeat"] = rates
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        _plot(result, args.json.with_suffix(".png"))


def _plot(result: dict[str, object], out: Path) -> None:
    plt = pyplot()
    rates = result["tokens_per_s_by_repeat"]
    assert isinstance(rates, dict)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for offset, (name, label) in enumerate((("none", "no request constrained"),
                                            ("half", "every other request: JSON schema"))):
        xs = [i + 0.2 * offset for i in range(len(rates[name]))]
        ax.bar(xs, rates[name], width=0.2, label=label)
    ax.set_xticks([i + 0.1 for i in range(len(rates["none"]))],
                  [str(i + 1) for i in range(len(rates["none"]))])
    ax.set_xlabel("repeat (alternated, same run)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Structured outputs on the demo model: median ratio {result['ratio']:.2f}")
    ax.legend(loc="lower right")
    save_figure(fig, out)


if __name__ == "__main__":
    main()
