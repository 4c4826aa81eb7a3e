"""Engine steps of the offline benchmark's adapter sweep when adapters outnumber the slots.

The sweep workload of ``offline_throughput.py`` (the first 64 requests of the seed-0
workload: prompts 32-512 tokens and outputs 16-256, log-uniform, EOS ignored; adapters
redrawn with Zipf popularity over N) runs through loraplex's ``LLM.generate`` with the
benchmark's engine settings (16 adapter slots, 256 sequences, 2,048 tokens a step), on a
tiny random Llama and tiny PEFT adapters built locally: how many steps a run takes, and who
waits how long, depend on the lengths and on scheduling only, not on the model.

The scheduler's starvation guard (``max_adapter_wait_s``, 2 s) reads a clock; here the
clock moves ``--seconds-per-step`` per engine step, so every result is deterministic:

- ``guard idle``: the clock stands still, the guard never fires (a fast machine);
- ``guard firing``: 1,000 s a step, so from the second step on every request that waits for
  a slot has waited past the limit. That is what the real benchmark on two CPU cores sees:
  its first steps are full 2,048-token prefills of several seconds each.

Per run: steps, a lower bound on steps, mean sequences per step, and how many steps
requests waited before their first one (mean, median and p99, nearest rank). The bound is
the larger of the longest output (a request runs one step per output token) and the slot
occupancy the adapters need at least: adapter a pins a slot for at least its longest
output D_a, so 16 slots need at least sum(D_a) / 16 steps. Writes JSON and a PNG.

    python benchmarks/adapter_slot_steps.py [--adapters 20,100] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _output import add_out_argument, pyplot, save_figure, write_json
from _workload import (
    WorkItem,
    WorkloadSpec,
    ensure_adapters,
    make_workload,
    num_output_tokens,
    num_prompt_tokens,
    with_adapters,
)

# The prompt lengths drawn depend on the vocabulary's size (through the random draws of the
# prompt tokens): the demo model's, so these are the benchmark's lengths. The tokens are
# then mapped into the tiny model's vocabulary.
DEMO_VOCAB_SIZE = 49152
GUARDS = {"guard idle": 0.0, "guard firing": 1000.0}


def sweep_items(num_adapters: int, num_requests: int = 64) -> list[WorkItem]:
    """The benchmark's sweep workload: its 200-request workload's first ``num_requests``,
    adapters redrawn over ``num_adapters`` (as ``offline_throughput.py`` does)."""
    workload = make_workload(WorkloadSpec(), DEMO_VOCAB_SIZE)[:num_requests]
    return with_adapters(workload, num_adapters, 1.0, 0)


def step_bound(items: Sequence[WorkItem], num_slots: int) -> int:
    longest: dict[int | None, int] = defaultdict(int)
    for w in items:
        longest[w.adapter] = max(longest[w.adapter], w.max_tokens)
    slot_steps = sum(d for a, d in longest.items() if a is not None)
    return max(max(longest.values()), math.ceil(slot_steps / num_slots))


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest rank."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


class StepClock:
    """The scheduler's clock: real time when the run starts, then a fixed amount a step
    (requests take their arrival time from the real clock as they are queued)."""

    def __init__(self, engine: Any, seconds_per_step: float) -> None:
        import time

        self.engine = engine
        self.seconds_per_step = seconds_per_step
        self.start = time.monotonic()
        self.start_step = engine.num_steps

    def __call__(self) -> float:
        return self.start + (self.engine.num_steps - self.start_step) * self.seconds_per_step


def run(llm: Any, loras: Sequence[Any], items: Sequence[WorkItem], seconds_per_step: float,
        salt: str) -> dict[str, Any]:
    from loraplex import SamplingParams

    engine = llm.engine
    scheduler = engine.scheduler
    vocab = [t for t in range(engine.vocab_size) if t not in set(llm.tokenizer.all_special_ids)]
    prompts = [[vocab[t % len(vocab)] for t in w.prompt_ids] for w in items]
    params = [SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
              for w in items]
    batch_sizes: list[int] = []
    first_step: dict[str, int] = {}
    schedule = scheduler.schedule

    def recording_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        if not out.is_empty:
            batch_sizes.append(len(out.scheduled))
            for s in out.scheduled:
                first_step.setdefault(s.request.request_id, len(batch_sizes))
        return out

    clock = scheduler.clock
    scheduler.schedule = recording_schedule
    scheduler.clock = StepClock(engine, seconds_per_step)
    try:
        outs = llm.generate(prompts, params,
                            [None if w.adapter is None else loras[w.adapter] for w in items],
                            cache_salt=salt)
    finally:
        del scheduler.schedule
        scheduler.clock = clock
    assert [len(o.outputs[0].token_ids) for o in outs] == [w.max_tokens for w in items]
    delays = sorted(first_step[o.request_id] - 1 for o in outs)
    return {"steps": len(batch_sizes),
            "mean_batch": round(sum(batch_sizes) / len(batch_sizes), 2),
            "delay_mean": round(sum(delays) / len(delays), 1),
            "delay_p50": percentile(delays, 0.5), "delay_p99": percentile(delays, 0.99),
            "adapter_slot_loads": engine.adapters.stats().num_slot_loads,
            "batch_sizes": batch_sizes}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default="20,100", help="adapter counts of the sweep")
    p.add_argument("--num-requests", type=int, default=64, help="the sweep's requests")
    p.add_argument("--max-loras", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    add_out_argument(p, "docs/benchmarks/adapter_slot_steps")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.adapters.split(",") if x.strip()]

    import transformers

    from loraplex import LLM, LoRARequest
    from loraplex.testing import build_tiny_model

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # building the adapters

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", max_position_embeddings=1024)
        paths = ensure_adapters(model_dir, max(counts), Path(tmp) / "cache", progress=False)
        max_len, block_size = 512 + 256, 16  # the workload's longest prompt plus output
        llm = LLM(str(model_dir), max_loras=args.max_loras, max_lora_rank=32,
                  max_cpu_loras=max(128, len(paths)),
                  num_kv_blocks=args.max_num_seqs * -(-max_len // block_size) + 64,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, progress=False)
        loras = [LoRARequest(f"lora-{i}", str(path)) for i, path in enumerate(paths)]
        try:
            for n in counts:
                items = sweep_items(n, args.num_requests)
                for guard, seconds in GUARDS.items():
                    result = run(llm, loras, items, seconds, f"run-{len(rows)}")
                    rows.append({"adapters": n, "guard": guard, "seconds_per_step": seconds,
                                 "bound": step_bound(items, args.max_loras),
                                 "num_prompt_tokens": num_prompt_tokens(items),
                                 "num_output_tokens": num_output_tokens(items), **result})
        finally:
            llm.close()

    print(f"{'adapters':>8}  {'guard':<13}{'steps':>6}{'bound':>6}{'mean batch':>11}"
          f"{'delay mean':>11}{'p50':>5}{'p99':>5}")
    for r in rows:
        print(f"{r['adapters']:>8}  {r['guard']:<13}{r['steps']:>6}{r['bound']:>6}"
              f"{r['mean_batch']:>11.2f}{r['delay_mean']:>11.1f}{r['delay_p50']:>5}"
              f"{r['delay_p99']:>5}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "adapter_slot_steps",
           "workload": {"num_requests": args.num_requests, "seed": 0, "zipf_exponent": 1.0,
                        "prompts": "32-512 log-uniform", "outputs": "16-256 log-uniform"},
           "engine": {"max_loras": args.max_loras, "max_num_seqs": args.max_num_seqs,
                      "max_num_batched_tokens": args.max_num_batched_tokens,
                      "max_adapter_wait_s": 2.0},
           "delay_unit": "steps before a request's first step", "runs": rows}
    print(f"wrote {write_json(out, doc)}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        ax.plot(range(1, r["steps"] + 1), r["batch_sizes"], lw=1,
                label=f"{r['adapters']} adapters, {r['guard']} ({r['steps']} steps)")
    ax.set_xlabel("engine step")
    ax.set_ylabel("sequences in the step")
    ax.set_title(f"adapter sweep through {args.max_loras} slots")
    ax.legend(fontsize=8)
    save_figure(fig, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
