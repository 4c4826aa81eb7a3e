"""Malformed and out-of-range requests: each gets its status and a message naming the
problem, in OpenAI's error shape."""

from __future__ import annotations

import json
import shutil
from typing import Any

import openai
import pytest

from loraplex.registry import db, service

LiveServer = Any  # tests/gateway/conftest.py's LiveServer


def post(live: LiveServer, path: str, body: Any, *, tenant: str = "alice",
         raw: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
    hdrs = {"Authorization": f"Bearer {live.keys[tenant]}",
            "Content-Type": "application/json"} | (headers or {})
    content = raw if raw is not None else json.dumps(body).encode()
    with live.http() as http:
        return http.post(path, content=content, headers=hdrs)


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"[1, 2]", b'"text"',
                                 b'{"model": NaN}', b"\xff\xfe"])
def test_malformed_json_is_400(live: LiveServer, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = error_of(post(live, path, None, raw=raw), 400)
        assert error["type"] == "invalid_request_error"
        assert "JSON" in error["message"]


COMPLETION_CASES = [
    # (body overrides, param named in the error, a word of the message)
    ({"max_tokens": "10"}, "max_tokens", "integer"),
    ({"max_tokens": -1}, "max_tokens", "between"),
    ({"max_tokens": 0}, "max_tokens", "between"),
    ({"max_tokens": 10**12}, "max_tokens", "between"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"n": 0}, "n", "between"),
    ({"n": 100}, "n", "between"),
    ({"n": 1.5}, "n", "integer"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": -0.5}, "temperature", "[0, 2]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"seed": "x"}, "seed", "integer"),
    ({"seed": 2**70}, "seed", "between"),
    ({"stop": 3}, "stop", "string"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most"),
    ({"stop": [""]}, "stop", "characters"),
    ({"logprobs": 50}, "logprobs", "between"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stream_options": []}, "stream_options", "object"),
    ({"user": 5}, "user", "string"),
    ({"model": 5}, "model", "string"),
    ({"model": None}, "model", "required"),
    ({"prompt": None}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [1, "a"]}, "prompt", "token ids"),
    ({"prompt": [999999]}, "prompt", "out of range"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": "\ud800"}, "prompt", "surrogate"),
    ({"echo": "yes"}, "echo", "boolean"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"presence_penalty": 2.5}, "presence_penalty", "must be in"),
    ({"frequency_penalty": -3}, "frequency_penalty", "must be in"),
    ({"frequency_penalty": "a"}, "frequency_penalty", "number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"min_tokens": 5}, "min_tokens", "max_tokens"),
    ({"logit_bias": []}, "logit_bias", "object"),
    ({"logit_bias": {"x1": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1": "5"}}, "logit_bias", "numbers"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"-1": 5}}, "logit_bias", ">= 0"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "out of range"),
    ({"logit_bias": {"9" * 5000: 5}}, "logit_bias", "out of range"),
    ({"logit_bias": {"7": 100, "07": 100}}, "logit_bias", "twice"),  # not +200 on 7
    ({"logit_bias": {" 7": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"\u0663": 5}}, "logit_bias", "token ids"),  # an Arabic-Indic 3
    ({"logit_bias": {"1": 10**400}}, "logit_bias", "too large"),
    ({"temperature": 10**400}, "temperature", "too large"),
    ({"presence_penalty": -(10**400)}, "presence_penalty", "too large"),
    ({"stop_token_ids": [999999]}, "stop_token_ids", "out of range"),
]


@pytest.mark.parametrize(("override", "param", "word"), COMPLETION_CASES)
def test_bad_completion_parameters_are_400_naming_the_param(
        live: LiveServer, override: dict[str, Any], param: str, word: str) -> None:
    body = {"model": live.served_name, "prompt": "hello", "max_tokens": 2} | override
    error = error_of(post(live, "/v1/completions", body), 400)
    assert error["param"] == param
    assert word in error["message"]


_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}

CHAT_CASES = [
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hi"}, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "text"),
    ({"messages": [5]}, "messages[0]", "object"),
    ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs", "between"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", "between"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "a-z"),
    ({"tools": [_TOOL, {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {"x": {"type": 7}}}}}]},
     "tools[1].function.parameters", "compiled"),
    ({"tools": [_TOOL, {"type": "function", "function": {"name": "bad", "parameters": 3}}]},
     "tools[1].function.parameters", "schema"),
    ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "does not declare"),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"tools": [_TOOL], "tool_choice": "sometimes"}, "tool_choice", "expected"),
    ({"tools": [_TOOL], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tool_choice", "response_format"),
    ({"tools": [_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", "id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0]", "function"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": '"\\ud800"'}}]}]},
     "messages[0].tool_calls[0].function.arguments", "surrogate"),  # escaped in the JSON
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"schema": {"type": "strnig"}}}},
     "response_format", "compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format", "compiled"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "compiled"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "compiled"),
    ({"guided_choice": []}, "guided_choice", "list"),
    ({"guided_choice": ["\ud800"]}, "guided_choice", "surrogate"),
    ({"store": "yes"}, "store", "boolean"),
    ({"metadata": {"k": 1}}, "metadata", "strings"),
    ({"metadata": []}, "metadata", "object"),
    ({"echo": 1}, "echo", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs",
     "second"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "unknown"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "second"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}, "strict": "yes"}}}, "response_format", "boolean"),
]


@pytest.mark.parametrize(("override", "param", "word"), CHAT_CASES)
def test_bad_chat_parameters_are_400_naming_the_param(
        live: LiveServer, override: dict[str, Any], param: str, word: str) -> None:
    body = {"model": live.served_name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]} | override
    error = error_of(post(live, "/v1/chat/completions", body), 400)
    assert error["param"] == param
    assert word in error["message"]


def test_tool_call_arguments_nested_past_the_parser_are_text(live: LiveServer) -> None:
    call = {"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "[" * 20_000}}
    body = {"model": live.served_name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c", "content": "42"}]}
    response = post(live, "/v1/chat/completions", body)
    # rendered as the text it is, or refused as too long for the context; never a 500
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert error_of(response, 400)["code"] == "context_length_exceeded"


@pytest.mark.parametrize("query", ["since=9999-12-31T23:59:59-14:00",
                                   "until=0001-01-01T00:00:00%2B14:00",
                                   "since=2030-01-01T00:00:00&until=2029-01-01T00:00:00"])
def test_usage_windows_past_the_calendar_or_reversed_are_empty(live: LiveServer,
                                                               query: str) -> None:
    # Valid date-times all (the OpenAPI document's fuzzer sends such); past the calendar
    # in UTC they had been a 500.
    with live.http() as http:
        response = http.get(f"/v1/usage?{query}",
                            headers={"Authorization": f"Bearer {live.keys['alice']}"})
    assert response.status_code == 200, response.text
    assert response.json()["data"] == []


def test_unknown_fields_are_400_as_openai_answers(live: LiveServer) -> None:
    body = {"model": live.served_name, "prompt": "hello", "max_tokens": 2,
            "some_future_option": {"x": 1}}
    error = error_of(post(live, "/v1/completions", body), 400)
    assert error["param"] == "some_future_option"
    assert "Unrecognized request argument supplied" in error["message"]
    chat = {"model": live.served_name, "max_tokens": 2, "prompt": "not a chat field",
            "messages": [{"role": "user", "content": "hi"}]}
    assert error_of(post(live, "/v1/chat/completions", chat), 400)["param"] == "prompt"


def test_known_neutral_fields_and_vendor_extras_are_accepted(live: LiveServer) -> None:
    body = {"model": live.served_name, "prompt": "hello", "max_tokens": 2, "best_of": 1,
            "presence_penalty": 0, "top_k": 5, "ignore_eos": True, "cache_salt": "ignored"}
    response = post(live, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_unknown_model_is_404(live: LiveServer) -> None:
    error = error_of(post(live, "/v1/completions", {"model": "nope", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_prompt_over_the_context_length_is_400_context_length_exceeded(
        live: LiveServer) -> None:
    """As OpenAI and vLLM answer it: 400, code context_length_exceeded, their wording."""
    max_len = live.client.description.max_model_len
    body = {"model": live.served_name, "prompt": [5] * max_len, "max_tokens": 1}
    error = error_of(post(live, "/v1/completions", body), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{max_len + 1} tokens ({max_len} in the messages, 1 in the completion).")
    # A prompt that fits but leaves no room for max_tokens names max_tokens.
    body = {"model": live.served_name, "prompt": [5] * (max_len - 10), "max_tokens": 50}
    error = error_of(post(live, "/v1/completions", body), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    with live.openai("alice") as client, pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=live.served_name, messages=[{"role": "user", "content": "word " * max_len}])
    assert chat.value.code == "context_length_exceeded"
    assert "maximum context length" in chat.value.message


def test_oversized_body_is_413(live: LiveServer) -> None:
    prompt = "x" * (live.max_body_bytes + 10)
    error = error_of(post(live, "/v1/completions", {"model": live.served_name,
                                                    "prompt": prompt}), 413)
    assert error["code"] == "payload_too_large"

    # Without a Content-Length (chunked), the body is counted while it is read.
    def chunks() -> Any:
        for _ in range(live.max_body_bytes // 1024 + 2):
            yield b" " * 1024

    with live.http() as http:
        response = http.post("/v1/completions", content=chunks(),
                             headers={"Authorization": f"Bearer {live.keys['alice']}"})
    assert response.status_code == 413


def test_unknown_route_and_method_in_openai_shape(live: LiveServer) -> None:
    with live.http() as http:
        assert error_of(http.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
        assert http.get("/v1/completions").status_code == 405
        assert "error" in http.get("/v1/completions").json()


def test_adapter_whose_files_do_not_match_its_digest_is_422(live: LiveServer) -> None:
    """A registry row whose stored weights are not the bytes it names is never served."""
    folder = live.adapter_store / "zz" / "tampered"
    shutil.copytree(live.adapter_dirs["alice/sql"], folder)
    engine = db.make_engine(live.db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            frank = service.get_tenant_by_name(session, "frank")
            service.register_adapter(
                session, tenant_id=frank.id, name="tampered", digest="f" * 64, size_bytes=1,
                storage_path="zz/tampered", base_model=str(live.model_dir), rank=4,
                alpha=8.0, use_rslora=False, target_modules=["q_proj"])
    finally:
        engine.dispose()
    error = error_of(post(live, "/v1/completions", {"model": "tampered", "prompt": "hi",
                                                    "max_tokens": 2}, tenant="frank"), 422)
    assert error["param"] == "model" and "digest" in error["message"]
    stats = live.wait_idle()
    assert stats["kv_blocks_used"] == 0
