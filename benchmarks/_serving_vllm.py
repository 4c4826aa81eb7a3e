"""The serving benchmark with vLLM's OpenAI server as the peer: both servers up side by
side, each rate's stream sent to one and then the other, then their greedy agreement."""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _log import log
from _server_process import free_port
from _serving_agreement import compare_outputs
from _serving_bench import Bench
from _serving_metrics import engine_stats
from _serving_server import SETUPS, Server, max_model_len
from _vllm_serve import VllmServer, vllm_python, vllm_stats


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
