"""What each per-token option costs a decode step, against the same batch without it.

One run on the demo model (loraplex's offline ``LLM``, float32): a batch of ``--requests``
plain sampled requests plus two requests of one "tenant" with ``n=8`` (16 more rows). The
control batch's two requests are plain; in each option's batch they carry the option. Both
batches have the same rows, tokens and steps (``ignore_eos``, ``min_tokens`` =
``max_tokens``), alternated ``--repeats`` times; the cost is the median step time with the
option over the median without it. The options are the ones a hostile tenant used to tax
everyone's tokens (issue 58): a ``logit_bias`` on every token id, 150,000
``stop_token_ids`` (banned through ``min_tokens``), a long repeated regex, besides the
ordinary ones (penalties, 20 logprobs, a JSON schema).

    python benchmarks/option_cost.py --out docs/benchmarks/option_cost   # ~3 min, 2 cores
    python benchmarks/option_cost.py --quick
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

from _output import add_out_argument, pyplot, save_figure, write_json  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.engine.sampling_params import GrammarSpec  # noqa: E402


def options(vocab: int) -> dict[str, dict[str, Any]]:
    """Each option as SamplingParams keywords for the two taxing requests."""
    return {
        "logit_bias on every token": {"logit_bias": {t: 0.5 for t in range(vocab)}},
        "150,000 stop_token_ids": {"stop_token_ids": [10 + (i % (vocab - 10))
                                                      for i in range(150_000)]},
        "regex a{1000}": {"grammar": GrammarSpec("regex", "a{1000}", "guided_regex")},
        # a string that cannot close within the run: the rows stay in the batch
        "JSON schema": {"grammar": GrammarSpec.json_schema(
            {"type": "string", "minLength": 1000})},
        "penalties (all three)": {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                                  "repetition_penalty": 1.2},
        "20 logprobs": {"logprobs": 20},
    }


def _batch(llm: LLM, prompts: list[list[int]], extra: dict[str, Any],
           max_tokens: int) -> tuple[float, int]:
    plain = {"temperature": 0.8, "max_tokens": max_tokens, "min_tokens": max_tokens,
             "ignore_eos": True}
    params = [SamplingParams(seed=i, **plain) for i in range(len(prompts) - 2)]
    params += [SamplingParams(seed=100 + i, n=8, **plain, **extra) for i in range(2)]
    steps = llm.engine.num_steps
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start, llm.engine.num_steps - steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8, help="plain requests beside the two")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    add_out_argument(p, "option_cost")
    args = p.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 4, 8, 1
    from loraplex.cli_engine import model_arg

    llm = LLM(model_arg(None), progress=False, max_num_seqs=64)
    vocab = llm.engine.vocab_size
    prompts = [[1 + (7 * i + j) % 500 for j in range(24)] for i in range(args.requests + 2)]
    table = options(vocab)
    _batch(llm, prompts, {}, 4)  # warm-up
    for extra in table.values():
        _batch(llm, prompts, extra, 2)  # compiles, caches: nothing of it is timed below
    step_ms: dict[str, list[float]] = {"plain": [], **{name: [] for name in table}}
    for _ in range(args.repeats):
        for name, extra in (("plain", {}), *table.items()):
            elapsed, steps = _batch(llm, prompts, extra, args.max_tokens)
            step_ms[name].append(1000 * elapsed / steps)
            print(f"{name:>28}: {steps} steps, {1000 * elapsed / steps:7.1f} ms a step",
                  flush=True)
    base = statistics.median(step_ms["plain"])
    rows = [{"option": name, "ms_per_step": statistics.median(v),
             "vs_plain": statistics.median(v) / base} for name, v in step_ms.items()]
    print(f"\n{'option':>28}  ms/step  vs plain")
    for row in rows:
        print(f"{row['option']:>28}  {row['ms_per_step']:7.1f}  {row['vs_plain']:7.2f}x")
    doc = {"model": "demo (SmolLM2-135M-Instruct, float32)", "rows": args.requests + 16,
           "max_tokens": args.max_tokens, "repeats": args.repeats, "results": rows,
           "step_ms_by_repeat": step_ms}
    out = Path(args.out)
    write_json(out, doc)
    _plot(rows, out.with_suffix(".png"))


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["option"] for r in rows], [r["vs_plain"] for r in rows])
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("decode step time / the same batch without the option")
    ax.set_title("Per-token options on the demo model (2 requests x n=8 in the batch)")
    ax.invert_yaxis()
    save_figure(fig, out)


if __name__ == "__main__":
    main()
