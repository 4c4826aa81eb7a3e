"""Ray mode of the serving benchmark (``--backend ray``): the in-process server and each Ray
Serve deployment in turn, on one registry and Redis; the per-request cost of the Ray path
(paired one-at-a-time probes) and the adapter hit rate on working sets, with and without
adapter affinity."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _log import log
from _scaleout import RayCluster, hit_rate, ray_env, settled_replica_stats, summed
from _serving_bench import Bench
from _serving_client import Record, one_request, run_stream
from _serving_metrics import engine_stats, fmt_ms, pct, probe_summary, summarise
from _serving_server import SETUPS, Server
from _serving_workload import Call, build_calls
from _workload import WorkloadSpec, make_workload


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
