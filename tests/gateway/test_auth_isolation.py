"""Keys and tenant isolation: who may call what, and what a refusal reveals."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from loraplex.gateway.auth import cache_salt
from loraplex.registry import db, service

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


def model_ids(live: LiveServer, tenant: str) -> set[str]:
    with live.openai(tenant) as client:
        return {m.id for m in client.models.list()}


def test_each_tenant_sees_own_adapters_and_public_ones(live: LiveServer) -> None:
    base = live.served_name
    assert model_ids(live, "alice") == {base, "sql", "summarizer"}
    assert model_ids(live, "bob") == {base, "secret", "alice/summarizer"}
    assert model_ids(live, "carol") == {base, "alice/summarizer"}


@pytest.mark.parametrize("model", ["secret", "bob/secret", "alice/sql", "nobody/secret",
                                   "does-not-exist", "a/b/c"])
def test_cross_tenant_and_unknown_models_are_the_same_404(live: LiveServer,
                                                          model: str) -> None:
    with live.openai("carol") as client:
        with pytest.raises(openai.NotFoundError) as completion:
            client.completions.create(model=model, prompt="hi", max_tokens=1)
        with pytest.raises(openai.NotFoundError) as chat:
            client.chat.completions.create(model=model, max_tokens=1,
                                           messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.NotFoundError) as retrieve:
            client.models.retrieve(model)
    for exc in (completion.value, chat.value):
        body: Any = exc.body
        assert body["code"] == "model_not_found" and body["param"] == "model"
        # Whether the adapter exists elsewhere is not revealed: the message is the same.
        assert body["message"] == (f"the model {model!r} does not exist or you do not have "
                                   "access to it")
    assert retrieve.value.status_code == 404


def test_own_adapter_by_full_name(live: LiveServer) -> None:
    with live.openai("bob") as client:
        result = client.completions.create(model="bob/secret", prompt="hi", max_tokens=2)
        assert client.models.retrieve("secret").id == "secret"
    assert result.model == "bob/secret"


@pytest.mark.parametrize("header", [None, "Bearer", "Basic abc", "Bearer lpx-wrong",
                                    "Bearer not-a-key"])
def test_missing_or_wrong_key_is_401(live: LiveServer, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    with live.http() as http:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/usage"),
                             ("GET", "/admin/api/engine"), ("GET", "/metrics")):
            response = http.request(method, path, headers=headers,
                                    json={"model": live.served_name, "prompt": "x"})
            assert response.status_code == 401, (method, path)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["message"]
            assert response.headers["www-authenticate"].startswith("Bearer")


def test_openai_client_with_wrong_key_is_authentication_error(live: LiveServer) -> None:
    with live.openai(key="lpx-" + "x" * 43) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_revoked_key_fails_at_once(live: LiveServer) -> None:
    engine = db.make_engine(live.db_url)
    try:
        factory = db.make_session_factory(engine)
        with db.transaction(factory) as session:
            tenant = service.get_tenant_by_name(session, "carol")
            row, key = service.create_key(session, tenant.id, name="short-lived")
        with live.openai(key=key) as client:
            assert live.served_name in {m.id for m in client.models.list()}
            with db.transaction(factory) as session:
                service.revoke_key(session, row.id)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
    finally:
        engine.dispose()


def test_admin_route_needs_admin_key(live: LiveServer, bearer: Any) -> None:
    with live.http() as http:
        for path in ("/admin/api/engine", "/metrics"):
            denied = http.get(path, headers=bearer(live.keys["alice"]))
            assert denied.status_code == 403
            assert denied.json()["error"]["type"] == "permission_error"
            assert http.get(path, headers=bearer(live.admin_key)).status_code == 200


def test_salt_in_body_is_ignored_and_salts_differ_per_tenant(live: LiveServer) -> None:
    # A body salt must change nothing: same greedy output, no error.
    with live.openai("alice") as client:
        plain = client.completions.create(model=live.served_name, prompt="hello world",
                                          max_tokens=4, temperature=0.0)
        salted = client.completions.create(model=live.served_name, prompt="hello world",
                                           max_tokens=4, temperature=0.0,
                                           extra_body={"cache_salt": "bob-salt",
                                                       "salt": "x"})
    assert plain.choices[0].text == salted.choices[0].text
    secret = b"k" * 32
    assert cache_salt(secret, 1) != cache_salt(secret, 2)
    assert cache_salt(secret, 1) != cache_salt(b"j" * 32, 1)


def test_tenants_do_not_share_prefix_cache_blocks(live: LiveServer) -> None:
    # The same 3-block prompt from two tenants: the second tenant gets no cache hit.
    prompt = list(range(3, 3 + 50))
    before = live.engine_stats()
    with live.openai("alice") as alice, live.openai("bob") as bob:
        alice.completions.create(model=live.served_name, prompt=prompt, max_tokens=1)
        mid = live.engine_stats()
        bob.completions.create(model=live.served_name, prompt=prompt, max_tokens=1)
        after_bob = live.engine_stats()
        alice.completions.create(model=live.served_name, prompt=prompt, max_tokens=1)
        after_alice = live.engine_stats()
    assert mid["prefix_cache_hit_tokens"] == before["prefix_cache_hit_tokens"]
    assert after_bob["prefix_cache_hit_tokens"] == mid["prefix_cache_hit_tokens"]
    assert after_alice["prefix_cache_hit_tokens"] > after_bob["prefix_cache_hit_tokens"]


def test_suspended_tenant_is_403_saying_so(live: LiveServer) -> None:
    engine = db.make_engine(live.db_url)
    try:
        factory = db.make_session_factory(engine)
        with db.transaction(factory) as session:
            tenant = service.create_tenant(session, "dave")
            _, key = service.create_key(session, tenant.id)
        with live.openai(key=key) as client:
            client.models.list()
            with db.transaction(factory) as session:
                service.set_tenant_status(session, tenant.id, "suspended")
            with pytest.raises(openai.PermissionDeniedError) as caught:
                client.models.list()
            with pytest.raises(openai.PermissionDeniedError):
                client.completions.create(model=live.served_name, prompt="hi", max_tokens=1)
        body: Any = caught.value.body
        assert body["code"] == "tenant_suspended" and body["type"] == "permission_error"
        assert "'dave' of this API key is suspended" in body["message"]
        # A revoked key of a suspended tenant is still just an incorrect key.
        with db.transaction(factory) as session:
            service.revoke_key(session, service.list_keys(session, tenant.id)[0].id)
        with live.openai(key=key) as client, pytest.raises(openai.AuthenticationError):
            client.models.list()
    finally:
        engine.dispose()
