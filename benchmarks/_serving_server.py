"""``loraplex serve`` as the serving benchmark runs it: the server configurations (chunked
prefill x prefix caching), the registry it is given (tenants, keys, adapters, through the
``loraplex`` CLI in this process) and the server subprocess itself."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _log import log
from _server_process import ServerProcess, free_port
from _serving_workload import Adapter, Tenant


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


def max_model_len(args: argparse.Namespace) -> int:
    """The longest request of the run: with the vLLM peer, both servers' context length."""
    return args.system_prompt_tokens + args.max_prompt + args.max_output


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
