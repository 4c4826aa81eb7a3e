"""Tool calls end to end on a model whose tokenizer carries Llama 3.1's chat template, through
the official ``openai`` client: the template renders the tools itself (checked on the
rendered prompt, and by the server's prompt token count); ``required`` and a named function
are forced in the model's own format, a bare ``{"name": ..., "parameters": ...}`` object, and
always parse and validate (``jsonschema``) on the base model and an adapter; ``auto`` reads
such an answer as a call; ``none`` shows no tools and reads none; streamed deltas
concatenate to the whole answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

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
from loraplex.gateway.schemas import parse_chat_completion, with_call_format
from loraplex.gateway.state import Tokenizers
from loraplex.gateway.tools import template_input
from loraplex.registry import db, service
from loraplex.testing import build_adapter, build_tiny_model

# Llama 3.1 Instruct's chat template (its tokenizer_config.json), verbatim.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}}]
MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Weather in Oslo?"}]
# An answer that is one call in Llama 3's format, whatever the random model would write.
BARE_CALL_FORMAT = {"type": "json_schema", "json_schema": {"name": "call", "schema": {
    "type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
    "required": ["name", "parameters"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, its tokenizer carrying Llama 3.1's chat template."""
    # Room for the template's long tool preamble (tools as indented JSON).
    out = build_tiny_model(tmp_path_factory.mktemp("tiny_llama3"), arch="llama", seed=3,
                           max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = LLAMA31_TEMPLATE
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def server(llama3_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           serve_app: Callable[..., contextlib.AbstractContextManager[str]],
           ) -> Iterator[openai.OpenAI]:
    """The model served (SQLite registry, in-process limiter) with an adapter ``lora``; an
    ``openai`` client of tenant ``t``."""
    root = tmp_path_factory.mktemp("llama3_server")
    db_url = f"sqlite:///{root / 'registry.db'}"
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            tenant = service.create_tenant(session, "t")
            _, key = service.create_key(session, tenant.id)
    finally:
        engine.dispose()
    adapter = build_adapter(root / "lora", llama3_dir, rank=4, seed=5)
    assert run_registry_cli(["adapters", "add", "--tenant", "t", "--name", "lora",
                             str(adapter), "--database-url", db_url, "--adapter-dir",
                             str(root / "store"), "--model", str(llama3_dir)]) == 0
    engine_config = EngineConfig(
        ModelConfig(str(llama3_dir)), CacheConfig(block_size=16, num_kv_blocks=512),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048))
    backend = EngineClient.from_config(engine_config)
    config = ServerConfig(served_model_name="tiny", max_tokens_limit=200, max_n=2)
    app = create_app(config, RegistryConfig(db_url, str(root / "store")), backend)
    try:
        with serve_app(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key=key,
                                                  max_retries=0, timeout=60) as client:
            yield client
    finally:
        backend.close()


def _check_call(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _raw_text(choice: Any) -> str:
    # What the model wrote, token by token (the answer itself is parsed into tool_calls).
    return "".join(entry.token for entry in choice.logprobs.content)


def test_the_template_renders_the_tools(llama3_dir: Path, server: openai.OpenAI) -> None:
    client = server
    tokenizers = Tokenizers(AutoTokenizer.from_pretrained(str(llama3_dir)))
    assert tokenizers.renders_tools and tokenizers.bare_tool_calls
    req = with_call_format(parse_chat_completion(
        {"model": "m", "messages": MESSAGES, "tools": TOOLS}, max_tokens_limit=10, max_n=1),
        bare=True)
    messages, tools = template_input(req.messages, req.tools, native=True)
    ids = asyncio.run(tokenizers.encode_chat(messages, tools))
    rendered = AutoTokenizer.from_pretrained(str(llama3_dir)).decode(ids)
    assert rendered.startswith("<|endoftext|><|start_header_id|>system<|end_header_id|>\n\n"
                               "Environment: ipython\n")
    assert "Be brief.<|eot_id|>" in rendered
    assert ("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, "
            "please respond with a JSON for a function call") in rendered
    assert json.dumps(TOOLS[0], indent=4) in rendered and "Functions you may call" not in rendered
    assert rendered.endswith("Weather in Oslo?<|eot_id|>"
                             "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # The server renders the same prompt: as many prompt tokens, and more than without tools.
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    bare = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert bare.usage is not None and bare.usage.prompt_tokens < len(ids)


@pytest.mark.parametrize(("choice", "names"), [
    ("required", {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
])
def test_forced_calls_are_llama_json_that_validates(server: openai.OpenAI, choice: Any,
                                                    names: set[str]) -> None:
    for i, (model, temperature) in enumerate([("tiny", 0.0), ("lora", 0.0), ("tiny", 0.9),
                                              ("lora", 1.3), ("tiny", 1.3), ("lora", 0.9)]):
        reply = server.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, temperature=temperature, seed=i, logprobs=True)
        out = reply.choices[0]
        assert out.finish_reason == "tool_calls", out
        assert out.message.content is None and out.message.tool_calls
        assert len(out.message.tool_calls) == 1
        call = out.message.tool_calls[0]
        _check_call(call, names)
        # The model wrote Llama 3's own format: one bare object, "parameters" and all.
        raw = json.loads(_raw_text(out))
        assert raw == {"name": call.function.name,
                       "parameters": json.loads(call.function.arguments)}


def test_parallel_calls_are_separated_and_each_validates(server: openai.OpenAI) -> None:
    done = 0
    for i in range(4):
        out = server.chat.completions.create(
            model="lora", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=i, max_tokens=200).choices[0]
        if out.finish_reason == "tool_calls":  # not cut by max_tokens
            assert out.message.tool_calls
            for call in out.message.tool_calls:
                _check_call(call, {"get_weather", "add"})
            done += 1
    assert done >= 1


def test_streamed_calls_concatenate_to_the_whole_answer(server: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs: dict[str, Any] = {"model": "lora", "messages": MESSAGES, "tools": TOOLS,
                                  "tool_choice": choice, "temperature": 0.0,
                                  "parallel_tool_calls": False}
        whole = server.chat.completions.create(**kwargs).choices[0]
        chunks = list(server.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == ""
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
            (0, c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"
        with server.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion().choices[0]
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []
                ] == [(c.function.name, c.function.arguments)
                      for c in whole.message.tool_calls or []]


def test_auto_reads_a_bare_json_answer_as_a_call(server: openai.OpenAI) -> None:
    """With auto the text is free; constrained here to a call in Llama 3's format, which the
    server reads back as a call, streamed and not."""
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                              "tool_choice": "auto", "response_format": BARE_CALL_FORMAT,
                              "temperature": 0.0, "max_tokens": 150}
    whole = server.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content is None and whole.message.tool_calls
    [call] = whole.message.tool_calls
    _check_call(call, {"get_weather"})
    chunks = list(server.chat.completions.create(stream=True, **kwargs))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
        (call.function.name, call.function.arguments)]
    free = server.chat.completions.create(**(kwargs | {"response_format": None,
                                                       "max_tokens": 8})).choices[0]
    assert free.message.tool_calls is None or free.finish_reason == "tool_calls"


def test_none_shows_no_tools_and_reads_no_calls(server: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                              "tool_choice": "none", "response_format": BARE_CALL_FORMAT,
                              "temperature": 0.0, "max_tokens": 150}
    whole = server.chat.completions.create(**kwargs)
    out = whole.choices[0]
    assert out.finish_reason == "stop" and out.message.tool_calls is None
    assert json.loads(out.message.content or "")["name"] == "get_weather"  # looks like one
    plain = server.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert whole.usage is not None and plain.usage is not None
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools rendered
    chunks = list(server.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(d.tool_calls is None for d in deltas)
    assert "".join(d.content or "" for d in deltas) == out.message.content


def test_the_conversation_goes_on_in_the_template_s_own_terms(llama3_dir: Path,
                                                              server: openai.OpenAI) -> None:
    first = server.chat.completions.create(model="lora", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", seed=2,
                                           parallel_tool_calls=False).choices[0]
    [call] = first.message.tool_calls or []
    messages = [*MESSAGES, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]
    tokenizers = Tokenizers(AutoTokenizer.from_pretrained(str(llama3_dir)))
    req = with_call_format(parse_chat_completion(
        {"model": "m", "messages": messages, "tools": TOOLS}, max_tokens_limit=10, max_n=1),
        bare=True)
    ids = asyncio.run(tokenizers.encode_chat(*template_input(req.messages, req.tools, True)))
    rendered = AutoTokenizer.from_pretrained(str(llama3_dir)).decode(ids)
    arguments = json.loads(call.function.arguments)
    assert ("<|start_header_id|>assistant<|end_header_id|>\n\n" + json.dumps(
        {"name": call.function.name, "parameters": arguments}) + "<|eot_id|>") in rendered
    # The template writes a string result as JSON (a string is "iterable" to Jinja).
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"12 C"<|eot_id|>' in rendered
    again = server.chat.completions.create(model="lora", messages=messages, tools=TOOLS,
                                           max_tokens=5, temperature=0.0)
    assert again.usage is not None and again.usage.prompt_tokens == len(ids)
