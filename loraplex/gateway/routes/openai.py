"""The tenant-facing, OpenAI-compatible routes: models, completions, chat, usage.

Each handler parses, resolves the caller and the model, and hands a ``Job`` to the engine,
which validates the prompt (``loraplex.engine.validation``); errors propagate to the one
exception handler (``gateway/errors.py``). Every request to these routes is counted in the
metrics exactly once, with its final status.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import EngineDeadError
from loraplex.gateway.auth import authenticate, is_own
from loraplex.gateway.errors import ClientDisconnected, describe
from loraplex.gateway.generation import Job, request_share
from loraplex.gateway.http import (
    EventStreamResponse,
    parse_json_body,
    parse_time_param,
    query_flag,
    read_body,
    run_until_disconnect,
    shielded,
    sse,
)
from loraplex.gateway.metrics import Observation, status_for_http
from loraplex.gateway.model_resolution import ResolvedModel, resolve_model
from loraplex.gateway.responses import Accumulator, ChunkWriter, Echo, dumps, usage
from loraplex.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationOptions,
    parse_chat_completion,
    parse_completion,
    with_call_format,
)
from loraplex.gateway.state import Gateway, gateway
from loraplex.gateway.tools import ToolUse, template_input
from loraplex.registry import service
from loraplex.registry.api_keys import Principal
from loraplex.registry.db import transaction
from loraplex.registry.models import Adapter

Handler = Callable[[Request, Gateway, Observation], Awaitable[Response]]
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def _observed(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Records the request in the metrics with the status it ends with (a Job that was
    admitted records itself, with its latencies)."""

    async def endpoint(request: Request) -> Response:
        gw = gateway(request)
        obs = Observation(gw.metrics)
        try:
            response = await handler(request, gw, obs)
        except Exception as exc:
            if isinstance(exc, ClientDisconnected):
                obs.record("aborted")
            elif not obs.delegated:
                obs.record_http(describe(exc).status)
            raise
        if not obs.delegated:
            obs.record_http(response.status_code)
        return response

    return endpoint


# --- models ------------------------------------------------------------------------------


def _model_object(gw: Gateway, principal: Principal, row: Adapter | None, *,
                  versioned: bool = False, split: dict[str, Any] | None = None,
                  versions: list[Adapter] | None = None) -> dict[str, Any]:
    # The one shape of a model, for the list and for one model: the base model, or an
    # adapter named as the caller names it (bare when it is the caller's own; with @N
    # when the caller named a version), with the version it reaches; each with the
    # served model's architecture (an adapter runs on it).
    architecture = gw.backend.description.architecture
    if row is None:
        return {"id": gw.served_model_name, "object": "model", "created": 0,
                "owned_by": "loraplex", "root": gw.served_model_name, "parent": None,
                "architecture": architecture}
    name = row.name if is_own(principal, row.tenant_id) else f"{row.tenant.name}/{row.name}"
    entry: dict[str, Any] = {
        "id": f"{name}@{row.version}" if versioned else name, "object": "model",
        "created": int(row.created_at.timestamp()), "owned_by": row.tenant.name,
        "root": row.identity, "parent": gw.served_model_name, "version": row.version,
        "architecture": architecture}
    if split is not None:
        entry["split"] = split
    if versions is not None:
        entry["versions"] = [{"id": f"{name}@{v.version}", "version": v.version,
                              "root": v.identity, "created": int(v.created_at.timestamp())}
                             for v in versions]
    return entry


def _model_entries(gw: Gateway, principal: Principal,
                   include_versions: bool) -> list[dict[str, Any]]:
    with transaction(gw.sessions) as session:
        rows = service.list_visible_adapters(session, principal.tenant_id)
        # An own adapter named like the base model (an upload from before such names were
        # refused) cannot be called: listing it would name the base model twice.
        served = gw.served_model_name.casefold()
        rows = [row for row in rows if not (row.tenant_id == principal.tenant_id
                                            and row.name.casefold() == served)]
        versions: dict[tuple[int, str], list[Adapter]] = {}
        if include_versions:
            for v in service.list_visible_adapters(session, principal.tenant_id,
                                                   current_only=False):
                versions.setdefault((v.tenant_id, v.name), []).append(v)
        # Only the owner sees a split (another tenant's callers are told one version).
        splits = {}
        own = [(row.tenant_id, row.name) for row in rows if row.tenant_id == principal.tenant_id]
        for key, traffic in service.traffic(session, own).items():
            if traffic.canary_id is not None:
                canary = service.get_adapter(session, traffic.canary_id)
                splits[key] = {"version": canary.version, "percent": traffic.canary_percent}
        return [_model_object(gw, principal, None),
                *(_model_object(gw, principal, row, split=splits.get((row.tenant_id, row.name)),
                                versions=versions.get((row.tenant_id, row.name), [])
                                if include_versions else None)
                  for row in rows)]


def _model_entry(gw: Gateway, principal: Principal, model: str) -> dict[str, Any]:
    if model == gw.served_model_name:
        return _model_object(gw, principal, None)
    with transaction(gw.sessions) as session:
        row = service.resolve_adapter(session, principal.tenant_id, model)
        return _model_object(gw, principal, row, versioned="@" in model)


async def list_models(request: Request, gw: Gateway, obs: Observation) -> Response:
    principal = await authenticate(request, gw.sessions)
    obs.tenant = principal.tenant_name
    data = await run_in_threadpool(_model_entries, gw, principal,
                                   query_flag(request, "include_versions"))
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request, gw: Gateway, obs: Observation) -> Response:
    principal = await authenticate(request, gw.sessions)
    obs.tenant = principal.tenant_name
    entry = await run_in_threadpool(_model_entry, gw, principal,
                                    request.path_params["model"])
    return JSONResponse(entry)


# --- generation --------------------------------------------------------------------------


def _sampling_params(gw: Gateway, options: GenerationOptions, num_prompt: int,
                     default_max_tokens: int, *, echo: bool = False) -> SamplingParams:
    max_tokens = options.max_tokens
    if max_tokens is None:
        # As many as fit; the engine refuses a prompt that leaves room for none.
        room = gw.backend.description.max_model_len - num_prompt
        max_tokens = max(1, min(default_max_tokens, gw.max_tokens_limit, room))
    # The request's keywords come from the field table (request_fields.FIELDS) and the
    # shapes the parser reads beside it; max_tokens and prompt_logprobs are the route's.
    return SamplingParams(
        **options.sampling, max_tokens=max_tokens,
        # An echoed prompt's logprobs need the prompt's logits: the engine computes them.
        prompt_logprobs=options.logprobs if echo else None)


async def _prepare(request: Request, gw: Gateway, obs: Observation,
                   parse: Callable[..., R]) -> tuple[Principal, R, ResolvedModel]:
    principal = await authenticate(request, gw.sessions)
    obs.tenant = principal.tenant_name
    body = parse_json_body(await read_body(request, gw.config.max_body_bytes))
    req = parse(body, max_tokens_limit=gw.max_tokens_limit, max_n=gw.config.max_n)
    resolved = await resolve_model(gw, principal, req.options.model, req.options.user)
    obs.adapter = resolved.label
    return principal, req, resolved


async def completions(request: Request, gw: Gateway, obs: Observation) -> Response:
    principal, req, resolved = await _prepare(request, gw, obs, parse_completion)
    token_ids = (list(req.prompt_token_ids) if req.prompt_token_ids is not None
                 else await gw.tokenizers.encode(req.prompt or ""))
    # OpenAI's default of 16 applies only when max_tokens is left out.
    params = _sampling_params(gw, req.options, len(token_ids), default_max_tokens=16,
                              echo=req.echo)
    echo = None
    if req.echo:
        text = req.prompt if req.prompt is not None else await gw.tokenizers.decode(token_ids)
        echo = Echo(text, token_ids)
    return await _generate(request, gw, obs, principal, resolved, token_ids, params,
                           req.options, chat=False, echo=echo)


async def chat_completions(request: Request, gw: Gateway, obs: Observation) -> Response:
    principal, req, resolved = await _prepare(request, gw, obs, parse_chat_completion)
    if req.tools is not None:
        # Each tool's parameters compile (a 400 naming the tool otherwise), in the grammar
        # sandbox and off the event loop: a costly schema stalls nobody's request.
        loop = asyncio.get_running_loop()
        for spec in req.tools.parameter_specs:
            await loop.run_in_executor(gw.grammars.executor, gw.grammars.check, spec,
                                       principal.tenant_name)
    req = with_call_format(req, bare=gw.tokenizers.bare_tool_calls)
    messages, tools = template_input(req.messages, req.tools, gw.tokenizers.renders_tools)
    token_ids = await gw.tokenizers.encode_chat(messages, tools)
    params = _sampling_params(gw, req.options, len(token_ids),
                              default_max_tokens=gw.max_tokens_limit)
    return await _generate(request, gw, obs, principal, resolved, token_ids, params,
                           req.options, chat=True, tools=req.tools,
                           chat_echo=req.echo or "")


async def _generate(request: Request, gw: Gateway, obs: Observation, principal: Principal,
                    resolved: ResolvedModel, token_ids: list[int], params: SamplingParams,
                    options: GenerationOptions, *, chat: bool, echo: Echo | None = None,
                    tools: ToolUse | None = None, chat_echo: str = "") -> Response:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    share = request_share(principal, options.priority_class)
    job = Job(gw, principal, resolved, token_ids, params, rid, obs, share)
    try:
        await job.start()
    except BaseException as exc:
        await shielded(job.finish(_failure_status(exc)))
        raise
    if options.stream:
        return EventStreamResponse(_events(gw, job, options, chat, echo, tools, chat_echo),
                                   on_close=lambda gone: job.finish(
                                       "aborted" if gone else job.stream_status),
                                   headers=resolved.headers)
    try:
        body = await run_until_disconnect(request,
                                          lambda: _collect(gw, job, options, chat, echo,
                                                           tools, chat_echo))
    except BaseException as exc:
        await shielded(job.finish(_failure_status(exc)))
        raise
    job.sent()  # the whole answer is handed over: all of it is metered
    await shielded(job.finish("ok"))
    return JSONResponse(body, headers=resolved.headers)


def _failure_status(exc: BaseException) -> str:
    if isinstance(exc, ClientDisconnected) or not isinstance(exc, Exception):
        return "aborted"  # also a cancelled task: the connection or the server went away
    return status_for_http(describe(exc).status)


async def _collect(gw: Gateway, job: Job, options: GenerationOptions, chat: bool,
                   echo: Echo | None, tools: ToolUse | None,
                   chat_echo: str) -> dict[str, Any]:
    acc = Accumulator(job.params.n, options.logprobs, gw.tokenizers.token_text, echo, tools,
                      chat_echo)
    async for delta in job.deltas():
        acc.add(delta)
    if acc.aborted:
        raise EngineDeadError("the request was aborted: the server is shutting down")
    usage_ = usage(job.num_prompt_tokens, job.num_completion_tokens)
    build = acc.chat if chat else acc.completion
    return build(job.request_id, job.created, job.resolved.model, usage_)


async def _events(gw: Gateway, job: Job, options: GenerationOptions, chat: bool,
                  echo: Echo | None, tools: ToolUse | None,
                  chat_echo: str) -> AsyncGenerator[bytes, None]:
    writer = ChunkWriter(chat=chat, rid=job.request_id, created=job.created,
                         model=job.resolved.model, n=job.params.n, logprobs=options.logprobs,
                         include_usage=options.include_usage,
                         token_text=gw.tokenizers.token_text, echo=echo, tools=tools,
                         chat_echo=chat_echo)
    try:
        for chunk in writer.role_chunks():
            yield sse(chunk)
        async for delta in job.deltas():
            if delta.finish_reason == "abort":
                raise EngineDeadError("the request was aborted: the server is shutting down")
            chunk_ = writer.delta_chunk(delta)
            if chunk_ is not None:
                yield sse(chunk_)
                # Resumed only once the chunk was written: its tokens reached the client.
                job.sent()
        final = writer.usage_chunk(usage(job.num_prompt_tokens, job.num_completion_tokens))
        if final is not None:
            yield sse(final)
    except Exception as exc:  # the status is sent: report the error as the last event
        info = describe(exc)
        job.stream_status = status_for_http(info.status)
        yield sse(dumps(info.payload()))
    yield sse("[DONE]")


# --- usage -------------------------------------------------------------------------------


def _usage_report(gw: Gateway, principal: Principal, since: datetime | None,
                  until: datetime | None) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        rows = service.list_usage(session, principal.tenant_id, since=since, until=until)
        totals = service.usage_totals(session, principal.tenant_id, since=since, until=until)
        data = [{"hour": row.hour.isoformat(),
                 "model": _usage_model(session, gw, principal, row.adapter_id),
                 "requests": row.requests, "prompt_tokens": row.prompt_tokens,
                 "completion_tokens": row.completion_tokens,
                 "total_tokens": row.prompt_tokens + row.completion_tokens}
                for row in rows]
    return {"object": "usage", "tenant": principal.tenant_name,
            "totals": {"requests": totals.requests, "prompt_tokens": totals.prompt_tokens,
                       "completion_tokens": totals.completion_tokens,
                       "total_tokens": totals.total_tokens},
            "data": data}


def _usage_model(session: Session, gw: Gateway, principal: Principal,
                 adapter_id: int | None) -> str:
    if adapter_id is None:
        return gw.served_model_name
    row = service.get_adapter(session, adapter_id)
    name = f"{row.name}@v{row.version}"
    return name if is_own(principal, row.tenant_id) else f"{row.tenant.name}/{name}"


async def get_usage(request: Request, gw: Gateway, obs: Observation) -> Response:
    principal = await authenticate(request, gw.sessions)
    obs.tenant = principal.tenant_name
    since = parse_time_param(request.query_params, "since")
    until = parse_time_param(request.query_params, "until")
    # Read-your-writes: what this process metered so far is written before reading.
    await gw.meter.flush()
    report = await run_in_threadpool(_usage_report, gw, principal, since, until)
    return JSONResponse(report)


def routes() -> list[Route]:
    """The routes of this module, for ``create_app``."""
    return [
        Route("/v1/models", _observed(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _observed(get_model), methods=["GET"]),
        Route("/v1/completions", _observed(completions), methods=["POST"]),
        Route("/v1/chat/completions", _observed(chat_completions), methods=["POST"]),
        Route("/v1/usage", _observed(get_usage), methods=["GET"]),
    ]
