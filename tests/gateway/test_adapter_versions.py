"""Addressable versions and canary splits over HTTP, with the ``openai`` client as the
caller, once on SQLite and once on PostgreSQL: ``name@N``, promote, rollback, deleting the
current version, ``/v1/models``, a split's percentage and stickiness (each user's side is
exactly what the gateway's split function says), usage and metrics per version, and bad
input answered with an OpenAI-style 4xx that changes nothing.

Which version answered is read from the ``X-Loraplex-Adapter-Version`` header, and checked
against the text: a greedy completion of a bare name equals that of ``name@N``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

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
from loraplex.gateway.model_resolution import VERSION_HEADER
from loraplex.gateway.splits import user_point
from loraplex.registry import db, service
from loraplex.testing import bootstrap_admin, postgres_schema

SERVED = "tiny-llama"
PROMPT = "The quick brown fox"


@dataclass
class Server:
    url: str
    db_url: str
    admin_key: str
    keys: dict[str, str] = field(default_factory=dict)
    tenant_ids: dict[str, int] = field(default_factory=dict)

    def openai(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant],
                             max_retries=0, timeout=60)

    def call(self, method: str, path: str, key: str | None = None,
             **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.admin_key}"} \
            | kwargs.pop("headers", {})
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=30,
                             **kwargs)

    def version_row(self, tenant: str, name: str, version: int) -> Any:
        engine = db.make_engine(self.db_url)
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                row = service.resolve_adapter(session, self.tenant_ids[tenant],
                                              f"{name}@{version}")
                session.expunge(row)
                return row
        finally:
            engine.dispose()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest, tiny_llama_dir: Path,
           llama_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
           serve_app: Callable[..., contextlib.AbstractContextManager[str]],
           ) -> Iterator[Server]:
    """Tenants acme (adapter ``bot``: versions 1, 2, 3, public) and bob, on a server of
    this module's own."""
    root = tmp_path_factory.mktemp(f"versions_{request.param}")
    store = root / "store"
    with contextlib.ExitStack() as stack:
        db_url = (f"sqlite:///{root / 'registry.db'}" if request.param == "sqlite"
                  else stack.enter_context(postgres_schema("versions")))
        live = Server("", db_url, bootstrap_admin(db_url))
        engine = db.make_engine(db_url)
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                for name in ("acme", "bob"):
                    tenant = service.create_tenant(session, name)
                    _, live.keys[name] = service.create_key(session, tenant.id)
                    live.tenant_ids[name] = tenant.id
        finally:
            engine.dispose()
        for spec in ("r4", "r8qv", "r16rs"):
            assert run_registry_cli([
                "adapters", "add", "--tenant", "acme", "--name", "bot", "--public",
                str(llama_adapters[spec]), "--database-url", db_url, "--adapter-dir",
                str(store), "--model", str(tiny_llama_dir)]) == 0
        client = EngineClient.from_config(EngineConfig(
            ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=256),
            LoRAConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=4),
            SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512)))
        stack.callback(client.close)
        app = create_app(ServerConfig(served_model_name=SERVED, usage_flush_interval_s=0.2),
                         RegistryConfig(db_url, str(store)), client)
        live.url = stack.enter_context(serve_app(app))
        yield live


def _complete(server: Server, tenant: str, model: str, user: str | None = None,
              max_tokens: int = 4) -> tuple[int | None, str]:
    """The version that answered (None: the base model) and the greedy text."""
    extra = {} if user is None else {"user": user}
    raw = server.openai(tenant).completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, **extra)
    header = raw.headers.get(VERSION_HEADER)
    return (None if header is None else int(header)), raw.parse().choices[0].text


def _state(server: Server, key: str | None = None) -> dict[str, Any]:
    path = "/v1/adapters/bot" if key else "/admin/api/tenants/acme/adapters/bot"
    response = server.call("GET", path, key)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _reset(server: Server) -> None:
    """Back to the fixture's state: version 3 current (promoted), no split."""
    response = server.call("POST", "/admin/api/tenants/acme/adapters/bot/promote",
                           json={"version": 3})
    assert response.status_code == 200, response.text


def _error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    message: str = error["message"]
    return message


def test_each_version_is_addressable(server: Server) -> None:
    texts = {}
    for n in (1, 2, 3):
        version, texts[n] = _complete(server, "acme", f"bot@{n}")
        assert version == n
        assert _complete(server, "bob", f"acme/bot@{n}") == (n, texts[n])
    assert _complete(server, "acme", "bot") == (3, texts[3])  # the latest by default
    assert _complete(server, "acme", "bot@v2") == (2, texts[2])  # as /v1/usage spells it
    assert _complete(server, "acme", SERVED)[0] is None
    client = server.openai("acme")
    for model, words in (("bot@4", "does not exist"), ("bot@0", "version number"),
                         ("bot@x", "version number"), ("bot@", "version number"),
                         ("bot@1@2", "version number"), ("bot@" + "9" * 5000, "version number"),
                         ("nobody/bot@1", "does not exist")):
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
        assert words in info.value.message and len(info.value.message) < 300, model
        assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):  # bob's own namespace has no bot
        server.openai("bob").completions.create(model="bot@1", prompt=PROMPT, max_tokens=1)


def test_models_list_each_name_once_with_its_versions_on_request(server: Server) -> None:
    _reset(server)
    client = server.openai("acme")
    bots = [m for m in client.models.list().data if "bot" in m.id]
    assert [(m.id, m.model_extra["version"]) for m in bots] == [("bot", 3)]  # type: ignore[index]
    assert "versions" not in bots[0].model_extra  # type: ignore[operator]
    listed = client.models.list(extra_query={"include_versions": "true"}).data
    bot = next(m for m in listed if m.id == "bot")
    assert [v["id"] for v in bot.model_extra["versions"]] == [  # type: ignore[index]
        "bot@1", "bot@2", "bot@3"]
    assert client.models.retrieve("bot@2").model_extra["version"] == 2  # type: ignore[index]
    assert client.models.retrieve("bot@2").id == "bot@2"
    others = [m.id for m in server.openai("bob").models.list().data]
    assert others.count("acme/bot") == 1
    with pytest.raises(openai.BadRequestError):
        client.models.list(extra_query={"include_versions": "maybe"})


def test_promote_rollback_and_delete_the_current_version(
        server: Server, tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    texts = {n: _complete(server, "acme", f"bot@{n}")[1] for n in (1, 2, 3)}
    # The tenant promotes with its own key; the bare name follows at once.
    state = server.call("POST", "/v1/adapters/bot/promote", server.keys["acme"],
                        json={"version": 2}).json()
    assert (state["current_version"], state["latest_version"], state["promoted"]) == (2, 3, True)
    assert [(v["version"], v["current"]) for v in state["versions"]] == [
        (1, False), (2, True), (3, False)]
    assert _complete(server, "acme", "bot") == (2, texts[2])
    assert _complete(server, "bob", "acme/bot") == (2, texts[2])
    assert [m.model_extra["version"] for m in server.openai("acme").models.list().data  # type: ignore[index]
            if m.id == "bot"] == [2]
    # Rollback by the operator: promote the older version.
    response = server.call("POST", "/admin/api/tenants/acme/adapters/bot/promote",
                           json={"version": 1})
    assert response.json()["current_version"] == 1
    assert _complete(server, "acme", "bot") == (1, texts[1])
    # Deleting the current version makes the previous active one current: promote 2, delete
    # it, and 1 (not the newer 3) answers.
    server.call("POST", "/v1/adapters/bot/promote", server.keys["acme"], json={"version": 2})
    deleted = server.call("DELETE", "/v1/adapters/bot", server.keys["acme"],
                          params={"version": "2"})
    assert deleted.status_code == 200, deleted.text
    assert _state(server)["current_version"] == 1
    assert _complete(server, "acme", "bot") == (1, texts[1])
    with pytest.raises(openai.NotFoundError):
        server.openai("acme").completions.create(model="bot@2", prompt=PROMPT, max_tokens=1)
    # Deleting version 1 too: none below it is left, so the next one up (3) is current.
    server.call("DELETE", "/admin/api/tenants/acme/adapters/bot", params={"version": "1"})
    assert _complete(server, "acme", "bot") == (3, texts[3])
    # Put back versions for the module's other tests (as new version numbers 4 and 5).
    for spec in ("r4", "r8qv"):
        with open(llama_adapters[spec] / "adapter_config.json", "rb") as config, \
                open(llama_adapters[spec] / "adapter_model.safetensors", "rb") as weights:
            response = server.call("POST", "/v1/adapters", server.keys["acme"],
                                   data={"name": "bot", "visibility": "public"},
                                   files={"adapter_config.json": config,
                                          "adapter_model.safetensors": weights})
        assert response.status_code == 201, response.text
    assert [v["version"] for v in _state(server)["versions"]] == [3, 4, 5]
    # Still promoted: new uploads do not take over, 3 stays until promoted away.
    assert _state(server)["current_version"] == 3


def test_a_split_is_sticky_by_user_and_reported_per_version(server: Server) -> None:
    _reset(server)
    versions = [v["version"] for v in _state(server)["versions"]]
    canary_version = versions[0] if versions[0] != 3 else versions[1]
    response = server.call("POST", "/v1/adapters/bot/split", server.keys["acme"],
                           json={"version": canary_version, "percent": 30})
    assert response.status_code == 200, response.text
    state = response.json()
    assert state["split"] == {"version": canary_version, "percent": 30.0}
    assert {v["version"]: v["traffic_percent"] for v in state["versions"]}[3] == 70.0
    canary = server.version_row("acme", "bot", canary_version)
    before = _usage(server)

    served: Counter[int] = Counter()  # acme's requests per version, as the headers say

    def call(user: str | None) -> int:
        version, _ = _complete(server, "acme", "bot", user=user, max_tokens=1)
        assert version is not None
        served[version] += 1
        return version

    def side(user: str) -> int:
        point = user_point(canary, server.tenant_ids["acme"], user)
        return canary_version if point * 100 < 30 else 3

    # Each user's side is exactly the gateway's split function's, and stays on it.
    users = [f"user-{i}" for i in range(120)]
    assert [call(user) for user in users] == [side(user) for user in users]
    assert [call(user) for user in users[:20]] == [side(user) for user in users[:20]]
    assert served[canary_version] > 10 and served[3] > 50, served
    # Without a user each request draws its side.
    assert {call(None) for _ in range(40)} == {3, canary_version}
    # Another tenant calling the public name is split too (by its own users).
    assert {_complete(server, "bob", "acme/bot", user=f"b{i}", max_tokens=1)[0]
            for i in range(40)} == {3, canary_version}

    # Usage and metrics count each version apart.
    after = _usage(server)
    for version in (3, canary_version):
        model = f"bot@v{version}"
        assert after.get(model, 0) - before.get(model, 0) == served[version], model
    labels = _metric_adapters(server)
    assert labels.get(f"acme/bot@{canary_version}", 0) >= served[canary_version]
    assert labels.get("acme/bot@3", 0) >= served[3]

    # Cancel: every request goes to the current version again; promote also ends a split.
    cancelled = server.call("DELETE", "/v1/adapters/bot/split", server.keys["acme"]).json()
    assert cancelled["split"] is None
    assert {_complete(server, "acme", "bot", user=u, max_tokens=1)[0] for u in users[:30]} \
        == {3}
    server.call("POST", "/admin/api/tenants/acme/adapters/bot/split",
                json={"version": canary_version, "percent": 100})
    assert _complete(server, "acme", "bot", max_tokens=1)[0] == canary_version
    promoted = server.call("POST", "/admin/api/tenants/acme/adapters/bot/promote",
                           json={"version": canary_version}).json()
    assert promoted["split"] is None and promoted["current_version"] == canary_version
    _reset(server)


def _usage(server: Server) -> dict[str, int]:
    response = server.call("GET", "/v1/usage", server.keys["acme"])
    assert response.status_code == 200, response.text
    out: Counter[str] = Counter()
    for row in response.json()["data"]:
        out[row["model"]] += row["requests"]
    return dict(out)


def _metric_adapters(server: Server) -> dict[str, float]:
    text = server.call("GET", "/metrics").text
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name == "loraplex_requests":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("tenant") == "acme":
                    out[sample.labels["adapter"]] += sample.value
    return dict(out)


@pytest.mark.parametrize("admin", [False, True])
def test_bad_input_is_a_4xx_that_changes_nothing(server: Server, admin: bool) -> None:
    _reset(server)
    versions = [v["version"] for v in _state(server)["versions"]]
    other = next(v for v in versions if v != 3)
    server.call("POST", "/admin/api/tenants/acme/adapters/bot/split",
                json={"version": other, "percent": 5})
    before = _state(server)
    base = "/admin/api/tenants/acme/adapters/bot" if admin else "/v1/adapters/bot"
    key = None if admin else server.keys["acme"]
    deleted = next(n for n in range(1, 3) if n not in versions)
    cases: list[tuple[str, str, Any, int, str | None, str]] = [
        ("POST", "/promote", {"version": 99}, 404, "model", "no version 99"),
        ("POST", "/promote", {"version": deleted}, 409, None, "deleted"),
        ("POST", "/promote", {"version": 0}, 400, "version", "version must be"),
        ("POST", "/promote", {"version": "2"}, 400, "version", "version must be"),
        ("POST", "/promote", {"version": 2**31}, 400, "version", "version must be"),
        ("POST", "/promote", {}, 400, "version", "version is required"),
        ("POST", "/promote", {"version": 3, "extra": 1}, 400, "extra", "unknown field"),
        ("POST", "/split", {"version": deleted, "percent": 10}, 409, None, "deleted"),
        ("POST", "/split", {"version": 99, "percent": 10}, 404, "model", "no version 99"),
        ("POST", "/split", {"version": 3, "percent": 10}, 409, None, "already the current"),
        ("POST", "/split", {"version": other, "percent": 100.5}, 400, "percent", "0 to 100"),
        ("POST", "/split", {"version": other, "percent": -1}, 400, "percent", "0 to 100"),
        ("POST", "/split", {"version": other, "percent": "10"}, 400, "percent", "0 to 100"),
        ("POST", "/split", {"version": other, "percent": True}, 400, "percent", "0 to 100"),
        ("POST", "/split", {"version": other}, 400, "percent", "percent is required"),
    ]
    for method, suffix, body, status, param, words in cases:
        message = _error(server.call(method, base + suffix, key, json=body), status, param)
        assert words in message, (suffix, body, message)
        assert _state(server) == before, (suffix, body)
    for raw in (b"1e999", b"[]", b"{", b'{"version": NaN}'):
        _error(server.call("POST", base + "/promote", key, content=raw,
                           headers={"Content-Type": "application/json"}), 400)
    other_name = "/admin/api/tenants/acme/adapters/nope" if admin else "/v1/adapters/nope"
    _error(server.call("POST", other_name + "/promote", key, json={"version": 1}), 404)
    assert _state(server) == before
    if not admin:  # another tenant's adapter is not found through the tenant API
        _error(server.call("POST", "/v1/adapters/bot/promote", server.keys["bob"],
                           json={"version": 3}), 404)
        assert _state(server) == before
    server.call("DELETE", base + "/split", key)
    _error(server.call("DELETE", base + "/split", key), 409)
    _reset(server)
