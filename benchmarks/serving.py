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
import contextlib
import functools
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Passed on to the server: idle OpenMP threads sleep instead of spinning, which on a CPU
# shared with other jobs turns every parallel op into a wait for a scheduler time slice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _log import log  # noqa: E402
from _output import add_out_argument  # noqa: E402
from _serving_bench import Bench  # noqa: E402
from _serving_metrics import engine_stats  # noqa: E402
from _serving_ray import run_ray  # noqa: E402
from _serving_report import write_outputs  # noqa: E402
from _serving_server import SETUPS, Server, register  # noqa: E402
from _serving_vllm import run_with_vllm, vllm_available  # noqa: E402
from _serving_workload import Call, build_calls  # noqa: E402
from _vllm_serve import DEFAULT_VENV  # noqa: E402
from _workload import (  # noqa: E402
    WorkloadSpec,
    add_model_argument,
    ensure_adapters,
    make_workload,
    resolve_model,
    zipf_weights,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(p)
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
    add_out_argument(p, "docs/benchmarks/serving")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ray_mode = args.backend == "ray"
    load_start = os.getloadavg()
    log(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
        f"({os.cpu_count()} CPUs)")
    model_dir = resolve_model(args.model, absolute=True)
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


if __name__ == "__main__":
    sys.exit(main())
