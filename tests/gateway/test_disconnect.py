"""A client that goes away aborts its request in the engine, and its blocks are freed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


def aborted_count(live: LiveServer, tenant: str) -> float:
    with live.http() as http:
        text = http.get("/metrics", headers={"Authorization": f"Bearer {live.admin_key}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "loraplex_requests_total" and sample.labels == {
                    "tenant": tenant, "adapter": "base", "status": "aborted"}:
                return float(sample.value)
    return 0.0


def long_request(live: LiveServer, stream: bool) -> dict[str, Any]:
    # 400 tokens take far longer than the test waits: only an abort ends them early.
    return {"model": live.served_name, "prompt": [5] * 20, "max_tokens": 400,
            "stream": stream, "ignore_eos": True}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_blocks(live: LiveServer, path: str) -> None:
    before = aborted_count(live, "carol")
    body = long_request(live, stream=True)
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello"}]
        del body["prompt"]
    headers = {"Authorization": f"Bearer {live.keys['carol']}"}
    with live.http() as http, http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first != "data: [DONE]"
        running = live.engine_stats()
        assert running["num_running"] + running["num_waiting"] >= 1
        assert running["kv_blocks_used"] > 0
    # The connection is closed: the engine must drop the request and every block it held.
    stats = live.wait_idle()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["num_unfinished"] == 0
    assert aborted_count(live, "carol") == before + 1


def test_disconnect_during_non_streaming_request_aborts(live: LiveServer) -> None:
    before = aborted_count(live, "carol")
    with live.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=long_request(live, stream=False),
                  headers={"Authorization": f"Bearer {live.keys['carol']}"}, timeout=0.5)
    stats = live.wait_idle()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    assert aborted_count(live, "carol") == before + 1


def test_stream_format(live: LiveServer) -> None:
    body = {"model": live.served_name, "prompt": "hello", "max_tokens": 3, "stream": True,
            "n": 2, "stream_options": {"include_usage": True}}
    with live.http() as http:
        response = http.post("/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {live.keys['alice']}"})
    events = [e for e in response.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 2
    assert all(c["usage"] is None for c in chunks[:-1])
    finished = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finished) == [0, 1]
