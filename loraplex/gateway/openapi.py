"""The OpenAPI 3.1 document of the gateway, written by hand and served at /openapi.json.

It states the limits this server enforces (``max_tokens``, ``n``, token ids, name patterns...)
so generated clients and fuzzers know them: a request valid by this document is never refused
for its shape (the tests send generated valid requests and expect them served). Bodies are
closed (``additionalProperties: false``) and list exactly the fields the server reads, the
vendor extras it accepts as vLLM does included (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``guided_*``, ``structured_outputs``...): the server
refuses any other field. Where a field takes more than JSON Schema can say (any schema,
regex or grammar the grammar engine compiles; ``min_tokens`` up to ``max_tokens``), the
document states the simplest values and its description says the rest.
"""

from __future__ import annotations

import re
from typing import Any

from loraplex.config import ServerConfig
from loraplex.engine.backend import ModelDescription
from loraplex.gateway.openapi_requests import closed, request_schemas
from loraplex.registry.models import (
    MAX_ADAPTER_VERSIONS,
    MAX_SLO_MS,
    MAX_STORAGE_BYTES,
    MAX_WEIGHT,
    MIN_WEIGHT,
    PRIORITY_CLASSES,
)
from loraplex.registry.names import ADAPTER_NAME_RE, MAX_VERSION, TENANT_NAME_RE

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "Invalid body or parameter (named in error.param); a prompt over the "
                 "model's context length has code context_length_exceeded",
            401: "Missing, unknown or revoked API key",
            403: "The key lacks the admin role, or its tenant is suspended; a lora_path "
                 "outside the allowed folders",
            404: "Unknown model, tenant, key or adapter (or one the caller may not see)",
            409: "Conflicts with existing state (a duplicate name)",
            413: "Body over the size limit",
            422: "The adapter cannot run on this base model, or an upload was refused",
            429: "Over a rate limit (see Retry-After)",
            503: "Engine queue full (see Retry-After) or engine not running"}
    return {str(c): {"$ref": f"#/components/responses/E{c}"} for c in codes if c in text}


def _error_responses() -> dict[str, Any]:
    out = {}
    for code, text in ((400, "Bad request"), (401, "Unauthorized"), (403, "Forbidden"),
                       (404, "Not found"), (409, "Conflict"), (413, "Too large"), (422, "Unprocessable"),
                       (429, "Rate limited"), (503, "Unavailable")):
        response = _json(_ref("Error"), text)
        if code in (429, 503):
            response["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                   "description": "Seconds to wait"}}
        out[f"E{code}"] = response
    return out


def _usage_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {k: {"type": "integer", "minimum": 0}
                           for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _pattern(regex: re.Pattern[str]) -> str:
    return f"^{regex.pattern}$"  # JSON Schema patterns are not anchored; names are


def _schemas(config: ServerConfig, model: ModelDescription) -> dict[str, Any]:
    choice_finish = {"type": ["string", "null"],
                     "enum": ["stop", "length", "tool_calls", None]}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
        "Usage": _usage_schema(),
        **request_schemas(config, model),
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
            "created": {"type": "integer"}, "owned_by": {"type": "string"},
            "architecture": {"type": "string",
                             "description": "The served model's family, e.g. Gemma 2"}}},
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


_OBJ: dict[str, Any] = {"type": "object"}
_LIST: dict[str, Any] = {"type": "object", "required": ["object", "data"],
                         "properties": {"object": {"const": "list"},
                                        "data": {"type": "array", "items": _OBJ}}}
_LIMIT = {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31 - 1}
_LIMITS = {f: _LIMIT for f in ("max_requests_per_minute", "max_tokens_per_minute",
                               "max_concurrent_requests")}


def _slo(what: str) -> dict[str, Any]:
    return {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_SLO_MS,
            "description": f"{what} objective in milliseconds; null: the server's default"}


# The tenant's scheduling settings; limits and settings share one body.
_SETTINGS: dict[str, Any] = {
    "weight": {"type": "number", "minimum": MIN_WEIGHT, "maximum": MAX_WEIGHT,
               "description": "Share of a busy engine relative to other tenants (default 1)"},
    "priority_class": {"type": "string", "enum": list(PRIORITY_CLASSES),
                       "description": "interactive work is admitted before batch work "
                                      "(default interactive)"},
    "max_kv_fraction": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1,
                        "description": "Most of the KV block pool the tenant's running "
                                       "requests may hold; null: the server's default"},
    "slo_ttft_ms": _slo("Time-to-first-token"),
    "slo_tpot_ms": _slo("Time-per-output-token"),
}
# The tenant's storage quotas, checked at upload; null: unlimited.
_QUOTAS: dict[str, Any] = {
    "max_storage_bytes": {"type": ["integer", "null"], "minimum": 1,
                          "maximum": MAX_STORAGE_BYTES,
                          "description": "Most bytes of adapter files the tenant keeps "
                                         "(active versions, and deleted ones until their "
                                         "bytes are reclaimed); null: unlimited"},
    "max_adapter_versions": {"type": ["integer", "null"], "minimum": 1,
                             "maximum": MAX_ADAPTER_VERSIONS,
                             "description": "Most active adapter versions the tenant has; "
                                            "null: unlimited"},
}


_COUNT = {"type": "integer", "minimum": 0}
_SCHEDULER_TENANT = {"type": "object", "description": (
    "One tenant as the scheduler sees it: tenant (the registry tenant's id as text, \"\" "
    "for none), name (the registry tenant's name; null when unknown), weight, requests "
    "waiting, running and swapped, prompt and decode tokens scheduled, service (its "
    "weighted fair-share counter) and KV blocks held"),
    "required": ["tenant", "name", "weight", "num_waiting", "num_running", "num_swapped",
                 "prefill_tokens", "decode_tokens", "service", "kv_blocks"],
    "properties": {"tenant": {"type": "string"}, "name": {"type": ["string", "null"]},
                   "weight": {"type": "number"}, "num_waiting": _COUNT,
                   "num_running": _COUNT, "num_swapped": _COUNT, "prefill_tokens": _COUNT,
                   "decode_tokens": _COUNT, "service": {"type": "number"},
                   "kv_blocks": _COUNT}}
_TENANTS = {"type": "array", "items": _SCHEDULER_TENANT}
_REPLICA_STATS = {"type": "object", "description": (
    "One replica's figures (the fields of EngineStats): replica (its ordinal 0..N-1), "
    "queue, KV pool, device slots (adapter_slots, and slots with each adapter's name), "
    "host_adapters, running_adapters and waiting_adapters (id@digest12), pinned_adapters "
    "(the versions an operator pinned that it holds, id@digest12; each slot says whether "
    "its adapter is pinned), tenants"),
    "required": ["replica", "num_waiting", "num_running", "kv_pool_usage", "max_loras",
                 "adapter_slots", "host_adapters", "running_adapters", "waiting_adapters",
                 "pinned_adapters", "slots", "tenants"],
    "properties": {"replica": {"type": "integer", "minimum": 0}, "tenants": _TENANTS}}
_ENGINE_STATS = {"type": "object", "description": (
    "The whole deployment's figures at the top level (replica -1: the replicas' sums, "
    "rates recomputed from them, slots concatenated in replica order, tenants summed "
    "over replicas), and each live replica's under replicas, ordered by ordinal (none "
    "while no replica is up); max_pinned: the most adapter versions pins may hold"),
    "required": ["replica", "slots", "served_model", "architecture", "max_pinned",
                 "replicas", "tenants"],
    "properties": {"replica": {"const": -1}, "tenants": _TENANTS,
                   "architecture": {"type": "string"}, "max_pinned": _COUNT,
                   "replicas": {"type": "array", "items": _REPLICA_STATS}}}

_SECONDS = {"type": ["number", "null"], "minimum": 0}
_STEPS = {"type": ["integer", "null"], "minimum": 0}
_LATENCY_ROW = {"type": "object", "description": (
    "One tenant (its metrics label: \"other\" past the label cap) over its latest "
    "requests: the p50 and p99 (nearest rank, one of the values) of TTFT, TPOT, "
    "end-to-end and queue time in seconds and of TTFT in engine steps, null where no "
    "request had the value; slo_attainment is met / (met + missed) of the completed "
    "requests judged against the SLO, null when none was; slo_ttft_ms and slo_tpot_ms "
    "are the latest SLO they were judged against"),
    "required": ["tenant", "requests", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                 "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "queue_p50_s", "queue_p99_s",
                 "ttft_steps_p50", "ttft_steps_p99", "slo_ttft_ms", "slo_tpot_ms",
                 "slo_attainment"],
    "properties": {
        "tenant": {"type": "string"}, "requests": _COUNT,
        **{f"{what}_{p}_s": _SECONDS for what in ("ttft", "tpot", "e2e", "queue")
           for p in ("p50", "p99")},
        "ttft_steps_p50": _STEPS, "ttft_steps_p99": _STEPS,
        "slo_ttft_ms": {"type": ["integer", "null"]}, "slo_tpot_ms": {"type": ["integer", "null"]},
        "slo_attainment": {"type": ["number", "null"], "minimum": 0, "maximum": 1}}}
_TENANT_LATENCY = {"type": "object", "description": (
    "Per tenant, its latest finished requests (at most window of them) as recorded by this "
    "gateway process since it started, sorted by tenant"),
    "required": ["object", "window", "data"],
    "properties": {"object": {"const": "tenant_latency"}, "window": {"type": "integer",
                                                                      "minimum": 1},
                   "data": {"type": "array", "items": _LATENCY_ROW}}}


_TENANT_NAME = {"type": "string", "pattern": _pattern(TENANT_NAME_RE)}
_ADAPTER_NAME = {"type": "string", "pattern": _pattern(ADAPTER_NAME_RE)}


def _path_param(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True,
            "schema": schema or {"type": "string", "minLength": 1}}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _body(schema: dict[str, Any], media: str = "application/json") -> dict[str, Any]:
    return {"required": True, "content": {media: {"schema": schema}}}


def _upload_body() -> dict[str, Any]:
    binary = {"type": "string", "format": "binary"}
    return _body({"type": "object", "required": ["name"], "properties": {
        "name": _ADAPTER_NAME | {"description": "The adapter's name"},
        "visibility": {"type": "string", "enum": ["private", "public"]},
        "adapter_config.json": binary, "adapter_model.safetensors": binary,
        "archive": binary | {"description": "A .zip or .tar.gz of the two files, instead"}}},
        "multipart/form-data")


_VERSION = _query("version", {"type": "integer", "minimum": 1, "maximum": 2**31 - 1})


_PROMOTE = closed({"type": "object", "required": ["version"], "properties": {
    "version": {"type": "integer", "minimum": 1, "maximum": MAX_VERSION,
                "description": "The version that becomes current (an older one: rollback)"}}})
_PIN = closed({"type": "object", "required": ["version"], "properties": {
    "version": {"type": "integer", "minimum": 1, "maximum": MAX_VERSION,
                "description": "The version to pin (an active one)"}}})
_SPLIT = closed({"type": "object", "required": ["version", "percent"], "properties": {
    "version": {"type": "integer", "minimum": 1, "maximum": MAX_VERSION,
                "description": "The canary version (not the current one)"},
    "percent": {"type": "number", "minimum": 0, "maximum": 100,
                "description": "Share of the name's requests the canary gets; requests "
                               "with the same user always get the same side"}}})


def _version_paths(prefix: str, params: list[dict[str, Any]], errors: dict[str, Any],
                   who: str) -> dict[str, Any]:
    """A name's versions, promote, split and cancel, under ``prefix`` (the name's path)."""
    changed = _json(_OBJ, "The name as it now stands: current version, split, versions")
    return {
        f"{prefix}/promote": {"parameters": params, "post": {
            "summary": f"Make a version of {who} adapter its current version (rollback: "
                       "an older one); ends a split",
            "requestBody": _body(_PROMOTE), "responses": {"200": changed, **errors}}},
        f"{prefix}/split": {
            "parameters": params,
            "post": {"summary": f"Split the requests naming {who} adapter between its "
                                "current version and a canary",
                     "requestBody": _body(_SPLIT), "responses": {"200": changed, **errors}},
            "delete": {"summary": f"End the split of {who} adapter",
                       "responses": {"200": changed, **errors}}},
    }


def _adapter_paths() -> dict[str, Any]:
    """The tenant's own adapters."""
    return {
        "/v1/adapters": {
            "get": {"summary": "Every version of the caller's adapters, and its storage "
                               "against its quotas (storage)",
                    "parameters": [_query("include_deleted", {"type": "boolean"})],
                    "responses": {"200": _json(_LIST, "Adapter versions"),
                                  **_errors(400, 401)}},
            "post": {"summary": "Upload a new version of one of the caller's adapters",
                     "requestBody": _upload_body(),
                     "responses": {"201": _json(_OBJ, "The stored version"),
                                   **_errors(400, 401, 409, 413, 422)}}},
        "/v1/adapters/{name}": {
            "get": {"summary": "The caller's adapter: its versions, the current one and the "
                               "split in progress",
                    "parameters": [_path_param("name", _ADAPTER_NAME)],
                    "responses": {"200": _json(_OBJ, "The adapter's versions"),
                                  **_errors(401, 404)}},
            "delete": {
                "summary": "Delete the caller's adapter (every version, or ?version=N)",
                "parameters": [_path_param("name", _ADAPTER_NAME), _VERSION],
                "responses": {"200": _json(_OBJ, "The deleted versions"),
                              **_errors(400, 401, 404)}}},
        **_version_paths("/v1/adapters/{name}", [_path_param("name", _ADAPTER_NAME)],
                         _errors(400, 401, 404, 409, 413), "the caller's"),
    }


def _admin_paths() -> dict[str, Any]:
    """Operator routes; every one needs an admin key."""
    tenant = _path_param("tenant", _TENANT_NAME)
    admin = _errors(400, 401, 403, 404)
    return {
        "/admin/api/engine": {"get": {"summary": "Engine statistics (admin)", "responses": {
            "200": _json(_ENGINE_STATS, "Engine statistics"), **_errors(401, 403)}}},
        "/admin/api/latency": {"get": {
            "summary": "Each tenant's recent latency percentiles and SLO attainment (admin)",
            "responses": {"200": _json(_TENANT_LATENCY, "Latency per tenant"),
                          **_errors(401, 403)}}},
        "/admin/api/usage": {"get": {
            "summary": "Hourly usage per tenant and model (admin)",
            "parameters": [_query(n, {"type": "string", "format": "date-time"})
                           for n in ("since", "until")] + [_query("tenant", {"type": "string"})],
            "responses": {"200": _json(_OBJ, "Usage"), **admin}}},
        "/admin/api/tenants": {
            "get": {"summary": "Every tenant (admin)",
                    "responses": {"200": _json(_LIST, "Tenants"), **_errors(401, 403)}},
            "post": {"summary": "Create a tenant (admin)",
                     "requestBody": _body(closed({
                         "type": "object", "required": ["name"],
                         "properties": {"name": _TENANT_NAME} | _LIMITS | _SETTINGS
                                       | _QUOTAS})),
                     "responses": {"201": _json(_OBJ, "The tenant"),
                                   **_errors(400, 401, 403, 409, 413)}}},
        "/admin/api/tenants/{tenant}": {
            "parameters": [tenant],
            "get": {"summary": "One tenant (admin)",
                    "responses": {"200": _json(_OBJ, "The tenant"), **admin}},
            "patch": {"summary": "Change a tenant's limits, scheduling settings, storage "
                                 "quotas or status (admin)",
                      "requestBody": _body(closed({"type": "object",
                                                   "properties": _LIMITS | _SETTINGS
                                                   | _QUOTAS | {
                          "status": {"type": "string", "enum": ["active", "suspended"]}}})),
                      "responses": {"200": _json(_OBJ, "The tenant"), **admin}}},
        "/admin/api/tenants/{tenant}/keys": {
            "parameters": [tenant],
            "get": {"summary": "A tenant's API keys (admin)",
                    "responses": {"200": _json(_LIST, "Keys"), **admin}},
            "post": {"summary": "Issue an API key; the key is in this response only (admin)",
                     "requestBody": _body(closed({"type": "object", "properties": {
                         "name": {"type": ["string", "null"], "maxLength": 128},
                         "role": {"type": "string", "enum": ["tenant", "admin"]}}})),
                     "responses": {"201": _json(_OBJ, "The key, with its plaintext"),
                                   **admin}}},
        "/admin/api/keys": {"get": {
            "summary": "Every API key (admin)", "parameters": [_query("tenant",
                                                                     {"type": "string"})],
            "responses": {"200": _json(_LIST, "Keys"), **admin}}},
        "/admin/api/keys/{key_id}": {"delete": {
            "summary": "Revoke an API key (admin)",
            "parameters": [_path_param("key_id", {"type": "integer", "minimum": 0})],
            "responses": {"200": _json(_OBJ, "The revoked key"), **admin}}},
        "/admin/api/adapters": {"get": {
            "summary": "Every adapter version (admin)",
            "parameters": [_query("tenant", {"type": "string"}),
                           _query("include_deleted", {"type": "boolean"})],
            "responses": {"200": _json(_LIST, "Adapter versions"), **admin}}},
        "/admin/api/tenants/{tenant}/adapters": {
            "parameters": [tenant],
            "get": {"summary": "A tenant's adapter versions (admin)",
                    "parameters": [_query("include_deleted", {"type": "boolean"})],
                    "responses": {"200": _json(_LIST, "Adapter versions"), **admin}},
            "post": {"summary": "Upload a new version of a tenant's adapter (admin)",
                     "requestBody": _upload_body(),
                     "responses": {"201": _json(_OBJ, "The stored version"),
                                   **_errors(400, 401, 403, 404, 409, 413, 422)}}},
        "/admin/api/tenants/{tenant}/adapters/{name}": {
            "parameters": [tenant, _path_param("name", _ADAPTER_NAME)],
            "patch": {"summary": "Make an adapter public or private (admin)",
                      "requestBody": _body(closed({
                          "type": "object", "required": ["visibility"],
                          "properties": {"visibility": {"type": "string",
                                                        "enum": ["private", "public"]}}})),
                      "responses": {"200": _json(_LIST, "The adapter's versions"), **admin}},
            "get": {"summary": "A tenant's adapter: its versions, the current one and the "
                               "split in progress (admin)",
                    "responses": {"200": _json(_OBJ, "The adapter's versions"), **admin}},
            "delete": {"summary": "Delete an adapter (every version, or ?version=N) (admin)",
                       "parameters": [_VERSION],
                       "responses": {"200": _json(_OBJ, "The deleted versions"), **admin}}},
        **_version_paths("/admin/api/tenants/{tenant}/adapters/{name}",
                         [tenant, _path_param("name", _ADAPTER_NAME)],
                         _errors(400, 401, 403, 404, 409, 413), "a tenant's"),
        "/admin/api/tenants/{tenant}/adapters/{name}/pin": {
            "parameters": [tenant, _path_param("name", _ADAPTER_NAME)],
            "post": {"summary": "Pin a version: it keeps a device slot and its host copy on "
                                "every replica, so its requests never wait for a load; 409 "
                                "past the server's share of slots for pins (admin)",
                     "requestBody": _body(_PIN),
                     "responses": {"200": _json(_OBJ, "The name as it now stands"),
                                   **_errors(400, 401, 403, 404, 409, 413)}},
            "delete": {"summary": "Unpin a version (?version=N) (admin)",
                       "parameters": [_VERSION | {"required": True}],
                       "responses": {"200": _json(_OBJ, "The name as it now stands"),
                                     **_errors(400, 401, 403, 404, 409)}}},
    }


def _vllm_paths(config: ServerConfig, model: ModelDescription) -> dict[str, Any]:
    """vLLM's routes beside the OpenAI ones (docs/vllm.md)."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    name = {"type": "string", "minLength": 1,
            "description": "The base model's name or an adapter the caller may use; "
                           "left out: the base model. An adapter changes no token"}
    strs = {"type": "boolean", "description": "Also return each token as text"}
    chat = request_schemas(config, model)["ChatCompletionRequest"]["properties"]["messages"]
    tokenize = {"oneOf": [
        closed({"type": "object", "required": ["prompt"], "properties": {
            "model": name, "prompt": {"type": "string"},
            "add_special_tokens": {"type": "boolean"}, "return_token_strs": strs}}),
        closed({"type": "object", "required": ["messages"], "properties": {
            "model": name, "messages": chat,
            "add_special_tokens": {"const": False,
                                   "description": "The chat template adds its own"},
            "return_token_strs": strs}})]}
    tokens = {"type": "array", "items": {"type": "integer", "minimum": 0,
                                         "maximum": model.vocab_size - 1}}
    lora_name = _ADAPTER_NAME | {"description": "The adapter's name in the caller's tenant"}
    return {
        "/tokenize": {"post": {
            "summary": "A prompt or messages as the model's token ids (vLLM's /tokenize)",
            "requestBody": _body(tokenize),
            "responses": {"200": _json({"type": "object", "required": [
                "count", "max_model_len", "tokens", "token_strs"], "properties": {
                    "count": _COUNT, "max_model_len": {"type": "integer"},
                    "tokens": tokens, "token_strs": {"type": ["array", "null"],
                                                     "items": {"type": "string"}}}},
                "The token ids"), **_errors(400, 401, 404, 413)}}},
        "/detokenize": {"post": {
            "summary": "Token ids as text (vLLM's /detokenize)",
            "requestBody": _body(closed({"type": "object", "required": ["tokens"],
                                         "properties": {"model": name, "tokens": tokens}})),
            "responses": {"200": _json({"type": "object", "required": ["prompt"],
                                        "properties": {"prompt": {"type": "string"}}},
                                       "The text"), **_errors(400, 401, 404, 413)}}},
        "/version": {"get": {
            "summary": "The server's version (vLLM's /version; needs a key)",
            "responses": {"200": _json({"type": "object", "required": ["version"],
                                        "properties": {"version": {"type": "string"}}},
                                       "The version"), **_errors(401)}}},
        "/v1/load_lora_adapter": {"post": {
            "summary": "Register the adapter folder lora_path, inside the server's allowed "
                       "folders (--allowed-lora-dir), as the caller's adapter lora_name: a "
                       "new version unless the current one has the same files",
            "requestBody": _body(closed({"type": "object",
                                         "required": ["lora_name", "lora_path"],
                                         "properties": {
                "lora_name": lora_name,
                "lora_path": {"type": "string", "minLength": 1, "maxLength": 4096,
                              "description": "A folder inside an allowed folder; a "
                                             "relative path is read from the first one"},
                "load_inplace": {"type": "boolean",
                                 "description": "Accepted; a new version always becomes "
                                                "the current one"}}})),
            "responses": {"200": {"description": "Success", "content": text},
                          **_errors(400, 401, 403, 404, 409, 413, 422)}}},
        "/v1/unload_lora_adapter": {"post": {
            "summary": "Delete the caller's adapter lora_name, every version",
            "requestBody": _body(closed({"type": "object", "required": ["lora_name"],
                                         "properties": {
                "lora_name": lora_name,
                "lora_int_id": {"type": "integer", "description": "Accepted and ignored"}}})),
            "responses": {"200": {"description": "Success", "content": text},
                          **_errors(400, 401, 404, 413)}}},
    }


def openapi_document(config: ServerConfig, model: ModelDescription) -> dict[str, Any]:
    """The document for a server with ``config``'s limits, serving ``model``."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    public: list[dict[str, Any]] = []
    return {
        "openapi": "3.1.0",
        "info": {"title": "loraplex", "version": "0.1.0",
                 "description": "OpenAI-compatible multi-tenant LoRA serving. Authenticate "
                                "with 'Authorization: Bearer <key>'."},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/models": {"get": {
                "summary": "Models the caller may use: each adapter name once, with the "
                           "version it reaches (and every version with include_versions)",
                "parameters": [_query("include_versions", {"type": "boolean"})],
                "responses": {
                    "200": _json(_ref("ModelList"), "The base model, own and public adapters"),
                    **_errors(400, 401)}}},
            "/v1/models/{model}": {"get": {
                "summary": "One model, if the caller may use it (name@N: version N)",
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
            **_adapter_paths(),
            **_vllm_paths(config, model),
            **_admin_paths(),
            "/metrics": {"get": {"summary": "Prometheus metrics (an admin key, or the "
                                            "scrape token LORAPLEX_METRICS_TOKEN)",
                                 "responses": {
                "200": {"description": "Exposition text", "content": text},
                **_errors(401, 403)}}},
            "/health": {"get": {"summary": "The process is alive", "security": public,
                                "responses": {"200": _json({"type": "object"}, "Alive"),
                                              "503": _json({"type": "object"},
                                                           "The engine failed for good")}}},
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
            "schemas": _schemas(config, model),
            "responses": _error_responses(),
        },
    }
