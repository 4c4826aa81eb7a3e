"""Structured outputs over HTTP with the official ``openai`` client: every answer that ends
with "stop" keeps to its constraint (``jsonschema``, ``re``), in batches that mix
constrained and free requests on different adapters, streamed and not; every spelling
(OpenAI's ``response_format``, vLLM's ``guided_*`` and ``structured_outputs``)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

LiveServer = Any  # tests/gateway/conftest.py's LiveServer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "population": {"type": "integer", "minimum": 0},
    "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def _chat(client: openai.OpenAI, model: str, i: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Describe city number {i}."}],
        max_tokens=80, seed=i, **kwargs).choices[0]


def test_constrained_answers_validate_in_mixed_batches(live: LiveServer) -> None:
    """json_schema, json_object and free requests on two adapters and the base model, at
    three temperatures, all in flight together: every constrained answer that stops keeps
    to its constraint."""
    client = live.openai("alice")
    models = ["sql", "summarizer", live.served_name]
    kinds: list[dict[str, Any] | None] = [RESPONSE_FORMAT, {"type": "json_object"}, None]
    jobs = [(model, temperature, kind, i) for i, (model, temperature, kind) in enumerate(
        (m, t, k) for m in models for t in (0.0, 0.7, 1.2) for k in kinds)]

    def run(job: tuple[str, float, dict[str, Any] | None, int]) -> tuple[Any, Any]:
        model, temperature, kind, i = job
        extra = {"response_format": kind} if kind else {}
        return kind, _chat(client, model, i, temperature=temperature, **extra)

    with ThreadPoolExecutor(9) as pool:
        results = list(pool.map(run, jobs))
    stopped = {"json_schema": 0, "json_object": 0}
    for kind, choice in results:
        if kind is None or choice.finish_reason != "stop":
            continue
        value = json.loads(choice.message.content)
        if kind["type"] == "json_schema":
            jsonschema.validate(value, SCHEMA)
        else:
            assert isinstance(value, dict)
        stopped[kind["type"]] += 1
    assert stopped["json_schema"] >= 4 and stopped["json_object"] >= 1, stopped


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_choice": ["positive", "negative"]},
     lambda text: text in ("positive", "negative")),
    ({"guided_regex": r"[A-Z]{2}-[0-9]{3}"},
     lambda text: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
    ({"structured_outputs": {"regex": r"[a-c]+!"}}, lambda text: re.fullmatch(r"[a-c]+!", text)),
    ({"guided_grammar": 'start: "<" /[a-z]{1,6}/ ">"'},
     lambda text: re.fullmatch(r"<[a-z]{1,6}>", text)),
    ({"guided_json": json.dumps(SCHEMA)},
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
])
def test_vllm_spellings_on_completions(live: LiveServer, extra: dict[str, Any],
                                       check: Any) -> None:
    client = live.openai("alice")
    for i in range(3):
        choice = client.completions.create(model="summarizer", prompt=f"label {i}:",
                                           max_tokens=60, temperature=0.9, seed=i,
                                           extra_body=extra).choices[0]
        assert choice.finish_reason == "stop", choice
        assert check(choice.text), choice.text


def test_streamed_greedy_answer_is_the_whole_answer(live: LiveServer) -> None:
    client = live.openai("alice")
    kwargs: dict[str, Any] = {"model": "sql", "temperature": 0.0, "max_tokens": 60,
                              "response_format": RESPONSE_FORMAT,
                              "messages": [{"role": "user", "content": "One city, please."}]}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [chunk.choices[0].delta.content or "" for chunk in
             client.chat.completions.create(stream=True, **kwargs) if chunk.choices]
    assert "".join(parts) == whole


def test_a_bad_schema_is_400_and_the_server_keeps_serving(live: LiveServer) -> None:
    client = live.openai("alice")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="sql", max_tokens=5, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "strnig"}}})
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    ok = client.chat.completions.create(model="sql", max_tokens=3,
                                        messages=[{"role": "user", "content": "x"}])
    assert ok.choices[0].finish_reason in ("stop", "length")


BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    # (route, the bad part of the body, the field the 400 names)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ("chat", {"extra_body": {"guided_json": {"not": {"type": "string"}}}}, "guided_json"),
    ("completion", {"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ("completion", {"extra_body": {"structured_outputs": {"regex": "a{2,1}"}}},
     "structured_outputs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strnig"}}}}}]},
     "tools[0].function.parameters"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {"required": ["x"]}, "then": {}}}}],
        "tool_choice": "required"}, "tools[0].function.parameters"),
    ("completion", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"3": -150}}, "logit_bias"),
    ("completion", {"extra_body": {"suffix": "tail"}}, "suffix"),
    ("completion", {"n": 1, "extra_body": {"best_of": 2}}, "best_of"),
]


def test_bad_constraints_are_400_and_the_engine_keeps_serving(live: LiveServer) -> None:
    client = live.openai("alice")
    for route, bad, param in BAD_REQUESTS:
        with pytest.raises(openai.BadRequestError) as info:
            if route == "chat":
                client.chat.completions.create(
                    model="summarizer", max_tokens=5,
                    messages=[{"role": "user", "content": "x"}], **bad)
            else:
                client.completions.create(model="summarizer", prompt="x", max_tokens=5, **bad)
        assert info.value.body["param"] == param, (bad, info.value.body)  # type: ignore[index]
    ok = _chat(client, "summarizer", 0, temperature=0.0, response_format=RESPONSE_FORMAT)
    assert ok.finish_reason in ("stop", "length")
    stats = live.wait_idle()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
