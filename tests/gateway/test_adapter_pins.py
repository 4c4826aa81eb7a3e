"""Pinned adapters over HTTP, once on SQLite and once on PostgreSQL: a pin through the
admin API shows in the version JSON and, right away, in the engine (``/admin/api/engine``:
the replica holds it, a device slot keeps it); after other adapters thrash the slots and
the host cache, requests to the pinned version load nothing. Pins take at most the
server's share of slots (409 past it, nothing changed); a CLI pin, written without the
server, applies within a few seconds; a deleted pinned version is no longer held; every
bad input is a 4xx that changes nothing.

The server has 2 device slots and a host cache of 4 (so one slot for pins), and tenant
``acme`` with adapters ``a0`` .. ``a5`` (version 1 each) and ``bot`` (versions 1 and 2,
the second deleted).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

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
from loraplex.testing import bootstrap_admin, postgres_schema

SPECS = ("r4", "r8qv", "r16rs", "r8mlp", "r4", "r8qv")  # a0 .. a5
BASE = "/admin/api/tenants/acme/adapters"


@dataclass
class PinServer:
    url: str
    db_url: str
    store: Path
    model_dir: Path
    admin_key: str
    tenant_key: str

    def call(self, method: str, path: str, *, key: str | None = None,
             **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.admin_key}"} | kwargs.pop(
            "headers", {})
        response = httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60,
                                 **kwargs)
        assert response.status_code < 500, response.text
        return response

    def engine(self) -> dict[str, Any]:
        response = self.call("GET", "/admin/api/engine")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data

    def complete(self, model: str) -> None:
        response = self.call("POST", "/v1/completions", key=self.tenant_key,
                             json={"model": model, "prompt": "Hello", "max_tokens": 1})
        assert response.status_code == 200, response.text

    def identity(self, name: str, version: int = 1) -> str:
        """The engine's spelling of a version: ``id@digest12``."""
        row = self.version(name, version)
        return f"{row['id']}@{row['digest'][:12]}"

    def version(self, name: str, version: int) -> dict[str, Any]:
        response = self.call("GET", f"{BASE}/{name}")
        assert response.status_code == 200, response.text
        row: dict[str, Any] = next(v for v in response.json()["versions"]
                                   if v["version"] == version)
        return row

    def cli(self, *argv: str) -> int:
        return run_registry_cli([*argv, "--database-url", self.db_url, "--adapter-dir",
                                 str(self.store), "--model", str(self.model_dir)])


def _wait(check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """``check()`` once true, else its last value after ``timeout_s``: the pins apply
    within one 2 s sync round, so a minute holds on a machine however busy."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def pin_server(request: pytest.FixtureRequest, tiny_llama_dir: Path,
               llama_adapters: dict[str, Path], serve_app: Any,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[PinServer]:
    root = tmp_path_factory.mktemp(f"pins_{request.param}")
    with contextlib.ExitStack() as stack:
        db_url = (f"sqlite:///{root / 'registry.db'}" if request.param == "sqlite"
                  else stack.enter_context(postgres_schema("pins")))
        admin_key = bootstrap_admin(db_url)
        engine = db.make_engine(db_url)
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                tenant = service.create_tenant(session, "acme")
                _, tenant_key = service.create_key(session, tenant.id)
        finally:
            engine.dispose()
        server = PinServer("", db_url, root / "store", tiny_llama_dir, admin_key, tenant_key)
        uploads = [(f"a{i}", spec) for i, spec in enumerate(SPECS)]
        for name, spec in [*uploads, ("bot", "r4"), ("bot", "r8qv")]:
            assert server.cli("adapters", "add", "--tenant", "acme", "--name", name,
                              str(llama_adapters[spec])) == 0
        assert server.cli("adapters", "delete", "--tenant", "acme", "--name", "bot",
                          "--version", "2") == 0
        client = EngineClient.from_config(EngineConfig(
            ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=128),
            LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)))
        stack.callback(client.close)
        app = create_app(ServerConfig(served_model_name="tiny-llama"),
                         RegistryConfig(db_url, str(root / "store")), client)
        server.url = stack.enter_context(serve_app(app))
        yield server


@pytest.fixture
def pins(pin_server: PinServer) -> Iterator[PinServer]:
    """The server with no pin, before and after the test."""
    yield pin_server
    for name in ("a0", "a1", "bot"):
        assert pin_server.call("DELETE", f"{BASE}/{name}/pin",
                               params={"version": 1}).status_code == 200
    assert _wait(lambda: pin_server.engine()["pinned_adapters"] == [])


def _slot_of(stats: dict[str, Any], identity: str) -> dict[str, Any] | None:
    return next((s for s in stats["slots"] if s is not None and s["identity"] == identity),
                None)


def test_a_pinned_version_stays_in_its_slot_and_never_loads(pins: PinServer) -> None:
    server = pins
    assert server.engine()["max_pinned"] == 1
    response = server.call("POST", f"{BASE}/a0/pin", json={"version": 1})
    assert response.status_code == 200, response.text
    row = response.json()["versions"][0]
    assert row["pinned"] is True and row["pinned_at"] is not None
    listed = server.call("GET", "/admin/api/adapters", params={"tenant": "acme"}).json()
    assert {(r["name"], r["version"]): r["pinned"] for r in listed["data"]}[("a0", 1)]
    pinned = server.identity("a0")

    # The engine holds it as soon as the pin is answered, and a slot keeps it.
    stats = server.engine()
    assert stats["pinned_adapters"] == [pinned]
    assert [r["pinned_adapters"] for r in stats["replicas"]] == [[pinned]]
    slot = _wait(lambda: _slot_of(server.engine(), pinned))
    assert slot is not None, "the pinned adapter never reached a slot"
    assert slot | {"slot": 0} == {"slot": 0, "identity": pinned, "model": "acme/a0",
                                  "version": 1, "status": "active", "pinned": True}

    # Five other adapters through the one slot left (and past the host cache of 4).
    before = server.engine()
    for i in range(1, 6):
        server.complete(f"a{i}")
        assert _slot_of(server.engine(), pinned) is not None
    thrashed = server.engine()
    assert thrashed["adapter_disk_loads"] - before["adapter_disk_loads"] >= 5
    assert thrashed["adapter_slot_loads"] - before["adapter_slot_loads"] >= 5
    assert pinned in thrashed["host_adapters"]

    # Requests to the pinned version load nothing: not from disk, not into a slot.
    for _ in range(3):
        server.complete("a0")
        server.complete("acme/a0@1")
    after = server.engine()
    assert (after["adapter_disk_loads"], after["adapter_slot_loads"]) == (
        thrashed["adapter_disk_loads"], thrashed["adapter_slot_loads"])

    # Unpinned, its slot is the working set's again.
    response = server.call("DELETE", f"{BASE}/a0/pin", params={"version": 1})
    assert response.status_code == 200, response.text
    assert response.json()["versions"][0] == row | {"pinned": False, "pinned_at": None}
    stats = server.engine()
    assert stats["pinned_adapters"] == []
    assert all(s is None or s["pinned"] is False for s in stats["slots"])
    server.complete("a1")
    server.complete("a2")
    assert _slot_of(server.engine(), pinned) is None


def test_pins_past_the_share_are_refused_and_change_nothing(pins: PinServer) -> None:
    server = pins
    assert server.call("POST", f"{BASE}/a0/pin", json={"version": 1}).status_code == 200
    # Pinning it again changes nothing, not even when it was pinned.
    pinned_at = server.version("a0", 1)["pinned_at"]
    again = server.call("POST", f"{BASE}/a0/pin", json={"version": 1})
    assert again.status_code == 200 and again.json()["versions"][0]["pinned_at"] == pinned_at
    before = server.call("GET", f"{BASE}/a1").json()
    refused = server.call("POST", f"{BASE}/a1/pin", json={"version": 1})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "conflict", error
    assert "at most 1 pinned version" in error["message"], error
    assert "acme/a0@1" in error["message"], error
    assert "unpin" in error["message"], error
    assert server.call("GET", f"{BASE}/a1").json() == before
    assert server.engine()["pinned_adapters"] == [server.identity("a0")]
    # Once a0 is unpinned, a1 may be.
    assert server.call("DELETE", f"{BASE}/a0/pin", params={"version": 1}).status_code == 200
    assert server.call("POST", f"{BASE}/a1/pin", json={"version": 1}).status_code == 200
    assert server.engine()["pinned_adapters"] == [server.identity("a1")]


def test_a_cli_pin_applies_within_seconds(pins: PinServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    server = pins
    assert server.cli("adapters", "pin", "--tenant", "acme", "a0", "--version", "1") == 0
    assert "oldest first: acme/a0@1" in capsys.readouterr().out
    a0 = server.identity("a0")
    assert _wait(lambda: server.engine()["pinned_adapters"] == [a0])
    # Past the share, the CLI records the pin; the server applies only the oldest.
    assert server.cli("adapters", "pin", "--tenant", "acme", "a1", "--version", "1") == 0
    assert server.version("a1", 1)["pinned"] is True
    time.sleep(2.5)  # a sync round
    assert server.engine()["pinned_adapters"] == [a0]
    # The older pin goes: the next one applies.
    assert server.cli("adapters", "unpin", "--tenant", "acme", "a0", "--version", "1") == 0
    a1 = server.identity("a1")
    assert _wait(lambda: server.engine()["pinned_adapters"] == [a1])


def test_a_deleted_pinned_version_is_no_longer_held(pins: PinServer,
                                                    llama_adapters: dict[str, Path]) -> None:
    server = pins
    assert server.cli("adapters", "add", "--tenant", "acme", "--name", "gone",
                      str(llama_adapters["r16rs"])) == 0
    assert server.call("POST", f"{BASE}/gone/pin", json={"version": 1}).status_code == 200
    gone = server.identity("gone")
    assert server.engine()["pinned_adapters"] == [gone]
    deleted = server.call("DELETE", f"{BASE}/gone", params={"version": 1})
    assert deleted.status_code == 200, deleted.text
    assert _wait(lambda: server.engine()["pinned_adapters"] == [])
    time.sleep(2.5)  # a sync round does not bring it back
    stats = server.engine()
    assert stats["pinned_adapters"] == [] and _slot_of(stats, gone) is None
    listed = server.call("GET", "/admin/api/adapters",
                         params={"tenant": "acme", "include_deleted": "true"}).json()
    row = next(r for r in listed["data"] if r["name"] == "gone")
    assert (row["status"], row["pinned"], row["pinned_at"]) == ("deleted", False, None)
    # Its slot's share is free for another pin.
    assert server.call("POST", f"{BASE}/a0/pin", json={"version": 1}).status_code == 200


BAD_PINS = [
    # (method, path, JSON body or query, status, param or a part of the message)
    ("POST", "/admin/api/tenants/nobody/adapters/a0/pin", {"version": 1}, 404, None),
    ("POST", f"{BASE}/nope/pin", {"version": 1}, 404, "model"),
    ("POST", f"{BASE}/a0/pin", {"version": 9}, 404, "model"),
    ("POST", f"{BASE}/bot/pin", {"version": 2}, 409, "deleted"),
    ("POST", f"{BASE}/a%00b/pin", {"version": 1}, 404, None),
    ("POST", f"{BASE}/a0/pin", {"version": "1"}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {"version": True}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {"version": 1.5}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {"version": 0}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {"version": 2**31}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {"version": 10**400}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {"version": None}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {}, 400, "version"),
    ("POST", f"{BASE}/a0/pin", {"version": 1, "percent": 5}, 400, "percent"),
    ("POST", f"{BASE}/a0/pin", [1], 400, None),
    ("POST", f"{BASE}/a0/pin", "not json", 400, None),
    ("DELETE", f"{BASE}/a0/pin", None, 400, "version"),
    ("DELETE", f"{BASE}/a0/pin", "version=x", 400, "version"),
    ("DELETE", f"{BASE}/a0/pin", "version=¹", 400, "version"),
    ("DELETE", f"{BASE}/a0/pin", "version=" + "9" * 400, 400, "version"),
    ("DELETE", f"{BASE}/a0/pin", "version=9", 404, "model"),
    ("DELETE", f"{BASE}/bot/pin", "version=2", 409, "deleted"),
    ("DELETE", f"{BASE}/nope/pin", "version=1", 404, "model"),
    ("DELETE", "/admin/api/tenants/nobody/adapters/a0/pin", "version=1", 404, None),
]


@pytest.mark.parametrize(("method", "path", "payload", "status", "expected"), BAD_PINS)
def test_bad_pins_are_4xx_and_change_nothing(pins: PinServer, method: str, path: str,
                                             payload: Any, status: int,
                                             expected: str | None) -> None:
    server = pins
    assert server.call("POST", f"{BASE}/a1/pin", json={"version": 1}).status_code == 200
    before = server.call("GET", "/admin/api/adapters",
                         params={"include_deleted": "true"}).json()
    engine_before = server.engine()["pinned_adapters"]
    kwargs: dict[str, Any] = {}
    if method == "DELETE":
        path = path if payload is None else f"{path}?{payload}"
    elif isinstance(payload, str):
        kwargs = {"content": payload.encode(), "headers": {"Content-Type": "application/json"}}
    else:
        kwargs = {"json": payload}
    response = server.call(method, path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert len(error["message"]) < 400, error
    if expected is not None:
        assert expected == error["param"] or expected in error["message"], error
    after = server.call("GET", "/admin/api/adapters", params={"include_deleted": "true"})
    assert after.json() == before
    assert server.engine()["pinned_adapters"] == engine_before


def test_only_an_admin_may_pin(pins: PinServer) -> None:
    server = pins
    for method, kwargs in (("POST", {"json": {"version": 1}}),
                           ("DELETE", {"params": {"version": 1}})):
        response = server.call(method, f"{BASE}/a0/pin", key=server.tenant_key, **kwargs)
        assert response.status_code == 403, response.text
        assert server.call(method, f"{BASE}/a0/pin", key="sk-nope", **kwargs
                           ).status_code == 401
    assert server.version("a0", 1)["pinned"] is False
    # The tenant sees whether its own version is pinned.
    server.call("POST", f"{BASE}/a0/pin", json={"version": 1})
    own = server.call("GET", "/v1/adapters/a0", key=server.tenant_key).json()
    assert own["versions"][0]["pinned"] is True
