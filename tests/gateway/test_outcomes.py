"""What a generation request ends as, seen through a live uvicorn server: the status it is
counted with in ``loraplex_requests_total``, and the tokens metered for it in /v1/usage.

Each test calls as a tenant of its own, so the counts it reads are its requests alone.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

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
from loraplex.testing import postgres_schema, redis_url_for_tests

LiveServer = Any  # tests/gateway/conftest.py's LiveServer
PROMPT_IDS = [5] * 20


def new_tenant(live: LiveServer) -> tuple[str, str]:
    name, key, _ = tenant_in(live.db_url)
    return name, key


def tenant_in(db_url: str) -> tuple[str, str, int]:
    name = f"out-{uuid.uuid4().hex[:8]}"
    engine = db.make_engine(db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            tenant = service.create_tenant(session, name)
            _, key = service.create_key(session, tenant.id)
            tenant_id = tenant.id
    finally:
        engine.dispose()
    return name, key, tenant_id


def statuses(live: LiveServer, tenant: str) -> dict[str, float]:
    with live.http() as http:
        text = http.get("/metrics", headers={"Authorization": f"Bearer {live.admin_key}"}).text
    return {s.labels["status"]: s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "loraplex_requests_total" and s.labels["tenant"] == tenant}


def metered(live: LiveServer, key: str) -> dict[str, int]:
    with live.http() as http:
        report = http.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    totals: dict[str, int] = report["totals"]
    return totals


def body(live: LiveServer, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": live.served_name, "prompt": PROMPT_IDS, "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}


def test_completed_requests_count_as_ok(live: LiveServer) -> None:
    tenant, key = new_tenant(live)
    headers = {"Authorization": f"Bearer {key}"}
    with live.http() as http:
        for _ in range(3):
            events = http.post("/v1/completions", json=body(live, 4, stream=True),
                               headers=headers).text
            assert events.endswith("data: [DONE]\n\n")
        assert http.post("/v1/completions", json=body(live, 4, stream=False),
                         headers=headers).status_code == 200
    assert statuses(live, tenant) == {"ok": 4}


def test_hang_up_counts_as_aborted_and_meters_what_was_sent(live: LiveServer) -> None:
    tenant, key = new_tenant(live)
    headers = {"Authorization": f"Bearer {key}"}
    received = 0
    with httpx.Client(base_url=live.url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body(live, 400, stream=True),
                        headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                received += 1 if chunk["choices"][0]["text"] else 0
            if received == 5:
                break  # hang up long before the 400 tokens are done
    live.wait_idle()
    assert statuses(live, tenant) == {"aborted": 1}
    totals = metered(live, key)
    assert totals["requests"] == 1
    assert totals["prompt_tokens"] == len(PROMPT_IDS)
    # At least what the client read was sent; never what the engine made after it left.
    assert 5 <= totals["completion_tokens"] < 400


def test_shutdown_meters_what_the_cut_streams_delivered(
        tiny_llama_dir: Path, tmp_path: Path, redis_prefix: str, serve_app: Any) -> None:
    max_tokens = 480  # far more than a stream makes before the shutdown cuts it
    with postgres_schema("shutdown") as db_url:
        db.upgrade(db_url)
        _, key, tenant_id = tenant_in(db_url)
        client = EngineClient.from_config(EngineConfig(
            ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=256),
            LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)))
        config = ServerConfig(served_model_name="tiny", redis_url=redis_url_for_tests(),
                              rate_limit_key_prefix=redis_prefix, max_tokens_limit=max_tokens,
                              usage_flush_interval_s=3600)  # only the final flush writes
        app = create_app(config, RegistryConfig(db_url, str(tmp_path / "store")), client)
        received = [0] * 4
        ended = [""] * 4
        started = threading.Barrier(len(received) + 1, timeout=30)

        def stream(i: int, url: str) -> None:
            payload = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True}
            with httpx.Client(base_url=url, timeout=60) as http, \
                    http.stream("POST", "/v1/completions", json=payload,
                                headers={"Authorization": f"Bearer {key}"}) as response:
                lines = response.iter_lines()
                try:
                    for line in lines:
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line.removeprefix("data: "))
                        if "error" in chunk:
                            ended[i] = "error"
                            continue
                        received[i] += 1
                        if chunk["choices"][0]["finish_reason"]:
                            ended[i] = chunk["choices"][0]["finish_reason"]
                        if received[i] == 5:
                            started.wait()
                except httpx.HTTPError:
                    ended[i] = "cut"

        try:
            with serve_app(app, graceful_s=0) as url:
                threads = [threading.Thread(target=stream, args=(i, url)) for i in range(4)]
                for thread in threads:
                    thread.start()
                started.wait()  # every stream has delivered 5 chunks; now stop the server
            for thread in threads:
                thread.join(30)
        finally:
            client.close()
        assert "length" not in ended, "a stream finished before the shutdown cut it"
        engine = db.make_engine(db_url)
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                totals = service.usage_totals(session, tenant_id)
        finally:
            engine.dispose()
    assert totals.requests == 4
    assert totals.prompt_tokens == 4 * len(PROMPT_IDS)
    assert sum(received) <= totals.completion_tokens < 4 * max_tokens
