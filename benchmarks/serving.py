"""Online serving: a running ``loraplex serve`` driven over HTTP with Poisson arrivals.

For each server configuration (chunked prefill on/off x prefix caching on/off) the script
starts ``loraplex serve`` as a subprocess on a free 127.0.0.1 port, with a fresh registry
(SQLite under a temporary LORAPLEX_HOME) holding N tenants and M LoRA adapters (Zipf
popularity over the adapters, some of them public and called by other tenants as
``owner/name``). At each arrival rate it sends the same seeded Poisson stream of streaming
``POST /v1/completions`` requests (async httpx clients), and records per request: TTFT
(send -> first streamed token), TPOT ((end - first token) / (output tokens - 1)), the gaps
between streamed chunks (ITL), end-to-end latency and output tokens (from the final usage
chunk). Every prompt is a shared system prompt followed by a per-request random part (token
ids), so prefix caching has something to reuse; the server salts the prefix cache per
tenant, so a cached system prompt is shared only among one tenant's requests.

Reported per (configuration, rate): output throughput, TTFT / TPOT / ITL p50 and p99,
goodput (requests per second that met the SLO: TTFT and TPOT under the limits), the engine's
prefix-cache hit rate and preemptions over the run (from ``/admin/api/engine``). Chunked
prefill on runs with a small token budget per step (``--chunk-budget``), the point of
chunking; off needs a budget that holds a whole prompt (``--max-num-batched-tokens``).

    python benchmarks/serving.py            # the default run (~15 min, 2 cores)
    python benchmarks/serving.py --quick    # a smoke run (~4 min)

``--backend ray`` measures ``loraplex serve --backend ray`` against the in-process server
(see docs/scale-out.md): each Ray deployment on a loopback Ray cluster of its own that the
script starts and stops, all servers on a PostgreSQL schema and a Redis prefix of the run's
own. It reports the per-request cost of the Ray path (requests one at a time, paired with
the idle in-process server), the Poisson streams at 1 and 4 req/s for 1 and 2 replicas,
and the adapter hit rate on working sets of 20 and 100 adapters with and without adapter
affinity (from the replicas' ``adapter_disk_loads`` in Redis).

    python benchmarks/serving.py --backend ray            # ~16 min, 2 cores
    python benchmarks/serving.py --backend ray --quick    # ~7 min

``--systems loraplex,vllm`` measures vLLM's OpenAI server as the peer (``vllm serve
--enable-lora --lora-modules ...`` from its own virtualenv, benchmarks/peers/vllm/setup.sh;
skipped with a message when that is absent): the same model folder, PEFT adapters, token-id
prompts, output lengths (``ignore_eos``), greedy sampling and client code, and the first
config's scheduling limits (token budget per step, sequences per step, adapter slots, KV
cache size, chunked prefill and prefix caching). Both servers are up side by side, each
rate's stream goes to one and then the other (the order alternating by rate), and the
greedy agreement of their outputs is reported per rate (where they differ, HF transformers +
PEFT on the same weights says which one is right). Defaults then: config
chunked+prefix, 1 GiB of KV cache each, --out docs/benchmarks/serving_vllm.

    python benchmarks/serving.py --systems loraplex,vllm --quick

Loads only 127.0.0.1; every run is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import json
import math
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Passed on to the server: idle OpenMP threads sleep instead of spinning, which on a CPU
# shared with other jobs turns every parallel op into a wait for a scheduler time slice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _scaleout import (  # noqa: E402
    RayCluster,
    hit_rate,
    ray_env,
    settled_replica_stats,
    summed,
)
from _server_process import ServerProcess  # noqa: E402
from _vllm_serve import (  # noqa: E402
    DEFAULT_VENV,
    VllmServer,
    agreement,
    comparison_table,
    hf_greedy,
    same_text,
    vllm_python,
    vllm_stats,
)
from _workload import (  # noqa: E402
    WorkItem,
    WorkloadSpec,
    ensure_adapters,
    make_workload,
    zipf_weights,
)

T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {message}", flush=True)


# --- configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSetup:
    name: str
    chunked_prefill: bool
    prefix_caching: bool

    def budget(self, args: argparse.Namespace) -> int:
        """Tokens per step: a small budget with chunking (its point), else one that holds
        any prompt."""
        return args.chunk_budget if self.chunked_prefill else args.max_num_batched_tokens

    def serve_args(self, args: argparse.Namespace) -> list[str]:
        out = ["--max-num-batched-tokens", str(self.budget(args))]
        if not self.chunked_prefill:
            out.append("--no-chunked-prefill")
        if not self.prefix_caching:
            out.append("--no-prefix-caching")
        return out


SETUPS = {
    "chunked+prefix": ServerSetup("chunked+prefix", True, True),
    "chunked": ServerSetup("chunked", True, False),
    "prefix": ServerSetup("prefix", False, True),
    "neither": ServerSetup("neither", False, False),
}


# --- workload -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str


@dataclass(frozen=True)
class Adapter:
    name: str
    owner: str  # tenant name
    public: bool


@dataclass(frozen=True)
class Call:
    """One request of the stream: when it is sent, by whom, to which model, what."""

    at: float  # seconds after the stream starts
    tenant: int
    model: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Record:
    index: int
    tenant: str
    model: str
    prompt_tokens: int
    max_tokens: int
    sent: float
    first: float | None = None
    end: float | None = None
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.first is not None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.first is not None and self.end is not None
        return (self.end - self.first) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent


def build_calls(items: Sequence[WorkItem], system_prompt: list[int], tenants: Sequence[Tenant],
                adapters: Sequence[Adapter], base_model: str, base_fraction: float,
                rate: float, seed: int) -> list[Call]:
    """A Poisson stream at ``rate`` req/s over ``items`` (in order). A request to a private
    adapter comes from its owner; to a public one, from any tenant; to the base model
    (``base_fraction`` of requests), from any tenant."""
    rng = random.Random(seed)
    names = [t.name for t in tenants]
    calls = []
    t = 0.0
    for item in items:
        t += rng.expovariate(rate)
        if item.adapter is None or rng.random() < base_fraction:
            caller, model = rng.randrange(len(tenants)), base_model
        else:
            a = adapters[item.adapter]
            caller = rng.randrange(len(tenants)) if a.public else names.index(a.owner)
            model = a.name if names[caller] == a.owner else f"{a.owner}/{a.name}"
        calls.append(Call(t, caller, model, system_prompt + item.prompt_ids, item.max_tokens))
    return calls


# --- the server ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(registry: Sequence[str], *argv: str) -> Any:
    """One ``loraplex`` registry command, run in this process (a subprocess each would pay
    for Python and torch imports every time); returns its JSON output."""
    import contextlib
    import io

    from loraplex.cli import main as loraplex_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = loraplex_main([*argv, *registry, "--json"])
    if rc != 0:
        raise RuntimeError(f"loraplex {' '.join(argv)} failed ({rc}): {buf.getvalue()}")
    return json.loads(buf.getvalue())


def register(registry: Sequence[str], model_dir: str, adapter_paths: Sequence[Path],
             num_tenants: int) -> tuple[list[Tenant], list[Adapter]]:
    """Tenants (no quotas) with one key each; adapter i belongs to tenant i % N, and every
    other adapter is public."""
    cli(registry, "db", "upgrade")
    tenants = []
    for i in range(num_tenants):
        name = f"tenant{i}"
        cli(registry, "tenants", "create", name)
        key = cli(registry, "keys", "create", "--tenant", name)["key"]
        tenants.append(Tenant(name, key))
    adapters = []
    for i, path in enumerate(adapter_paths):
        a = Adapter(f"lora{i}", tenants[i % num_tenants].name, public=i % 2 == 1)
        extra = ["--public"] if a.public else []
        cli(registry, "adapters", "add", "--model", model_dir, "--tenant", a.owner,
            "--name", a.name, str(path), *extra)
        adapters.append(a)
    return tenants, adapters


class Server(ServerProcess):
    def __init__(self, setup: ServerSetup, args: argparse.Namespace, env: dict[str, str],
                 model_dir: str, log_path: Path, extra: Sequence[str] = ()) -> None:
        super().__init__(free_port(), log_path)
        cmd = ["loraplex", "serve", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", "--dtype", args.dtype,
               "--device", "cpu", "--max-loras", str(args.max_loras),
               "--max-lora-rank", str(args.max_lora_rank),
               "--max-num-seqs", str(args.max_num_seqs), "--seed", "0",
               *setup.serve_args(args), *extra]
        if args.max_cpu_loras is not None:
            cmd += ["--max-cpu-loras", str(args.max_cpu_loras)]
        if args.kv_cache_gib is not None:
            cmd += ["--kv-cache-memory", str(int(args.kv_cache_gib * 2**30))]
        if "vllm" in args.systems:  # the peer's context length, so both refuse the same
            cmd += ["--max-model-len", str(max_model_len(args))]
        self.cmd = cmd
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGINT (a graceful uvicorn shutdown), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"the server did not stop in {timeout:.0f} s; killing it")
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# --- the client ---------------------------------------------------------------------------


def request_body(call: Call, tenant: str, vllm: bool = False) -> dict[str, Any]:
    """The completion request of ``call``. To vLLM (no tenants), the adapter goes by its
    bare name and the tenant's name is the prefix-cache salt, so its cache is shared within
    a tenant only, as loraplex's (which derives the salt from the key)."""
    body: dict[str, Any] = {"model": call.model, "prompt": call.prompt,
                            "max_tokens": call.max_tokens, "temperature": 0.0,
                            "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    if vllm:
        body["model"] = call.model.rsplit("/", 1)[-1]
        body["cache_salt"] = tenant
    return body


async def one_request(client: httpx.AsyncClient, url: str, key: str, call: Call,
                      rec: Record, t_start: float, vllm: bool = False) -> None:
    await asyncio.sleep(max(0.0, t_start + call.at - time.monotonic()))
    rec.sent = time.monotonic()
    body = request_body(call, rec.tenant, vllm)
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                now = time.monotonic()
                if chunk.get("choices"):
                    rec.text += chunk["choices"][0].get("text") or ""
                    if rec.first is None:
                        rec.first = now
                    elif last is not None:
                        rec.gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    rec.output_tokens = int(chunk["usage"]["completion_tokens"])
        rec.end = last if last is not None else time.monotonic()
        if rec.output_tokens != call.max_tokens:
            rec.error = f"expected {call.max_tokens} tokens, got {rec.output_tokens}"
    except asyncio.CancelledError:
        rec.error = "cancelled at the drain limit"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


async def run_stream(url: str, tenants: Sequence[Tenant], calls: Sequence[Call],
                     drain_timeout: float, label: str,
                     vllm: bool = False) -> tuple[list[Record], float]:
    """Sends ``calls`` on schedule; returns the records and the span (first send to the last
    completion, or to the drain limit)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=10, read=None, write=10, pool=None)
    records = [Record(i, tenants[c.tenant].name, c.model, len(c.prompt), c.max_tokens, 0.0)
               for i, c in enumerate(calls)]
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t_start = time.monotonic() + 0.2
        tasks = [asyncio.create_task(one_request(client, url, tenants[c.tenant].key, c, r,
                                                 t_start, vllm))
                 for c, r in zip(calls, records, strict=True)]
        deadline = t_start + calls[-1].at + drain_timeout
        progress = asyncio.create_task(_progress(records, t_start, label))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        progress.cancel()
    ends = [r.end for r in records if r.end is not None]
    span = (max(ends) if ends else time.monotonic()) - t_start
    if pending:
        span = max(span, deadline - t_start)
    return records, span


async def _progress(records: Sequence[Record], t_start: float, label: str) -> None:
    while True:
        await asyncio.sleep(10)
        now = time.monotonic()
        sent = sum(1 for r in records if r.sent)
        done = sum(1 for r in records if r.end is not None or r.error is not None)
        log(f"  {label}: t={now - t_start:5.0f}s sent {sent}/{len(records)}, "
            f"done {done}, in flight {sent - done}")


# --- statistics ---------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarise(records: Sequence[Record], span: float,
              slos: Sequence[tuple[float, float]]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    gaps = [g for r in ok for g in r.gaps]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": errors, "span_s": span,
        "output_tokens": sum(r.output_tokens for r in ok),
        "throughput_tok_s": sum(r.output_tokens for r in ok) / span,
        "request_rate_done": len(ok) / span,
        "goodput_req_s": [_good(ok, slo) / span for slo in slos],
        "slo_met_fraction": [_good(ok, slo) / len(records) for slo in slos],
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
        "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
    }


def _good(ok: Sequence[Record], slo: tuple[float, float]) -> int:
    return sum(1 for r in ok if (r.ttft or 0) < slo[0] and (r.tpot or 0) < slo[1])


def slo_label(slo: tuple[float, float]) -> str:
    return f"TTFT<{slo[0]:g}s, TPOT<{slo[1] * 1000:g}ms"


def engine_stats(url: str, admin_key: str) -> dict[str, Any]:
    try:
        r = httpx.get(f"{url}/admin/api/engine", headers={"Authorization": f"Bearer {admin_key}"},
                      timeout=30)
        return dict(r.json()) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def engine_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def d(name: str) -> float:
        return float(after.get(name, 0) or 0) - float(before.get(name, 0) or 0)

    queried = d("prefix_cache_queried_tokens")
    return {"prefix_cache_hit_rate": d("prefix_cache_hit_tokens") / queried if queried else 0.0,
            "preemptions": d("num_preemptions"), "steps": d("num_steps"),
            "adapter_slot_loads": d("adapter_slot_loads"),
            "kv_blocks_total": after.get("kv_blocks_total")}


# --- output -------------------------------------------------------------------------------


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def table(results: Sequence[dict[str, Any]], slos: Sequence[tuple[float, float]]) -> str:
    good = " | ".join(f"goodput {i + 1} (req/s)" for i in range(len(slos)))
    head = ("| config | rate (req/s) | done/sent | out tok/s | TTFT p50 / p99 (ms) "
            f"| TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | {good} | prefix hit | preempt |")
    lines = [head, "|" + "---|" * (9 + len(slos))]
    for r in results:
        s = r["summary"]
        goodput = " | ".join(f"{g:.3f} ({100 * f:.0f}%)"
                             for g, f in zip(s["goodput_req_s"], s["slo_met_fraction"],
                                             strict=True))
        lines.append(
            f"| {r['config']} | {r['rate']:g} | {s['completed']}/{s['requests']} "
            f"| {s['throughput_tok_s']:.1f} | {fmt_ms(s['ttft_p50'])} / {fmt_ms(s['ttft_p99'])} "
            f"| {fmt_ms(s['tpot_p50'])} / {fmt_ms(s['tpot_p99'])} "
            f"| {fmt_ms(s['itl_p50'])} / {fmt_ms(s['itl_p99'])} "
            f"| {goodput} | {100 * r['engine']['prefix_cache_hit_rate']:.0f}% "
            f"| {r['engine']['preemptions']:.0f} |")
    lines.append("")
    lines.append("; ".join(f"SLO {i + 1}: {slo_label(slo)}" for i, slo in enumerate(slos))
                 + ". Goodput = requests meeting the SLO / span (first send to last "
                 "completion); in brackets, the share of sent requests meeting it.")
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path, title: str,
         slos: Sequence[tuple[float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    configs = list(dict.fromkeys(r["config"] for r in results))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = [
        (axes[0][0], ("ttft_p50", "ttft_p99"), 1000, "TTFT (ms)", [s[0] * 1000 for s in slos]),
        (axes[0][1], ("tpot_p50", "tpot_p99"), 1000, "TPOT (ms)", [s[1] * 1000 for s in slos]),
        (axes[1][0], ("goodput_req_s",), 1, "goodput (req/s meeting the SLO)", []),
        (axes[1][1], ("throughput_tok_s",), 1, "output throughput (tok/s)", []),
    ]
    for ax, keys, scale, ylabel, slo_lines in panels:
        for ci, config in enumerate(configs):
            rows = [r for r in results if r["config"] == config]
            rates = [r["rate"] for r in rows]
            if keys == ("goodput_req_s",):
                for si, style in zip(range(len(slos)), ("-o", "--x", ":s"), strict=False):
                    ys = [r["summary"]["goodput_req_s"][si] for r in rows]
                    ax.plot(rates, ys, style, color=colors[ci % len(colors)],
                            label=f"{config}, SLO {si + 1}")
                continue
            for key, style in zip(keys, ("-o", "--x"), strict=False):
                ys = [(r["summary"][key] or float("nan")) * scale for r in rows]
                label = config if len(keys) == 1 else f"{config} {key.split('_')[1]}"
                ax.plot(rates, ys, style, color=colors[ci % len(colors)], label=label)
        for si, slo in enumerate(slo_lines):
            ax.axhline(slo, color="grey", lw=0.8, ls=":")
            ax.annotate(f"SLO {si + 1}", (0, slo), xycoords=("axes fraction", "data"),
                        fontsize=7, color="grey")
        if slo_lines:
            ax.set_yscale("log")
        if keys == ("goodput_req_s",):
            ax.set_title("; ".join(f"SLO {i + 1}: {slo_label(x)}" for i, x in enumerate(slos)),
                         fontsize=8)
        if keys == ("goodput_req_s",):
            rates = sorted({r["rate"] for r in results})
            ax.plot(rates, rates, color="grey", lw=0.8, ls=":", label="offered rate")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info(load_start: tuple[float, float, float]) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"cpu": cpu, "os_cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg_at_start": [round(x, 2) for x in load_start],
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


# --- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model folder (default: the demo model, prepared if needed)")
    p.add_argument("--configs", default=",".join(SETUPS),
                   help=f"comma-separated subset of {', '.join(SETUPS)}")
    p.add_argument("--rates", default="0.15,0.3,0.6", help="arrival rates, req/s")
    p.add_argument("--duration", type=float, default=45,
                   help="seconds of arrivals per rate (the request count is rate x duration)")
    p.add_argument("--max-requests", type=int, default=60, help="cap on requests per rate")
    p.add_argument("--drain-timeout", type=float, default=40,
                   help="seconds after the last arrival before unfinished requests are cancelled")
    p.add_argument("--num-tenants", type=int, default=4)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.0, help="adapter popularity exponent")
    p.add_argument("--base-fraction", type=float, default=0.1,
                   help="share of requests to the base model")
    p.add_argument("--system-prompt-tokens", type=int, default=256,
                   help="shared system prompt, prepended to every prompt")
    p.add_argument("--min-prompt", type=int, default=16, help="per-request part of the prompt")
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--min-output", type=int, default=8)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--slo", default="1:0.1,3:0.5",
                   help="comma-separated SLOs, each TTFT:TPOT in seconds; goodput is reported "
                        "for each")
    p.add_argument("--chunk-budget", type=int, default=256,
                   help="--max-num-batched-tokens with chunked prefill on")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="--max-num-batched-tokens with chunked prefill off (holds any prompt)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=32,
                   help="largest adapter rank each server accepts (the adapters': 8/16/32)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and activations, for every server")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache of each server in GiB (default: loraplex's own, or 1 for "
                        "every server when the vLLM peer runs: 18,900 float32 tokens of this "
                        "model)")
    p.add_argument("--systems", default="loraplex",
                   help="comma-separated: loraplex, vllm (vLLM's `vllm serve` on the same "
                        "model, adapters and streams, with the first config's scheduling "
                        "settings; each rate's stream goes to every system in turn)")
    p.add_argument("--vllm-venv", default=DEFAULT_VENV,
                   help="vLLM's own virtualenv (benchmarks/peers/vllm/setup.sh builds it); "
                        "without it the peer is skipped")
    p.add_argument("--oracle-requests", type=int, default=10,
                   help="per rate, how many of the requests loraplex and vLLM disagree on are "
                        "rerun with HF transformers + PEFT to tell which output is right")
    p.add_argument("--vllm-omp-bind", default="nobind",
                   help="VLLM_CPU_OMP_THREADS_BIND: nobind (threads left to the OS scheduler, "
                        "as loraplex's), auto (pinned to the first cores), or a core list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", help="where benchmark adapters are cached")
    p.add_argument("--keep-logs", action="store_true", help="keep the server logs and registry")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: rates 0.2,0.5, 25 s of arrivals, outputs <= 32, "
                        "configs chunked+prefix and neither")
    p.add_argument("--out", default="docs/benchmarks/serving",
                   help="output path without extension: writes .json and .png")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters each engine keeps in host memory (default: the server's; "
                        "--max-loras in Ray mode, so the working-set runs have a known "
                        "per-replica capacity)")
    g = p.add_argument_group(
        "Ray mode", "--backend ray: the in-process server (the peer) and Ray Serve replicas, "
        "each deployment on a fresh loopback Ray cluster this script starts and stops, all "
        "on a PostgreSQL schema and Redis prefix of the run's own (loraplex.testing's "
        "servers). Defaults then: config chunked+prefix, rates 1,4, 20 s per rate (30 s "
        "drain), output at most 64 tokens, --out docs/benchmarks/serving_ray.")
    g.add_argument("--backend", default="local", choices=["local", "ray"])
    g.add_argument("--replicas", default="1,2", help="replica counts, comma-separated")
    g.add_argument("--affinity-adapters", default="20,100",
                   help="adapter working sets for the hit-rate runs (at the largest replica "
                        "count, with and without adapter affinity; empty: none)")
    g.add_argument("--adapter-requests", type=int, default=100,
                   help="measured requests per working set (after --adapter-warmup)")
    g.add_argument("--adapter-warmup", type=int, default=30)
    g.add_argument("--adapter-rate", type=float, default=2.5,
                   help="arrival rate of the working-set runs, req/s (prompts 16-32 "
                        "tokens, 4 output tokens)")
    g.add_argument("--probe-requests", type=int, default=16,
                   help="requests sent one at a time to an idle server (per-request cost)")
    args = p.parse_args(argv)
    if args.backend == "ray":
        if args.configs == ",".join(SETUPS):
            args.configs = "chunked+prefix"
        if args.rates == p.get_default("rates"):
            args.rates = "1,4"
        if args.duration == p.get_default("duration"):
            args.duration = 20
        if args.drain_timeout == p.get_default("drain_timeout"):
            args.drain_timeout = 30
        if args.max_requests == p.get_default("max_requests"):
            args.max_requests = 120
        if args.out == p.get_default("out"):
            args.out = "docs/benchmarks/serving_ray"
        if args.max_cpu_loras is None:
            args.max_cpu_loras = args.max_loras
        if args.quick:
            args.duration = min(args.duration, 15)
            args.adapter_requests = min(args.adapter_requests, 60)
            args.adapter_warmup = min(args.adapter_warmup, 20)
            args.probe_requests = min(args.probe_requests, 8)
            args.max_output = min(args.max_output, 32)
            args.drain_timeout = min(args.drain_timeout, 25)
    args.systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    if not args.systems or set(args.systems) - {"loraplex", "vllm"}:
        p.error(f"--systems: choose from loraplex, vllm; got {args.systems}")
    if "vllm" in args.systems:
        if args.backend == "ray":
            p.error("--systems vllm runs with the in-process backend only")
        if args.configs == ",".join(SETUPS):
            args.configs = "chunked+prefix"
        if args.out == p.get_default("out"):
            args.out = "docs/benchmarks/serving_vllm"
        if args.kv_cache_gib is None:
            args.kv_cache_gib = 1.0
    if args.quick and args.backend == "local":
        if args.rates == p.get_default("rates"):
            args.rates = "0.2,0.5"
        args.duration = min(args.duration, 25)
        args.max_output = min(args.max_output, 32)
        args.drain_timeout = min(args.drain_timeout, 25)
        if args.configs == ",".join(SETUPS):
            args.configs = "chunked+prefix,neither"
    try:
        args.slos = [(float(a), float(b)) for a, b in
                     (x.split(":") for x in args.slo.split(",") if x.strip())]
    except ValueError:
        p.error(f"--slo: expected TTFT:TPOT pairs, got {args.slo!r}")
    args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.replicas = [int(x) for x in args.replicas.split(",") if x.strip()]
    args.affinity_adapters = [int(x) for x in args.affinity_adapters.split(",") if x.strip()]
    if args.backend == "ray" and len(args.configs) != 1:
        p.error("Ray mode runs one config (--configs)")
    if not args.replicas or min(args.replicas) < 1:
        p.error("--replicas: counts >= 1")
    unknown = set(args.configs) - set(SETUPS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {list(SETUPS)}")
    return args


def resolve_model(model: str | None) -> str:
    if model:
        return str(Path(model).absolute())
    from loraplex.model.demo import prepare_demo_model

    return str(prepare_demo_model(progress=True))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ray_mode = args.backend == "ray"
    load_start = os.getloadavg()
    log(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
        f"({os.cpu_count()} CPUs)")
    model_dir = resolve_model(args.model)
    num_registered = max([args.num_adapters, *args.affinity_adapters]) if ray_mode \
        else args.num_adapters
    adapter_paths = ensure_adapters(model_dir, num_registered, args.cache_dir)

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    excluded = set(tokenizer.all_special_ids)
    rng = random.Random(args.seed + 17)
    allowed = [t for t in range(vocab) if t not in excluded]
    system_prompt = [rng.choice(allowed) for _ in range(args.system_prompt_tokens)]

    home = Path(tempfile.mkdtemp(prefix="loraplex-serving-bench-"))
    admin_key = "lpx-" + secrets.token_urlsafe(40)
    with contextlib.ExitStack() as shared:
        redis_url = redis_prefix = None
        if ray_mode:
            # Ray mode needs what several gateways can share: a PostgreSQL schema and a Redis
            # key prefix of this run's own (both removed at the end), and one salt secret.
            from loraplex.testing import postgres_schema, redis_key_prefix, redis_url_for_tests

            database_url = shared.enter_context(postgres_schema("bench_serving"))
            redis_url = redis_url_for_tests()
            redis_prefix = shared.enter_context(redis_key_prefix("bench-serving"))
        else:
            database_url = f"sqlite:///{home / 'loraplex.db'}"
        adapter_dir = str(home / "adapters")
        env = dict(os.environ, LORAPLEX_HOME=str(home), LORAPLEX_ADMIN_KEY=admin_key,
                   LORAPLEX_MODEL=model_dir, LORAPLEX_DATABASE_URL=database_url,
                   LORAPLEX_ADAPTER_DIR=adapter_dir)
        for var in ("LORAPLEX_REDIS_URL", "LORAPLEX_CACHE_SALT_SECRET", "LORAPLEX_RAY_ADDRESS"):
            env.pop(var, None)
        if ray_mode:
            env["LORAPLEX_CACHE_SALT_SECRET"] = secrets.token_hex(32)
        log(f"registering {args.num_tenants} tenants and {num_registered} adapters in {home}")
        tenants, adapters = register(["--database-url", database_url, "--adapter-dir",
                                      adapter_dir], model_dir, adapter_paths, args.num_tenants)
        base_model = Path(model_dir).name

        streams: dict[float, list[Call]] = {}
        for ri, rate in enumerate(args.rates):
            n = max(2, min(args.max_requests, round(rate * args.duration)))
            spec = WorkloadSpec(num_requests=n, num_adapters=args.num_adapters,
                                min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                                min_output=args.min_output, max_output=args.max_output,
                                zipf_exponent=args.zipf, seed=args.seed * 1000 + ri)
            items = make_workload(spec, vocab, sorted(excluded))
            streams[rate] = build_calls(items, system_prompt, tenants, adapters, base_model,
                                        args.base_fraction, rate, args.seed * 1000 + ri)
        total = sum(len(c) for c in streams.values())
        log(f"{len(args.configs)} configs x {len(args.rates)} rates, {total} requests per "
            f"config; adapter popularity (Zipf {args.zipf}): "
            + ", ".join(f"{w:.2f}" for w in zipf_weights(args.num_adapters, args.zipf)))

        results: list[dict[str, Any]] = []
        servers: list[dict[str, Any]] = []
        extra: dict[str, Any] = {}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, tenants, adapters, base_model, admin_key, streams, results)
        try:
            if ray_mode:
                assert redis_url is not None and redis_prefix is not None
                run_ray(bench, env, model_dir, home, database_url, redis_url, redis_prefix,
                        vocab, sorted(excluded), servers, extra)
            configs = [] if ray_mode or "loraplex" not in args.systems else args.configs
            if "vllm" in args.systems and vllm_available(args):
                run_with_vllm(bench, env, model_dir, home, adapter_paths, servers, extra,
                              lambda text: tokenizer(text, add_special_tokens=False)[
                                  "input_ids"])
                configs = configs[1:]
            for config in configs:
                setup = SETUPS[config]
                log(f"== {config}: starting the server")
                t_boot = time.monotonic()
                server = Server(setup, args, env, model_dir, home / f"server-{config}.log")
                try:
                    server.wait_ready(300)
                    log(f"   ready in {time.monotonic() - t_boot:.1f} s on {server.url}: "
                        f"{' '.join(server.cmd[2:])}")
                    bench.warm_up(server)
                    bench.run_rates(server, config,
                                    functools.partial(engine_stats, server.url, admin_key))
                finally:
                    rc = server.stop()
                    log(f"   server stopped (exit {rc})")
                    servers.append({"config": config, "cmd": server.cmd[2:], "exit_code": rc})
        finally:
            if results or extra:
                write_outputs(args, out, results, servers, load_start, extra)
            if not args.keep_logs:
                shutil.rmtree(home, ignore_errors=True)
            else:
                log(f"server logs and registry kept in {home}")
    return 0


@dataclass
class Bench:
    """What every server of a run is measured with, and where the results go."""

    args: argparse.Namespace
    tenants: Sequence[Tenant]
    adapters: Sequence[Adapter]
    base_model: str
    admin_key: str
    streams: dict[float, list[Call]]
    results: list[dict[str, Any]]

    def warm_up(self, server: Server | VllmServer, vllm: bool = False) -> None:
        warm = warmup_calls(self.tenants, self.adapters[:self.args.num_adapters],
                            self.base_model, self.args.seed)
        recs, _ = asyncio.run(run_stream(server.url, self.tenants, warm, 120, "warm-up",
                                         vllm))
        bad = [r.error for r in recs if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up requests failed: {bad[:3]}\n{server.tail()}")

    def run_rates(self, server: Server, config: str,
                  stats: Callable[[], dict[str, Any]]) -> None:
        for rate in self.args.rates:
            self.run_rate(server, config, rate, stats)

    def run_rate(self, server: Server | VllmServer, config: str, rate: float,
                 stats: Callable[[], dict[str, Any]], vllm: bool = False) -> None:
        calls = self.streams[rate]
        label = f"{config} @ {rate:g} req/s"
        log(f"   {label}: {len(calls)} requests over {calls[-1].at:.0f} s")
        before = stats()
        records, span = asyncio.run(run_stream(server.url, self.tenants, calls,
                                               self.args.drain_timeout, label, vllm))
        after = stats()
        summary = summarise(records, span, self.args.slos)
        delta = engine_delta(before, after)
        self.results.append({"config": config, "rate": rate, "summary": summary,
                             "engine": delta,
                             "records": [dict(asdict(r), gaps=None, ttft=r.ttft,
                                              tpot=r.tpot) for r in records]})
        log(f"   {label}: done {summary['completed']}/{summary['requests']}, "
            f"{summary['throughput_tok_s']:.1f} tok/s, TTFT p50/p99 "
            f"{fmt_ms(summary['ttft_p50'])}/{fmt_ms(summary['ttft_p99'])} ms, "
            f"TPOT p50/p99 {fmt_ms(summary['tpot_p50'])}/"
            f"{fmt_ms(summary['tpot_p99'])} ms, goodput "
            + "/".join(f"{g:.3f}" for g in summary["goodput_req_s"])
            + " req/s, prefix hit "
            f"{100 * delta['prefix_cache_hit_rate']:.0f}%, load "
            f"{os.getloadavg()[0]:.2f}"
            + (f", errors {summary['errors']}" if summary["errors"] else ""))


# --- the vLLM peer --------------------------------------------------------------------------


def max_model_len(args: argparse.Namespace) -> int:
    return args.system_prompt_tokens + args.max_prompt + args.max_output


def vllm_available(args: argparse.Namespace) -> bool:
    if vllm_python(args.vllm_venv) is not None:
        return True
    log(f"vLLM peer skipped: no virtualenv at {args.vllm_venv} "
        f"(benchmarks/peers/vllm/setup.sh {args.vllm_venv} builds it)")
    return False


def run_with_vllm(bench: Bench, env: dict[str, str], model_dir: str, home: Path,
                  adapter_paths: Sequence[Path], servers: list[dict[str, Any]],
                  extra: dict[str, Any], encode: Callable[[str], list[int]]) -> None:
    """loraplex (the first config) and ``vllm serve`` (its scheduling settings) up side by
    side; each rate's stream goes to one and then the other, the order alternating by rate
    so that neither always runs first on a machine whose load drifts. Then the greedy
    agreement of the two systems' outputs, per rate."""
    args = bench.args
    setup = SETUPS[args.configs[0]]
    lp_name, v_name = f"loraplex {setup.name}", "vllm"
    targets: list[tuple[str, Server | VllmServer, Callable[[], dict[str, Any]], bool]] = []
    try:
        log(f"== {lp_name} and {v_name}: starting both servers")
        if "loraplex" in args.systems:
            lp = Server(setup, args, env, model_dir, home / "server-loraplex.log")
            targets.append((lp_name, lp, functools.partial(engine_stats, lp.url,
                                                           bench.admin_key), False))
        v = VllmServer(args.vllm_venv, free_port(), model_dir, bench.base_model,
                       adapter_paths[:args.num_adapters], dtype=args.dtype,
                       max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=setup.budget(args),
                       max_model_len=max_model_len(args), prefix_caching=setup.prefix_caching,
                       chunked_prefill=setup.chunked_prefill, threads=os.cpu_count() or 1,
                       kv_cache_gib=args.kv_cache_gib or 1.0, env=env,
                       log_path=home / "server-vllm.log", omp_bind=args.vllm_omp_bind)
        targets.append((v_name, v, functools.partial(vllm_stats, v.url), True))
        t_boot = time.monotonic()
        for name, server, _, _ in targets:
            server.wait_ready(900)
            log(f"   {name} ready after {time.monotonic() - t_boot:.1f} s on {server.url}: "
                f"{' '.join(server.cmd[2:])}")
        extra["vllm_version"] = v.version()
        for _, server, _, is_vllm in targets:
            bench.warm_up(server, is_vllm)
        for ri, rate in enumerate(args.rates):
            for name, server, stats, is_vllm in targets[::1 if ri % 2 == 0 else -1]:
                bench.run_rate(server, name, rate, stats, is_vllm)
    finally:
        for name, server, _, _ in targets:
            rc = server.stop()
            log(f"   {name} stopped (exit {rc})")
            servers.append({"config": name, "cmd": server.cmd, "exit_code": rc,
                            "env": getattr(server, "env_vars", None)})
    if len(targets) == 2:
        extra["compared"] = [lp_name, v_name]
        extra["agreement"] = compare_outputs(bench, model_dir, adapter_paths,
                                             (lp_name, v_name), encode)


def compare_outputs(bench: Bench, model_dir: str, adapter_paths: Sequence[Path],
                    names: Sequence[str], encode: Callable[[str], list[int]]
                    ) -> list[dict[str, Any]]:
    """Per rate, the greedy agreement of two systems' outputs on the same stream."""
    rows = []
    for rate in bench.args.rates:
        texts = [[r["text"] if r["error"] is None and r["end"] is not None else None
                  for r in _row(bench.results, name, rate)["records"]] for name in names]
        row = dict(rate=rate, **agreement(*texts, encode))
        row["oracle"] = judge(bench, model_dir, adapter_paths, rate, row["differ"], texts)
        rows.append(row)
    return rows


def judge(bench: Bench, model_dir: str, adapter_paths: Sequence[Path], rate: float,
          differ: Sequence[int], texts: Sequence[Sequence[str | None]]) -> list[dict[str, Any]]:
    """Each request the two systems disagree on (up to --oracle-requests per rate), run by
    the oracle (HF transformers + PEFT, greedy): which system's output is the oracle's."""
    calls = bench.streams[rate]
    cases = differ[:bench.args.oracle_requests]
    if not cases:
        return []
    log(f"   {rate:g} req/s: {len(differ)} outputs differ; HF transformers + PEFT on "
        f"{len(cases)} of them")

    def adapter(model: str) -> Path | None:
        name = model.rsplit("/", 1)[-1]
        return None if model == bench.base_model else adapter_paths[int(name[len("lora"):])]

    oracle = hf_greedy(model_dir, bench.args.dtype,
                       [(calls[i].prompt, adapter(calls[i].model), calls[i].max_tokens)
                        for i in cases])
    out = []
    for i, want in zip(cases, oracle, strict=True):
        lp, v = texts[0][i], texts[1][i]
        out.append({"index": i, "model": calls[i].model,
                    "loraplex_is_oracle": lp is not None and same_text(lp, want),
                    "vllm_is_oracle": v is not None and same_text(v, want)})
        log(f"     request {i} ({calls[i].model}): loraplex "
            f"{'=' if out[-1]['loraplex_is_oracle'] else '!='} oracle, vLLM "
            f"{'=' if out[-1]['vllm_is_oracle'] else '!='} oracle")
    return out


def _row(results: Sequence[dict[str, Any]], config: str, rate: float) -> dict[str, Any]:
    return next(r for r in results if r["config"] == config and r["rate"] == rate)


# --- Ray mode -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """One server of a Ray-mode run: the in-process peer (replicas 0) or Ray replicas."""

    name: str
    replicas: int
    affinity: bool = True
    rates: bool = True  # the Poisson streams (latency, throughput)
    adapter_streams: bool = False  # the adapter working-set streams (hit rate)

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-")


def ray_deployments(args: argparse.Namespace) -> list[Deployment]:
    top = max(args.replicas)
    sets = bool(args.affinity_adapters)
    out = [Deployment("in-process", 0, adapter_streams=sets)]
    out += [Deployment(f"ray x{n}", n, adapter_streams=sets and n == top and n >= 2)
            for n in args.replicas]
    if sets and top >= 2:
        out.append(Deployment(f"ray x{top} no-affinity", top, affinity=False, rates=False,
                              adapter_streams=True))
    return out


def run_ray(bench: Bench, env: dict[str, str], model_dir: str, home: Path, database_url: str,
            redis_url: str, redis_prefix: str, vocab: int, excluded: Sequence[int],
            servers: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    """The in-process peer and each Ray deployment, one after the other, on the same
    registry (PostgreSQL) and Redis; each Ray deployment on a fresh loopback cluster."""
    args = bench.args
    setup = SETUPS[args.configs[0]]
    cpus = os.cpu_count() or 2
    probes: dict[str, Any] = {}
    sets: list[dict[str, Any]] = []
    extra.update(probes=probes, adapter_sets=sets, cluster_cpus=cpus)
    # The in-process server stays up (idle) after its own runs: each Ray probe pairs
    # its requests with it.
    peer: Server | None = None
    try:
        for dep in ray_deployments(args):
            prefix = f"{redis_prefix}{dep.slug}:"
            flags = ["--database-url", database_url, "--redis-url", redis_url,
                     "--redis-key-prefix", prefix]
            dep_env = dict(env)
            cluster = None
            if dep.replicas:
                # The cluster's CPUs split evenly: Ray sets each replica's OMP_NUM_THREADS to
                # its whole CPUs, so one replica gets every core, as the in-process engine does.
                ray_vars = ray_env()
                dep_env.update(ray_vars)
                cluster = RayCluster(cpus, home / f"ray-{dep.slug}.log", ray_vars)
                replica_cpus = cpus / dep.replicas
                flags += ["--backend", "ray", "--replicas", str(dep.replicas), "--ray-address",
                          cluster.address, "--replica-cpus", f"{replica_cpus:g}"]
                if not dep.affinity:
                    flags.append("--no-adapter-affinity")
            log(f"== {dep.name}: starting" + (" a Ray cluster and" if cluster else "")
                + " the server")
            t_boot = time.monotonic()
            server = None
            try:
                if cluster is not None:
                    cluster.wait_ready()
                server = Server(setup, args, dep_env, model_dir, home / f"server-{dep.slug}.log",
                                flags)
                server.wait_ready(420)
                if dep.replicas:
                    settled_replica_stats(redis_url, prefix, dep.replicas, timeout=60)
                boot_s = time.monotonic() - t_boot
                log(f"   ready in {boot_s:.1f} s on {server.url}")

                def stats(dep: Deployment = dep, prefix: str = prefix,
                          url: str = server.url) -> dict[str, Any]:
                    if dep.replicas:
                        return summed(settled_replica_stats(redis_url, prefix, dep.replicas))
                    return engine_stats(url, bench.admin_key)

                def per_replica(dep: Deployment = dep, prefix: str = prefix,
                                stats: Callable[[], dict[str, Any]] = stats
                                ) -> dict[int, dict[str, Any]]:
                    if dep.replicas:
                        return settled_replica_stats(redis_url, prefix, dep.replicas)
                    return {0: stats()}

                bench.warm_up(server)
                if dep.rates:
                    probes[dep.name] = run_probe(bench, server, dep.name,
                                                 peer if dep.replicas else None)
                    bench.run_rates(server, dep.name, stats)
                if dep.adapter_streams:
                    for num in args.affinity_adapters:
                        sets.append(run_adapter_set(bench, server, dep, num, vocab, excluded,
                                                    per_replica))
                if not dep.replicas:
                    peer, server = server, None
            finally:
                rc = server.stop() if server is not None else None
                if server is not None:
                    servers.append({"config": dep.name, "cmd": server.cmd[2:],
                                    "exit_code": rc, "replicas": dep.replicas,
                                    "affinity": dep.affinity})
                if cluster is not None:
                    log(f"   server stopped (exit {rc}); cluster stopped (exit {cluster.stop()})")
                elif server is not None:
                    log(f"   server stopped (exit {rc})")
                else:
                    log("   in-process server kept up (idle), the Ray probes' pair")
    finally:
        if peer is not None:
            rc = peer.stop()
            log(f"   in-process server stopped (exit {rc})")
            servers.append({"config": "in-process", "cmd": peer.cmd[2:], "exit_code": rc,
                            "replicas": 0, "affinity": True})
    loads = sum(r["disk_loads"] for r in sets)
    if loads:
        extra["adapter_load_s_per_load"] = sum(r["adapter_load_seconds"] for r in sets) / loads


def run_probe(bench: Bench, server: Server, name: str,
              peer: Server | None = None) -> dict[str, Any]:
    """Requests one at a time on an idle server (base model and adapters in turn, fresh
    prompts, all adapters already loaded): the per-request cost of the path itself. With a
    ``peer`` (the in-process server, idle meanwhile), each request goes to both, one after
    the other in alternating order, so both see the same background load: the paired
    differences are the Ray path's cost."""
    args = bench.args
    rng = random.Random(args.seed + 4242)
    names = [t.name for t in bench.tenants]
    models = [(0, bench.base_model)] + [(names.index(a.owner), a.name)
                                        for a in bench.adapters[:min(3, args.num_adapters)]]
    calls = [Call(0.0, *models[i % len(models)],
                  [rng.randrange(1000, 20000) for _ in range(32)], 16)
             for i in range(args.probe_requests)]

    async def sequential() -> tuple[list[Record], list[Record]]:
        mine: list[Record] = []
        theirs: list[Record] = []
        timeout = httpx.Timeout(connect=10, read=120, write=10, pool=None)
        async with httpx.AsyncClient(timeout=timeout) as client:
            for i, call in enumerate(calls):
                targets = [(server, mine)] if peer is None else \
                    [(server, mine), (peer, theirs)][::1 if i % 2 else -1]
                for target, records in targets:
                    rec = Record(i, names[call.tenant], call.model, len(call.prompt),
                                 call.max_tokens, 0.0)
                    await one_request(client, target.url, bench.tenants[call.tenant].key,
                                      call, rec, time.monotonic())
                    records.append(rec)
        return mine, theirs

    records, peer_records = asyncio.run(sequential())
    out = probe_summary(records)
    text = (f"TTFT p50 {fmt_ms(out['ttft_p50'])} ms, TPOT p50 {fmt_ms(out['tpot_p50'])} ms, "
            f"e2e p50 {fmt_ms(out['e2e_p50'])} ms")
    if peer is not None:
        out["peer"] = probe_summary(peer_records)
        for key in ("ttft", "e2e", "tpot"):
            diffs = [getattr(a, key) - getattr(b, key)
                     for a, b in zip(records, peer_records, strict=True)
                     if getattr(a, key) is not None and getattr(b, key) is not None]
            ratios = [getattr(a, key) / getattr(b, key)
                      for a, b in zip(records, peer_records, strict=True)
                      if getattr(a, key) and getattr(b, key)]
            out[f"paired_{key}_diff_p50"] = pct(diffs, 50)
            out[f"paired_{key}_ratio_p50"] = pct(ratios, 50)
        text += (f"; paired with in-process: TTFT {fmt_ms(out['paired_ttft_diff_p50'])} ms "
                 f"({out['paired_ttft_ratio_p50']:.2f}x), e2e "
                 f"{fmt_ms(out['paired_e2e_diff_p50'])} ms "
                 f"({out['paired_e2e_ratio_p50']:.2f}x), TPOT "
                 f"{out['paired_tpot_ratio_p50']:.2f}x (p50 of per-request differences)")
    log(f"   probe {name}: {out['completed']}/{out['requests']} one at a time, {text}")
    return out


def probe_summary(records: Sequence[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    return {"requests": len(records), "completed": len(ok), "max_tokens": 16,
            "prompt_tokens": 32, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99), "e2e_p50": pct(e2e, 50),
            "e2e_p99": pct(e2e, 99),
            "errors": sorted({r.error for r in records if r.error})[:3]}


def run_adapter_set(bench: Bench, server: Server, dep: Deployment, num_adapters: int,
                    vocab: int, excluded: Sequence[int],
                    per_replica: Callable[[], dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Short requests over ``num_adapters`` adapters (Zipf popularity, no base-model
    requests): a warm-up stream, then the measured stream of the same distribution; the hit
    rate comes from the replicas' disk-load counters over the measured one."""
    args = bench.args
    adapters = bench.adapters[:num_adapters]
    streams = []
    for part, n in (("warm", args.adapter_warmup), ("measured", args.adapter_requests)):
        seed = args.seed * 1000 + 500 + num_adapters + (part == "measured")
        spec = WorkloadSpec(num_requests=n, num_adapters=num_adapters, min_prompt=16,
                            max_prompt=32, min_output=4, max_output=4,
                            zipf_exponent=args.zipf, seed=seed)
        items = make_workload(spec, vocab, excluded)
        streams.append(build_calls(items, [], bench.tenants, adapters, bench.base_model, 0.0,
                                   args.adapter_rate, seed))
    label = f"{dep.name}, {num_adapters} adapters"
    log(f"   {label}: {len(streams[0])} warm-up + {len(streams[1])} measured requests at "
        f"{args.adapter_rate:g} req/s")
    warm, _ = asyncio.run(run_stream(server.url, bench.tenants, streams[0],
                                     args.drain_timeout, label + " (warm-up)"))
    before = per_replica()
    records, span = asyncio.run(run_stream(server.url, bench.tenants, streams[1],
                                           args.drain_timeout, label))
    after = per_replica()
    hits = hit_rate(before, after, len(records))
    summary = summarise(records, span, args.slos)
    row = {"config": dep.name, "replicas": max(1, dep.replicas), "affinity": dep.affinity,
           "num_adapters": num_adapters, "capacity_per_replica": args.max_cpu_loras,
           "failed": summary["failed"] + sum(1 for r in warm if not r.ok),
           "ttft_p50": summary["ttft_p50"], "ttft_p99": summary["ttft_p99"],
           "sequence": [c.model for c in streams[0] + streams[1]], **hits}
    log(f"   {label}: hit rate {100 * hits['hit_rate']:.1f}%, "
        f"{hits['loads_per_request']:.3f} disk loads per request "
        f"(per replica {hits['disk_loads_per_replica']}), TTFT p50 "
        f"{fmt_ms(summary['ttft_p50'])} ms, failed {row['failed']}")
    return row


def warmup_calls(tenants: Sequence[Tenant], adapters: Sequence[Adapter], base_model: str,
                 seed: int) -> list[Call]:
    """One short request per adapter and one to the base model, 0.5 s apart, so adapters
    are read from disk and installed in slots here, not in the measured runs. The prompts
    do not share the system prompt: the prefix cache starts cold at the first rate."""
    rng = random.Random(seed + 99)
    names = [t.name for t in tenants]
    models = [(names.index(a.owner), a.name) for a in adapters] + [(0, base_model)]
    return [Call(0.5 * i, caller, model, [rng.randrange(1000, 2000) for _ in range(16)], 2)
            for i, (caller, model) in enumerate(models)]


def write_outputs(args: argparse.Namespace, out: Path, results: Sequence[dict[str, Any]],
                  servers: Sequence[dict[str, Any]],
                  load_start: tuple[float, float, float],
                  extra: dict[str, Any] | None = None) -> None:
    machine = machine_info(load_start)
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    doc = {"benchmark": "serving", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "command": "python benchmarks/serving.py " + " ".join(sys.argv[1:]),
           "machine": machine, "settings": settings, "servers": servers,
           "results": results, **(extra or {})}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    scope = (f"{args.num_tenants} tenants, {args.num_adapters} adapters, "
             f"{args.system_prompt_tokens}-token shared system prompt")
    what = ("loraplex serve vs vllm serve" if (extra or {}).get("compared")
            else "loraplex serve")
    title = (f"{what} over HTTP, CPU ({machine['os_cpus']} cores, load "
             f"{machine['load_avg_at_start'][0]:.1f}-{machine['load_avg_at_end'][0]:.1f}), "
             f"{args.dtype}; "
             + (f"in-process vs Ray Serve replicas; {scope}" if args.backend == "ray"
                else scope))
    if results:
        plot(results, out.with_suffix(".png"), title, args.slos)
        log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    ray = args.backend == "ray" and bool(extra)
    if ray:
        assert extra is not None
        path = out.parent / f"{out.name}_adapters.png"
        plot_ray(extra, path, title)
        log(f"wrote {path}")
    print()
    if results:
        print(table(results, args.slos))
    if ray:
        assert extra is not None
        print()
        print(ray_tables(extra))
    if extra and extra.get("compared"):
        print()
        print(comparison_table(results, extra["compared"], args.slos, extra["agreement"]))


def ray_tables(extra: dict[str, Any]) -> str:
    probes = extra.get("probes", {})
    lines = ["| deployment (one request at a time) | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
             "| e2e p50 (ms) | paired vs in-process: TTFT | e2e | TPOT |",
             "|---|---|---|---|---|---|---|"]

    def paired(p: dict[str, Any], key: str) -> str:
        diff, ratio = p.get(f"paired_{key}_diff_p50"), p.get(f"paired_{key}_ratio_p50")
        if diff is None or ratio is None:
            return "-"
        return f"{diff * 1000:+.0f} ms ({ratio:.2f}x)"

    for name, p in probes.items():
        lines.append(f"| {name} | {fmt_ms(p['ttft_p50'])} / {fmt_ms(p['ttft_p99'])} "
                     f"| {fmt_ms(p['tpot_p50'])} / {fmt_ms(p['tpot_p99'])} "
                     f"| {fmt_ms(p['e2e_p50'])} | {paired(p, 'ttft')} | {paired(p, 'e2e')} "
                     f"| {paired(p, 'tpot')} |")
    lines += ["", "| deployment | adapters | requests | disk loads (per replica) "
              "| loads / request | hit rate (1 - loads/request) | TTFT p50 / p99 (ms) |",
              "|---|---|---|---|---|---|---|"]
    for r in extra.get("adapter_sets", []):
        per = ", ".join(str(v) for v in r["disk_loads_per_replica"].values())
        lines.append(f"| {r['config']} | {r['num_adapters']} | {r['adapter_requests']} "
                     f"| {r['disk_loads']} ({per}) | {r['loads_per_request']:.3f} "
                     f"| {100 * r['hit_rate']:.1f}% | {fmt_ms(r['ttft_p50'])} / "
                     f"{fmt_ms(r['ttft_p99'])} |")
    return "\n".join(lines)


def plot_ray(extra: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    probes = extra.get("probes", {})
    names = [n for n in probes if "paired_e2e_diff_p50" in probes[n]]
    for i, (key, label) in enumerate((("ttft", "TTFT"), ("e2e", "end to end"),
                                      ("tpot", "TPOT"))):
        ys = [(probes[n][f"paired_{key}_diff_p50"] or float("nan")) * 1000 for n in names]
        ax0.bar([x + 0.27 * i for x in range(len(names))], ys, width=0.27, label=label)
    ax0.axhline(0, color="grey", lw=0.8)
    ax0.set_xticks([x + 0.27 for x in range(len(names))], names, fontsize=8)
    ax0.set_ylabel("ms, Ray minus in-process (p50 of paired requests)")
    ax0.set_title("per-request cost of the Ray path (idle servers, 32-token prompt, "
                  "16 tokens out)", fontsize=9)
    ax0.legend(fontsize=8)
    ax0.grid(alpha=0.3, axis="y")
    sets = extra.get("adapter_sets", [])
    configs = list(dict.fromkeys(r["config"] for r in sets))
    sizes = sorted({r["num_adapters"] for r in sets})
    width = 0.8 / max(1, len(configs))
    for ci, config in enumerate(configs):
        ys = [next((100 * r["hit_rate"] for r in sets
                    if r["config"] == config and r["num_adapters"] == n), float("nan"))
              for n in sizes]
        ax1.bar([x + width * ci for x in range(len(sizes))], ys, width=width, label=config)
    ax1.set_xticks([x + 0.4 - width / 2 for x in range(len(sizes))],
                   [f"{n} adapters" for n in sizes])
    cap = sets[0]["capacity_per_replica"] if sets else "?"
    ax1.set_ylabel("adapter hit rate (%)")
    ax1.set_title(f"requests served without a disk load (host cache {cap} adapters/replica)",
                  fontsize=9)
    ax1.set_ylim(min(0.0, *[100 * r["hit_rate"] for r in sets], 0.0) - 5, 100)
    ax1.axhline(0, color="grey", lw=0.8)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
