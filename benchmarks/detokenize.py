"""Incremental detokenization: the engine's Detokenizer against decoding the whole output
again for every token (what the engine did before, and what a server that re-decodes does).

Outputs of the demo model's tokenizer (SmolLM2's byte-level BPE; ``--model`` for another)
are cut from the project's own docs (prose with tables, code and non-ASCII characters
that some tokens end halfway through), ``--batch`` of them at each length, fed one token
at a time, the batch's sequences interleaved as in a decode step, each token followed by
the streamed text delta, as ``Engine`` does. Both ways run in the same process, alternated,
best of ``--repeats``; their final texts are checked equal to the tokenizer decoding each
whole output at once. Prints microseconds per token and writes JSON and a PNG.

    python benchmarks/detokenize.py [--lengths 64,256,1024,4096] [--batch 16]   # ~1 minute
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _output import add_out_argument, command_line, cpu_name, pyplot, save_loglog, write_json
from _workload import resolve_model

from loraplex.engine.detokenizer import Detokenizer
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


class WholeDecode(Detokenizer):
    """The peer: the whole output decoded again for every token."""

    def update(self, request: Request, final: bool = False) -> str | None:
        return super().update(request, final=True)


def _feed(detok: Detokenizer, outputs: list[list[int]]) -> tuple[float, list[str]]:
    """Seconds to take every output token by token, the sequences interleaved."""
    requests = [Request(str(i), [0], SamplingParams(max_tokens=len(o), ignore_eos=True))
                for i, o in enumerate(outputs)]
    start = time.perf_counter()
    for step in range(max(map(len, outputs))):
        for request, out in zip(requests, outputs, strict=True):
            if step < len(out):
                request.output_token_ids.append(out[step])
                final = step == len(out) - 1
                detok.update(request, final=final)
                Detokenizer.take_text_delta(request, final)
    return time.perf_counter() - start, [r.output_text for r in requests]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model",
                   help="HF model folder whose tokenizer to use (default: the demo model)")
    p.add_argument("--lengths", default="64,256,1024,4096")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    add_out_argument(p, "benchmarks/results/detokenize")
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.batch < 1 or args.repeats < 1 or not lengths or min(lengths) < 1:
        p.error("--batch, --repeats and every length must be at least 1")
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # the docs are one text longer than the model's context
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    text = "\n".join(f.read_text(encoding="utf-8") for f in sorted((ROOT / "docs").glob("*.md")))
    stream = tokenizer.encode(text, add_special_tokens=False)
    if len(stream) < max(lengths) + args.batch:
        p.error(f"the docs give {len(stream)} tokens: lengths up to {len(stream) - args.batch}")
    ways: dict[str, Callable[[], Detokenizer]] = {
        "incremental": lambda: Detokenizer(tokenizer),
        "whole decode": lambda: WholeDecode(tokenizer),
    }
    rows: list[dict[str, Any]] = []
    print(f"{'tokens':>6} {'batch':>5} {'whole decode us/token':>22} {'incremental':>12} "
          f"{'speedup':>8}")
    for n in lengths:
        step = (len(stream) - n) // args.batch
        outputs = [stream[i * step:i * step + n] for i in range(args.batch)]
        expected = [tokenizer.decode(o) for o in outputs]
        best = {name: float("inf") for name in ways}
        for _ in range(args.repeats):
            for name, make in ways.items():
                seconds, texts = _feed(make(), outputs)
                if texts != expected:
                    raise SystemExit(f"{name}: the text differs from the whole decode "
                                     f"at {n} tokens")
                best[name] = min(best[name], seconds)
        per = {name: best[name] / (n * args.batch) * 1e6 for name in ways}
        rows.append({"tokens": n, "batch": args.batch, "us_per_token": per,
                     "speedup": per["whole decode"] / per["incremental"]})
        print(f"{n:6} {args.batch:5} {per['whole decode']:22.2f} {per['incremental']:12.2f} "
              f"{rows[-1]['speedup']:7.1f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "detokenize", "machine": cpu_name(),
           "tokenizer": tokenizer.name_or_path,
           "command": command_line("detokenize.py", args),
           "rows": rows}
    print(f"wrote {write_json(out, doc)}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ways:
        ax.plot(lengths, [r["us_per_token"][name] for r in rows], marker="o", label=name)
    save_loglog(fig, ax, out, "output tokens per sequence", "microseconds per token",
                f"Detokenization, {args.batch} sequences interleaved")


if __name__ == "__main__":
    main()
