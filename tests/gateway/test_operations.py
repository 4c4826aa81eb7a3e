"""Health, readiness, metrics and the OpenAPI document of a live server; engine overload."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError
from servers import wait_until

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
from loraplex.gateway.ratelimit import RedisRateLimiter, TenantLimits
from loraplex.registry import db, service
from loraplex.testing import bootstrap_admin, build_tiny_model

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


def test_health_and_ready_need_no_key(live: LiveServer) -> None:
    with live.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        ready = http.get("/ready")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "engine": True, "database": True,
                            "redis": True}


def test_openapi_document_describes_the_routes(live: LiveServer) -> None:
    with live.http() as http:
        doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/usage",
            "/health", "/ready", "/metrics", "/admin/api/engine"} <= set(doc["paths"])
    body = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert body["max_tokens"]["maximum"] == live.max_tokens_limit


def samples(live: LiveServer) -> dict[str, list[Any]]:
    with live.http() as http:
        response = http.get("/metrics", headers={"Authorization": f"Bearer {live.admin_key}"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_metrics_cover_requests_latency_engine_and_adapters(live: LiveServer) -> None:
    with live.openai("bob") as client:
        client.completions.create(model="secret", prompt="hello", max_tokens=3)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="alice/sql", prompt="hello", max_tokens=3)
    metrics = samples(live)
    requests = {(s.labels["tenant"], s.labels["adapter"], s.labels["status"]): s.value
                for s in metrics["loraplex_requests_total"]}
    # The version that served it: a canary split's sides are counted apart.
    assert requests[("bob", "bob/secret@1", "ok")] >= 1
    # The refused name is not a label value: unknown models are counted as "none".
    assert requests[("bob", "none", "client_error")] >= 1
    assert not any("alice/sql" in key[1] and key[0] == "bob" for key in requests)
    for histogram in ("loraplex_time_to_first_token_seconds",
                      "loraplex_time_per_output_token_seconds",
                      "loraplex_e2e_request_latency_seconds", "loraplex_adapter_load_seconds"):
        count = [s for s in metrics[f"{histogram}_count"]]
        assert count and count[0].value >= 1, histogram
    for gauge in ("loraplex_queue_depth", "loraplex_running_requests",
                  "loraplex_kv_blocks_used", "loraplex_kv_blocks_free",
                  "loraplex_prefix_cache_hit_rate"):
        assert gauge in metrics, gauge
    assert metrics["loraplex_kv_blocks_free"][0].value > 0
    assert metrics["loraplex_adapter_loads_total"][0].value >= 1
    assert "loraplex_adapter_evictions_total" in metrics


@contextlib.contextmanager
def small_server(model_dir: Path, root: Path, serve_app: Any, config: ServerConfig,
                 max_waiting: int = 1024) -> Iterator[tuple[str, str, str]]:
    """A server on SQLite; yields its URL, the key of an unlimited tenant and the key of
    one limited to 2 requests per window."""
    db_url = f"sqlite:///{root / 'registry.db'}"
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            tenant = service.create_tenant(session, "solo")
            _, key = service.create_key(session, tenant.id)
            limited = service.create_tenant(session, "limited", max_requests_per_minute=2)
            _, limited_key = service.create_key(session, limited.id)
    finally:
        engine.dispose()
    client = EngineClient.from_config(EngineConfig(
        ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=64), LoRAConfig(),
        SchedulerConfig(max_num_seqs=4, max_waiting=max_waiting)))
    app = create_app(config, RegistryConfig(db_url, str(root / "store")), client)
    try:
        with serve_app(app) as url:
            yield url, key, limited_key
    finally:
        client.close()


@pytest.fixture(scope="module")
def tiny_queue(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               serve_app: Any) -> Iterator[tuple[str, str, str]]:
    """A server whose engine admits one unfinished request (in-process limiter)."""
    with small_server(tiny_llama_dir, tmp_path_factory.mktemp("tiny_queue"), serve_app,
                      ServerConfig(served_model_name="tiny"), max_waiting=1) as served:
        yield served


def test_full_engine_queue_is_503_with_retry_after(tiny_queue: tuple[str, str, str]) -> None:
    url, key, _ = tiny_queue

    async def scenario() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key,
                                      max_retries=0) as client:

            async def one() -> Any:
                try:
                    return await client.completions.create(
                        model="tiny", prompt=[5] * 8, max_tokens=200,
                        extra_body={"ignore_eos": True})
                except openai.APIStatusError as exc:
                    return exc

            return list(await asyncio.gather(*(one() for _ in range(4))))

    results = asyncio.run(scenario())
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert refused and len(refused) < 4
    for exc in refused:
        assert exc.status_code == 503
        assert exc.response.headers["retry-after"] == "1"
        assert exc.body["code"] == "engine_overloaded"  # type: ignore[index]


def free_port() -> int:
    with socket.socket() as sock:  # a port with nobody listening, once closed
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisProcess:
    """A redis-server of the test's own on ``port``, to kill and restart under a server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self._proc

        def answers() -> bool:
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, proc, "redis-server")

    def pause(self, paused: bool) -> None:
        """Stops (or resumes) the process: a hung Redis, its port open, never answering."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None


def add_tenant(root: Path, name: str, **limits: int) -> str:
    engine = db.make_engine(f"sqlite:///{root / 'registry.db'}")
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            tenant = service.create_tenant(session, name, **limits)
            _, key = service.create_key(session, tenant.id)
    finally:
        engine.dispose()
    return key


def call(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=30)


def test_unreachable_redis_is_503_for_limited_tenants_only(
        tiny_llama_dir: Path, tmp_path: Path, serve_app: Any) -> None:
    port = free_port()
    config = ServerConfig(served_model_name="tiny", redis_url=f"redis://127.0.0.1:{port}/0")
    with small_server(tiny_llama_dir, tmp_path, serve_app, config) as (url, key, limited):
        refused = call(url, limited)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "dependency_unavailable"
        assert int(refused.headers["retry-after"]) >= 1
        assert str(port) not in refused.text and "127.0.0.1" not in refused.text
        assert call(url, key).status_code == 200  # no limits: nothing to check


@contextlib.contextmanager
def own_redis_server(model_dir: Path, root: Path,
                     serve_app: Any) -> Iterator[tuple[RedisProcess, str, str, str]]:
    """A small server on a redis-server of its own: yields that Redis, the URL, an
    unlimited tenant's key and one with a (high) requests-per-minute limit."""
    store = RedisProcess(free_port())
    store.start()
    config = ServerConfig(served_model_name="tiny", redis_url=store.url)
    try:
        with small_server(model_dir, root, serve_app, config) as (url, free, _):
            yield store, url, free, add_tenant(root, "capped", max_requests_per_minute=100_000)
    finally:
        store.kill()


@pytest.mark.server
def test_redis_restart_under_a_live_server(tiny_llama_dir: Path, tmp_path: Path,
                                           serve_app: Any) -> None:
    with own_redis_server(tiny_llama_dir, tmp_path, serve_app) as (store, url, free, capped):
        with ThreadPoolExecutor(8) as pool:
            # Fill the pool with connections that the restart will leave stale.
            assert [r.status_code for r in pool.map(lambda _: call(url, capped),
                                                    range(16))] == [200] * 16
            assert httpx.get(f"{url}/ready").json()["redis"] is True

            store.kill()
            ready = httpx.get(f"{url}/ready", timeout=30)
            assert ready.status_code == 503 and ready.json()["redis"] is False
            down = list(pool.map(lambda _: call(url, capped), range(8)))
            assert [r.status_code for r in down] == [503] * 8
            for response in [ready, *down]:
                assert str(store.port) not in response.text
                assert "127.0.0.1" not in response.text
            assert all(r.headers["retry-after"] for r in down)
            assert call(url, free).status_code == 200

            store.start()
            after = list(pool.map(lambda _: call(url, capped), range(60)))
            assert [r.status_code for r in after] == [200] * 60
            assert httpx.get(f"{url}/ready").status_code == 200


@pytest.mark.server
def test_a_hung_redis_is_a_down_redis(tiny_llama_dir: Path, tmp_path: Path,
                                      serve_app: Any) -> None:
    """Redis paused (port open, no answer): a limited tenant gets the 503 with Retry-After
    a down Redis gets, an unlimited one is served, /ready says so; each Redis call costs a
    request at most the limiter's budget (0.5 s), where it had cost 3 to 9.6 s."""
    with own_redis_server(tiny_llama_dir, tmp_path, serve_app) as (store, url, free, limited):
        assert call(url, limited).status_code == 200
        store.pause(True)
        refused = call(url, limited)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "dependency_unavailable"
        assert call(url, free).status_code == 200
        ready = httpx.get(f"{url}/ready", timeout=30)
        assert ready.status_code == 503 and ready.json()["redis"] is False
        store.pause(False)
        assert call(url, limited).status_code == 200


def test_the_limiter_bounds_each_call_on_a_hung_redis() -> None:
    """The bound itself, measured on the limiter's calls (an event loop's timer, not a
    request's end-to-end time)."""
    store = RedisProcess(free_port())
    store.start()

    async def main() -> list[float]:
        limiter = RedisRateLimiter(store.url, "hung-test:", request_budget_s=0.5)
        limits = TenantLimits(requests_per_minute=10)
        lease = await limiter.acquire("t", limits, 1)
        store.pause(True)
        took = []
        for call_ in (lambda: limiter.acquire("t", limits, 1),
                      lambda: limiter.release(lease, 1), limiter.ping):
            began = time.monotonic()
            with contextlib.suppress(RedisError):
                assert await call_() in (False, None)  # ping is False, release None
            took.append(time.monotonic() - began)
        store.pause(False)
        await limiter.close()
        return took

    try:
        took = asyncio.run(main())
    finally:
        store.kill()
    # 0.5 s each, plus what a busy machine adds to a timer's wakeup.
    assert all(t < 1.5 for t in took), took


def test_in_process_limiter_without_redis(tiny_queue: tuple[str, str, str]) -> None:
    url, _, limited_key = tiny_queue
    with openai.OpenAI(base_url=f"{url}/v1", api_key=limited_key, max_retries=0) as client:
        for _ in range(2):
            client.completions.create(model="tiny", prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["type"] == "requests"  # type: ignore[index]


@dataclass
class OneSeqServer:
    """A server whose engine runs one sequence at a time, with two adapters of tenant
    ``obs``: ``one`` and ``two``, by their engine identities."""

    url: str
    admin_key: str
    key: str
    identities: dict[str, str]

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {self.admin_key}"})

    def metrics(self) -> dict[str, list[Any]]:
        with self.admin() as http:
            response = http.get("/metrics")
        assert response.status_code == 200, response.text
        out: dict[str, list[Any]] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append(sample)
        return out

    def body(self, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        return {"model": model, "prompt": [5] * 8, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": stream}


# Tokens of the request that holds the one sequence slot: seconds of decoding, so the
# scrapes taken meanwhile see it running however fast the machine is (it is aborted then).
LONG_TOKENS = 4000


@pytest.fixture(scope="module")
def one_seq(llama_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
            serve_app: Any) -> Iterator[OneSeqServer]:
    root = tmp_path_factory.mktemp("one_seq")
    # The tiny Llama's shapes (its adapters fit) with room for a long completion.
    model_dir = build_tiny_model(root / "model", arch="llama", max_position_embeddings=4096)
    db_url = f"sqlite:///{root / 'registry.db'}"
    admin_key = bootstrap_admin(db_url)
    client = EngineClient.from_config(EngineConfig(
        ModelConfig(str(model_dir)), CacheConfig(block_size=16, num_kv_blocks=300),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        SchedulerConfig(max_num_seqs=1)))
    app = create_app(ServerConfig(served_model_name="tiny"),
                     RegistryConfig(db_url, str(root / "store")), client)
    try:
        with serve_app(app) as url:
            server = OneSeqServer(url, admin_key, "", {})
            with server.admin() as http:
                assert http.post("/admin/api/tenants", json={"name": "obs"}).status_code == 201
                server.key = http.post("/admin/api/tenants/obs/keys", json={}).json()["key"]
                for name, spec in (("one", "r4"), ("two", "r8qv")):
                    files = {f: (f, (llama_adapters[spec] / f).read_bytes())
                             for f in ("adapter_config.json", "adapter_model.safetensors")}
                    made = http.post("/admin/api/tenants/obs/adapters", data={"name": name},
                                     files=files)
                    assert made.status_code == 201, made.text
                    row = made.json()
                    server.identities[name] = f"{row['id']}@{row['digest'][:12]}"
            yield server
    finally:
        client.close()


def lora_info(metrics: dict[str, list[Any]]) -> dict[str, str]:
    (sample,) = metrics["loraplex_lora_requests_info"]
    return dict(sample.labels)


@pytest.mark.server
def test_metrics_name_running_and_waiting_adapters_mid_stream(one_seq: OneSeqServer) -> None:
    one, two = one_seq.identities["one"], one_seq.identities["two"]
    headers = {"Authorization": f"Bearer {one_seq.key}"}
    with httpx.Client(base_url=one_seq.url, timeout=60, headers=headers) as http, \
            ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions",
                         json=one_seq.body("one", LONG_TOKENS, stream=True)) as streaming:
            assert streaming.status_code == 200
            # Held, not dropped: a collected line iterator would close the stream.
            lines = streaming.iter_lines()
            next(lines)  # the first token: "one" runs
            running = lora_info(one_seq.metrics())
            assert running == {"replica": "0", "max_lora": "2", "running_lora_adapters": one,
                               "waiting_lora_adapters": ""}
            # The only sequence slot is taken: a request on "two" waits for it.
            queued = pool.submit(http.post, "/v1/completions",
                                 json=one_seq.body("two", 2, stream=False))
            # Until the request is queued: it cannot finish before "one" is closed.
            while (info := lora_info(metrics := one_seq.metrics()))[
                    "waiting_lora_adapters"] != two:
                assert not queued.done(), info
            assert info["running_lora_adapters"] == one
            assert metrics["loraplex_queue_depth"][0].labels == {"replica": "0"}
            assert metrics["loraplex_queue_depth"][0].value == 1
            assert metrics["loraplex_running_requests"][0].value == 1
            with one_seq.admin() as admin:
                replica = admin.get("/admin/api/engine").json()["replicas"][0]
            assert replica["running_adapters"] == [one]
        # Closing the stream aborts "one": "two" runs and ends.
        assert queued.result(timeout=60).status_code == 200

    after = one_seq.metrics()
    assert lora_info(after) == {"replica": "0", "max_lora": "2",
                                "running_lora_adapters": "", "waiting_lora_adapters": ""}
    resident = {(s.labels["replica"], s.labels["level"]): s.value
                for s in after["loraplex_adapter_resident"]}
    assert resident == {("0", "device"): 2, ("0", "host"): 2}
    capacity = {s.labels["level"]: s.value for s in after["loraplex_adapter_capacity"]}
    assert capacity == {"device": 2, "host": 4}
    loads = after["loraplex_adapter_loads_total"]
    assert [(s.labels, s.value) for s in loads] == [({"replica": "0"}, 2)]
