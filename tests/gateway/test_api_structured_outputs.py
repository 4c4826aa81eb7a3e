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


def test_json_schema_answers_validate_in_mixed_batches(live: LiveServer) -> None:
    client = live.openai("alice")
    jobs = []
    for i in range(18):
        model = ["sql", "summarizer", live.served_name][i % 3]
        temperature = [0.0, 0.7, 1.2][(i // 3) % 3]
        constrained = i % 2 == 0
        jobs.append((model, temperature, constrained, i))

    def run(job: tuple[str, float, bool, int]) -> tuple[bool, Any]:
        model, temperature, constrained, i = job
        extra = {"response_format": RESPONSE_FORMAT} if constrained else {}
        return constrained, _chat(client, model, i, temperature=temperature, **extra)

    with ThreadPoolExecutor(9) as pool:
        results = list(pool.map(run, jobs))
    stopped = 0
    for constrained, choice in results:
        if constrained and choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            stopped += 1
    assert stopped >= 5


def test_json_object_answers_are_objects(live: LiveServer) -> None:
    client = live.openai("alice")
    stopped = 0
    for i in range(6):
        choice = _chat(client, "sql", i, temperature=0.8,
                       response_format={"type": "json_object"})
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            stopped += 1
    assert stopped >= 1


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
