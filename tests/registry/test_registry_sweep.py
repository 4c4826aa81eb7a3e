"""Crash recovery: processes killed with SIGKILL at each stage of an upload leave nothing
behind once the sweep has run past the grace period, and the sweep never touches an
upload in progress in any process, on SQLite and PostgreSQL.

The stages are driven for real: a ``loraplex serve`` killed while it receives an upload,
the upload pipeline in a subprocess killed mid-copy and between the store's rename and the
registry's commit, ``loraplex adapters add`` killed mid-copy; then a restarted server
sweeps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from servers import wait_ready
from sqlalchemy.orm import Session, sessionmaker

from loraplex.adapter_format import folder_digest
from loraplex.registry import db, service
from loraplex.registry.models import Adapter
from loraplex.registry.ownership import open_store
from loraplex.registry.store import AdapterStore
from loraplex.registry.sweep import sweep_store

pytestmark = pytest.mark.server

BIG = 96 << 20  # large enough that a copy takes many milliseconds to observe and cut
GRACE_S = 1.0
ENV = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}


def _loraplex() -> list[str]:
    exe = shutil.which("loraplex")
    return [exe] if exe else [sys.executable, "-m", "loraplex.cli"]


def _tmp_entries(store: AdapterStore) -> list[Path]:
    tmp = store.root / ".tmp"
    return sorted(tmp.iterdir()) if tmp.is_dir() else []


def _rows(factory: sessionmaker[Session]) -> list[Adapter]:
    with factory() as session:
        return list(session.scalars(sa.select(Adapter).order_by(Adapter.id)))


def assert_clean(store: AdapterStore, factory: sessionmaker[Session]) -> None:
    """No staging file, no folder no row names, and every row's files are whole."""
    assert _tmp_entries(store) == []
    rows = _rows(factory)
    assert store.stored_digests() == sorted({r.digest for r in rows if r.status == "active"})
    for row in rows:
        assert folder_digest(store.resolve(row.storage_path)) == row.digest


def _wait_for(predicate: Callable[[], object], what: str, timeout_s: float = 60) -> None:
    """Polls ``predicate`` until true. A predicate that lists the store can race the sweep
    it waits for (a folder removed between its listing and its scan): not true yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


# The upload pipeline in a process of its own, stopped at a stage by the parent's SIGKILL.
DRIVER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from loraplex.registry import db
    from loraplex.registry.ownership import open_store
    url, root, stage, src, marker = sys.argv[1:6]
    store = open_store(db.make_session_factory(db.make_engine(url)), root, url)
    if stage == "copy":
        store.put_dir(src)
        raise SystemExit("the copy finished before it was killed")
    from loraplex.model.adapter_loader import TargetShapes, validate_adapter_dir
    from loraplex.registry.upload import AdapterUploader
    target = TargetShapes.from_model_dir(sys.argv[6])
    uploader = AdapterUploader(store, lambda p: validate_adapter_dir(p, target, 16),
                               base_model="tiny")

    def stop(session, row):  # inside the row's transaction: flushed, not committed
        Path(marker + ".part").write_text(row.digest)
        os.replace(marker + ".part", marker)  # the parent never reads half of it
        time.sleep(600)

    engine = db.make_engine(url)
    uploader.upload_path(db.make_session_factory(engine), tenant_id=int(sys.argv[7]),
                         name="crashed", path=src, on_registered=stop)
""")


def _big_source(tmp_path: Path) -> Path:
    src = tmp_path / "big"
    src.mkdir()
    with open(src / "adapter_model.safetensors", "wb") as f:
        f.truncate(BIG)  # never validated: the copy is cut before
    (src / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    return src


def _partial(folder_glob: str, root: Path) -> Callable[[], bool]:
    def check() -> bool:
        # Only the big file's copies count (the small adapters' files are whole at once).
        return any(BIG // 100 < p.stat().st_size < BIG for p in root.glob(folder_glob))
    return check


def crash_mid_copy(url: str, store: AdapterStore, src: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, url, str(store.root), "copy",
                             str(src), "-"], env=ENV)
    try:
        _wait_for(_partial(".tmp/*/adapter_model.safetensors", store.root),
                  "put_dir to be mid-copy")
    finally:
        _kill(proc)


def crash_before_commit(url: str, store: AdapterStore, src: Path, model_dir: Path,
                        tenant_id: int, tmp_path: Path) -> str:
    marker = tmp_path / "registered"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, url, str(store.root), "commit",
                             str(src), str(marker), str(model_dir), str(tenant_id)], env=ENV)
    try:
        _wait_for(marker.exists, "the row to be flushed", timeout_s=120)
    finally:
        _kill(proc)
    return marker.read_text()


def crash_cli_mid_copy(url: str, store: AdapterStore, src: Path, model_dir: Path) -> None:
    proc = subprocess.Popen(_loraplex() + [
        "adapters", "add", "--tenant", "acme", "--name", "cli", str(src),
        "--database-url", url, "--adapter-dir", str(store.root), "--model", str(model_dir)],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(_partial(".tmp/upload-*/in/adapter_model.safetensors", store.root),
                  "the CLI to be mid-copy", timeout_s=120)
    finally:
        _kill(proc)


class Server:
    """``loraplex serve`` as a subprocess, sweeping with a tiny grace period."""

    def __init__(self, url: str, store: AdapterStore, model_dir: Path, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.admin_key = service.generate_key()
        env = dict(ENV, LORAPLEX_ADMIN_KEY=self.admin_key)
        self.proc = subprocess.Popen(_loraplex() + [
            "serve", "--model", str(model_dir), "--port", str(port), "--num-kv-blocks", "32",
            "--database-url", url, "--adapter-dir", str(store.root),
            "--sweep-grace-s", str(GRACE_S), "--sweep-interval-s", "0.2",
            "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
        wait_ready(self.base, self.proc)

    def slow_upload(self, src: Path, release: threading.Event,
                    result: list[httpx.Response]) -> threading.Thread:
        """Posts ``src`` as a multipart upload that stalls halfway until ``release``."""
        request = httpx.Request("POST", f"{self.base}/v1/adapters", data={"name": "slow"},
                                files={n: (n, (src / n).read_bytes()) for n in
                                       ("adapter_config.json", "adapter_model.safetensors")},
                                headers={"Authorization": f"Bearer {self.admin_key}"})
        body = request.read()

        def chunks() -> Iterator[bytes]:
            yield body[:len(body) // 2]
            release.wait(120)
            yield body[len(body) // 2:]

        def send() -> None:
            try:
                result.append(httpx.post(request.url, content=chunks(),
                                         headers=dict(request.headers), timeout=120))
            except httpx.TransportError:
                pass  # the server was killed under it

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                _kill(self.proc)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(params=["sqlite", "postgres"])
def registry(request: pytest.FixtureRequest, tmp_path: Path,
             make_postgres_schema: Callable[[str], str]) -> Iterator[str]:
    url = (f"sqlite:///{tmp_path / 'registry.db'}" if request.param == "sqlite"
           else make_postgres_schema("crash"))
    db.upgrade(url)
    yield url


@pytest.mark.slow
def test_kill_at_every_stage_then_restart_leaves_nothing(
        registry: str, tmp_path: Path, tiny_llama_dir: Path,
        llama_adapters: dict[str, Path]) -> None:
    url = registry
    engine = db.make_engine(url)
    factory = db.make_session_factory(engine)
    store = open_store(factory, tmp_path / "store", url)
    try:
        with db.transaction(factory) as session:
            tenant_id = service.create_tenant(session, "acme").id
        big = _big_source(tmp_path)

        # 1. A server killed while it receives an upload: its staging file stays.
        server = Server(url, store, tiny_llama_dir, _free_port())
        try:
            release, result = threading.Event(), list[httpx.Response]()
            server.slow_upload(llama_adapters["r4"], release, result)
            _wait_for(lambda: list(store.root.glob(".tmp/upload-*/in/*")),
                      "the server to be receiving")
        finally:
            _kill(server.proc)
            release.set()
        # 2. The pipeline killed mid-copy, 3. between the rename and the commit, 4. the
        # CLI killed mid-copy.
        crash_mid_copy(url, store, big)
        digest = crash_before_commit(url, store, llama_adapters["r8qv"], tiny_llama_dir,
                                     tenant_id, tmp_path)
        crash_cli_mid_copy(url, store, big, tiny_llama_dir)
        assert len(_tmp_entries(store)) >= 4  # staging and copies of all four
        assert store.exists(digest) and _rows(factory) == []  # an orphan, no half row

        # A restarted server sweeps at start and then periodically; meanwhile an upload
        # stalled for longer than the grace period is in progress and must survive.
        server = Server(url, store, tiny_llama_dir, _free_port())
        try:
            release, result = threading.Event(), list[httpx.Response]()
            thread = server.slow_upload(llama_adapters["r16rs"], release, result)
            _wait_for(lambda: list(store.root.glob(".tmp/upload-*/in/*")) and
                      not store.exists(digest) and len(_tmp_entries(store)) == 1,
                      "the sweep to remove the crash leftovers", timeout_s=30)
            staging = _tmp_entries(store)[0]
            old = time.time() - 3600
            os.utime(staging, (old, old))  # stale by its age: only its lock protects it
            time.sleep(4 * GRACE_S)
            # Another process sharing the store sweeps too, with no grace at all.
            assert sweep_store(factory, store, grace_s=0).num_tmp_removed == 0
            assert _tmp_entries(store) == [staging]
            release.set()
            thread.join(60)
            assert result and result[0].status_code == 201, result
        finally:
            server.stop()
        assert [r.name for r in _rows(factory)] == ["slow"]
        time.sleep(GRACE_S)
        sweep_store(factory, store, grace_s=GRACE_S)
        assert_clean(store, factory)
    finally:
        engine.dispose()


def test_orphan_found_by_an_upload_is_not_swept(
        tmp_path: Path, make_adapter: Callable[..., Path],
        session_factory: sessionmaker[Session]) -> None:
    """An old orphan that an upload in flight deduplicates against is renewed by it, so a
    sweep between that upload's put and its commit keeps it."""
    store = open_store(session_factory, tmp_path / "store", "sqlite://")
    src = make_adapter()
    orphan = store.put_dir(src)
    old = time.time() - 7200
    os.utime(orphan.path, (old, old))
    again = store.put_dir(src)  # an upload about to commit a row naming it
    assert not again.created
    assert sweep_store(session_factory, store, grace_s=3600).orphans_removed == ()
    os.utime(orphan.path, (old, old))
    assert sweep_store(session_factory, store, grace_s=3600).orphans_removed == (
        orphan.digest,)
    assert_clean(store, session_factory)
