"""Request bodies of the OpenAI-compatible routes, parsed and validated into dataclasses.

Parsing is strict about what it reads: a field of the wrong JSON type, or out of range, is a
400 that names the field. A field it does not know is a 400 too, as OpenAI answers
("Unrecognized request argument supplied"); the fields it knows are ``COMPLETION_FIELDS``
and ``CHAT_FIELDS``, which /openapi.json lists exactly (a test holds them equal). They
include the vendor extras loraplex accepts, as vLLM does (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``guided_*``, ``structured_outputs``, chat ``echo``, sent
through the client's ``extra_body``). Known OpenAI fields that loraplex cannot honour
(``suffix``, ``best_of`` other than ``n``, the deprecated ``functions`` and
``function_call``) are refused when set to anything but their neutral value, never silently
dropped. The scalar sampling fields (their JSON types, defaults, ranges and the
``SamplingParams`` keywords they set) are read from one table,
``loraplex.engine.request_fields.FIELDS``, which ``SamplingParams`` checks its ranges from
too: a value the HTTP API takes, the engine takes, and the other way round, short of the
server's own caps (``max_n``, ``max_tokens_limit``). This module adds the shapes the table
does not hold (messages, tools, stop sequences, logit_bias, output constraints) and the
rules between fields; the engine's own rules (``min_tokens`` up to ``max_tokens``) are
``SamplingParams``'. ``cache_salt``/``salt`` in a body is accepted and ignored on purpose:
the salt is derived by the server from the tenant.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from loraplex.engine.request_fields import Route, route_fields
from loraplex.engine.sampling_params import MAX_SCHEMA_DEPTH, GrammarSpec
from loraplex.engine.share import PRIORITIES
from loraplex.errors import InvalidRequestError
from loraplex.gateway.fields import (
    bad,
    check_text,
    read_bool,
    read_field,
    read_logit_bias,
    read_stop,
    read_str,
    read_token_ids,
    type_name,
)
from loraplex.gateway.tools import (
    ChatMessage,
    ToolCall,
    ToolUse,
    parse_tools,
    tool_arguments,
)

CHAT_ROLES: Final = ("system", "developer", "user", "assistant", "tool")

# OpenAI fields with no effect here when left at their neutral value; anything else is
# refused so a caller never believes a setting was applied when it was not.
_NEUTRAL: Final[dict[str, tuple[Any, ...]]] = {
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
}
# OpenAI's deprecated spellings of tools: refused with the way to say it today.
_DEPRECATED: Final = {"functions": "use tools instead",
                      "function_call": "use tool_choice (with tools) instead"}


# The fields besides the table's (request_fields.FIELDS, which says which route takes each).
_COMMON_FIELDS: Final = frozenset({
    "model", "stream", "stream_options", "stop", "user", "logit_bias", "response_format",
    # structured outputs as vLLM spells them: its older guided_* fields and its newer object
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    # vendor extras, and the salt that is ignored on purpose
    "stop_token_ids", "cache_salt", "salt", "priority_class",
})


def _table_names(route: Route) -> frozenset[str]:
    return frozenset(f.name for f in route_fields(route))


COMPLETION_FIELDS: Final = _COMMON_FIELDS | _table_names("completions") | {
    "prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS: Final = _COMMON_FIELDS | _table_names("chat") | {
    "messages", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "store", "metadata", "echo",
}


def _check_known(body: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise InvalidRequestError(
            f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])


def _check_neutral(body: dict[str, Any]) -> None:
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is None:
            continue
        if not any(type(value) is type(n) and value == n for n in neutral):
            if key in _DEPRECATED:
                raise bad(key, f"is deprecated and not supported by this server: "
                                f"{_DEPRECATED[key]}")
            raise bad(key, "is not supported by this server (leave it unset)")
    n, best_of = body.get("n", 1), body.get("best_of")
    if best_of is not None and best_of != n and best_of != 1:
        raise bad("best_of", "is not supported by this server (leave it unset)")


def _grammar(body: dict[str, Any]) -> GrammarSpec | None:
    """The request's output constraint, from whichever one field sets it: OpenAI's
    ``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, or vLLM's
    ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``). Two set at once is a 400 naming the second."""
    found: list[GrammarSpec] = []
    fmt = body.get("response_format")
    if fmt is not None:
        found.extend(_response_format(fmt))
    for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if body.get(key) is not None:
            found.append(_guided(key, key.removeprefix("guided_"), body[key]))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", f"expected an object, got {type_name(so)}")
        unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise bad("structured_outputs", f"unknown field {unknown[0]!r}")
        for key, value in so.items():
            if value is None or (key == "json_object" and value is False):
                continue
            if key == "json_object":
                if value is not True:
                    raise bad("structured_outputs", "json_object must be true")
                found.append(GrammarSpec("json_object", "", "structured_outputs"))
            else:
                found.append(_guided("structured_outputs", key, value))
    if len(found) > 1:
        raise bad(found[1].param, f"sets a second output constraint (besides "
                                   f"{found[0].param}): set one")
    return found[0] if found else None


def _response_format(fmt: Any) -> list[GrammarSpec]:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("response_format", "expected an object with a string 'type'")
    kind = fmt["type"]
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if extra:
        raise bad("response_format", f"unknown field {extra[0]!r}")
    if kind == "text":
        return []
    if kind == "json_object":
        return [GrammarSpec("json_object", "", "response_format")]
    if kind != "json_schema":
        raise bad("response_format", f"type must be text, json_object or json_schema, got "
                                      f"{kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format", "json_schema must be an object with a 'schema'")
    extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if extra:
        raise bad("response_format", f"unknown field json_schema.{extra[0]}")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}",
                                                                         name)):
        raise bad("response_format", "json_schema.name must be 1 to 64 of a-z, A-Z, 0-9, "
                                      "_ and -")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad("response_format", "json_schema.strict must be a boolean")
    if "schema" not in spec:
        raise bad("response_format", "json_schema.schema is required")
    # Strict or not, the schema is enforced: a constrained decoder has no looser mode.
    return [GrammarSpec.json_schema(spec["schema"], "response_format")]


def _guided(param: str, kind: str, value: Any) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):  # vLLM accepts the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError:
                raise bad(param, "the JSON schema is not valid JSON") from None
            except RecursionError:  # nested past Python's limit, far past ours
                raise bad(param, f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} "
                                 "levels deep") from None
        return GrammarSpec.json_schema(value, param)
    if kind == "choice":
        for choice in value if isinstance(value, list) else ():
            if isinstance(choice, str):
                check_text(param, choice)
        return GrammarSpec.choice(value, param)
    if not isinstance(value, str):
        raise bad(param, f"expected a string, got {type_name(value)}")
    return GrammarSpec("regex" if kind == "regex" else "grammar", check_text(param, value),
                       param)


# --- the requests ------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationOptions:
    """What both routes share: the model, sampling and streaming options."""

    model: str
    # SamplingParams' keywords as the request sets them, max_tokens aside: the table's
    # fields, stop, stop_token_ids, logit_bias, logprobs and grammar.
    sampling: Mapping[str, Any]
    max_tokens: int | None  # None: as many as fit (chat) or OpenAI's 16 (completions)
    stream: bool
    include_usage: bool
    user: str | None
    priority_class: str | None = None  # None: the tenant's class

    @property
    def logprobs(self) -> int | None:
        """Top alternatives per token; 0: only the sampled token's; None: no logprobs."""
        value: int | None = self.sampling["logprobs"]
        return value

    @property
    def grammar(self) -> GrammarSpec | None:
        """The output's constraint (structured outputs)."""
        value: GrammarSpec | None = self.sampling["grammar"]
        return value


@dataclass(frozen=True)
class CompletionRequest:
    """``POST /v1/completions``: one prompt, as text or token ids."""

    options: GenerationOptions
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    echo: bool  # the prompt (and, with logprobs, its logprobs) before the completion


@dataclass(frozen=True)
class ChatCompletionRequest:
    """``POST /v1/chat/completions``."""

    options: GenerationOptions
    messages: tuple[ChatMessage, ...]
    tools: ToolUse | None  # None: no tool may be called
    # vLLM's echo: the last message's content, when it is the assistant's, opens the answer
    echo: str | None = None


def _options(body: dict[str, Any], route: Route, limits: Mapping[str, int],
             derived: Mapping[str, Any]) -> GenerationOptions:
    """The options both routes share; ``derived``: keywords the route sets itself."""
    model = read_str(body, "model")
    if not model:
        raise bad("model", "is required (the base model's name or an adapter's)")
    _check_neutral(body)
    table = route_fields(route)
    values = {f.name: read_field(body, f, limits) for f in table}
    max_tokens = None
    for f in table:  # max_tokens, and chat's max_completion_tokens, the later one winning
        if f.keyword == "max_tokens" and values[f.name] is not None:
            max_tokens = values[f.name]
    stream = read_bool(body, "stream", False)
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad("stream_options", f"expected an object, got {type_name(stream_options)}")
        include_usage = read_bool(stream_options, "include_usage", False)
    raw_stop_ids = body.get("stop_token_ids")
    stop_token_ids = read_token_ids(raw_stop_ids) if raw_stop_ids is not None else ()
    if stop_token_ids is None:
        raise bad("stop_token_ids", "expected an array of integers")
    sampling = {f.keyword: values[f.name] for f in table if f.keyword and f.passed}
    return GenerationOptions(
        model=model,
        sampling={**sampling, "stop": read_stop(body), "stop_token_ids": stop_token_ids,
                  "logit_bias": read_logit_bias(body), "grammar": _grammar(body), **derived},
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        user=read_str(body, "user"),
        priority_class=_priority_class(body),
    )


def _priority_class(body: dict[str, Any]) -> str | None:
    value = read_str(body, "priority_class")
    if value is not None and value not in PRIORITIES:
        raise bad("priority_class", f"must be one of {', '.join(PRIORITIES)}, got {value!r}")
    return value


def parse_completion(body: dict[str, Any], *, max_tokens_limit: int,
                     max_n: int) -> CompletionRequest:
    """Validates a completions body; InvalidRequestError names the first bad field."""
    _check_known(body, COMPLETION_FIELDS)
    limits = {"max_tokens_limit": max_tokens_limit, "max_n": max_n}
    options = _options(body, "completions", limits, derived={})
    if options.max_tokens is None:
        options = _replace_max_tokens(options, min(16, max_tokens_limit))  # OpenAI's default
    echo = read_bool(body, "echo", False)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "is required")
    # One prompt per request: a string, token ids, or an array holding exactly one of those.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
        return CompletionRequest(options=options, prompt=check_text("prompt", prompt),
                                 prompt_token_ids=None, echo=echo)
    token_ids = read_token_ids(prompt)
    if token_ids:
        return CompletionRequest(options=options, prompt=None, prompt_token_ids=token_ids,
                                 echo=echo)
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "batches of prompts are not supported: send one prompt per "
                             "request")
    raise bad("prompt", "expected a non-empty string or a non-empty array of token ids")


def _replace_max_tokens(options: GenerationOptions, max_tokens: int) -> GenerationOptions:
    return replace(options, max_tokens=max_tokens)


def parse_messages(body: dict[str, Any]) -> tuple[ChatMessage, ...]:
    """The body's ``messages`` as chat completions reads them (``/tokenize`` too)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty array of messages")
    return tuple(_message(i, m) for i, m in enumerate(messages))


def _message(i: int, raw: Any) -> ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad(param, f"expected an object, got {type_name(raw)}")
    role = raw.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"{param}.role", f"must be one of {', '.join(CHAT_ROLES)}")
    content = raw.get("content")
    calls = _tool_calls(param, raw.get("tool_calls")) if role == "assistant" else ()
    if content is None and calls:
        return ChatMessage(role, None, calls)
    if isinstance(content, list):  # content parts: only text is understood
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"{param}.content[{j}]", "only text parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad(f"{param}.content", "expected a string or an array of text parts")
    check_text(f"{param}.content", content)
    call_id = None
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(f"{param}.tool_call_id", "a tool message needs the id of its call")
        check_text(f"{param}.tool_call_id", call_id)
    # The template's "system" is what OpenAI now calls "developer".
    return ChatMessage("system" if role == "developer" else role, content, calls, call_id)


def _tool_calls(param: str, raw: Any) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad(f"{param}.tool_calls", f"expected an array, got {type_name(raw)}")
    calls = []
    for j, call in enumerate(raw):
        where = f"{param}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("type", "function") == "function"
                and isinstance(call.get("id"), str) and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise bad(where, "expected {\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}} with strings")
        for text in (call["id"], fn["name"], fn["arguments"]):
            check_text(where, text)
        tool_arguments(fn["arguments"], f"{where}.function.arguments")
        calls.append(ToolCall(fn["name"], fn["arguments"], call["id"]))
    return tuple(calls)


def parse_chat_completion(body: dict[str, Any], *, max_tokens_limit: int,
                          max_n: int) -> ChatCompletionRequest:
    """Validates a chat completions body; InvalidRequestError names the first bad field."""
    _check_known(body, CHAT_FIELDS)
    limits = {"max_tokens_limit": max_tokens_limit, "max_n": max_n}
    # Chat's logprobs is a switch; top_logprobs (in range, or the 400 names it) says how
    # many alternatives, and only with it.
    top = {f.name: f for f in route_fields("chat")}["top_logprobs"]
    top_logprobs = read_field(body, top, limits)
    logprobs = None
    if read_bool(body, "logprobs", False):
        logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise bad("top_logprobs", "requires logprobs to be true")
    options = _options(body, "chat", limits, derived={"logprobs": logprobs})
    parsed = parse_messages(body)
    _store_and_metadata(body)
    echo = None
    if read_bool(body, "echo", False) and parsed[-1].role == "assistant":
        echo = parsed[-1].content or ""
    tools = parse_tools(body)
    if tools is not None and tools.mode == "required" and options.grammar is not None:
        raise bad("tool_choice", f"forces a tool call, which cannot be combined with "
                                  f"{options.grammar.param}")
    return with_call_format(ChatCompletionRequest(options=options, messages=parsed, tools=tools,
                                                  echo=echo), bare=False)


def with_call_format(req: ChatCompletionRequest, *, bare: bool) -> ChatCompletionRequest:
    """``req`` for a model whose calls are Llama 3's bare JSON (``bare``) or ``<tool_call>``
    blocks: a forced call's grammar is that format's."""
    if req.tools is None:
        return req
    tools = replace(req.tools, bare=bare)
    forced = tools.grammar()
    options = req.options if forced is None else replace(
        req.options, sampling={**req.options.sampling, "grammar": forced})
    return replace(req, options=options, tools=tools)


MAX_METADATA_PAIRS: Final = 16


def _store_and_metadata(body: dict[str, Any]) -> None:
    # Read for their shape only (OpenAI's limits): nothing is stored, as no answer is kept.
    read_bool(body, "store", False)
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise bad("metadata", f"expected an object of at most {MAX_METADATA_PAIRS} pairs")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad("metadata", "keys must have at most 64 characters and values must be "
                                   "strings of at most 512")
        check_text("metadata", key)
        check_text("metadata", value)
