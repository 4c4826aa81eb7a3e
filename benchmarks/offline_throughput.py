"""Offline throughput: one multi-adapter workload through three systems, in one run.

(a) HF transformers + PEFT, one request at a time (``generate`` with KV cache, the
    request's adapter made active with ``set_adapter``);
(b) HF + PEFT static batches, left-padded, one adapter per row through PEFT's mixed-batch
    ``adapter_names``; each batch generates to its longest requested output;
(c) loraplex's offline ``LLM.generate`` (continuous batching, paged KV, per-token LoRA).

Only requested output tokens count (padding and the extra tokens of a static batch do
not). Every system decodes greedily and ignores EOS, so it produces exactly the requested
lengths. Loading the model and reading adapters from disk happen before the clock starts,
for every system; installing adapters into loraplex's device slots is timed.

All three run the first ``--peer-requests`` requests of the workload (default: all 200;
the headline ratios); (c) runs the whole workload a second time, and an adapter sweep
(1, 20 and 100 adapters on the first ``--sweep-requests``, same prompts and lengths, and
the base model only).

    python benchmarks/offline_throughput.py            # the full run (~32 min on 2 cores)
    python benchmarks/offline_throughput.py --quick    # a smoke run (a few minutes)

``--dtype float32,bfloat16`` runs every system in both dtypes, one after the other, and
``--systems c:float32,c:bfloat16,v:bfloat16`` picks a dtype per system; ratios and greedy
agreement are reported within one dtype (keys ending in it) and across the dtypes of one
system (``c_bfloat16_over_c_float32``, ``c_bfloat16_vs_c_float32``).

``--rounds N`` runs the peer subset N times, the order of the systems reversed every other
round: a ratio is taken within each round (both of its runs in the same state of the
machine, minutes apart) and the report gives the median, each round's kept
(``ratios_by_round``), and whether each system gave the same tokens every round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# How idle OpenMP threads wait: loraplex's shipped default (a brief spin, then sleep; see
# loraplex/openmp.py) unless the caller set a wait, applied before torch is imported. It
# reaches the in-process peers (a) and (b) alike; vLLM (v) runs in a process of its own
# with its own OpenMP runtime and defaults.
from loraplex.openmp import apply_defaults  # noqa: E402

apply_defaults()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _floor import ModelShapes, compute_floor_seconds, higher, measure  # noqa: E402
from _hf_peer import HFPeer, peer_gemm, run_hf_batched, run_hf_single  # noqa: E402
from _log import log_clock as log  # noqa: E402
from _offline_loraplex import LoraplexSystem  # noqa: E402
from _offline_report import print_table, write_outputs  # noqa: E402
from _offline_results import (  # noqa: E402
    DTYPES,
    SYSTEM_LABELS,
    RunResult,
    check_lengths,
    summarise,
)
from _output import add_out_argument  # noqa: E402
from _vllm_offline import run_vllm  # noqa: E402
from _vllm_serve import DEFAULT_VENV  # noqa: E402
from _workload import (  # noqa: E402
    WorkItem,
    WorkloadSpec,
    add_model_argument,
    ensure_adapters,
    make_workload,
    num_output_tokens,
    num_prompt_tokens,
    resolve_model,
    with_adapters,
)


def quiet_hf() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")



def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(p)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--num-adapters", type=int, default=20)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--zipf", type=float, default=1.0, help="adapter popularity exponent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="a,b,c",
                   help="comma-separated subset of a,b,c,v (v: vLLM's CPU build); an entry "
                        "SYSTEM:DTYPE runs in that dtype only (e.g. c:float32,c:bfloat16,"
                        "v:bfloat16)")
    p.add_argument("--dtype", default="float32",
                   help="comma-separated dtypes (float32, bfloat16) every system without its "
                        "own :DTYPE runs in, each one after the other")
    p.add_argument("--vllm-venv", default=DEFAULT_VENV,
                   help="vLLM's own virtualenv (benchmarks/peers/vllm/setup.sh builds it)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over the systems on the peer subset, the order reversed on "
                        "every other pass; ratios are taken within a pass and the median "
                        "reported (the full workload and the sweep run in the first pass)")
    p.add_argument("--peer-requests", type=int, default=200,
                   help="first K requests: the workload all three systems run")
    p.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of (b)")
    p.add_argument("--peer-gemm", choices=("torch", "onednn"), default="torch",
                   help="the float32 GEMM of (a) and (b): PyTorch's default, or loraplex's "
                        "oneDNN-packed weights (a sensitivity check)")
    p.add_argument("--adapter-sweep", default="1,20,100",
                   help="adapter counts for (c) on the sweep workload ('' to skip)")
    p.add_argument("--sweep-requests", type=int, default=64,
                   help="first K requests: the workload of the adapter sweep (0: all)")
    p.add_argument("--sweep-rounds", type=int, default=1,
                   help="passes over the adapter sweep (its order reversed every other "
                        "pass); its ratios are taken within a pass, the median reported")
    p.add_argument("--peer-only", action="store_true",
                   help="(c) runs the peer subset only: no full workload, no adapter sweep")
    p.add_argument("--no-base-only", action="store_true",
                   help="skip (c) with the base model only on the sweep workload")
    p.add_argument("--max-loras", type=int, default=16, help="loraplex device adapter slots")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", help="where benchmark adapters are cached")
    p.add_argument("--profile", action="store_true",
                   help="cProfile loraplex's full-workload run; stats written to OUT.prof")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 48 requests, prompts <= 256, outputs <= 64, "
                        "8 peer requests, 24 sweep requests")
    add_out_argument(p, "docs/benchmarks/offline_throughput")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 48)
        args.max_prompt = min(args.max_prompt, 256)
        args.max_output = min(args.max_output, 64)
        args.peer_requests = min(args.peer_requests, 8)
        args.sweep_requests = min(args.sweep_requests or args.num_requests, 24)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not dtypes or not set(dtypes) <= set(DTYPES):
        p.error(f"--dtype must be drawn from {', '.join(DTYPES)}; got {args.dtype!r}")
    args.runs = []  # (system, dtype) in the order they run
    for entry in (s.strip() for s in args.systems.split(",") if s.strip()):
        system, _, dtype = entry.partition(":")
        if system not in SYSTEM_LABELS or (dtype and dtype not in DTYPES):
            p.error(f"--systems entries are a, b, c or v, optionally :float32 or :bfloat16; "
                    f"got {entry!r}")
        args.runs += [(system, d) for d in ([dtype] if dtype else dtypes)
                      if (system, d) not in args.runs]
    if not args.runs:
        p.error("--systems names no system")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1; got {args.rounds}")
    if args.sweep_rounds < 1:
        p.error(f"--sweep-rounds must be at least 1; got {args.sweep_rounds}")
    args.systems = sorted({s for s, _ in args.runs})
    if "v" in args.systems and os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE":
        # measured: one of this process's idle OpenMP threads spun on one of the two cores
        # for the whole of vLLM's run in its subprocess
        p.error("OMP_WAIT_POLICY=ACTIVE keeps this process's idle OpenMP threads spinning "
                "through vLLM's run in its own process; unset it (loraplex's default wait "
                "applies) or set GOMP_SPINCOUNT")
    args.adapter_sweep = [int(x) for x in args.adapter_sweep.split(",") if x.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_hf()
    started = time.perf_counter()
    model_dir = resolve_model(args.model)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    vocab = hf_config.vocab_size
    # This machine's floors, now, before anything else runs (see _floor.py).
    shapes = ModelShapes.from_config(hf_config)
    floors = {d: measure(shapes, d, args.threads) for d in dict.fromkeys(d for _, d in args.runs)}
    for f in floors.values():
        log(f"floors at the start ({f.dtype}): {f.describe()}")
    spec = WorkloadSpec(args.num_requests, args.num_adapters, args.min_prompt, args.max_prompt,
                        args.min_output, args.max_output, args.zipf, args.seed)
    workload = make_workload(spec, vocab, tokenizer.all_special_ids)
    subset = workload[:args.peer_requests]
    sweep = args.adapter_sweep if "c" in args.systems and not args.peer_only else []
    adapter_paths = ensure_adapters(model_dir, max([args.num_adapters, *sweep]), args.cache_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    log(f"model {model_dir}; workload: {len(workload)} requests, "
        f"{num_prompt_tokens(workload)} prompt / {num_output_tokens(workload)} output tokens, "
        f"{args.num_adapters} adapters; peer subset: {len(subset)} requests, "
        f"{num_output_tokens(subset)} output tokens; runs: "
        + ", ".join(f"{s}:{d}" for s, d in args.runs))

    results: list[RunResult] = []
    outputs: dict[str, list[list[int]]] = {}

    round_no = 0

    def record(name: str, system: str, dtype: str, items: Sequence[WorkItem],
               num_adapters: int, seconds: float, outs: list[list[int]],
               extra: dict[str, Any] | None = None,
               workload_name: str = "peer subset", sweep_round: int = 0) -> RunResult:
        name = f"{name} [{dtype}]"
        if args.rounds > 1 and workload_name == "peer subset":
            name += f" #{round_no + 1}"
        if args.sweep_rounds > 1 and workload_name == "sweep":
            name += f" #{sweep_round + 1}"
        check_lengths(name, items, outs)
        floor = compute_floor_seconds(shapes, floors[dtype], num_prompt_tokens(items),
                                      num_output_tokens(items))
        extra = {**(extra or {}), "load_avg_1m_after": round(os.getloadavg()[0], 2),
                 "compute_floor_s": round(floor, 2),
                 "fraction_of_compute_floor": round(floor / seconds, 3)}
        r = RunResult(name, system, dtype, workload_name, len(items),
                      num_adapters, num_output_tokens(items), num_prompt_tokens(items), seconds,
                      extra, round_no if workload_name == "peer subset" else sweep_round)
        results.append(r)
        outputs[name] = outs
        log(f"{name}: {r.num_output_tokens} tokens in {seconds:.1f}s = "
            f"{r.tokens_per_s:.1f} tok/s {extra}")
        return r

    for round_no in range(args.rounds):
        order = args.runs if round_no % 2 == 0 else args.runs[::-1]
        if args.rounds > 1:
            log(f"round {round_no + 1} of {args.rounds}: " + ", ".join(f"{s}:{d}" for s, d in order))
        for system_id, dtype in order:
            if system_id in ("a", "b"):
                run_hf(args, system_id, dtype, model_dir, adapter_paths, pad_id, subset, record)
            elif system_id == "v":
                log(f"(v) vLLM from {args.vllm_venv}, {dtype}: {len(subset)} requests")
                secs, outs, extra = run_vllm(args, model_dir,
                                             adapter_paths[:args.num_adapters], subset, dtype)
                record(f"(v) {SYSTEM_LABELS['v']}", "v", dtype, subset, args.num_adapters,
                       secs, outs, extra)
            else:
                run_loraplex(args, dtype, model_dir, adapter_paths, subset, workload, record,
                             subset_only=args.peer_only or round_no > 0)

    # The floors again, after the last run: each run's fraction is against the higher of
    # the two measurements (_floor.py), the start's kept beside it.
    floors_end = {d: measure(shapes, d, args.threads) for d in floors}
    best = {d: higher(floors[d], floors_end[d]) for d in floors}
    for f in floors_end.values():
        log(f"floors at the end ({f.dtype}): {f.describe()}")
    for r in results:
        floor = compute_floor_seconds(shapes, best[r.dtype], r.num_prompt_tokens,
                                      r.num_output_tokens)
        r.extra["fraction_of_start_floor"] = r.extra["fraction_of_compute_floor"]
        r.extra["compute_floor_s"] = round(floor, 2)
        r.extra["fraction_of_compute_floor"] = round(floor / r.seconds, 3)
    report = summarise(results, outputs, args, model_dir, spec, time.perf_counter() - started)
    report["floors"] = {d: f.as_dict() for d, f in best.items()}
    report["floors_start"] = {d: f.as_dict() for d, f in floors.items()}
    report["floors_end"] = {d: f.as_dict() for d, f in floors_end.items()}
    write_outputs(report, results, Path(args.out))
    print_table(report)
    return 0


def run_hf(args: argparse.Namespace, system_id: str, dtype: str, model_dir: str,
           adapter_paths: Sequence[Path], pad_id: int, subset: Sequence[WorkItem],
           record: Any) -> None:
    log(f"loading HF + PEFT with all adapters, {dtype}")
    peer = HFPeer(model_dir, adapter_paths[:args.num_adapters], pad_id, dtype)
    gemm = "" if args.peer_gemm == "torch" else f", {args.peer_gemm} GEMM"
    with peer_gemm(args.peer_gemm):
        if system_id == "a":
            secs, outs = run_hf_single(peer, subset, "(a)")
            record(f"(a) {SYSTEM_LABELS['a']}{gemm}", "a", dtype, subset, args.num_adapters,
                   secs, outs)
        else:
            secs, outs = run_hf_batched(peer, subset, args.hf_batch_size, "(b)")
            record(f"(b) {SYSTEM_LABELS['b']} (batch {args.hf_batch_size}){gemm}", "b", dtype,
                   subset, args.num_adapters, secs, outs)


def run_loraplex(args: argparse.Namespace, dtype: str, model_dir: str,
                 adapter_paths: Sequence[Path], subset: Sequence[WorkItem],
                 workload: Sequence[WorkItem], record: Any, subset_only: bool) -> None:
    """(c) on the peer subset; unless ``subset_only``, then the whole workload and the
    adapter sweep."""
    log(f"loading loraplex, {dtype}")
    max_len = args.max_prompt + args.max_output
    system = LoraplexSystem(model_dir, adapter_paths, args, max_len, dtype)
    try:
        system.warm_host_cache(len(adapter_paths))
        _loraplex_runs(args, dtype, system, subset, workload, record, subset_only)
    finally:
        system.llm.close()  # frees the engine (a round's engines once outlived it: 16 GB)


def _loraplex_runs(args: argparse.Namespace, dtype: str, system: LoraplexSystem,
                   subset: Sequence[WorkItem], workload: Sequence[WorkItem], record: Any,
                   subset_only: bool) -> None:
    secs, outs, extra = system.generate(subset)
    record("(c) loraplex", "c", dtype, subset, args.num_adapters, secs, outs, extra)
    if subset_only:
        return
    out_base = Path(args.out)
    log(f"(c) full workload, {args.num_adapters} adapters: {len(workload)} requests")
    prof = out_base.with_name(f"{out_base.name}.{dtype}.prof") if args.profile else None
    if prof is not None:
        prof.parent.mkdir(parents=True, exist_ok=True)
    secs, outs, extra = system.generate(workload, prof)
    record(f"(c) loraplex, {args.num_adapters} adapters", "c", dtype, workload,
           args.num_adapters, secs, outs, extra, "full")
    sweep_items = workload[:args.sweep_requests] if args.sweep_requests else workload
    counts = list(args.adapter_sweep) + ([] if args.no_base_only else [0])
    for sweep_round in range(args.sweep_rounds):
        for n in counts if sweep_round % 2 == 0 else counts[::-1]:
            if sweep_items is workload and n == args.num_adapters and sweep_round == 0:
                continue  # that is the full run above
            items = with_adapters(sweep_items, n, args.zipf, args.seed)
            what = "base model only" if n == 0 else f"{n} adapters"
            passes = f", pass {sweep_round + 1} of {args.sweep_rounds}" \
                if args.sweep_rounds > 1 else ""
            log(f"(c) sweep, {what}: {len(items)} requests{passes}")
            secs, outs, extra = system.generate(items)
            record(f"(c) loraplex, {what}", "c", dtype, items, n, secs, outs, extra, "sweep",
                   sweep_round)


if __name__ == "__main__":
    raise SystemExit(main())
