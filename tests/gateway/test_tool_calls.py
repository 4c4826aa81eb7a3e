"""Tool calls on chat completions: with ``required`` or a named function every answer that
stops is calls that parse and validate against the declared parameters schema
(``jsonschema``), through the official ``openai`` client, streamed and not; ``auto`` reads
the calls out of free text; conversations go on with the ``tool`` role; the prompt shows the
tools through the template's own ``tools``, or the fallback system message."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import openai
import pytest

from loraplex.engine.grammar import GrammarCompiler
from loraplex.gateway.schemas import parse_chat_completion
from loraplex.gateway.state import Tokenizers
from loraplex.gateway.tools import ToolCallReader, parse_tools, template_input
from loraplex.testing import build_tokenizer

LiveServer = Any  # tests/gateway/conftest.py's LiveServer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function",
                     "function": {"name": "get_weather", "parameters": WEATHER}}]
TWO_TOOLS: list[Any] = [*TOOLS, {"type": "function",
                                 "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]


def _check_calls(message: Any, names: set[str]) -> None:
    assert message.content is None
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(("tools", "choice", "names"), [
    (TOOLS, "required", {"get_weather"}),
    (TWO_TOOLS, {"type": "function", "function": {"name": "add"}}, {"add"}),
])
def test_forced_calls_parse_and_validate(live: LiveServer, tools: list[Any], choice: Any,
                                         names: set[str]) -> None:
    client = live.openai("alice")
    for i, model in enumerate(["sql", "summarizer", live.served_name] * 2):
        choice_ = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=tools, tool_choice=choice,
            parallel_tool_calls=False, temperature=1.0, seed=i).choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        _check_calls(choice_.message, names)
        assert len(choice_.message.tool_calls) == 1


def test_parallel_calls_each_validate(live: LiveServer) -> None:
    client = live.openai("alice")
    done = 0
    for i in range(4):
        choice = client.chat.completions.create(
            model="sql", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            temperature=0.8, seed=i).choices[0]
        if choice.finish_reason == "tool_calls":  # not cut by the context's end
            _check_calls(choice.message, {"get_weather"})
            done += 1
    assert done >= 1


def test_streamed_calls_accumulate_to_the_whole_answer(live: LiveServer) -> None:
    client = live.openai("alice")
    kwargs: dict[str, Any] = {"model": "summarizer", "messages": MESSAGES, "tools": TOOLS,
                              "tool_choice": "required", "parallel_tool_calls": False,
                              "temperature": 0.0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    _check_calls(streamed.message, {"get_weather"})
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] \
        == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.index for tc in calls] == [0] and calls[0].id.startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_conversation_goes_on_after_a_call(live: LiveServer) -> None:
    client = live.openai("alice")
    first = client.chat.completions.create(model="sql", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", seed=1).choices[0]
    call = first.message.tool_calls[0]  # type: ignore[index]
    messages = [*MESSAGES, first.message,
                {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]
    kwargs: dict[str, Any] = {"model": "sql", "messages": messages, "tools": TOOLS,
                              "max_tokens": 12, "temperature": 0.0}
    again = client.chat.completions.create(**kwargs).choices[0]
    assert again.finish_reason in ("stop", "length")  # auto: free text from this model
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert deltas[0].content is None  # may stay null, as with calls only
    assert "".join(d.content or "" for d in deltas) == again.message.content


def test_bad_tools_are_400_and_the_server_keeps_serving(live: LiveServer) -> None:
    client = live.openai("alice")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strnig"}}}}}]
    for tools, choice, param in ((bad, "auto", "tools[0].function.parameters"),
                                 (TOOLS, {"type": "function", "function": {"name": "nope"}},
                                  "tool_choice")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="sql", messages=MESSAGES, tools=tools,
                                           tool_choice=choice, max_tokens=3)
        assert info.value.body["param"] == param  # type: ignore[index]
    ok = client.chat.completions.create(model="sql", max_tokens=3, messages=MESSAGES)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def checker() -> Iterator[GrammarCompiler]:
    """What the gateway checks tool schemas with: a compiler for any tokenizer."""
    compiler = GrammarCompiler(None, 0, ())
    yield compiler
    compiler.close()


def test_parameters_with_definitions_compile_inside_the_call_grammar(
        checker: GrammarCompiler) -> None:
    pydantic_style = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}},
                      "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}
    tools = parse_tools({"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": pydantic_style}}]})
    assert tools is not None
    grammar = tools.grammar()
    assert grammar is not None
    checker.check(grammar)


# --- reading calls out of free text (auto) ----------------------------------------------


AUTO = parse_tools({"tools": TWO_TOOLS})
CALL = '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("plain answer", "plain answer", []),
    ("Let me add. " + CALL, "Let me add. ", [("add", '{"a": 3}')]),
    (CALL + "\n" + CALL + "\n", "", [("add", '{"a": 3}')] * 2),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ("<tool_call>{broken", "<tool_call>{broken", []),
    ("a <tool_ b", "a <tool_ b", []),
])
def test_auto_reads_calls_the_same_streamed_or_whole(text: str, content: str,
                                                     calls: list[tuple[str, str]]) -> None:
    assert AUTO is not None
    whole = ToolCallReader(AUTO)
    got = whole.feed(text)[0] + whole.close()[0]
    assert got == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    streamed = ToolCallReader(AUTO)
    pieces = [streamed.feed(ch)[0] for ch in text]
    assert "".join(pieces) + streamed.close()[0] == content
    assert [(c.name, c.arguments) for c in streamed.calls] == calls


def test_without_parallel_calls_a_second_block_stays_text() -> None:
    tools = parse_tools({"tools": TWO_TOOLS, "parallel_tool_calls": False})
    assert tools is not None
    reader = ToolCallReader(tools)
    assert reader.feed(CALL + CALL)[0] + reader.close()[0] == CALL
    assert len(reader.calls) == 1


BARE = None if AUTO is None else replace(AUTO, bare=True)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "add", "parameters": {"a": 3}}', "", [("add", '{"a": 3}')]),
    (' {"name": "add", "arguments": {"a": 3}}', "", [("add", '{"a": 3}')]),
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ('{"a": 1} is JSON', '{"a": 1} is JSON', []),
    ("plain " + CALL, "plain ", [("add", '{"a": 3}')]),
    ('{"name": "add", "parameters": {"a": 3}}; {"name": "get_weather", "parameters": {}}',
     "", [("add", '{"a": 3}'), ("get_weather", "{}")]),
    ('{"name": "add", "parameters": {"a": 3}} and more',
     '{"name": "add", "parameters": {"a": 3}} and more', []),
])
def test_a_native_template_answer_may_be_a_bare_json_call(
        text: str, content: str, calls: list[tuple[str, str]]) -> None:
    """Llama 3's template asks for a call as a bare JSON object (several separated by
    "; "): auto reads it too, held whole until the answer ends (streamed and whole
    alike)."""
    assert BARE is not None
    for pieces in ([text], list(text)):
        reader = ToolCallReader(BARE)
        got = "".join(reader.feed(p)[0] for p in pieces)
        rest, late = reader.close()
        assert got + rest == content
        assert [(c.name, c.arguments) for c in reader.calls] == calls
        assert len(late) == (len(calls) if not text.startswith("plain") else 0)


def test_bare_calls_beyond_parallel_tool_calls_false_stay_text() -> None:
    tools = parse_tools({"tools": TWO_TOOLS, "parallel_tool_calls": False})
    assert tools is not None
    reader = ToolCallReader(replace(tools, bare=True))
    text = '{"name": "add", "parameters": {"a": 3}}; {"name": "add", "parameters": {"a": 4}}'
    assert reader.feed(text)[0] + reader.close()[0] == text and not reader.calls


@pytest.mark.parametrize("parallel", [False, True])
def test_the_bare_call_grammar_compiles(parallel: bool, checker: GrammarCompiler) -> None:
    tools = parse_tools({"tool_choice": "required", "tools": TWO_TOOLS,
                         "parallel_tool_calls": parallel})
    assert tools is not None
    grammar = replace(tools, bare=True).grammar()
    assert grammar is not None and '"parameters"' in grammar.source
    assert ('"; "' in grammar.source) is parallel
    checker.check(grammar)


# --- the prompt ---------------------------------------------------------------------------


LLAMA3_STYLE = (  # the parts of Llama 3.1's template that concern tools
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% endfor %}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
CONVERSATION = {"model": "m", "tools": TOOLS, "messages": [
    {"role": "system", "content": "Be brief."}, *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]}


def _rendered(tmp_path: Any, template: str | None) -> tuple[bool, str]:
    tok = build_tokenizer(tmp_path)
    if template is not None:
        tok.chat_template = template
    tokenizers = Tokenizers(tok)
    req = parse_chat_completion(CONVERSATION, max_tokens_limit=10, max_n=1)
    messages, tools = template_input(req.messages, req.tools, tokenizers.renders_tools)
    ids = asyncio.run(tokenizers.encode_chat(messages, tools))
    return tokenizers.renders_tools, tok.decode(ids)


def test_a_template_without_tools_gets_the_fallback_system_message(tmp_path: Any) -> None:
    native, text = _rendered(tmp_path, None)
    assert not native
    assert text.startswith("<|im_start|>system\nBe brief.\n\nFunctions you may call")
    assert '{"name":"get_weather","parameters":' in text
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "c"}}</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>12 C</tool_response><|im_end|>" in text


def test_a_template_with_tools_renders_them_itself(tmp_path: Any) -> None:
    native, text = _rendered(tmp_path, LLAMA3_STYLE)
    assert native
    assert "Functions you may call" not in text
    assert '"name": "get_weather"' in text and "<|im_start|>ipython\n12 C" in text
    assert '"parameters": {"city": "Oslo", "unit": "c"}' in text  # arguments as an object


# --- tool_choice none, and the deprecated spellings ---------------------------------------


def test_none_reads_no_call_even_from_text_that_looks_like_one(live: LiveServer) -> None:
    """none: the tools are not shown (the prompt is the one without tools) and nothing is
    read as a call, even an answer that is a well-formed block of a declared function."""
    client = live.openai("alice")
    block = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "c"\}\}</tool_call>'
    kwargs: dict[str, Any] = {"model": "sql", "messages": MESSAGES, "tools": TOOLS,
                              "tool_choice": "none", "temperature": 0.0, "max_tokens": 150,
                              "extra_body": {"guided_regex": block}}
    whole = client.chat.completions.create(**kwargs)
    out = whole.choices[0]
    assert out.finish_reason == "stop" and out.message.tool_calls is None
    assert out.message.content == ('<tool_call>{"name": "get_weather", "arguments": '
                                   '{"city": "Oslo", "unit": "c"}}</tool_call>')
    plain = client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=1)
    assert whole.usage is not None and plain.usage is not None
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert all(d.tool_calls is None for d in deltas)
    assert "".join(d.content or "" for d in deltas) == out.message.content


@pytest.mark.parametrize(("field", "value", "hint"), [
    ("functions", [{"name": "get_weather", "parameters": WEATHER}], "use tools"),
    ("function_call", "auto", "use tool_choice"),
    ("function_call", {"name": "get_weather"}, "use tool_choice"),
])
def test_deprecated_functions_are_400_pointing_to_tools(live: LiveServer, field: str,
                                                        value: Any, hint: str) -> None:
    client = live.openai("alice")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=2,
                                       **{field: value})
    body: Any = info.value.body
    assert body["param"] == field and "deprecated" in body["message"] and hint in body["message"]
    # Their neutral values change nothing, and are accepted.
    ok = client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=2,
                                        functions=[], function_call="none")
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_the_demo_model_s_template_gets_the_fallback() -> None:
    """The demo model's own template (SmolLM2's, which knows no tools): the fallback system
    message replaces its default one, calls and results come back as blocks."""
    from transformers import AutoTokenizer

    from loraplex.model.demo import prepare_demo_model

    tok = AutoTokenizer.from_pretrained(str(prepare_demo_model(progress=False)))
    tokenizers = Tokenizers(tok)
    assert not tokenizers.renders_tools and not tokenizers.bare_tool_calls
    body = dict(CONVERSATION, messages=CONVERSATION["messages"][1:])  # no system message
    req = parse_chat_completion(body, max_tokens_limit=10, max_n=1)
    messages, tools = template_input(req.messages, req.tools, tokenizers.renders_tools)
    text = tok.decode(asyncio.run(tokenizers.encode_chat(messages, tools)))
    assert text.startswith("<|im_start|>system\nFunctions you may call")
    assert "SmolLM" not in text  # the template's default system message gave way
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"' in text
    assert text.endswith("<|im_start|>user\n<tool_response>12 C</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
