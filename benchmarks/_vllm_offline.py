"""System (v) of the offline benchmark: vLLM's offline API in a subprocess of its own
virtualenv (``benchmarks/peers/vllm/offline.py`` runs there)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _vllm_serve import vllm_env
from _workload import WorkItem


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
