"""Greedy sampling on CPU: the sampler's argmax for a decode step's greedy rows (the native
kernel, on the logits in the model's dtype) against what it did before (and what a
PyTorch engine does): widen the logits to float32, then take ``max(dim=-1).indices``. The
rest of ``sample`` is the same both ways.

Each step runs the demo model's LM head as the engine does (its 576 x 49,152 weights
through ``linear``: the skinny GEMM up to 64 rows, ``--vocab`` and
``--hidden`` for others) on random hidden states, so the logits sit in the caches as they
do in the engine (with its allocator settings, ``loraplex/malloc.py``), then samples them both ways, alternated, in the same process; only the
argmax is timed, best of ``--repeats`` over ``--steps`` steps. The two ways' tokens, and
the sampler's own for greedy rows, are checked equal. Prints milliseconds per step and
writes JSON and a PNG.

    python benchmarks/greedy_sampling.py [--rows 1,4,16,64] [--dtype float32,bfloat16]  # ~1 min
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loraplex.openmp import apply_defaults  # noqa: E402

apply_defaults()  # the OpenMP wait the engine runs with, before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _output import (  # noqa: E402
    add_out_argument,
    command_line,
    cpu_name,
    pyplot,
    save_loglog,
    write_json,
)

from loraplex.malloc import keep_freed_memory  # noqa: E402
from loraplex.model.sampler import SamplingRow, sample  # noqa: E402
from loraplex_kernels.ops import (  # noqa: E402
    PackedWeight,
    argmax_rows,
    linear,
    pack_linear_weight,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _widen_then_max(logits: torch.Tensor) -> list[int]:
    """The peer: the sampler before, float32 logits and torch's max."""
    return logits.float().max(dim=-1).indices.tolist()


def _native(logits: torch.Tensor) -> list[int]:
    return argmax_rows(logits).tolist()


def _time(way: Callable[[torch.Tensor], list[int]], weight: torch.Tensor,
          packed: PackedWeight | None, hiddens: list[torch.Tensor],
          ) -> tuple[float, list[list[int]]]:
    """Seconds of the argmax over the steps (each after its LM head), and the tokens."""
    total, tokens = 0.0, []
    for h in hiddens:
        logits = linear(h, weight, None, packed)  # [rows, vocab]
        start = time.perf_counter()
        tokens.append(way(logits))
        total += time.perf_counter() - start
    return total, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64", help="greedy rows in a step")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_out_argument(p, "benchmarks/results/greedy_sampling")
    args = p.parse_args()
    rows_list = [int(n) for n in args.rows.split(",")]
    dtypes = args.dtype.split(",")
    if min(rows_list) < 1 or min(args.vocab, args.hidden, args.steps, args.repeats,
                                 args.threads) < 1:
        p.error("--rows, --vocab, --hidden, --steps, --repeats and --threads must be >= 1")
    if any(d not in DTYPES for d in dtypes):
        p.error(f"--dtype: each of {', '.join(DTYPES)}")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # the engine's allocator: the logits' pages stay mapped between steps
    ways: dict[str, Callable[[torch.Tensor], list[int]]] = {
        "native argmax": _native, "float32 + max": _widen_then_max}
    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []
    print(f"{'dtype':>9} {'rows':>5} {'float32 + max ms':>17} {'native ms':>10} {'speedup':>8}")
    for name in dtypes:
        dtype = DTYPES[name]
        weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.05).to(dtype)
        packed = pack_linear_weight(weight, shared=True)  # a tied head, as the demo model's
        for rows in rows_list:
            hiddens = [torch.randn(rows, args.hidden, generator=gen).to(dtype)
                       for _ in range(args.steps)]
            best = {w: float("inf") for w in ways}
            tokens: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for w, way in ways.items():
                    seconds, tokens[w] = _time(way, weight, packed, hiddens)
                    best[w] = min(best[w], seconds)
            sampled = [t.token_id for t in sample(linear(hiddens[-1], weight, None, packed),
                                                  [SamplingRow()] * rows)]
            if tokens["native argmax"] != tokens["float32 + max"] \
                    or sampled != tokens["native argmax"][-1]:
                raise SystemExit(f"{name}, {rows} rows: the tokens differ")
            ms = {w: best[w] / args.steps * 1e3 for w in ways}
            results.append({"dtype": name, "rows": rows, "ms_per_step": ms,
                            "speedup": ms["float32 + max"] / ms["native argmax"]})
            print(f"{name:>9} {rows:5} {ms['float32 + max']:17.3f} {ms['native argmax']:10.3f} "
                  f"{results[-1]['speedup']:7.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "greedy_sampling", "machine": cpu_name(),
           "command": command_line("greedy_sampling.py", args),
           "results": results}
    print(f"wrote {write_json(out, doc)}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dtypes:
        mine = [r for r in results if r["dtype"] == name]
        for w, style in zip(ways, ("-", "--"), strict=True):
            ax.plot([r["rows"] for r in mine], [r["ms_per_step"][w] for r in mine],
                    linestyle=style, marker="o", label=f"{w}, {name}")
    save_loglog(fig, ax, out, "greedy rows in the step", "milliseconds per step",
                f"Greedy argmax of {args.vocab:,} logits a row, {args.threads} threads")


if __name__ == "__main__":
    main()
