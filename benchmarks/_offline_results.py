"""The offline benchmark's results: one run of one system on one workload, the checks on
its outputs, and the report over all runs (same-run ratios, greedy agreement)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _output import cpu_name
from _workload import WorkItem, WorkloadSpec

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
    round: int = 0  # which pass over the systems (``--rounds``); the peer subset only

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}



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

    return {"cpu": cpu_name(), "os_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__}


def summarise(results: list[RunResult], outputs: dict[str, list[list[int]]],
              args: argparse.Namespace, model_dir: str, spec: WorkloadSpec,
              total_seconds: float) -> dict[str, Any]:
    """Ratios and greedy agreement between systems of one dtype (keys end in the dtype),
    and between the dtypes of one system (``c_bfloat16_over_c_float32``).

    With several rounds, a ratio is taken within each round (both runs of a pair in the
    same pass, so a slow phase of the machine hits numerator and denominator alike) and
    the report's value is the median over rounds (``ratios_by_round`` keeps each one);
    agreement is that of the first round, and ``repeat_agreement`` says whether a system
    gave the same tokens in every round."""
    by_round: dict[int, dict[tuple[str, str], RunResult]] = {}
    for r in results:
        if r.workload == "peer subset":
            by_round.setdefault(r.round, {})[r.system, r.dtype] = r
    ratios_by_round: dict[str, list[float]] = {}
    for subset in by_round.values():
        for key, value in subset_ratios(subset).items():
            ratios_by_round.setdefault(key, []).append(value)
    ratios = {key: statistics.median(values) for key, values in ratios_by_round.items()}
    first = by_round[min(by_round)] if by_round else {}
    agree = subset_agreement(first, outputs)
    repeat: dict[str, float] = {}  # share of requests with the same tokens in every round
    for system_dtype, run in first.items():
        later = [outputs[s[system_dtype].name] for s in by_round.values()
                 if system_dtype in s and s[system_dtype] is not run]
        if later:
            same = sum(all(list(o[i]) == list(ref) for o in later)
                       for i, ref in enumerate(outputs[run.name]))
            repeat[":".join(system_dtype)] = same / max(1, len(outputs[run.name]))
    floor_fraction = {
        ":".join(key): statistics.median(s[key].extra["fraction_of_compute_floor"]
                                         for s in by_round.values() if key in s)
        for key in first}
    by_pass: dict[str, list[float]] = {}  # the sweep's ratios, one per pass
    for d in DTYPES:
        for sweep in (sweep_runs(results, d, k) for k in sweep_passes(results, d)):
            for key, value in sweep_ratios(sweep, args.num_adapters, d).items():
                by_pass.setdefault(key, []).append(value)
        full = next((r for r in results if r.workload == "full" and r.dtype == d), None)
        if ("c", d) in first and full is not None:
            ratios[f"c_full_over_c_subset_{d}"] = full.tokens_per_s / first["c", d].tokens_per_s
    ratios_by_round.update(by_pass)
    ratios.update({key: statistics.median(values) for key, values in by_pass.items()})
    return {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "model": model_dir,
        "machine": machine_info(),
        "runs_order": [f"{s}:{d}" for s, d in args.runs],
        "rounds": len(by_round),
        "sweep_rounds": getattr(args, "sweep_rounds", 1),
        "workload": {**asdict(spec), "peer_requests": args.peer_requests,
                     "length_distribution": "log-uniform", "greedy": True, "ignore_eos": True},
        "hf_batch_size": args.hf_batch_size,
        "peer_gemm": args.peer_gemm,
        "loraplex": {"max_loras": args.max_loras, "max_lora_rank": 32,
                     "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens},
        "runs": [r.as_dict() for r in results],
        "ratios": ratios,
        "ratios_by_round": ratios_by_round,
        "median_fraction_of_compute_floor": floor_fraction,
        "greedy_prefix16_agreement": agree,
        "repeat_agreement": repeat,
        "total_seconds": total_seconds,
    }


def subset_ratios(subset: dict[tuple[str, str], RunResult]) -> dict[str, float]:
    """Throughput ratios among one round's runs of the peer subset."""
    ratios: dict[str, float] = {}

    def tps(system: str, dtype: str) -> float:
        return subset[system, dtype].tokens_per_s

    for d in DTYPES:
        for num, den, key in (("c", "a", "c_over_a"), ("c", "b", "c_over_b"),
                              ("b", "a", "b_over_a"), ("c", "v", "c_over_vllm")):
            if (num, d) in subset and (den, d) in subset:
                ratios[f"{key}_{d}"] = tps(num, d) / tps(den, d)
    for system in SYSTEM_LABELS:
        if (system, "bfloat16") in subset and (system, "float32") in subset:
            ratios[f"{system}_bfloat16_over_{system}_float32"] = (
                tps(system, "bfloat16") / tps(system, "float32"))
    return ratios


def subset_agreement(subset: dict[tuple[str, str], RunResult],
                     outputs: dict[str, list[list[int]]]) -> dict[str, float]:
    """Greedy agreement among one round's runs of the peer subset: first 16 tokens, and
    whole outputs (keys ending in ``_whole``) where vLLM or another dtype is involved."""
    agree: dict[str, float] = {}

    def outs(system: str, dtype: str) -> list[list[int]]:
        return outputs[subset[system, dtype].name]

    for d in DTYPES:
        for other in ("b", "c"):
            if ("a", d) in subset and (other, d) in subset:
                agree[f"{other}_vs_a_{d}"] = agreement(outs("a", d), outs(other, d))
        if ("v", d) in subset and ("c", d) in subset:
            agree[f"c_vs_vllm_{d}"] = agreement(outs("v", d), outs("c", d))
            agree[f"c_vs_vllm_{d}_whole"] = agreement(outs("v", d), outs("c", d),
                                                      prefix=1 << 30)
    for system in SYSTEM_LABELS:
        if system != "c" and (system, "bfloat16") in subset and ("c", "float32") in subset:
            # how far another system's bf16 strays from float32 (loraplex's is the oracle's)
            agree[f"{system}_bfloat16_vs_c_float32"] = agreement(outs("c", "float32"),
                                                                 outs(system, "bfloat16"))
        if (system, "bfloat16") in subset and (system, "float32") in subset:
            agree[f"{system}_bfloat16_vs_{system}_float32"] = agreement(
                outs(system, "float32"), outs(system, "bfloat16"))
            agree[f"{system}_bfloat16_vs_{system}_float32_whole"] = agreement(
                outs(system, "float32"), outs(system, "bfloat16"), prefix=1 << 30)
    return agree


def sweep_passes(results: list[RunResult], dtype: str) -> list[int]:
    """The passes over the adapter sweep in ``dtype`` (``--sweep-rounds``; [0] for none)."""
    return sorted({r.round for r in results
                   if r.workload == "sweep" and r.dtype == dtype}) or [0]


def sweep_runs(results: list[RunResult], dtype: str, sweep_round: int = 0,
               ) -> dict[int, RunResult]:
    """(c) in ``dtype`` by adapter count on the sweep workload, in one pass over it
    (``--sweep-rounds``); the full run counts when it is the same."""
    sweep = {r.num_adapters: r for r in results
             if r.workload == "sweep" and r.dtype == dtype and r.round == sweep_round}
    full = next((r for r in results if r.workload == "full" and r.dtype == dtype), None)
    if full is not None and full.num_adapters not in sweep and \
            all(r.num_requests == full.num_requests for r in sweep.values()):
        sweep[full.num_adapters] = full
    return dict(sorted(sweep.items()))


def sweep_ratios(sweep: dict[int, RunResult], num_adapters: int, dtype: str,
                 ) -> dict[str, float]:
    """One pass's throughput ratios: ``num_adapters`` over base only, each other count over
    ``num_adapters``."""
    ratios: dict[str, float] = {}
    if num_adapters not in sweep:
        return ratios
    mixed = sweep[num_adapters].tokens_per_s
    if 0 in sweep:
        ratios[f"mixed_over_base_only_{dtype}"] = mixed / sweep[0].tokens_per_s
    for n, r in sweep.items():
        if n and n != num_adapters:
            ratios[f"adapters_{n}_over_{num_adapters}_{dtype}"] = r.tokens_per_s / mixed
    return ratios

