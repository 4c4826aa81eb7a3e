"""One serving run's measuring harness: what every server is measured with (the tenants,
adapters and streams), its warm-up, and one rate's stream sent, summarised and logged."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from _log import log
from _serving_client import run_stream
from _serving_metrics import engine_delta, fmt_ms, summarise
from _serving_server import Server
from _serving_workload import Adapter, Call, Tenant, warmup_calls
from _vllm_serve import VllmServer


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
