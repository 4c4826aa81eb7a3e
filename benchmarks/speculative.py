"""Speculative decoding against none, side by side in one run, on the demo model: tokens/s
with and without, acceptance rate, mean accepted length. By default prompt lookup; with
``--methods`` several methods at once, each against the same no-speculation peer:

- ``ngram``: prompt lookup;
- ``layer_skip``: the target's first ``--draft-layers`` layers as the draft;
- ``draft_model``: those same layers saved as a separate model folder
  (``loraplex.model.truncate``), run as a draft model with its own KV cache;
- ``random_draft``: a tiny random draft model (1 layer, hidden 64) with the demo model's
  tokenizer: cheap, and never right (the controller's case).

Workloads, each at batch sizes 1, 8 and 64 (``max_num_seqs``; twice as many requests as
the batch holds, but 64 at batch 64, so that continuous batching refills the slots of
sequences that finish early, as a server's would):

- ``copy``: chat prompts that ask the model to repeat, quote or lightly edit a passage
  given in the prompt (what prompt lookup is for);
- ``offline``: the offline benchmark's random-token prompts (``_workload``), where proposals
  are rarely right: the controller's test.

Every engine decodes greedily with EOS ignored (identical outputs, checked), prefix
caching off (every round computes the same work), a KV budget of ``KV_CACHE_BYTES``. Each
round runs every engine in turn (off first), so a burst of load from other jobs on this
shared machine hits them alike; the ratio reported is the median of the rounds' ratios. Engine steps are counted too: unlike seconds they do not move with load.

    python benchmarks/speculative.py            # the full run
    python benchmarks/speculative.py --quick    # a smoke run
    python benchmarks/speculative.py --draft-layers 24 --batches 1 8 \
        --out docs/benchmarks/speculative_layer_skip   # the layer-skip draft instead
    python benchmarks/speculative.py --methods ngram layer_skip draft_model random_draft \
        --draft-layers 24 --batches 1 8 --workloads copy \
        --out docs/benchmarks/speculative_draft_model   # the methods side by side
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see offline_throughput.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, pyplot, save_figure, write_json  # noqa: E402
from _workload import WorkloadSpec, make_workload  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.model.demo import prepare_demo_model  # noqa: E402

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, members agreed to increase funding for the public library by ten percent, "
    "to repair the bridge on Mill Street before winter, and to postpone the new parking "
    "garage until a traffic study is complete.",
    "To reset your password, open the settings page and choose Security. Enter your current "
    "password, then type the new one twice. The new password must be at least twelve "
    "characters long and may not match any of your last five passwords. You will be signed "
    "out of every other device.",
    "Preheat the oven to 180 degrees. Mix the flour, sugar and baking powder in a large "
    "bowl, then add the eggs, milk and melted butter and stir until smooth. Pour the batter "
    "into a greased tin and bake for thirty five minutes, until a knife comes out clean.",
    "The river rises in the northern hills and flows south for about two hundred miles "
    "before it reaches the sea. Along the way it passes through three large towns, feeds two "
    "lakes, and drives the old mills that gave the valley its name and its first wealth.",
]
INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:",
    "Quote the passage below in full:",
    "Rewrite the passage below, changing nothing except that every number is written in "
    "digits:",
    "Copy this text and correct any spelling mistakes:",
]
# Each engine's KV budget: room for every workload here (no preemption) while five engines
# (off and four methods) fit in memory side by side.
KV_CACHE_BYTES = 384 << 20
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}


def copy_prompts(llm: LLM, num: int) -> list[list[int]]:
    prompts = []
    for i in range(num):
        content = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def offline_prompts(llm: LLM, num: int) -> list[list[int]]:
    spec = WorkloadSpec(num_requests=num, num_adapters=0, min_prompt=32, max_prompt=256)
    items = make_workload(spec, llm.engine.vocab_size, llm.tokenizer.all_special_ids)
    return [item.prompt_ids for item in items]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.stats()
    return {"seconds": seconds, "steps": after.num_steps - before.num_steps,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "ids": [o.outputs[0].token_ids for o in outs],
            "draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "accepted": after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            "drafts": after.spec_num_drafts - before.spec_num_drafts}


def measure(model: str, batch: int, workload: str, max_tokens: int, rounds: int,
            specs: dict[str, dict[str, Any]], dtype: str = "float32") -> list[dict[str, Any]]:
    """One result per method in ``specs``, each against the same no-speculation engine;
    rounds run every engine in turn, so load from other jobs hits them alike."""
    def make(config: dict[str, Any] | None) -> LLM:
        return LLM(model, dtype=dtype, max_num_seqs=batch, enable_prefix_caching=False,
                   progress=False, kv_cache_memory=KV_CACHE_BYTES, speculative_config=config)

    engines = {"off": make(None), **{name: make(spec) for name, spec in specs.items()}}
    num_requests = 2 * batch if batch < 64 else batch
    prompts = (copy_prompts if workload == "copy" else offline_prompts)(engines["off"],
                                                                       num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm up each
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            runs[name].append(timed(llm, prompts, params))
    off = runs["off"]
    results = []
    for name in specs:
        on_runs = runs[name]
        assert all(r["ids"] == off[0]["ids"] for r in on_runs), f"{name}: outputs differ"
        ratios = [(b["tokens"] / b["seconds"]) / (a["tokens"] / a["seconds"])
                  for a, b in zip(off, on_runs, strict=True)]
        proposed = sum(r["draft_tokens"] for r in on_runs)
        accepted = sum(r["accepted"] for r in on_runs)
        drafts = sum(r["drafts"] for r in on_runs)
        results.append({
            "method": name,
            "speculative_config": {k: v for k, v in specs[name].items() if k != "model"},
            "workload": workload, "batch": batch, "requests": len(prompts),
            "max_tokens": max_tokens, "rounds": rounds,
            "tokens_per_s_off": [r["tokens"] / r["seconds"] for r in off],
            "tokens_per_s_on": [r["tokens"] / r["seconds"] for r in on_runs],
            "ratios": ratios, "median_ratio": statistics.median(ratios),
            "steps_off": off[0]["steps"], "steps_on": on_runs[0]["steps"],
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "proposed_per_round": proposed // rounds,
        })
    for llm in engines.values():
        llm.close()
    return results


def random_draft(model: str, out: Path) -> Path:
    """A 1-layer random Llama (hidden 64) with ``model``'s vocabulary, tokenizer and
    context: a draft model that costs little and is never right."""
    import shutil

    import torch
    import transformers

    from loraplex.model.truncate import TOKENIZER_FILES

    config = transformers.AutoConfig.from_pretrained(model)
    draft = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(draft).save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(model) / name).is_file():
            shutil.copyfile(Path(model) / name, out / name)
    return out


def method_specs(model: str, methods: Sequence[str], draft_layers: int,
                 work_dir: Path) -> dict[str, dict[str, Any]]:
    """The speculative config of each method, making the draft model folders it needs."""
    from loraplex.model.truncate import save_first_layers

    specs: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method == "ngram":
            specs[method] = SPEC
        elif method == "layer_skip":
            specs[method] = {"method": "layer_skip", "num_draft_layers": draft_layers,
                             "num_speculative_tokens": 3}
        elif method == "draft_model":
            folder = save_first_layers(model, work_dir / f"first{draft_layers}", draft_layers)
            specs[method] = {"method": "draft_model", "model": str(folder),
                             "num_speculative_tokens": 3}
        else:
            folder = random_draft(model, work_dir / "random")
            specs[method] = {"method": "draft_model", "model": str(folder),
                             "num_speculative_tokens": 3}
    return specs


def _label(method: str, spec: dict[str, Any], draft_layers: int) -> str:
    if method == "ngram":
        return "prompt lookup"
    if method == "layer_skip":
        return f"layer-skip draft ({spec['num_draft_layers']} layers)"
    if method == "draft_model":
        return f"draft model (first {draft_layers} layers)"
    return "random 1-layer draft model"


def plot(results: Sequence[dict[str, Any]], draft_layers: int, path: Path) -> None:
    plt = pyplot()
    cells = list(dict.fromkeys((r["workload"], r["batch"]) for r in results))
    methods = list(dict.fromkeys(r["method"] for r in results))
    fig, ax = plt.subplots(figsize=(8 + 1.5 * max(0, len(methods) - 1), 4))
    width = 0.8 / len(methods)
    colors = ["#4a7ab5", "#d08c3c", "#5b9e5b", "#a05050"]
    for m, method in enumerate(methods):
        by_cell = {(r["workload"], r["batch"]): r for r in results if r["method"] == method}
        spec = next(r["speculative_config"] for r in results if r["method"] == method)
        ax.bar([c + (m - (len(methods) - 1) / 2) * width for c in range(len(cells))],
               [by_cell[cell]["median_ratio"] for cell in cells], width,
               label=_label(method, spec, draft_layers), color=colors[m % len(colors)])
    ax.set_xticks(range(len(cells)), [f"{w}\nbatch {b}" for w, b in cells])
    for y, style in ((1.5, "--"), (1.0, "-"), (0.97, ":")):
        ax.axhline(y, color="grey", linestyle=style, linewidth=1)
    ax.set_ylabel("tokens/s with / without speculation")
    if len(methods) > 1:
        ax.legend(fontsize=8)
        ax.set_title("Speculation methods on the demo model (CPU, median of rounds)")
    else:
        spec = results[0]["speculative_config"]
        ax.set_title(f"Speculation by {_label(methods[0], spec, draft_layers)} on the demo "
                     f"model (CPU, median of rounds)")
    save_figure(fig, path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, short outputs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--workloads", nargs="+", default=["copy", "offline"],
                        choices=["copy", "offline"])
    parser.add_argument("--no-batch-limit", action="store_true",
                        help="speculate at any batch size (disable_by_batch_size off), to "
                             "find the cross-over")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="the draft's layers (layer_skip, draft_model); alone: measure "
                             "the layer-skip draft instead of prompt lookup")
    parser.add_argument("--methods", nargs="+", default=None,
                        choices=["ngram", "layer_skip", "draft_model", "random_draft"],
                        help="measure these methods side by side (default: ngram, or "
                             "layer_skip with --draft-layers)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype, with and without speculation alike")
    add_out_argument(parser, "docs/benchmarks/speculative")
    args = parser.parse_args(argv)
    model = str(prepare_demo_model(progress=False))
    batches = [b for b in args.batches if b < 64] if args.quick else args.batches
    methods = args.methods or (["ngram"] if args.draft_layers is None else ["layer_skip"])
    draft_layers = args.draft_layers or 24
    work_dir = Path(tempfile.mkdtemp(prefix="loraplex-drafts-"))
    specs = method_specs(model, methods, draft_layers, work_dir)
    if args.no_batch_limit:
        specs = {name: {**spec, "disable_by_batch_size": None} for name, spec in specs.items()}
    results: list[dict[str, Any]] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every cell: an interrupted long run keeps what it measured
        report = {"speculative_configs": {name: {k: v for k, v in spec.items() if k != "model"}
                                          for name, spec in specs.items()},
                  "draft_layers": draft_layers, "dtype": args.dtype,
                  "load_average": os.getloadavg(),
                  "cpu_count": os.cpu_count(), "results": results}
        write_json(out, report)
        plot(results, draft_layers, out.with_suffix(".png"))

    print(f"{'method':<12} {'workload':<8} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} "
          f"{'ratio':>6} {'steps off/on':>13} {'accept':>7} {'mean len':>8}", flush=True)
    for workload in args.workloads:
        for batch in batches:
            max_tokens = 24 if args.quick else 32 if batch >= 64 else 64
            for r in measure(model, batch, workload, max_tokens, args.rounds, specs,
                             args.dtype):
                results.append(r)
                print(f"{r['method']:<12} {workload:<8} {batch:>5} "
                      f"{statistics.median(r['tokens_per_s_off']):>10.1f} "
                      f"{statistics.median(r['tokens_per_s_on']):>9.1f} "
                      f"{r['median_ratio']:>6.2f} {r['steps_off']:>6}/{r['steps_on']:<6} "
                      f"{r['acceptance_rate']:>7.2f} {r['mean_accepted_length']:>8.2f}",
                      flush=True)
            write()
    shutil.rmtree(work_dir, ignore_errors=True)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
