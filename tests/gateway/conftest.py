"""Live gateway servers for the HTTP tests: real uvicorn, real engine, real databases.

``live`` is the main server: the tiny Llama, a PostgreSQL registry (a schema of its own),
rate limits in the real Redis (a key prefix of its own), tenants and adapters created
through the registry's services and CLI. ``fuzz_live`` is a smaller server, once on SQLite
and once on PostgreSQL, with the in-process rate limiter, for the fuzzing runs. All run
uvicorn on a background thread, on a socket bound to a free port of 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from sqlalchemy.orm import Session

from loraplex.cli_registry import run_registry_cli
from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RegistryConfig,
    SchedulerConfig,
    ServerConfig,
)
from loraplex.engine.client import EngineClient
from loraplex.gateway.app import create_app
from loraplex.registry import db, service
from loraplex.testing import (
    bootstrap_admin,
    postgres_schema,
    redis_key_prefix,
    redis_url_for_tests,
)

REDIS_URL = redis_url_for_tests()
SERVED_NAME = "tiny-llama"
WINDOW_S = 4.0  # rate-limit window of the main server, short so recovery is testable
MAX_TOKENS_LIMIT = 400
MAX_BODY_BYTES = 64 * 1024

# Tenants of the main server: name -> (requests/min, tokens/min, concurrency).
TENANT_LIMITS: dict[str, tuple[int | None, int | None, int | None]] = {
    "alice": (None, None, None),
    "bob": (None, None, None),
    "carol": (None, None, None),
    "erin": (None, None, None),  # only test_usage_is_metered calls as erin
    "frank": (None, None, None),  # owns the tampered adapter of test_bad_inputs
    "rl-rpm": (3, None, None),
    "rl-tpm": (None, 300, None),
    "rl-conc": (None, None, 3),
}


@dataclass
class LiveServer:
    """A running gateway and what the tests need to call it."""

    url: str
    client: EngineClient
    model_dir: Path
    db_url: str
    served_name: str = SERVED_NAME
    window_s: float = WINDOW_S
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    max_body_bytes: int = MAX_BODY_BYTES
    keys: dict[str, str] = field(default_factory=dict)  # tenant name -> key
    key_ids: dict[str, int] = field(default_factory=dict)
    admin_key: str = ""
    adapter_store: Path | None = None
    adapter_dirs: dict[str, Path] = field(default_factory=dict)  # model name -> folder

    def openai(self, tenant: str | None = None, *, key: str | None = None,
               **kwargs: Any) -> openai.OpenAI:
        """An OpenAI client as ``tenant`` (no retries: a 429 must reach the test)."""
        api_key = key if key is not None else self.keys[tenant or "alice"]
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=60, **kwargs)

    def async_openai(self, tenant: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant],
                                  max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def engine_stats(self) -> dict[str, Any]:
        with self.http() as http:
            response = http.get("/admin/api/engine",
                                headers={"Authorization": f"Bearer {self.admin_key}"})
            response.raise_for_status()
            data: dict[str, Any] = response.json()
            return data

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """Polls the engine until no request runs and no KV block is referenced."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine_stats()
            idle = (stats["num_running"] == 0 and stats["num_waiting"] == 0
                    and stats["kv_blocks_used"] == 0 and stats["num_unfinished"] == 0)
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


class _ThreadedUvicorn:
    def __init__(self, app: Any, graceful_s: float = 5) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=graceful_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(model_dir)),
        CacheConfig(block_size=16, num_kv_blocks=256),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
    )


def _add_adapter(db_url: str, adapter_dir: Path, model_dir: Path, tenant: str, name: str,
                 source: Path, public: bool = False) -> None:
    argv = ["adapters", "add", "--tenant", tenant, "--name", name, str(source),
            "--database-url", db_url, "--adapter-dir", str(adapter_dir),
            "--model", str(model_dir)] + (["--public"] if public else [])
    assert run_registry_cli(argv) == 0


@pytest.fixture(scope="session")
def postgres_schema_url() -> Iterator[str]:
    """A fresh schema in the test PostgreSQL, dropped at the end."""
    with postgres_schema("gateway") as url:
        yield url


@pytest.fixture(scope="session")
def redis_prefix() -> Iterator[str]:
    """A Redis key prefix of this run; its keys are deleted at the end."""
    with redis_key_prefix("gateway") as prefix:
        yield prefix


def _start(app: Any, graceful_s: float = 5) -> _ThreadedUvicorn:
    server = _ThreadedUvicorn(app, graceful_s)
    server.start()
    return server


@pytest.fixture(scope="session")
def live(tiny_llama_dir: Path, llama_adapters: dict[str, Path], postgres_schema_url: str,
         redis_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The main server (PostgreSQL + Redis) with tenants alice, bob, carol, the rl-*
    tenants, and adapters: alice's private ``sql`` (r4) and public ``summarizer`` (r8qv),
    bob's private ``secret`` (r16rs)."""
    db_url = postgres_schema_url
    adapter_dir = tmp_path_factory.mktemp("gateway_store")
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    server_live = LiveServer("", None, tiny_llama_dir, db_url)  # type: ignore[arg-type]
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            for name, (rpm, tpm, conc) in TENANT_LIMITS.items():
                tenant = service.create_tenant(session, name, max_requests_per_minute=rpm,
                                               max_tokens_per_minute=tpm,
                                               max_concurrent_requests=conc)
                row, key = service.create_key(session, tenant.id)
                server_live.keys[name] = key
                server_live.key_ids[name] = row.id
            admin = service.create_tenant(session, "ops")
            _, server_live.admin_key = service.create_key(session, admin.id, role="admin")
    finally:
        engine.dispose()
    for tenant, name, spec, public in (("alice", "sql", "r4", False),
                                       ("alice", "summarizer", "r8qv", True),
                                       ("bob", "secret", "r16rs", False)):
        _add_adapter(db_url, adapter_dir, tiny_llama_dir, tenant, name, llama_adapters[spec],
                     public)
        server_live.adapter_dirs[f"{tenant}/{name}"] = llama_adapters[spec]
    config = ServerConfig(redis_url=REDIS_URL, served_model_name=SERVED_NAME,
                          max_body_bytes=MAX_BODY_BYTES, max_tokens_limit=MAX_TOKENS_LIMIT,
                          max_n=4, rate_limit_window_s=WINDOW_S,
                          rate_limit_key_prefix=redis_prefix, usage_flush_interval_s=0.2)
    client = EngineClient.from_config(engine_config(tiny_llama_dir))
    app = create_app(config, RegistryConfig(db_url, str(adapter_dir)), client)
    server = _start(app)
    server_live.url = f"http://127.0.0.1:{server.port}"
    server_live.client = client
    server_live.adapter_store = adapter_dir
    try:
        yield server_live
    finally:
        server.stop()
        client.close()


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def fuzz_live(request: pytest.FixtureRequest, tiny_llama_dir: Path,
              llama_adapters: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A small server for fuzzing, once on SQLite and once on PostgreSQL (what the one
    accepts, the other must too): in-process limiter, max_tokens <= 4, n <= 2. Tenant
    ``fuzzer`` and an admin key (``ops``); ``/v1/load_lora_adapter`` may read the folder
    ``allowed``, which holds the adapter ``r4``."""
    root = tmp_path_factory.mktemp(f"fuzz_{request.param}")
    shutil.copytree(llama_adapters["r4"], root / "allowed" / "r4")
    with contextlib.ExitStack() as stack:
        db_url = (f"sqlite:///{root / 'registry.db'}" if request.param == "sqlite"
                  else stack.enter_context(postgres_schema("fuzz")))
        live_ = LiveServer("", None, tiny_llama_dir, db_url)  # type: ignore[arg-type]
        live_.admin_key = bootstrap_admin(db_url)
        engine = db.make_engine(db_url)
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                tenant = service.create_tenant(session, "fuzzer",
                                               max_requests_per_minute=100000)
                _, live_.keys["fuzzer"] = service.create_key(session, tenant.id)
        finally:
            engine.dispose()
        config = ServerConfig(served_model_name=SERVED_NAME, max_tokens_limit=4, max_n=2,
                              max_body_bytes=16 * 1024,
                              allowed_lora_dirs=(str(root / "allowed"),))
        client = EngineClient.from_config(engine_config(tiny_llama_dir))
        server = _start(create_app(config, RegistryConfig(db_url, str(root / "store")),
                                   client))
        live_.url = f"http://127.0.0.1:{server.port}"
        live_.client = client
        try:
            yield live_
        finally:
            server.stop()
            client.close()


@contextlib.contextmanager
def _serving(app: Any, graceful_s: float = 5) -> Iterator[str]:
    server = _start(app, graceful_s)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def serve_app() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """``with serve_app(app) as url:`` runs another app on a live uvicorn; at the end it
    waits ``graceful_s`` (keyword, default 5) for open requests, then cancels them."""
    return _serving


@dataclass
class OwnServer:
    """A server of a test's own (``own_server``): its URL and app, each tenant's key and
    registry id, and an admin key."""

    url: str
    app: Any
    keys: dict[str, str]
    tenant_ids: dict[str, int]
    admin_key: str

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        """GET ``path`` with ``key`` (default: the admin key)."""
        headers = {"Authorization": f"Bearer {key or self.admin_key}"}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=30)


@contextlib.contextmanager
def _own_server(root: Path, model_dir: Path, tenants: dict[str, dict[str, Any]],
                scheduler: SchedulerConfig, config: ServerConfig) -> Iterator[OwnServer]:
    root.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{root / 'registry.db'}"
    admin_key = bootstrap_admin(db_url)
    keys, ids = {}, {}
    engine = db.make_engine(db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            for name, settings in tenants.items():
                tenant = service.create_tenant(session, name, **settings)
                _, keys[name] = service.create_key(session, tenant.id)
                ids[name] = tenant.id
    finally:
        engine.dispose()
    client = EngineClient.from_config(EngineConfig(
        ModelConfig(str(model_dir)), CacheConfig(block_size=16, num_kv_blocks=256),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4), scheduler))
    app = create_app(config, RegistryConfig(db_url, str(root / "store")), client)
    try:
        with _serving(app) as url:
            yield OwnServer(url, app, keys, ids, admin_key)
    finally:
        client.close()


@pytest.fixture(scope="session")
def own_server() -> Callable[..., contextlib.AbstractContextManager[OwnServer]]:
    """``with own_server(root, model_dir, tenants, scheduler, config) as server:`` runs a
    server of its own: a SQLite registry under ``root`` holding ``tenants`` (name ->
    ``create_tenant`` settings) and an admin key, the model's engine with ``scheduler``,
    and the gateway with ``config``."""
    return _own_server


@pytest.fixture
def bearer() -> Callable[[str], dict[str, str]]:
    return lambda key: {"Authorization": f"Bearer {key}"}


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    """A session on a fresh SQLite registry at head."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with db.make_session_factory(engine)() as s:
            yield s
    finally:
        engine.dispose()
