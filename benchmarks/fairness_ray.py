"""Tenant fairness across Ray replicas, with skewed ingress (issue 54, item 8d).

Two engine replicas of the demo model (float32, ``--max-num-seqs`` each) on a loopback Ray
cluster, behind two gateways (PostgreSQL registry, Redis). A noisy tenant sends all its
requests through gateway 0; quiet tenants send short streamed requests through gateway 1,
one at a time. Three phases, under ``fifo`` and then ``fair`` (each on a fresh cluster):

- alone: the quiet tenant with no other load;
- engine backlog: the noisy tenant keeps ``--engine-backlog`` requests in flight, fewer
  than the replicas accept (2 × 2 × max_num_seqs): its backlog waits in the engines,
  where the scheduler orders it;
- router backlog: it keeps ``--router-backlog`` in flight, more than the replicas accept:
  the rest waits in gateway 0's Serve router queue, first come first served, before any
  engine sees it.

For each quiet tenant (one per phase): TTFT in engine steps (the gateways' per-tenant
window, ``/admin/api/latency``) and TTFT at the client, p50 and max.

    python benchmarks/fairness_ray.py --out docs/benchmarks/fairness_ray   # ~6 min, 2 cores
    python benchmarks/fairness_ray.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, command_line, pyplot, save_figure, write_json  # noqa: E402
from _scaleout import RayCluster, ray_env, replica_stats  # noqa: E402
from _server_process import free_port  # noqa: E402

from loraplex.registry import db, service  # noqa: E402
from loraplex.testing import (  # noqa: E402
    bootstrap_admin,
    postgres_schema,
    redis_key_prefix,
    redis_url_for_tests,
)

PHASES = ("alone", "engine backlog", "router backlog")
QUIET_PROMPT = "Name three colours. " * 4
NOISY_PROMPT = "Write a long story about a ship and its crew. " * 4


def _tenants(db_url: str) -> tuple[str, dict[str, str]]:
    admin_key = bootstrap_admin(db_url)
    keys: dict[str, str] = {}
    engine = db.make_engine(db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            for name in ("noisy", *(f"quiet-{i}" for i in range(len(PHASES)))):
                tenant = service.create_tenant(session, name)
                keys[name] = service.create_key(session, tenant.id)[1]
    finally:
        engine.dispose()
    return admin_key, keys


async def _quiet(url: str, key: str, n: int) -> list[float]:
    """n short streamed requests one after another; each one's client TTFT in seconds."""
    ttfts = []
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        for _ in range(n):
            start = time.perf_counter()
            body = {"model": "demo", "prompt": QUIET_PROMPT, "max_tokens": 8,
                    "temperature": 0, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                first: float | None = None
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - start
            ttfts.append(first if first is not None else float("nan"))
            await asyncio.sleep(0.3)
    return ttfts


async def _noisy(url: str, key: str, in_flight: int, stop: asyncio.Event) -> int:
    """Keeps ``in_flight`` requests open until ``stop``; returns how many finished."""
    done = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            body = {"model": "demo", "prompt": NOISY_PROMPT, "max_tokens": 48,
                    "temperature": 0, "ignore_eos": True}
            response = await http.post("/v1/completions", json=body)
            if response.status_code == 200:
                done += 1
            else:  # 503 past the gateway's queue: back off a little
                await asyncio.sleep(0.2)

    limits = httpx.Limits(max_connections=in_flight + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        await asyncio.gather(*(worker(http) for _ in range(in_flight)))
    return done


async def _phases(gateways: list[str], keys: dict[str, str], args: argparse.Namespace,
                  ) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, phase in enumerate(PHASES):
        backlog = {"alone": 0, "engine backlog": args.engine_backlog,
                   "router backlog": args.router_backlog}[phase]
        stop = asyncio.Event()
        noisy = asyncio.create_task(_noisy(gateways[0], keys["noisy"], backlog, stop)) \
            if backlog else None
        if noisy is not None:
            await asyncio.sleep(args.warmup_s)  # the backlog builds up
        ttfts = await _quiet(gateways[1], keys[f"quiet-{i}"], args.num_quiet)
        stop.set()
        finished = await noisy if noisy is not None else 0
        out[phase] = {"noisy_in_flight": backlog, "noisy_finished": finished,
                      "client_ttft_s": ttfts}
        print(f"  {phase}: quiet TTFT at the client p50 {statistics.median(ttfts):.2f} s, "
              f"max {max(ttfts):.2f} s", flush=True)
    return out


def _start_gateways(args: argparse.Namespace, policy: str, cluster: RayCluster,
                    model: str, db_url: str, prefix: str, env: dict[str, str],
                    logs: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs, urls = [], []
    for i in range(2):
        port = free_port()
        argv = [str(Path(sys.executable).parent / "loraplex"), "serve", "--backend", "ray",
                "--replicas", "2", "--replica-cpus", "0.5", "--ray-address", cluster.address,
                "--model", model, "--served-model-name", "demo", "--database-url", db_url,
                "--adapter-dir", str(logs / f"store-{policy}"), "--redis-url", redis_url_for_tests(),
                "--redis-key-prefix", prefix, "--scheduling-policy", policy,
                "--max-num-seqs", str(args.max_num_seqs), "--port", str(port),
                "--log-level", "warning"]
        with open(logs / f"{policy}-gw{i}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 900
        while True:  # the first deploys the replicas, the second attaches to them
            if procs[-1].poll() is not None:
                raise RuntimeError(f"gateway {i} exited: "
                                   + (logs / f"{policy}-gw{i}.log").read_text()[-2000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{urls[-1]}/ready", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway {i} not ready in 900 s")
            time.sleep(1)
    return procs, urls


def run_policy(args: argparse.Namespace, policy: str, model: str, logs: Path,
               ) -> dict[str, Any]:
    cluster_env = ray_env()  # the gateways join with the cluster's token
    env = {**os.environ, **cluster_env, "LORAPLEX_CACHE_SALT_SECRET": "fairness-ray-bench",
           "LORAPLEX_HOME": str(logs / "home")}
    cluster = RayCluster(2, logs / f"{policy}-ray.log", cluster_env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cluster.wait_ready()
        with postgres_schema(f"fairray{policy}") as db_url, \
                redis_key_prefix(f"fairray{policy}") as prefix:
            admin_key, keys = _tenants(db_url)
            procs, urls = _start_gateways(args, policy, cluster, model, db_url, prefix,
                                          env, logs)
            phases = asyncio.run(_phases(urls, keys, args))
            latency = httpx.get(f"{urls[1]}/admin/api/latency", timeout=30, headers={
                "Authorization": f"Bearer {admin_key}"}).json()["data"]
            by_tenant = {t["tenant"]: t for t in latency}
            for i, phase in enumerate(PHASES):
                t = by_tenant.get(f"quiet-{i}", {})
                phases[phase].update(ttft_steps_p50=t.get("ttft_steps_p50"),
                                     ttft_steps_p99=t.get("ttft_steps_p99"))
            replicas = replica_stats(redis_url_for_tests(), prefix)
            service_by_replica = {o: {t["tenant"]: t["prefill_tokens"] + t["decode_tokens"]
                                      for t in s["tenants"]} for o, s in replicas.items()}
            return {"phases": phases, "service_tokens_by_replica": service_by_replica}
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--engine-backlog", type=int, default=24,
                   help="noisy requests in flight, fewer than the replicas accept")
    p.add_argument("--router-backlog", type=int, default=64,
                   help="noisy requests in flight, more than the replicas accept")
    p.add_argument("--num-quiet", type=int, default=8)
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--quick", action="store_true")
    add_out_argument(p, "fairness_ray")
    args = p.parse_args()
    if args.quick:
        args.num_quiet, args.warmup_s = 3, 4.0
    from loraplex.cli_engine import model_arg

    model = model_arg(None)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fairray-") as tmp:
        for policy in ("fifo", "fair"):
            print(f"{policy}:", flush=True)
            results[policy] = run_policy(args, policy, model, Path(tmp))
    print(f"\n{'phase':>16} {'policy':>6}  TTFT steps p50/p99   client TTFT p50 / max")
    for phase in PHASES:
        for policy in ("fifo", "fair"):
            r = results[policy]["phases"][phase]
            print(f"{phase:>16} {policy:>6}  {r['ttft_steps_p50']!s:>5} / "
                  f"{r['ttft_steps_p99']!s:<8}  {statistics.median(r['client_ttft_s']):6.2f}"
                  f" / {max(r['client_ttft_s']):6.2f} s")
    out = Path(args.out)
    write_json(out, {"command": command_line("fairness_ray.py", args), "max_num_seqs": args.max_num_seqs,
                     "replicas": 2, "gateways": 2, "results": results})
    _plot(results, out.with_suffix(".png"))


def _plot(results: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for k, policy in enumerate(("fifo", "fair")):
        values = [statistics.median(results[policy]["phases"][p]["client_ttft_s"])
                  for p in PHASES]
        ax.bar([i + (k - 0.5) * width for i in range(len(PHASES))], values, width,
               label=policy)
    ax.set_xticks(range(len(PHASES)), PHASES)
    ax.set_ylabel("quiet tenant's TTFT p50 (s)")
    ax.set_title("Two Ray replicas, noisy tenant through gateway 0, quiet through gateway 1")
    ax.legend()
    save_figure(fig, out)


if __name__ == "__main__":
    main()
