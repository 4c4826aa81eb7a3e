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
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep instead of spinning. On a CPU shared with other jobs, spinning
# threads that get descheduled turn every parallel op into a wait of a scheduler time slice
# (measured: a 64x576x1536 matmul at 2 threads went from 7 ms to 29 ms). Set before torch
# is imported, so it applies to every system alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _floor import ModelShapes, compute_floor_seconds, measure  # noqa: E402
from _hf_peer import HFPeer, peer_gemm, run_hf_batched, run_hf_single  # noqa: E402
from _vllm_serve import vllm_env  # noqa: E402
from _workload import (  # noqa: E402
    WorkItem,
    WorkloadSpec,
    ensure_adapters,
    make_workload,
    num_output_tokens,
    num_prompt_tokens,
    with_adapters,
)

SYSTEM_LABELS = {
    "a": "HF+PEFT, one at a time",
    "b": "HF+PEFT, static mixed batches",
    "c": "loraplex",
    "v": "vLLM CPU (its own venv)",
}


DTYPES = ("float32", "bfloat16")


@dataclass
class RunResult:
    name: str
    system: str  # "a", "b", "c" or "v"
    dtype: str  # the model's weights, activations and KV cache
    workload: str  # "peer subset", "full" or "sweep"
    num_requests: int
    num_adapters: int  # distinct adapters the workload draws from (0: base model only)
    num_output_tokens: int
    num_prompt_tokens: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def quiet_hf() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


# --- (c): loraplex ----------------------------------------------------------------------


class LoraplexSystem:
    def __init__(self, model_dir: str, adapter_paths: Sequence[Path], args: argparse.Namespace,
                 max_len: int, dtype: str) -> None:
        from loraplex import LLM, LoRARequest

        block_size = 16
        blocks_per_seq = -(-max_len // block_size)
        self.config = dict(dtype=dtype, max_loras=args.max_loras, max_lora_rank=32,
                           max_cpu_loras=max(128, len(adapter_paths)),
                           num_kv_blocks=args.max_num_seqs * blocks_per_seq + 64,
                           max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           enable_prefix_caching=True)
        self.llm = LLM(model=model_dir, progress=False, **self.config)  # type: ignore[arg-type]
        self.loras = [LoRARequest(f"lora-{i}", str(p)) for i, p in enumerate(adapter_paths)]
        self.num_runs = 0

    def warm_host_cache(self, num_adapters: int) -> None:
        """Reads adapters from disk into the host cache (the HF peers load theirs up front)."""
        for lr in self.loras[:num_adapters]:
            self.llm.engine.adapters.load_now(lr.to_ref())

    def generate(self, items: Sequence[WorkItem], profile: Path | None = None,
                 ) -> tuple[float, list[list[int]], dict[str, Any]]:
        from loraplex import SamplingParams

        self.num_runs += 1
        # A salt per run: the same prompts in another run must not hit the prefix cache.
        salt = f"run-{self.num_runs}"
        warm = [w.prompt_ids[:16] for w in items[:2]]
        self.llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                          [self._lora(w) for w in items[:2]], cache_salt=f"warm-{salt}")
        before = self.llm.stats()
        params = [SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
                  for w in items]
        prompts = [w.prompt_ids for w in items]
        loras = [self._lora(w) for w in items]
        profiler = cProfile.Profile() if profile is not None else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outs = self.llm.generate(prompts, params, loras, cache_salt=salt)
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - start
        if profiler is not None and profile is not None:
            profiler.dump_stats(str(profile))
        after = self.llm.stats()
        keys = ("num_steps", "num_preemptions", "adapter_slot_loads", "adapter_slot_evictions",
                "adapter_disk_loads")
        delta = {k: getattr(after, k) - getattr(before, k) for k in keys}
        delta["adapter_load_seconds"] = round(after.adapter_load_seconds
                                              - before.adapter_load_seconds, 3)
        delta["output_tokens_per_step"] = round(
            num_output_tokens(items) / max(1, delta["num_steps"]), 1)
        return seconds, [o.outputs[0].token_ids for o in outs], delta

    def _lora(self, item: WorkItem) -> Any:
        return None if item.adapter is None else self.loras[item.adapter]


# --- (v): vLLM, in its own virtualenv -----------------------------------------------------


def run_vllm(args: argparse.Namespace, model_dir: str, adapter_paths: Sequence[Path],
             items: Sequence[WorkItem], dtype: str,
             ) -> tuple[float, list[list[int]], dict[str, Any]]:
    """The same requests through vLLM's offline API, in a subprocess of its own venv
    (benchmarks/peers/vllm/setup.sh builds it); model load and adapter reads are outside
    the timed call, as for the other systems."""
    import subprocess
    import tempfile

    venv = Path(args.vllm_venv).expanduser()
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM venv at {venv}: run benchmarks/peers/vllm/setup.sh {venv}")
    # Its threads pinned to the run's cores, as vLLM's CPU build is meant to run.
    env = vllm_env(venv, args.threads, kv_cache_gib=4, omp_bind="auto")
    max_len = args.max_prompt + args.max_output
    job = {"model": model_dir, "dtype": dtype,
           "adapters": [str(p) for p in adapter_paths], "max_loras": args.max_loras,
           "max_lora_rank": 32, "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": max(args.max_num_batched_tokens, max_len),
           "max_model_len": max_len,
           "requests": [{"prompt_ids": list(w.prompt_ids), "max_tokens": w.max_tokens,
                         "adapter": w.adapter} for w in items]}
    script = Path(__file__).resolve().parent / "peers" / "vllm" / "offline.py"
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        # Not from the checkout: vLLM's subprocesses import transformers, which probes
        # for a package named `kernels`, and the checkout's own would be found first.
        subprocess.run([str(python), str(script), str(job_path), str(out_path)], env=env,
                       check=True, cwd=tmp)
        result = json.loads(out_path.read_text())
    return result["seconds"], result["outputs"], {"vllm": result["vllm"]}


# --- the run ----------------------------------------------------------------------------


def check_lengths(name: str, items: Sequence[WorkItem], outputs: Sequence[Sequence[int]]) -> None:
    bad = [w.index for w, o in zip(items, outputs, strict=True) if len(o) != w.max_tokens]
    if bad:
        raise SystemExit(f"{name}: wrong output lengths for requests {bad[:10]}")


def agreement(ref: Sequence[Sequence[int]], other: Sequence[Sequence[int]],
              prefix: int = 16) -> float:
    """Share of requests whose first ``prefix`` greedy tokens are identical."""
    same = sum(1 for r, o in zip(ref, other, strict=True) if list(r[:prefix]) == list(o[:prefix]))
    return same / max(1, len(ref))


def machine_info() -> dict[str, Any]:
    import peft
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"cpu": cpu, "os_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model folder (default: the demo model, prepared if needed)")
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
    p.add_argument("--vllm-venv", default="~/.cache/loraplex/peers/vllm-venv",
                   help="vLLM's own virtualenv (benchmarks/peers/vllm/setup.sh builds it)")
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
    p.add_argument("--out", default="docs/benchmarks/offline_throughput",
                   help="output path without extension: writes .json and .png")
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
    args.systems = sorted({s for s, _ in args.runs})
    args.adapter_sweep = [int(x) for x in args.adapter_sweep.split(",") if x.strip()]
    return args


def resolve_model(model: str | None) -> str:
    if model:
        return model
    from loraplex.model.demo import prepare_demo_model

    return str(prepare_demo_model(progress=True))


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
        log(f"floors ({f.dtype}): GEMM {f.gemm_gflops_prefill:.0f} GFLOP/s (256 rows), "
            f"{f.gemm_gflops_decode:.0f} (16 rows); streaming {f.stream_gbps:.1f} GB/s")
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

    def record(name: str, system: str, dtype: str, items: Sequence[WorkItem],
               num_adapters: int, seconds: float, outs: list[list[int]],
               extra: dict[str, Any] | None = None,
               workload_name: str = "peer subset") -> RunResult:
        name = f"{name} [{dtype}]"
        check_lengths(name, items, outs)
        floor = compute_floor_seconds(shapes, floors[dtype], num_prompt_tokens(items),
                                      num_output_tokens(items))
        extra = {**(extra or {}), "load_avg_1m_after": round(os.getloadavg()[0], 2),
                 "compute_floor_s": round(floor, 2),
                 "fraction_of_compute_floor": round(floor / seconds, 3)}
        r = RunResult(name, system, dtype, workload_name, len(items),
                      num_adapters, num_output_tokens(items), num_prompt_tokens(items), seconds,
                      extra)
        results.append(r)
        outputs[name] = outs
        log(f"{name}: {r.num_output_tokens} tokens in {seconds:.1f}s = "
            f"{r.tokens_per_s:.1f} tok/s {extra}")
        return r

    for system_id, dtype in args.runs:
        if system_id in ("a", "b"):
            run_hf(args, system_id, dtype, model_dir, adapter_paths, pad_id, subset, record)
        elif system_id == "v":
            log(f"(v) vLLM from {args.vllm_venv}, {dtype}: {len(subset)} requests")
            secs, outs, extra = run_vllm(args, model_dir, adapter_paths[:args.num_adapters],
                                         subset, dtype)
            record(f"(v) {SYSTEM_LABELS['v']}", "v", dtype, subset, args.num_adapters, secs,
                   outs, extra)
        else:
            run_loraplex(args, dtype, model_dir, adapter_paths, subset, workload, record)

    report = summarise(results, outputs, args, model_dir, spec, time.perf_counter() - started)
    report["floors"] = {d: f.as_dict() for d, f in floors.items()}
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
                 workload: Sequence[WorkItem], record: Any) -> None:
    """(c) on the peer subset; unless ``--peer-only``, then the whole workload and the
    adapter sweep."""
    log(f"loading loraplex, {dtype}")
    max_len = args.max_prompt + args.max_output
    system = LoraplexSystem(model_dir, adapter_paths, args, max_len, dtype)
    system.warm_host_cache(len(adapter_paths))
    secs, outs, extra = system.generate(subset)
    record("(c) loraplex", "c", dtype, subset, args.num_adapters, secs, outs, extra)
    if args.peer_only:
        system.llm.close()
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
    for n in counts:
        if sweep_items is workload and n == args.num_adapters:
            continue  # that is the full run above
        items = with_adapters(sweep_items, n, args.zipf, args.seed)
        what = "base model only" if n == 0 else f"{n} adapters"
        log(f"(c) sweep, {what}: {len(items)} requests")
        secs, outs, extra = system.generate(items)
        record(f"(c) loraplex, {what}", "c", dtype, items, n, secs, outs, extra, "sweep")
    system.llm.close()


def summarise(results: list[RunResult], outputs: dict[str, list[list[int]]],
              args: argparse.Namespace, model_dir: str, spec: WorkloadSpec,
              total_seconds: float) -> dict[str, Any]:
    """Ratios and greedy agreement between systems of one dtype (keys end in the dtype),
    and between the dtypes of one system (``c_bfloat16_over_c_float32``)."""
    subset = {(r.system, r.dtype): r for r in results if r.workload == "peer subset"}
    ratios: dict[str, float] = {}
    agree: dict[str, float] = {}

    def tps(system: str, dtype: str) -> float:
        return subset[system, dtype].tokens_per_s

    def outs(system: str, dtype: str) -> list[list[int]]:
        return outputs[subset[system, dtype].name]

    for d in DTYPES:
        for num, den, key in (("c", "a", "c_over_a"), ("c", "b", "c_over_b"),
                              ("b", "a", "b_over_a"), ("c", "v", "c_over_vllm")):
            if (num, d) in subset and (den, d) in subset:
                ratios[f"{key}_{d}"] = tps(num, d) / tps(den, d)
        for other in ("b", "c"):
            if ("a", d) in subset and (other, d) in subset:
                agree[f"{other}_vs_a_{d}"] = agreement(outs("a", d), outs(other, d))
        if ("v", d) in subset and ("c", d) in subset:
            agree[f"c_vs_vllm_{d}"] = agreement(outs("v", d), outs("c", d))
            agree[f"c_vs_vllm_{d}_whole"] = agreement(outs("v", d), outs("c", d),
                                                      prefix=1 << 30)
        sweep = sweep_runs(results, d)
        if 0 in sweep and args.num_adapters in sweep:
            ratios[f"mixed_over_base_only_{d}"] = (sweep[args.num_adapters].tokens_per_s
                                                   / sweep[0].tokens_per_s)
        for n, r in sweep.items():
            if n and n != args.num_adapters and args.num_adapters in sweep:
                ratios[f"adapters_{n}_over_{args.num_adapters}_{d}"] = (
                    r.tokens_per_s / sweep[args.num_adapters].tokens_per_s)
        full = next((r for r in results if r.workload == "full" and r.dtype == d), None)
        if ("c", d) in subset and full is not None:
            ratios[f"c_full_over_c_subset_{d}"] = full.tokens_per_s / tps("c", d)
    for system in SYSTEM_LABELS:
        if system != "c" and (system, "bfloat16") in subset and ("c", "float32") in subset:
            # how far another system's bf16 strays from float32 (loraplex's is the oracle's)
            agree[f"{system}_bfloat16_vs_c_float32"] = agreement(outs("c", "float32"),
                                                                 outs(system, "bfloat16"))
        if (system, "bfloat16") in subset and (system, "float32") in subset:
            ratios[f"{system}_bfloat16_over_{system}_float32"] = (
                tps(system, "bfloat16") / tps(system, "float32"))
            agree[f"{system}_bfloat16_vs_{system}_float32"] = agreement(
                outs(system, "float32"), outs(system, "bfloat16"))
            agree[f"{system}_bfloat16_vs_{system}_float32_whole"] = agreement(
                outs(system, "float32"), outs(system, "bfloat16"), prefix=1 << 30)
    return {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "model": model_dir,
        "machine": machine_info(),
        "runs_order": [f"{s}:{d}" for s, d in args.runs],
        "workload": {**asdict(spec), "peer_requests": args.peer_requests,
                     "length_distribution": "log-uniform", "greedy": True, "ignore_eos": True},
        "hf_batch_size": args.hf_batch_size,
        "peer_gemm": args.peer_gemm,
        "loraplex": {"max_loras": args.max_loras, "max_lora_rank": 32,
                     "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens},
        "runs": [r.as_dict() for r in results],
        "ratios": ratios,
        "greedy_prefix16_agreement": agree,
        "total_seconds": total_seconds,
    }


def sweep_runs(results: list[RunResult], dtype: str) -> dict[int, RunResult]:
    """(c) in ``dtype`` by adapter count on the sweep workload; the full run counts when it
    is the same."""
    sweep = {r.num_adapters: r for r in results if r.workload == "sweep" and r.dtype == dtype}
    full = next((r for r in results if r.workload == "full" and r.dtype == dtype), None)
    if full is not None and full.num_adapters not in sweep and \
            all(r.num_requests == full.num_requests for r in sweep.values()):
        sweep[full.num_adapters] = full
    return dict(sorted(sweep.items()))


def write_outputs(report: dict[str, Any], results: list[RunResult], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, report, out.with_suffix(".png"))
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(results: list[RunResult], report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subset = [r for r in results if r.workload == "peer subset"]
    sweep_dtype = next((r.dtype for r in results if r.workload == "full"), "float32")
    full = list(sweep_runs(results, sweep_dtype).values())
    if len(full) < 2:
        full = []  # no sweep: the full-workload run alone is not one
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[max(1, len(subset)),
                                                                    max(1, len(full))])
    colors = {"a": "#9e9e9e", "b": "#5b8bd0", "c": "#e0702a", "v": "#6a3d9a"}
    if subset:
        ax = axes[0]
        base = next((r.tokens_per_s for r in subset if r.system == "a"), None)
        labels = [r.name.replace(" ", "\n", 1).replace(", ", "\n") for r in subset]
        bars = ax.bar(labels, [r.tokens_per_s for r in subset],
                      color=[colors[r.system] for r in subset])
        for bar, r in zip(bars, subset, strict=True):
            bar.set_hatch("//" if r.dtype == "bfloat16" else "")
        for bar, r in zip(bars, subset, strict=True):
            note = f"{r.tokens_per_s:.0f}" + (f"\n{r.tokens_per_s / base:.1f}x (a)" if base else "")
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"same {subset[0].num_requests} requests, "
                     f"{subset[0].num_adapters} adapters", fontsize=10)
        ax.margins(y=0.25)
        ax.tick_params(axis="x", labelsize=8)
    else:
        axes[0].axis("off")
    if full:
        ax = axes[1]
        labels = ["base only" if r.num_adapters == 0 else f"{r.num_adapters} adapter"
                  + ("s" if r.num_adapters > 1 else "") for r in full]
        bars = ax.bar(labels, [r.tokens_per_s for r in full], color=colors["c"])
        for bar, r in zip(bars, full, strict=True):
            ax.annotate(f"{r.tokens_per_s:.0f}", (bar.get_x() + bar.get_width() / 2,
                                                  bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(f"loraplex {sweep_dtype}, adapter sweep (first {full[0].num_requests} "
                     "requests)",
                     fontsize=10)
        ax.margins(y=0.15)
        ax.tick_params(axis="x", labelsize=8)
    else:
        axes[1].axis("off")
    m = report["machine"]
    dtypes = ", ".join(dict.fromkeys(r.dtype for r in results))
    fig.suptitle(f"Offline throughput, {Path(report['model']).name}, {dtypes}, "
                 f"{m['torch_threads']} CPU threads ({report['date'][:10]})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(report: dict[str, Any]) -> None:
    runs = report["runs"]
    base = next((r["tokens_per_s"] for r in runs if r["system"] == "a"), None)
    head = f"{'system':<58} {'workload':<12} {'reqs':>5} {'adapt':>5} {'out tok':>8} " \
           f"{'secs':>8} {'tok/s':>8} {'vs (a)':>7} {'floor':>6}"
    print()
    print(head)
    print("-" * len(head))
    for r in runs:
        vs = f"{r['tokens_per_s'] / base:.1f}x" if base else "-"
        print(f"{r['name']:<58} {r['workload']:<12} {r['num_requests']:>5} "
              f"{r['num_adapters']:>5} {r['num_output_tokens']:>8} {r['seconds']:>8.1f} "
              f"{r['tokens_per_s']:>8.1f} {vs:>7} "
              f"{r['extra'].get('fraction_of_compute_floor', 0):>6.0%}")
    for f in report["floors"].values():
        print(f"floors ({f['dtype']}, {f['threads']} threads): GEMM "
              f"{f['gemm_gflops_prefill']:.0f} GFLOP/s at 256 rows, "
              f"{f['gemm_gflops_decode']:.0f} at 16; streaming {f['stream_gbps']:.1f} GB/s")
    print("'floor': the fraction of the compute floor (in the run's own dtype) reached")
    print()
    for k, v in report["ratios"].items():
        print(f"{k:<36} {v:6.2f}")
    for k, v in report["greedy_prefix16_agreement"].items():
        what = "whole outputs" if k.endswith("_whole") else "first 16 tokens"
        print(f"greedy agreement {k.removesuffix('_whole'):<36} {v:6.0%} ({what})")
    print(f"total wall time {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    raise SystemExit(main())
