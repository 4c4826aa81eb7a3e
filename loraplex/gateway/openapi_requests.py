"""The OpenAPI schemas of the generation routes' request bodies (completions and chat).

They list exactly the fields the parsers read (``COMPLETION_FIELDS``, ``CHAT_FIELDS``), the
vendor extras included: the scalar sampling fields from their table
(``loraplex.engine.request_fields.FIELDS``, which the parser and ``SamplingParams`` read
too), the others written here; and the cross-field rules JSON Schema can state: one output
constraint per request, none beside a forced tool call, ``top_logprobs`` only with
``logprobs``. Where a field takes more than a schema can say (any JSON schema, regex or
grammar the grammar engine compiles; ``min_tokens`` up to ``max_tokens``), the schema states
the simplest values and its description says the rest, so a request valid by the document is
never refused for its shape.
"""

from __future__ import annotations

from typing import Any

from loraplex.config import ServerConfig
from loraplex.engine.backend import ModelDescription
from loraplex.engine.request_fields import RequestField, Route, route_fields
from loraplex.engine.sampling_params import MAX_CHOICES, MAX_LOGIT_BIAS
from loraplex.gateway.fields import MAX_STOP_SEQUENCES
from loraplex.gateway.schemas import CHAT_ROLES


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    # The server refuses unknown fields (400), so the document does too.
    return schema | {"additionalProperties": False}


def _below(limit: int) -> str:
    """An anchored pattern of the decimal integers 0 .. limit - 1 (no leading zeros)."""
    top = str(limit - 1)
    shorter = [rf"[1-9]\d{{0,{len(top) - 2}}}"] if len(top) > 1 else []
    same = [top]
    for i, digit in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            same.append(top[:i] + f"[{low}-{int(digit) - 1}]" + (r"\d" * rest))
    return "^(" + "|".join(["0", *shorter, *same]) + ")$"


# The output constraints; one per request (a 400 names the second).
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structured_outputs")
_NO_FORMAT: dict[str, Any] = {"anyOf": [{"type": "null"}, {
    "type": "object", "properties": {"type": {"const": "text"}}}]}


def _alone(field: str) -> dict[str, Any]:
    """What the body's other constraint fields must be when ``field`` is set."""
    return {"properties": {other: (_NO_FORMAT if other == "response_format" else False)
                           for other in CONSTRAINTS if other != field}}


def _one_constraint() -> dict[str, Any]:
    # Each vLLM field excludes the others and a response_format other than text, which
    # covers every pair.
    return {field: _alone(field) for field in CONSTRAINTS if field != "response_format"}


def _simple_schema(description: str) -> dict[str, Any]:
    return closed({"type": "object", "required": ["type"], "description": description,
                    "properties": {"type": {"enum": ["object", "array", "string", "integer",
                                                     "number", "boolean", "null"]}}})


def _guided() -> dict[str, Any]:
    schema = _simple_schema("A JSON schema (or its JSON text) the output keeps to; any "
                            "schema the grammar engine compiles is accepted (a 400 names "
                            "what it cannot), this document lists the simplest")
    regex = {"type": "string", "pattern": "^[a-z]{1,16}$",
             "description": "A regular expression the whole output matches; any the grammar "
                            "engine compiles is accepted, this document lists the simplest "
                            "(literals)"}
    choice = {"type": "array", "minItems": 1, "maxItems": 16,
              "items": {"type": "string", "pattern": "^[A-Za-z0-9 ]{1,16}$"},
              "description": f"The output is one of these strings (1 to {MAX_CHOICES} "
                             "non-empty ones)"}
    grammar = {"type": "string", "pattern": '^start: "[a-z]{1,8}"$',
               "description": "A Lark (or llama.cpp GBNF) grammar of the output; any the "
                              "grammar engine compiles is accepted, this document lists the "
                              "simplest"}
    return {
        "guided_json": schema, "guided_regex": regex, "guided_choice": choice,
        "guided_grammar": grammar,
        "structured_outputs": closed({
            "type": "object", "maxProperties": 1,
            "description": "vLLM's object: one of json, regex, choice, grammar, "
                           "json_object: true",
            "properties": {"json": schema, "regex": regex, "choice": choice,
                           "grammar": grammar, "json_object": {"type": "boolean"}}}),
    }


def max_tokens_limit(config: ServerConfig, model: ModelDescription) -> int:
    """The largest max_tokens: the operator's cap, else the model's context length."""
    return config.max_tokens_limit or model.max_model_len


def _table_field(field: RequestField, config: ServerConfig,
                 model: ModelDescription) -> dict[str, Any]:
    """A field of the table as the document states it: its JSON type or null, the range
    the server takes under its limits (or the narrower one it documents), its text."""
    schema: dict[str, Any] = {"type": [field.json_type, "null"]}
    limits = {"max_n": config.max_n, "max_tokens_limit": max_tokens_limit(config, model)}
    accepted = field.documented or field.accepted(limits)
    if accepted is not None:
        if accepted.lo is not None:
            schema["exclusiveMinimum" if accepted.lo_open else "minimum"] = accepted.lo
        if accepted.hi is not None:
            schema["exclusiveMaximum" if accepted.hi_open else "maximum"] = accepted.hi
    if field.description:
        schema["description"] = field.description
    return schema


def _table(route: Route, config: ServerConfig, model: ModelDescription) -> dict[str, Any]:
    return {f.name: _table_field(f, config, model) for f in route_fields(route)}


def _sampling(config: ServerConfig, model: ModelDescription) -> dict[str, Any]:
    """The fields both routes take beside the table's."""
    return _guided() | {
        "model": {"type": "string", "minLength": 1,
                  "description": "The base model's name, your adapter's name, or a public "
                                 "adapter as owner/name; name@N (owner/name@N) is version "
                                 "N, a name alone its current version"},
        "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                           {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                            "items": {"type": "string", "minLength": 1, "maxLength": 256}},
                           {"type": "null"}]},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"],
                           "properties": {"include_usage": {"type": "boolean"}}},
        "user": {"type": ["string", "null"]},
        "response_format": {"oneOf": [
            {"type": "null"},
            closed({"type": "object", "required": ["type"],
                     "properties": {"type": {"enum": ["text", "json_object"]}}}),
            closed({"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": closed({
                    "type": "object", "required": ["schema"],
                    "description": "The output is constrained to the schema (strict or not). "
                                   "Any JSON Schema the grammar engine compiles is accepted "
                                   "(a 400 names what it cannot); this document lists the "
                                   "simplest.",
                    "properties": {
                        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                        "description": {"type": "string"},
                        "strict": {"type": ["boolean", "null"]},
                        "schema": closed({"type": "object", "required": ["type"],
                                           "properties": {"type": {"enum": [
                                               "object", "array", "string", "integer",
                                               "number", "boolean", "null"]}}})}})}})]},
        "logit_bias": {"type": ["object", "null"],
                       "description": "Token id (as a string) to a bias added to its logit",
                       "propertyNames": {"pattern": _below(model.vocab_size)},
                       "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                "maximum": MAX_LOGIT_BIAS}},
        "priority_class": {"type": ["string", "null"], "enum": ["interactive", "batch", None],
                           "description": "batch: this request waits behind interactive "
                                          "work (at most the server's max_batch_wait_s). A "
                                          "request may not ask for a class above its "
                                          "tenant's (a 400 names priority_class)"},
        "stop_token_ids": {"type": ["array", "null"], "maxItems": 16, "items": {
            "type": "integer", "minimum": 0, "maximum": model.vocab_size - 1}},
        "cache_salt": {"type": ["string", "null"],
                       "description": "Accepted and ignored: the server derives each "
                                      "tenant's prefix-cache salt"},
        "salt": {"type": ["string", "null"], "description": "Accepted and ignored, as "
                                                             "cache_salt"},
    }


def request_schemas(config: ServerConfig, model: ModelDescription) -> dict[str, Any]:
    """The ``CompletionRequest`` and ``ChatCompletionRequest`` components."""
    sampling = _sampling(config, model)
    # Token ids the vocabulary has, and few enough to leave room for any max_tokens. A text
    # prompt's length in tokens is known only once tokenized: over the context it is 400
    # context_length_exceeded.
    token_ids = {"type": "array", "minItems": 1,
                 "maxItems": max(1, model.max_model_len - max_tokens_limit(config, model)),
                 "items": {"type": "integer", "minimum": 0, "maximum": model.vocab_size - 1}}
    content = {"oneOf": [
        {"type": "string"},
        {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"},
            "arguments": {"type": "string", "description": "JSON text"}}}}}
    calls = {"type": "array", "items": call}
    message = {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": [r for r in CHAT_ROLES if r not in ("assistant", "tool")]},
            "content": content, "name": {"type": "string"}}},
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": "assistant"}, "content": content, "name": {"type": "string"},
            "tool_calls": calls}},
        {"type": "object", "required": ["role", "tool_calls"],
         "description": "An assistant's turn that only called tools",
         "properties": {"role": {"const": "assistant"}, "content": {"type": "null"},
                        "name": {"type": "string"}, "tool_calls": calls | {"minItems": 1}}},
        {"type": "object", "required": ["role", "content", "tool_call_id"],
         "description": "A tool's result", "properties": {
             "role": {"const": "tool"}, "content": content,
             "tool_call_id": {"type": "string"}}}]}
    tool = closed({"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": closed({"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": "string"},
            "strict": {"type": ["boolean", "null"]},
            "parameters": closed({
                "type": "object", "required": ["type", "properties"],
                "description": "The arguments' JSON schema. Any JSON Schema the grammar "
                               "engine compiles is accepted (a 400 names "
                               "tools[i].function.parameters when it cannot); this "
                               "document lists the simplest: flat objects.",
                "properties": {
                    "type": {"const": "object"},
                    "properties": {"type": "object", "additionalProperties": closed({
                        "type": "object", "required": ["type"], "properties": {
                            "type": {"enum": ["string", "integer", "number", "boolean"]},
                            "description": {"type": "string"}}})}}})}})}})
    return {
        "CompletionRequest": closed({
            "type": "object", "required": ["model", "prompt"],
            "dependentSchemas": _one_constraint(),
            "properties": sampling | _table("completions", config, model) | {
                "prompt": {"oneOf": [
                    {"type": "string", "minLength": 1},
                    token_ids,
                    {"type": "array", "minItems": 1, "maxItems": 1,
                     "items": {"type": "string", "minLength": 1}}]},
                "echo": {"type": ["boolean", "null"],
                         "description": "The prompt (with logprobs: its logprobs, null for "
                                        "the first token) before the completion"},
                "suffix": {"enum": ["", None],
                           "description": "Not supported: a 400 unless empty"},
                "best_of": {"enum": [1, None],
                            "description": "Not supported: a 400 unless 1 or equal to n"}}}),
        "ChatCompletionRequest": closed({
            "type": "object", "required": ["model", "messages"],
            # top_logprobs is read only with logprobs: true (400 otherwise).
            "dependentSchemas": _one_constraint() | {"top_logprobs": {
                "required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
            # auto and required need tools; required forces the output, so no other
            # constraint may be set beside it (400 otherwise).
            "allOf": [
                {"if": {"required": ["tool_choice"], "properties": {
                    "tool_choice": {"enum": ["auto", "required"]}}},
                 "then": {"required": ["tools"],
                          "properties": {"tools": {"type": "array", "minItems": 1}}}},
                {"if": {"required": ["tool_choice"], "properties": {
                    "tool_choice": {"const": "required"}}},
                 "then": _alone("")}],
            "properties": sampling | _table("chat", config, model) | {
                "messages": {"type": "array", "minItems": 1, "items": message},
                "tools": {"type": ["array", "null"], "items": tool,
                          "description": "Functions the model may call"},
                "tool_choice": {
                    "enum": ["none", "auto", "required", None],
                    "description": "Default: auto with tools, none without. The server "
                                   "also accepts {\"type\": \"function\", \"function\": "
                                   "{\"name\": ...}} naming one of tools (a 400 when it "
                                   "names none), which forces that function"},
                "parallel_tool_calls": {"type": ["boolean", "null"],
                                        "description": "false: at most one call"},
                "echo": {"type": ["boolean", "null"],
                         "description": "vLLM's: when the last message is the assistant's, "
                                        "the answer opens with its content (streamed as the "
                                        "first content delta)"},
                "functions": {"type": ["array", "null"], "maxItems": 0,
                              "description": "Deprecated: use tools (a 400 unless empty)"},
                "function_call": {"enum": ["none", None],
                                  "description": "Deprecated: use tool_choice (a 400 unless "
                                                 "none)"},
                "store": {"type": ["boolean", "null"],
                          "description": "Accepted; answers are never stored"},
                "metadata": {"type": ["object", "null"], "maxProperties": 16,
                             "propertyNames": {"maxLength": 64},
                             "additionalProperties": {"type": "string", "maxLength": 512},
                             "description": "Accepted and ignored"}}}),
    }
