"""A hostile tenant's grammars over HTTP, with the official ``openai`` client: the schema
that panicked the grammar engine (as ``response_format`` and as a tool's parameters),
schemas nested past any limit, a NUL in a regex, a grammar no output satisfies. Each is a
400 naming its field; the server serves on; and a step loop that dies fails ``/health``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

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
from loraplex.errors import EngineDeadError
from loraplex.gateway.app import create_app
from loraplex.registry import db
from loraplex.testing import bootstrap_admin

LiveServer = Any  # tests/gateway/conftest.py's LiveServer

PANIC = {"type": "object", "properties": {"x": {"type": "string", "maxLength": "a" * 96 + "😀"}}}
MESSAGES = [{"role": "user", "content": "Give me JSON."}]


def _bad_request(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    return body


def _still_serving(live: LiveServer) -> None:
    client = live.openai("carol")
    answer = client.completions.create(model=live.served_name, prompt="hi", max_tokens=3)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{live.url}/health", timeout=30).json() == {"status": "ok"}


def test_the_panicking_schema_is_a_400_wherever_it_is_sent(live: LiveServer) -> None:
    client = live.openai("carol")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": PANIC}}
    body = _bad_request(lambda: client.chat.completions.create(
        model=live.served_name, messages=MESSAGES, max_tokens=5, response_format=fmt))
    assert body["param"] == "response_format" and "cannot be compiled" in body["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": PANIC}}]
    for choice in ("auto", "required"):
        body = _bad_request(lambda c=choice: client.chat.completions.create(
            model=live.served_name, messages=MESSAGES, max_tokens=5, tools=tools,
            tool_choice=c))
        assert body["param"] == "tools[0].function.parameters", body
    _still_serving(live)


def test_nesting_past_the_limit_is_a_400(live: LiveServer) -> None:
    """As JSON text past Python's recursion limit, as JSON text nested 200 deep, and as an
    object nested 970 levels (under the body parser's limit, past the schema's)."""
    client = live.openai("carol")
    for text in ("[" * 5000 + "]" * 5000, '{"type": "array", "items": ' * 200 + "{}" + "}" * 200):
        body = _bad_request(lambda t=text: client.completions.create(
            model=live.served_name, prompt="x", max_tokens=2, extra_body={"guided_json": t}))
        assert body["param"] == "guided_json" and "nested more than 64" in body["message"]
    # The openai client cannot encode these (its own recursion limit): raw bodies. Nested
    # 600 levels, the body parses and the schema is refused; 970 levels (the report's),
    # past what the body parser takes with the server's own frames on the stack, the body
    # is refused: a 400 either way, never the 500 it was.
    for levels, field in ((300, "guided_json"), (485, None)):
        schema = '{"type": "object", "properties": {"a": ' * levels + "{}" + "}}" * levels
        raw = (f'{{"model": "{live.served_name}", "prompt": "x", "max_tokens": 2, '
               f'"guided_json": {schema}}}')
        response = httpx.post(f"{live.url}/v1/completions", content=raw, timeout=30,
                              headers={"Authorization": f"Bearer {live.keys['carol']}",
                                       "Content-Type": "application/json"})
        error = response.json()["error"]
        assert response.status_code == 400, error
        if field is not None:
            assert error["param"] == field and "nested more than 64" in error["message"]
    _still_serving(live)


def test_a_nul_in_a_regex_or_grammar_is_a_400(live: LiveServer) -> None:
    client = live.openai("carol")
    for field, value in (("guided_regex", "a\x00b"), ("guided_grammar", 'start: "a\x00"')):
        body = _bad_request(lambda f=field, v=value: client.completions.create(
            model=live.served_name, prompt="x", max_tokens=2, extra_body={f: v}))
        assert body["param"] == field and "NUL" in body["message"]


def test_a_grammar_no_output_satisfies_is_never_a_stop(live: LiveServer) -> None:
    client = live.openai("carol")
    for schema, words in (({"$ref": "#"}, "no output satisfies it"),
                          ({"type": "string", "pattern": "^a{1000000}$"}, "cannot be followed")):
        body = _bad_request(lambda s=schema: client.completions.create(
            model=live.served_name, prompt="x", max_tokens=20,
            extra_body={"guided_json": s}))
        assert body["param"] == "guided_json" and words in body["message"], body
    # Streamed: a 400 when it fails before the first token was sent (as here), else the
    # error event that ends the stream; never a "stop".
    with pytest.raises(openai.APIError, match="cannot be followed"):
        stream = client.completions.create(
            model=live.served_name, prompt="x", max_tokens=20, stream=True,
            extra_body={"guided_json": {"type": "string", "pattern": "^a{1000000}$"}})
        for chunk in stream:
            assert all(c.finish_reason != "stop" for c in chunk.choices)
    _still_serving(live)


def test_a_dead_step_loop_fails_health(tiny_llama_dir: Path, tmp_path: Path,
                                       serve_app: Any) -> None:
    """An engine whose step loop died never comes back: /health is 503 so a liveness probe
    restarts the server (it stayed 200 while every request got 503)."""

    class Fatal(BaseException):
        """What no step loop survives: a BaseException it does not catch."""

    def fail(_engine: Any) -> None:
        raise Fatal("the step loop is gone")

    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    db.upgrade(db_url)
    key = bootstrap_admin(db_url)
    client = EngineClient.from_config(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), CacheConfig(num_kv_blocks=32), LoRAConfig(),
        SchedulerConfig(max_num_seqs=2)))
    app = create_app(ServerConfig(served_model_name="tiny"),
                     RegistryConfig(db_url, str(tmp_path / "store")), client)
    try:
        with serve_app(app) as url:
            assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
            with pytest.raises(EngineDeadError):
                asyncio.run(client.run_in_engine(fail))
            health = httpx.get(f"{url}/health", timeout=30)
            assert health.status_code == 503 and health.json() == {"status": "engine failed"}
            with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as api, \
                    pytest.raises(openai.InternalServerError):
                api.completions.create(model="tiny", prompt="hi", max_tokens=2)
    finally:
        client.close()
