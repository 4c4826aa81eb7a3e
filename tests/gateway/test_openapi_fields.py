"""/openapi.json lists exactly the request fields the server reads: every field the parser
accepts is in the document and every field in the document is accepted (both lists come from
the code); the document's cross-field rules (one output constraint, a forced call alone)
agree with what the server answers."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from loraplex.gateway.schemas import CHAT_FIELDS, COMPLETION_FIELDS

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


@pytest.fixture(scope="module")
def request_schemas(live: LiveServer) -> dict[str, Any]:
    with live.http() as http:
        response = http.get("/openapi.json")
    assert response.status_code == 200
    schemas: dict[str, Any] = response.json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        jsonschema.Draft202012Validator.check_schema(schemas[name])
    return schemas


def test_the_document_lists_exactly_the_fields_the_parser_accepts(
        request_schemas: dict[str, Any]) -> None:
    for name, fields in (("CompletionRequest", COMPLETION_FIELDS),
                         ("ChatCompletionRequest", CHAT_FIELDS)):
        documented = set(request_schemas[name]["properties"])
        assert documented == set(fields), (name, documented ^ set(fields))
        assert request_schemas[name]["additionalProperties"] is False


WEATHER_TOOL = {"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT_BODIES: list[tuple[dict[str, Any], bool]] = [
    # (extra fields, accepted by the server)
    ({"guided_regex": "abc"}, True),
    ({"guided_choice": ["yes", "no"]}, True),
    ({"guided_grammar": 'start: "ab"'}, True),
    ({"guided_json": {"type": "object"}}, True),
    ({"structured_outputs": {"regex": "ab"}}, True),
    ({"structured_outputs": {"json_object": True}}, True),
    ({"response_format": {"type": "text"}, "guided_choice": ["a"]}, True),
    ({"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1,
      "ignore_eos": True, "stop_token_ids": [3], "include_stop_str_in_output": True,
      "cache_salt": "x", "salt": "y", "store": False, "metadata": {"k": "v"},
      "echo": True, "functions": [], "function_call": "none"}, True),
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto", "guided_regex": "ab"}, True),
    ({"guided_regex": "ab", "guided_choice": ["a"]}, False),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, False),
    ({"structured_outputs": {"regex": "ab", "choice": ["a"]}}, False),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "ab"}, False),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required",
      "structured_outputs": {"json_object": True}}, False),
    ({"functions": [{"name": "w"}]}, False),
    ({"function_call": "auto"}, False),
]


@pytest.mark.parametrize(("extra", "accepted"), CHAT_BODIES)
def test_the_document_and_the_server_agree(live: LiveServer, request_schemas: dict[str, Any],
                                           extra: dict[str, Any], accepted: bool) -> None:
    body = {"model": live.served_name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]} | extra
    valid = jsonschema.Draft202012Validator(
        request_schemas["ChatCompletionRequest"]).is_valid(body)
    with live.http() as http:
        response = http.post("/v1/chat/completions", content=json.dumps(body),
                             headers={"Authorization": f"Bearer {live.keys['alice']}",
                                      "Content-Type": "application/json"})
    assert (response.status_code == 200) is accepted, response.text
    assert valid is accepted
    if not accepted:
        assert response.status_code == 400 and response.json()["error"]["param"] in extra
