"""Edges of who is calling and what a refusal costs: repeated Authorization headers, the
queries behind a 404, and the one shape of a model object."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


def _operations(live: LiveServer) -> list[tuple[str, str]]:
    """(method, path) of every operation /openapi.json declares behind a key, with its path
    parameters filled in."""
    with live.http() as http:
        doc = http.get("/openapi.json").json()
    ops = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "parameters" or op.get("security") == []:
                continue
            filled = re.sub(r"\{\w+\}", "x", path.replace("{key_id}", "1"))
            ops.append((method.upper(), filled))
    return ops


def test_two_authorization_headers_are_400_on_every_route(live: LiveServer) -> None:
    ops = _operations(live)
    assert len(ops) > 15  # the document's routes, not a handful picked by hand
    twice = [("Authorization", f"Bearer {live.admin_key}"),
             ("Authorization", f"Bearer {live.keys['alice']}")]
    with live.http() as http:
        for method, path in ops:
            response = http.request(method, path, headers=twice, content=b"{}")
            assert response.status_code == 400, (method, path, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "more than once" in error["message"], (method, path)
        # One of them alone is served.
        single = {"Authorization": f"Bearer {live.admin_key}"}
        assert http.get("/admin/api/tenants", headers=single).status_code == 200


@contextlib.contextmanager
def _statements() -> Iterator[list[str]]:
    """The SQL text of every statement any engine of this process issues meanwhile, less
    the gateway's pin sync (gateway/pins.py), which reads the pins every 2 s whatever the
    requests do."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "adapters.pinned_at IS NOT NULL" not in statement:
            seen.append(statement)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)


def _not_found(http: httpx.Client, live: LiveServer, model: str) -> list[str]:
    headers = {"Authorization": f"Bearer {live.keys['carol']}"}
    with _statements() as seen:
        retrieve = http.get(f"/v1/models/{model}", headers=headers)
        completion = http.post("/v1/completions", headers=headers,
                               json={"model": model, "prompt": "hi", "max_tokens": 1})
    assert retrieve.status_code == completion.status_code == 404, (model, completion.text)
    return seen


def test_a_missing_tenant_costs_the_queries_of_a_private_or_missing_adapter(
        live: LiveServer) -> None:
    """Timing must not tell whether a tenant exists: the 404s issue the same statements."""
    models = ("nobody-here/secret", "bob/secret", "bob/no-such-adapter")
    with live.http() as http:
        for model in models:  # warm: the key's last_used_at is written at most once a minute
            _not_found(http, live, model)
        time.sleep(0.5)  # the usage flusher has nothing left to write
        runs = {model: _not_found(http, live, model) for model in models}
    assert runs["bob/secret"], "no statement was recorded"
    assert runs["nobody-here/secret"] == runs["bob/secret"] == runs["bob/no-such-adapter"]


@pytest.mark.parametrize("tenant", ["alice", "bob"])
def test_one_model_is_the_object_the_list_shows(live: LiveServer, tenant: str) -> None:
    with live.openai(tenant) as client:
        listed = client.models.list().data
        assert len(listed) >= 3
        for entry in listed:
            retrieved = client.models.retrieve(entry.id)
            assert retrieved.model_dump() == entry.model_dump()
            if entry.id != live.served_name:
                assert json.loads(retrieved.model_dump_json())["created"] > 0
                assert "@" in (entry.model_extra or {})["root"]


METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def test_a_405_names_every_method_of_the_path(live: LiveServer) -> None:
    with live.http() as http:
        doc = http.get("/openapi.json").json()
        for path, item in doc["paths"].items():
            declared = {m.upper() for m in item if m != "parameters"}
            if "GET" in declared:
                declared.add("HEAD")
            filled = re.sub(r"\{\w+\}", "x", path.replace("{key_id}", "1"))
            for method in set(METHODS) - declared:
                response = http.request(method, filled)
                assert response.status_code == 405, (method, path, response.text)
                assert set(response.headers["allow"].split(", ")) == declared, (method, path)
                assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/admin/nothing", "/admin/api/nothing", "/admin/api/",
                                  "/admin/api/tenants/x/nothing", "/admin/x/y.html"])
def test_an_unknown_path_under_admin_is_404_whatever_the_method(live: LiveServer,
                                                                 path: str) -> None:
    with live.http() as http:
        for method in METHODS:
            response = http.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
        # A page that exists takes only GET.
        page = http.post("/admin/index.html")
        assert page.status_code == 405 and page.headers["allow"] == "GET, HEAD"
