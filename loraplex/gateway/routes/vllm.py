"""The routes vLLM's server has beside the OpenAI ones, answered as vLLM answers them:
``/tokenize``, ``/detokenize``, ``/version``, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (docs/vllm.md says what differs and why).

Every one needs a key (vLLM leaves the first three open). ``model`` names the base model or
an adapter the caller may see, as in completions; an adapter changes no token, so the
served model's tokenizer answers for all. Loading by path registers the folder for the
caller's tenant, only from the folders the operator allowed (``--allowed-lora-dir``);
unloading deletes the caller's adapter, every version.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from loraplex.errors import AdapterError, InvalidRequestError
from loraplex.gateway.adapter_uploads import adapter_service
from loraplex.gateway.auth import authenticate
from loraplex.gateway.errors import AdapterRejectedError
from loraplex.gateway.fields import bad, read_bool, read_str, read_token_ids, type_name
from loraplex.gateway.http import read_json_object
from loraplex.gateway.lora_modules import load_for_tenant, resolve_allowed_path
from loraplex.gateway.model_resolution import resolve_model
from loraplex.gateway.schemas import parse_messages
from loraplex.gateway.state import Gateway, gateway
from loraplex.gateway.tools import template_input
from loraplex.registry.api_keys import Principal

TOKENIZE_FIELDS: Final = ("model", "prompt", "messages", "add_special_tokens",
                          "return_token_strs")
DETOKENIZE_FIELDS: Final = ("model", "tokens")
LOAD_FIELDS: Final = ("lora_name", "lora_path", "load_inplace")
UNLOAD_FIELDS: Final = ("lora_name", "lora_int_id")


def _version() -> str:
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


async def _caller(request: Request) -> tuple[Gateway, Principal]:
    gw = gateway(request)
    return gw, await authenticate(request, gw.sessions)


async def _check_model(gw: Gateway, principal: Principal, body: dict[str, Any]) -> None:
    # The base model or an adapter the caller may see (404 otherwise, as completions say).
    model = read_str(body, "model")
    if model == "":
        raise bad("model", "must not be empty (leave it out for the base model)")
    if model is not None:
        await resolve_model(gw, principal, model)


async def tokenize(request: Request) -> Response:
    """``{"prompt": text}`` or ``{"messages": [...]}`` as the model reads it:
    ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    gw, principal = await _caller(request)
    body = await read_json_object(request, gw.config.max_body_bytes,
                                  TOKENIZE_FIELDS)
    await _check_model(gw, principal, body)
    return_strs = read_bool(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("send exactly one of prompt and messages", param="prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad("prompt", f"expected a string, got {type_name(prompt)}")
        read_str(body, "prompt")  # a lone surrogate is a 400 naming it
        tokens = await gw.tokenizers.encode(prompt,
                                            read_bool(body, "add_special_tokens", True))
    else:
        # The chat template adds the special tokens it wants, as in chat completions.
        if read_bool(body, "add_special_tokens", False):
            raise bad("add_special_tokens", "must be false with messages: the chat "
                                            "template adds its own")
        messages, _ = template_input(parse_messages(body), None,
                                     gw.tokenizers.renders_tools)
        tokens = await gw.tokenizers.encode_chat(messages, None)
    strs = await gw.tokenizers.token_strs(tokens) if return_strs else None
    return JSONResponse({"count": len(tokens),
                         "max_model_len": gw.backend.description.max_model_len,
                         "tokens": tokens, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    """``{"tokens": [ids]}`` as text: ``{"prompt": text}``."""
    gw, principal = await _caller(request)
    body = await read_json_object(request, gw.config.max_body_bytes,
                                  DETOKENIZE_FIELDS)
    await _check_model(gw, principal, body)
    tokens = read_token_ids(body.get("tokens"))
    if tokens is None:
        raise bad("tokens", "expected an array of token ids")
    vocab = gw.backend.description.vocab_size
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab:
            raise bad(f"tokens[{i}]", f"must be a token id from 0 to {vocab - 1}, got {token}")
    return JSONResponse({"prompt": await gw.tokenizers.decode(tokens)})


async def version(request: Request) -> Response:
    """The server's version, ``{"version": ...}``."""
    await _caller(request)
    return JSONResponse({"version": _version()})


def _lora_name(body: dict[str, Any]) -> str:
    name = read_str(body, "lora_name")
    if not name:
        raise bad("lora_name", "the adapter's name is required")
    return name


async def load_lora_adapter(request: Request) -> Response:
    """Registers the adapter folder ``lora_path`` (inside an allowed folder) as the caller's
    adapter ``lora_name``: a new version, unless the current one has the same files."""
    gw, principal = await _caller(request)
    body = await read_json_object(request, gw.config.max_body_bytes, LOAD_FIELDS)
    name = _lora_name(body)
    read_bool(body, "load_inplace", False)  # a new version always becomes the current one
    service = adapter_service(request)
    service.uploader.check_field("name", name)  # before the filesystem is looked at
    raw_path = read_str(body, "lora_path")
    if not raw_path:
        raise bad("lora_path", "the adapter folder's path is required")
    folder = resolve_allowed_path(raw_path, gw.config.allowed_lora_dirs)
    try:
        await asyncio.to_thread(load_for_tenant, service.uploader, gw.sessions,
                                principal.tenant_id, name, folder)
    except AdapterError as exc:
        raise AdapterRejectedError(str(exc).replace(str(folder), "lora_path")) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """Deletes the caller's adapter ``lora_name``, every version (404 if it has none)."""
    gw, principal = await _caller(request)
    body = await read_json_object(request, gw.config.max_body_bytes, UNLOAD_FIELDS)
    name = _lora_name(body)
    int_id = body.get("lora_int_id")
    if int_id is not None and (not isinstance(int_id, int) or isinstance(int_id, bool)):
        raise bad("lora_int_id", f"expected an integer, got {type_name(int_id)}")
    await adapter_service(request).delete(principal.tenant_id, name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def routes() -> list[Route]:
    """The routes of this module, for ``create_app``."""
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    ]
