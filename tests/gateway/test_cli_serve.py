"""``loraplex serve`` as users run it: a subprocess on SQLite with the in-process limiter,
then the admin key bootstrap on its own."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy.orm import Session

from loraplex.errors import ConfigError
from loraplex.gateway.auth import ensure_admin_key
from loraplex.registry import db, service


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, proc: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"loraplex serve exited with {proc.returncode}")
            try:
                if http.get(f"{url}/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise AssertionError("loraplex serve did not become ready")


def test_loraplex_serve_end_to_end(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env["LORAPLEX_HOME"] = str(tmp_path / "home")
    exe = shutil.which("loraplex")
    cmd = ([exe] if exe else [sys.executable, "-m", "loraplex.cli"]) + [
           "serve", "--model", str(tiny_llama_dir),
           "--port", str(port), "--num-kv-blocks", "64", "--served-model-name", "tiny",
           "--max-upload-bytes", "1000", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        assert proc.stdout is not None
        admin_key = proc.stdout.readline().strip()  # the bootstrap key, printed once
        assert admin_key.startswith("lpx-") and len(admin_key) >= 47
        with openai.OpenAI(base_url=f"{url}/v1", api_key=admin_key, max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["tiny"]
            result = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
            assert result.usage is not None and result.usage.completion_tokens <= 3
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="nope", prompt="hello", max_tokens=3)
        # --max-upload-bytes reaches the upload pipeline: 2 KB is refused before reading.
        big = httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {admin_key}"},
                         files={"adapter_model.safetensors": ("adapter_model.safetensors",
                                                              b"\0" * 2000)},
                         data={"name": "big"}, timeout=30)
        assert big.status_code == 413, big.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, err
    # The database and the usage written at shutdown are in LORAPLEX_HOME's SQLite file.
    engine = db.make_engine(f"sqlite:///{tmp_path / 'home' / 'loraplex.db'}")
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            admin = service.get_tenant_by_name(session, "admin")
            assert service.usage_totals(session, admin.id).requests == 1
    finally:
        engine.dispose()


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with db.make_session_factory(engine)() as s:
            yield s
    finally:
        engine.dispose()


def test_admin_key_is_created_once(session: Session) -> None:
    key = ensure_admin_key(session, None)
    assert key is not None and key.startswith("lpx-")
    assert ensure_admin_key(session, None) is None
    principal = service.authenticate(session, key)
    assert principal is not None and principal.is_admin


def test_admin_key_from_the_environment(session: Session) -> None:
    key = "lpx-" + "a" * 43
    assert ensure_admin_key(session, key) is None
    assert ensure_admin_key(session, key) is None  # idempotent
    principal = service.authenticate(session, key)
    assert principal is not None and principal.is_admin
    # With an admin key present, no other is created on a start without the variable.
    assert ensure_admin_key(session, None) is None
    service.revoke_key(session, principal.key_id)
    with pytest.raises(ConfigError, match="revoked"):
        ensure_admin_key(session, key)


@pytest.mark.parametrize("key", ["short", "lpx-short", "x" * 60])
def test_weak_admin_key_is_refused(session: Session, key: str) -> None:
    with pytest.raises(ConfigError, match="LORAPLEX_ADMIN_KEY"):
        ensure_admin_key(session, key)
