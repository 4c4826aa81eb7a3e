"""Ray mode of ``benchmarks/serving.py``: a loopback Ray cluster it starts and stops, the
replicas' own figures from Redis, and the adapter-affinity workload.

The cluster is ``ray start --head --block`` on 127.0.0.1 with token authentication (as
docs/scale-out.md asks of every cluster), its own port and temp dir; stopping it is a
SIGTERM to that one process (never ``ray stop``, which would stop every cluster on the
machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _server_process import ServerProcess, free_port  # noqa: E402

from loraplex.testing import process_descendants  # noqa: E402


def ray_env() -> dict[str, str]:
    """What both the cluster and the gateways that join it need in their environment."""
    # Without the first, Ray binds a non-loopback address even when told 127.0.0.1.
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32)}


class RayCluster:
    """A one-node Ray cluster on loopback, owned by this process."""

    def __init__(self, num_cpus: int, log_path: Path, env: dict[str, str],
                 object_store_bytes: int = 200 << 20) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Short: Ray's AF_UNIX socket paths under it must stay within 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="lpxray-", dir="/tmp"))
        temp_dir = self.temp_dir
        self.log_path = log_path
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        ray_bin = str(Path(sys.executable).parent / "ray")
        self.proc = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={self.port}", f"--num-cpus={num_cpus}",
             f"--object-store-memory={object_store_bytes}", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={temp_dir}",
             f"--ray-client-server-port={free_port()}"],
            # No drain on SIGTERM: the gateway has stopped by then, nothing is in flight
            # (the default waits 30 s for a drain).
            env={**os.environ, **env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited ({self.proc.returncode}):\n"
                                   + self.log_path.read_text()[-2000:])
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray cluster did not start in {timeout:.0f} s")
            time.sleep(0.2)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM to our ``ray start --block`` (it takes its cluster down), then SIGKILL to
        its process group after ``timeout``, and to any process it started that outlived
        it (some agents and workers leave its process group)."""
        spawned = process_descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in spawned:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return self.proc.returncode


# --- the replicas' own figures --------------------------------------------------------------


def stats_key(prefix: str) -> str:
    """The hash every replica writes its EngineStats to (see loraplex/engine/ray_backend.py):
    ``{--redis-key-prefix}replicas:`` + ``{app name}:stats``."""
    return f"{prefix}replicas:loraplex:stats"


def replica_stats(redis_url: str, prefix: str, fresh_s: float = 5.0) -> dict[int, dict[str, Any]]:
    """Ordinal -> the EngineStats fields (plus ``pid``) each live replica last published."""
    import redis

    with redis.Redis.from_url(redis_url) as r:
        raw = r.hgetall(stats_key(prefix))
    out: dict[int, dict[str, Any]] = {}
    for ordinal, value in raw.items():
        record = json.loads(value)
        if time.time() - float(record["at"]) <= fresh_s:
            out[int(ordinal)] = {"pid": record["pid"], **json.loads(record["stats"])}
    return out


def settled_replica_stats(redis_url: str, prefix: str, num_replicas: int,
                          timeout: float = 30) -> dict[int, dict[str, Any]]:
    """The figures once every replica has published after this call (they publish each
    second), so counters include everything that finished before it."""
    t0 = time.time()
    deadline = time.monotonic() + timeout
    while True:
        import redis

        with redis.Redis.from_url(redis_url) as r:
            raw = r.hgetall(stats_key(prefix))
        records = {int(k): json.loads(v) for k, v in raw.items()}
        fresh = {k: v for k, v in records.items() if float(v["at"]) > t0 + 0.05}
        if len(fresh) >= num_replicas:
            return {k: {"pid": v["pid"], **json.loads(v["stats"])} for k, v in fresh.items()}
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(fresh)} of {num_replicas} replicas published "
                               f"stats within {timeout:.0f} s")
        time.sleep(0.2)


def summed(per_replica: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Counters summed over replicas, in the shape ``/admin/api/engine`` answers."""
    out: dict[str, Any] = {}
    for stats in per_replica.values():
        for name, value in stats.items():
            if name != "pid" and isinstance(value, int | float) and not isinstance(value, bool):
                out[name] = out.get(name, 0) + value
    return out


def hit_rate(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]],
             adapter_requests: int) -> dict[str, Any]:
    """Adapter hits from the replicas' ``adapter_disk_loads`` deltas: a request whose
    replica already held its adapter (in device slots or host cache) reads nothing from
    disk, so hits = adapter requests - disk loads."""
    loads = {k: int(after[k]["adapter_disk_loads"]) - int(before.get(k, {}).get(
        "adapter_disk_loads", 0)) for k in sorted(after)}
    total = sum(loads.values())
    # Disk reads and slot installs alike (the engine sums both).
    seconds = sum(float(after[k]["adapter_load_seconds"]) - float(before.get(k, {}).get(
        "adapter_load_seconds", 0.0)) for k in after)
    return {"adapter_requests": adapter_requests, "disk_loads_per_replica": loads,
            "disk_loads": total, "adapter_load_seconds": seconds,
            "loads_per_request": total / adapter_requests if adapter_requests else 0.0,
            "hit_rate": 1 - total / adapter_requests if adapter_requests else 0.0}


# --- a gateway in front of the replicas -----------------------------------------------------


class Gateway(ServerProcess):
    """``loraplex serve`` (``argv``, less ``--port``) logging to ``log_path``."""

    name = "the gateway"

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log_path: Path,
                 ) -> None:
        super().__init__(port, log_path)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([*argv, "--port", str(port)], env=env, stdout=log,
                                         stderr=log)

    def stop(self) -> None:
        """SIGINT (a clean stop), then SIGKILL after 60 s."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tenant_keys(db_url: str, tenants: int) -> list[str]:
    """One API key for each of ``tenants`` new tenants (t0, t1, ...) in the registry."""
    from loraplex.registry import db, service

    engine = db.make_engine(db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            return [service.create_key(session, service.create_tenant(session, f"t{t}").id)[1]
                    for t in range(tenants)]
    finally:
        engine.dispose()


@contextlib.contextmanager
def ray_gateway(name: str, serve_args: list[str], model: str, logs: Path, num_tenants: int,
                secret: str) -> Iterator[tuple[Gateway, list[str], str]]:
    """A fresh loopback Ray cluster (2 CPUs) and one ``loraplex serve --backend ray``
    gateway on it (``serve_args`` add to the model, registry, Redis and cluster flags; a
    fresh PostgreSQL schema and Redis key prefix named for ``name``), with
    ``num_tenants`` tenants: (the gateway, their keys, the Redis prefix). All of it goes
    on exit."""
    from loraplex.registry import db
    from loraplex.testing import postgres_schema, redis_key_prefix, redis_url_for_tests

    cluster_env = ray_env()
    env = {**os.environ, **cluster_env, "LORAPLEX_CACHE_SALT_SECRET": secret,
           "LORAPLEX_HOME": str(logs / "home")}
    cluster = RayCluster(2, logs / f"{name}-ray.log", cluster_env)
    gateway: Gateway | None = None
    try:
        cluster.wait_ready()
        with postgres_schema(name) as db_url, redis_key_prefix(name) as prefix:
            db.upgrade(db_url)
            keys = tenant_keys(db_url, num_tenants)
            argv = [str(Path(sys.executable).parent / "loraplex"), "serve", "--backend", "ray",
                    "--ray-address", cluster.address, "--model", model,
                    "--served-model-name", "demo", "--database-url", db_url,
                    "--adapter-dir", str(logs / f"store-{name}"),
                    "--redis-url", redis_url_for_tests(), "--redis-key-prefix", prefix,
                    "--log-level", "warning", *serve_args]
            gateway = Gateway(argv, env, free_port(), logs / f"{name}-gateway.log")
            gateway.wait_ready(900)
            yield gateway, keys, prefix
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.stop()
