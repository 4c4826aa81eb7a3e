"""What a generation request ends as, seen through a live uvicorn server: the status it is
counted with in ``loraplex_requests_total``, and the tokens metered for it in /v1/usage.

Each test calls as a tenant of its own, so the counts it reads are its requests alone.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.registry import db, service

LiveServer = Any  # tests/gateway/conftest.py's LiveServer
PROMPT_IDS = [5] * 20


def new_tenant(live: LiveServer) -> tuple[str, str]:
    name = f"out-{uuid.uuid4().hex[:8]}"
    engine = db.make_engine(live.db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            tenant = service.create_tenant(session, name)
            _, key = service.create_key(session, tenant.id)
    finally:
        engine.dispose()
    return name, key


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
