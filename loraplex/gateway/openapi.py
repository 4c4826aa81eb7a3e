"""The OpenAPI 3.1 document of the gateway, written by hand and served at /openapi.json.

It states the limits this server enforces (``max_tokens``, ``n``...) so generated clients and
fuzzers know them. Fields the server ignores are not listed; a request may still send them
(see ``gateway/schemas.py``).
"""

from __future__ import annotations

from typing import Any

from loraplex.config import ServerConfig
from loraplex.engine.sampling_params import MAX_LOGPROBS
from loraplex.gateway.schemas import CHAT_ROLES, MAX_SEED, MAX_STOP_SEQUENCES

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "Invalid body or parameter (named in error.param)",
            401: "Missing, unknown or revoked API key", 403: "The key lacks the admin role",
            404: "Unknown model (or one the caller may not see)",
            413: "Body over the size limit, or prompt longer than the model's context",
            422: "The adapter cannot run on this base model",
            429: "Over a rate limit (see Retry-After)",
            503: "Engine queue full (see Retry-After) or engine not running"}
    return {str(c): {"$ref": f"#/components/responses/E{c}"} for c in codes if c in text}


def _error_responses() -> dict[str, Any]:
    out = {}
    for code, text in ((400, "Bad request"), (401, "Unauthorized"), (403, "Forbidden"),
                       (404, "Not found"), (413, "Too large"), (422, "Unprocessable"),
                       (429, "Rate limited"), (503, "Unavailable")):
        response = _json(_ref("Error"), text)
        if code in (429, 503):
            response["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                   "description": "Seconds to wait"}}
        out[f"E{code}"] = response
    return out


def _sampling(config: ServerConfig) -> dict[str, Any]:
    nullable_num = {"type": ["number", "null"]}
    return {
        "model": {"type": "string", "minLength": 1,
                  "description": "The base model's name, your adapter's name, or a public "
                                 "adapter as owner/name"},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1,
                       "maximum": config.max_tokens_limit},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": config.max_n},
        "temperature": nullable_num | {"minimum": 0, "maximum": 2},
        "top_p": nullable_num | {"exclusiveMinimum": 0, "maximum": 1},
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_SEED},
        "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                           {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                            "items": {"type": "string", "minLength": 1, "maxLength": 256}},
                           {"type": "null"}]},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"],
                           "properties": {"include_usage": {"type": "boolean"}}},
        "user": {"type": ["string", "null"]},
    }


def _usage_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {k: {"type": "integer", "minimum": 0}
                           for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _schemas(config: ServerConfig) -> dict[str, Any]:
    sampling = _sampling(config)
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"oneOf": [
            {"type": "string"},
            {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        "name": {"type": "string"}}}
    choice_finish = {"type": ["string", "null"], "enum": ["stop", "length", None]}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
        "Usage": _usage_schema(),
        "CompletionRequest": {
            "type": "object", "required": ["model", "prompt"],
            "properties": sampling | {
                "prompt": {"oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "integer",
                                                               "minimum": 0}},
                    {"type": "array", "minItems": 1, "maxItems": 1,
                     "items": {"type": "string", "minLength": 1}}]},
                "logprobs": {"type": ["integer", "null"], "minimum": 0,
                             "maximum": MAX_LOGPROBS}}},
        "ChatCompletionRequest": {
            "type": "object", "required": ["model", "messages"],
            "properties": sampling | {
                "messages": {"type": "array", "minItems": 1, "items": message},
                "logprobs": {"type": ["boolean", "null"]},
                "top_logprobs": {"type": ["integer", "null"], "minimum": 0,
                                 "maximum": MAX_LOGPROBS},
                "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1,
                                          "maximum": config.max_tokens_limit}}},
        "Completion": {"type": "object", "required": ["id", "object", "choices", "usage"],
                       "properties": {
                           "id": {"type": "string"}, "object": {"const": "text_completion"},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": {
                               "type": "object", "properties": {
                                   "index": {"type": "integer"}, "text": {"type": "string"},
                                   "logprobs": {"type": ["object", "null"]},
                                   "finish_reason": choice_finish}}},
                           "usage": _ref("Usage")}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "choices", "usage"],
                           "properties": {
                               "id": {"type": "string"},
                               "object": {"const": "chat.completion"},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": {"type": "array", "items": {
                                   "type": "object", "properties": {
                                       "index": {"type": "integer"},
                                       "message": {"type": "object"},
                                       "logprobs": {"type": ["object", "null"]},
                                       "finish_reason": choice_finish}}},
                               "usage": _ref("Usage")}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Model")}}},
        "Model": {"type": "object", "required": ["id", "object", "owned_by"], "properties": {
            "id": {"type": "string"}, "object": {"const": "model"},
            "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
        "UsageReport": {"type": "object", "required": ["object", "totals", "data"],
                        "properties": {"object": {"const": "usage"},
                                       "tenant": {"type": "string"},
                                       "totals": {"type": "object"},
                                       "data": {"type": "array",
                                                "items": {"type": "object"}}}},
    }


def _generation_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "The completion; with stream=true, server-sent events "
                                   "of chunks ending with 'data: [DONE]'",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 413, 422, 429, 503)}}


def openapi_document(config: ServerConfig) -> dict[str, Any]:
    """The document for a server with ``config``'s limits."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    public: list[dict[str, Any]] = []
    return {
        "openapi": "3.1.0",
        "info": {"title": "loraplex", "version": "0.1.0",
                 "description": "OpenAI-compatible multi-tenant LoRA serving. Authenticate "
                                "with 'Authorization: Bearer <key>'."},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/models": {"get": {"summary": "Models the caller may use", "responses": {
                "200": _json(_ref("ModelList"), "The base model, own and public adapters"),
                **_errors(401)}}},
            "/v1/models/{model}": {"get": {
                "summary": "One model, if the caller may use it",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string", "minLength": 1}}],
                "responses": {"200": _json(_ref("Model"), "The model"), **_errors(401, 404)}}},
            "/v1/completions": {"post": _generation_op(
                "Complete a prompt", "CompletionRequest", "Completion")},
            "/v1/chat/completions": {"post": _generation_op(
                "Reply to a conversation", "ChatCompletionRequest", "ChatCompletion")},
            "/v1/usage": {"get": {
                "summary": "The caller's metered usage, per hour and model",
                "parameters": [{"name": n, "in": "query", "required": False,
                                "schema": {"type": "string", "format": "date-time"}}
                               for n in ("since", "until")],
                "responses": {"200": _json(_ref("UsageReport"), "Usage"),
                              **_errors(400, 401)}}},
            "/admin/api/engine": {"get": {"summary": "Engine statistics (admin)", "responses": {
                "200": _json({"type": "object"}, "Engine statistics"), **_errors(401, 403)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (admin)", "responses": {
                "200": {"description": "Exposition text", "content": text},
                **_errors(401, 403)}}},
            "/health": {"get": {"summary": "The process is alive", "security": public,
                                "responses": {"200": _json({"type": "object"}, "Alive")}}},
            "/ready": {"get": {"summary": "Engine loaded and database reachable",
                               "security": public, "responses": {
                                   "200": _json({"type": "object"}, "Ready"),
                                   "503": _json({"type": "object"}, "Not ready")}}},
            "/openapi.json": {"get": {"summary": "This document", "security": public,
                                      "responses": {"200": _json({"type": "object"},
                                                                 "OpenAPI 3.1")}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(config),
            "responses": _error_responses(),
        },
    }
