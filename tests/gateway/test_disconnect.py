"""A client that goes away aborts its request in the engine, and its blocks are freed."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

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


def metered(live: LiveServer, tenant: str) -> dict[str, int]:
    with live.http() as http:
        response = http.get("/v1/usage", headers={"Authorization": f"Bearer {live.keys[tenant]}"})
    totals: dict[str, int] = response.json()["totals"]
    return totals


def test_disconnect_during_non_streaming_request_aborts(live: LiveServer) -> None:
    before = aborted_count(live, "carol")
    usage_before = metered(live, "carol")
    body = json.dumps(long_request(live, stream=False) | {"n": 4}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: Bearer {live.keys['carol']}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request.encode() + body)
        # Hang up as soon as the engine runs it (no reply can have been sent yet: the
        # reply of a non-streaming request comes when all 4 x 400 tokens are done).
        deadline = time.monotonic() + 10
        while live.engine_stats()["num_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # nothing has come back
    stats = live.wait_idle()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    assert aborted_count(live, "carol") == before + 1
    # The engine made tokens, but the answer never left: only the prompt is owed.
    usage = metered(live, "carol")
    assert {k: usage[k] - usage_before[k] for k in usage} == {
        "requests": 1, "prompt_tokens": 20, "completion_tokens": 0, "total_tokens": 20}


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
