"""``loraplex serve --backend ray`` refuses, in one line and before loading anything, what
several gateways cannot share, and a cluster it cannot reach; a refusal after it started a
local cluster leaves nothing of it behind."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from loraplex.registry import db
from loraplex.testing import postgres_schema, redis_key_prefix, redis_url_for_tests


def _serve(tmp_path: Path, *args: str, env: dict[str, str]) -> tuple[int, list[str], float]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    full_env.update(LORAPLEX_HOME=str(tmp_path / "home"), **env)
    started = time.monotonic()
    proc = subprocess.run([str(Path(sys.executable).parent / "loraplex"), "serve",
                           "--backend", "ray", "--port", "0", *args],
                          env=full_env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("loraplex: error")]
    return proc.returncode, lines, time.monotonic() - started


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_schema("rayrefuse") as url:
        yield url


def test_refuses_without_a_shared_salt_secret(tmp_path: Path, tiny_llama_dir: Path,
                                              pg_url: str) -> None:
    code, lines, _ = _serve(tmp_path, "--model", str(tiny_llama_dir), "--database-url", pg_url,
                            "--redis-url", redis_url_for_tests(), env={})
    assert code == 2 and len(lines) == 1
    assert "LORAPLEX_CACHE_SALT_SECRET" in lines[0]


def test_refuses_sqlite(tmp_path: Path, tiny_llama_dir: Path) -> None:
    code, lines, _ = _serve(tmp_path, "--model", str(tiny_llama_dir),
                            "--database-url", f"sqlite:///{tmp_path / 'r.db'}",
                            "--redis-url", redis_url_for_tests(),
                            env={"LORAPLEX_CACHE_SALT_SECRET": "s"})
    assert code == 2 and len(lines) == 1
    assert "PostgreSQL" in lines[0] and "SQLite" in lines[0]


def test_refuses_the_in_process_limiter(tmp_path: Path, tiny_llama_dir: Path,
                                        pg_url: str) -> None:
    code, lines, _ = _serve(tmp_path, "--model", str(tiny_llama_dir), "--database-url", pg_url,
                            env={"LORAPLEX_CACHE_SALT_SECRET": "s"})
    assert code == 2 and len(lines) == 1
    assert "Redis" in lines[0]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_an_unreachable_cluster_is_one_line_in_seconds(tmp_path: Path,
                                                       tiny_llama_dir: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with postgres_schema("rayunreachable") as url:
        code, lines, took = _serve(tmp_path, "--model", str(tiny_llama_dir),
                                   "--database-url", url, "--redis-url", redis_url_for_tests(),
                                   env={"LORAPLEX_CACHE_SALT_SECRET": "s",
                                        "LORAPLEX_RAY_ADDRESS": f"127.0.0.1:{port}"})
        # Refused before the registry was touched or Ray imported: nothing was migrated.
        engine = db.make_engine(url)
        try:
            assert db.current_revision(engine) is None
        finally:
            engine.dispose()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].count("cannot reach the Ray cluster") == 1
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused" in lines[0]
    assert took < 60


def _carrying(variable: str) -> list[int]:
    """The processes whose environment holds ``variable`` (``NAME=value``): Ray's processes
    inherit the gateway's, whatever their command line becomes."""
    needle = variable.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes() + b"\0":
                    found.append(int(entry.name))
    return found


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_a_model_the_replicas_cannot_load_is_named_in_one_line(
        tmp_path: Path, tiny_llama_dir: Path, pg_url: str) -> None:
    """The gateway reads only the config; the replicas fail on a truncated weights file,
    and the gateway's one line says which file and why (not Serve's bare "Failed to update
    the deployments"). The local cluster it started goes with it: no process, no session
    folder, no key in Redis."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    # Where Ray puts its folder (else /tmp/ray): short, as its socket paths must fit 107 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="lpx", dir="/tmp"))
    try:
        with redis_key_prefix("rayrefuse") as prefix:
            code, lines, _ = _serve(tmp_path, "--model", str(model), "--database-url", pg_url,
                                    "--redis-url", redis_url_for_tests(),
                                    "--redis-key-prefix", prefix,
                                    env={"LORAPLEX_CACHE_SALT_SECRET": "s",
                                         "RAY_TMPDIR": str(ray_tmp)})
            with redis.Redis.from_url(redis_url_for_tests()) as r:
                assert list(r.scan_iter(match=f"{prefix}*")) == []
        assert list(ray_tmp.iterdir()) == []
        assert _carrying(f"RAY_TMPDIR={ray_tmp}") == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 2 and len(lines) == 1, lines
    assert "the engine replicas did not start" in lines[0]
    assert f"{weights}: not a readable safetensors file" in lines[0]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
# Ray Serve's own models, on import.
@pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")
def test_a_foreign_replica_failure_is_named() -> None:
    """Serve's message for a constructor that raised something not ours: its first line,
    with the last exception of the traceback it carries. (Serve not started here: the
    message alone.)"""
    from loraplex.engine.ray_backend import _replica_failure

    text = ("Deploying application loraplex failed: Failed to update the deployments "
            "['engine'].\n\nThe deployment failed to start 3 times in a row. Error:\n"
            "Traceback (most recent call last):\n"
            '  File "/app/loraplex/model/loader.py", line 26, in load_hf_config\n'
            "    return AutoConfig.from_pretrained(str(path))\n"
            "ray.exceptions.RayTaskError(RuntimeError): \x1b[36mray::ServeReplica\x1b[39m\n"
            "ImportError: cannot import name 'CUDAProperties' from 'kernels' "
            "(/app/kernels/__init__.py)\n")
    line = _replica_failure(RuntimeError(text), "an-app-not-deployed")
    assert line == ("Deploying application loraplex failed: Failed to update the deployments "
                    "['engine']. (ImportError: cannot import name 'CUDAProperties' from "
                    "'kernels' (/app/kernels/__init__.py))")
    ours = text + "loraplex.errors.ModelLoadError: /m/model.safetensors: truncated\n"
    assert _replica_failure(RuntimeError(ours), "an-app-not-deployed") == \
        "/m/model.safetensors: truncated"


@pytest.mark.parametrize(("backend", "flags", "says"), [
    ("ray", ["--decode-replicas", "2"], "--decode-replicas needs --prefill-replicas"),
    ("ray", ["--replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"],
     "--replicas and --decode-replicas: give one"),
    ("ray", ["--prefill-replicas", "1", "--decode-replicas", "0"],
     "--decode-replicas must be at least 1"),
    ("ray", ["--prefill-replicas", "-1"], "--prefill-replicas must be at least 0"),
    ("local", ["--prefill-replicas", "1"], "need --backend ray"),
])
def test_disaggregation_flags_that_do_not_go_together(
        tmp_path: Path, tiny_llama_dir: Path, pg_url: str, backend: str, flags: list[str],
        says: str) -> None:
    code, lines, _ = _serve(tmp_path, "--model", str(tiny_llama_dir), "--database-url", pg_url,
                            "--redis-url", redis_url_for_tests(), "--backend", backend, *flags,
                            env={"LORAPLEX_CACHE_SALT_SECRET": "s"})
    assert code == 2 and len(lines) == 1, lines
    assert says in lines[0]
