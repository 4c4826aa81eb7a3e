"""Tenants' scheduling settings through the admin API (weight, priority class, KV fraction,
SLOs), on SQLite and on PostgreSQL: stored and shown as given, refused with an OpenAI-style
400 naming the field, and a refused request changes nothing.

Runs on ``fuzz_live`` (the small server, once per backend) in tenants of its own, so the
settings never touch the ``fuzzer`` tenant the fuzzing runs call as.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

LiveServer = Any  # tests/gateway/conftest.py's LiveServer
SETTINGS = ("weight", "priority_class", "max_kv_fraction", "slo_ttft_ms", "slo_tpot_ms")
DEFAULTS = (1.0, "interactive", None, None, None)
GOOD = {"weight": 9, "priority_class": "batch", "max_kv_fraction": 0.9, "slo_ttft_ms": 9,
        "slo_tpot_ms": 9}

class Raw(str):
    """JSON text sent as is: ``1e400`` is a number that Python reads as infinity."""


OVERFLOW = Raw("1e400")
BAD = [
    *[("weight", v) for v in (0, -1, 1000.5, OVERFLOW, 10**30, "2", "abc", True, None, [1], {})],
    *[("priority_class", v) for v in ("urgent", "", "BATCH", None, 1, ["batch"])],
    *[("max_kv_fraction", v) for v in (0, -0.1, 1.5, OVERFLOW, "0.5", False)],
    *[(field, v) for field in ("slo_ttft_ms", "slo_tpot_ms")
      for v in (0, -1, 3_600_001, 2**63, 12.5, 100.0, "100", True)],
]


def _settings(tenant: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(tenant[field] for field in SETTINGS)


def _name(prefix: str = "sched") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def admin(fuzz_live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_live.url, timeout=30,
                      headers={"Authorization": f"Bearer {fuzz_live.admin_key}"}) as http:
        yield http


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    """httpx's keyword arguments sending ``fields`` (at least one not Raw) as JSON, Raw
    values unquoted."""
    text = json.dumps({k: v for k, v in fields.items() if not isinstance(v, Raw)})
    text = text[:-1] + "".join(f', "{k}": {v}' for k, v in fields.items()
                               if isinstance(v, Raw)) + "}"
    return {"content": text.encode(), "headers": {"Content-Type": "application/json"}}


def _ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def _refused(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


def test_settings_are_stored_shown_and_changed(admin: httpx.Client) -> None:
    plain = _ok(admin.post("/admin/api/tenants", json={"name": _name()}), 201)
    assert _settings(plain) == DEFAULTS
    name = _name()
    created = _ok(admin.post("/admin/api/tenants", json={
        "name": name, "weight": 2.5, "priority_class": "batch", "max_kv_fraction": 0.25,
        "slo_ttft_ms": 500, "slo_tpot_ms": 50, "max_requests_per_minute": 60}), 201)
    assert _settings(created) == (2.5, "batch", 0.25, 500, 50)
    assert _settings(_ok(admin.get(f"/admin/api/tenants/{name}"))) == _settings(created)
    listed = {t["name"]: t for t in _ok(admin.get("/admin/api/tenants"))["data"]}
    assert _settings(listed[name]) == _settings(created)
    assert _settings(listed[plain["name"]]) == DEFAULTS

    # Only what is given changes; null returns a KV fraction or SLO to the server's default.
    patched = _ok(admin.patch(f"/admin/api/tenants/{name}", json={
        "weight": 1000, "slo_ttft_ms": None, "max_kv_fraction": 1}))
    assert _settings(patched) == (1000.0, "batch", 1.0, None, 50)
    assert patched["max_requests_per_minute"] == 60
    patched = _ok(admin.patch(f"/admin/api/tenants/{name}", json={
        "priority_class": "interactive", "weight": 0.01, "slo_tpot_ms": 3_600_000}))
    assert _settings(patched) == (0.01, "interactive", 1.0, None, 3_600_000)
    assert _settings(_ok(admin.get(f"/admin/api/tenants/{name}"))) == _settings(patched)


@pytest.mark.parametrize(("field", "value"), BAD)
def test_a_bad_setting_is_a_400_naming_it_and_changes_nothing(
        admin: httpx.Client, field: str, value: Any) -> None:
    name = _name("bad")
    error = _refused(admin.post("/admin/api/tenants",
                                **_body({"name": name, **GOOD, field: value})))
    assert error["param"] == field and field in error["message"], error
    assert admin.get(f"/admin/api/tenants/{name}").status_code == 404  # not created

    before = _ok(admin.post("/admin/api/tenants", json={"name": name, "weight": 3}), 201)
    # The good values and the status change around the bad one are not applied either.
    error = _refused(admin.patch(f"/admin/api/tenants/{name}", **_body({
        **GOOD, "max_requests_per_minute": 7, "status": "suspended", field: value})))
    assert error["param"] == field, error
    after = _ok(admin.get(f"/admin/api/tenants/{name}"))
    assert after == before | {"num_active_keys": 0, "num_adapters": 0}


def test_non_finite_json_numbers_are_refused(admin: httpx.Client) -> None:
    name = _name()
    _ok(admin.post("/admin/api/tenants", json={"name": name}), 201)
    for text in ("NaN", "Infinity", "-Infinity"):
        response = admin.patch(f"/admin/api/tenants/{name}",
                               content=f'{{"weight": {text}}}'.encode(),
                               headers={"Content-Type": "application/json"})
        assert "not valid JSON" in _refused(response)["message"]
    assert _settings(_ok(admin.get(f"/admin/api/tenants/{name}"))) == DEFAULTS


def test_the_openai_client_reads_the_refusal(fuzz_live: LiveServer) -> None:
    client = openai.OpenAI(base_url=fuzz_live.url, api_key=fuzz_live.admin_key,
                           max_retries=0, timeout=30)
    name = _name()
    created = client.post("/admin/api/tenants", cast_to=object,
                          body={"name": name, "priority_class": "batch", "weight": 0.5})
    assert isinstance(created, dict) and _settings(created)[:2] == (0.5, "batch")
    for field, value in (("weight", -math.pi), ("priority_class", "realtime"),
                         ("slo_tpot_ms", 0), ("max_kv_fraction", 2)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.patch(f"/admin/api/tenants/{name}", cast_to=object, body={field: value})
        assert refused.value.param == field and refused.value.status_code == 400
