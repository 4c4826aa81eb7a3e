"""One generation request from admission to its last token, and its transport.

``Job`` takes a rate-limit lease, submits the request to the engine, and waits for its
first output before any HTTP status is sent, so admission errors (queue full, prompt too
long) still get their own status even when streaming. ``Job.finish`` is the single exit:
it aborts the engine request if it is still running, settles the lease with the real token
count, meters usage and records metrics, exactly once, whatever ended the request.

``EventStreamResponse`` and ``run_until_disconnect`` watch the connection while the engine
works and end the job as soon as the client goes away.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import anyio
from redis.exceptions import RedisError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loraplex.engine.outputs import RequestMetrics, SequenceDelta
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import InvalidRequestError
from loraplex.gateway.auth import cache_salt, tenant_limits
from loraplex.gateway.errors import (
    ClientDisconnected,
    DependencyUnavailableError,
    PayloadTooLargeError,
)
from loraplex.gateway.metrics import status_for_http
from loraplex.gateway.ratelimit import Lease
from loraplex.gateway.state import Gateway
from loraplex.registry import service
from loraplex.registry.api_keys import Principal
from loraplex.registry.db import transaction
from loraplex.registry.usage import UsageRecord

T = TypeVar("T")

logger = logging.getLogger("loraplex.gateway")

BASE_LABEL = "base"


def declared_length(request: Request) -> int | None:
    """The request's Content-Length, if it sent one (400 when it is not an integer)."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    try:
        return int(declared)
    except ValueError:
        raise InvalidRequestError("Content-Length is not an integer") from None


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 once it passes ``max_bytes`` (declared or counted)."""
    size = declared_length(request)
    if size is not None and size > max_bytes:
        raise PayloadTooLargeError(f"the request body ({size} bytes) is over the limit "
                                   f"of {max_bytes} bytes")
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_bytes:
                raise PayloadTooLargeError(f"the request body is over the limit of "
                                           f"{max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection while sending") from None
    return b"".join(chunks)


@dataclass(frozen=True)
class Target:
    """What a ``model`` field resolved to for the caller."""

    model: str  # as the caller spelled it, echoed in responses
    label: str  # bounded metrics label: "base" or owner/name
    adapter_id: int | None = None
    ref: AdapterRef | None = None


def _resolve(gw: Gateway, factory: sessionmaker[Session], tenant_id: int, model: str) -> Target:
    with transaction(factory) as session:
        row = service.resolve_adapter(session, tenant_id, model)
        owner = row.tenant.name
        folder = gw.store.resolve(row.storage_path)
        # The id names the version, the digest the bytes: caches key on both.
        ref = AdapterRef(adapter_id=str(row.id), digest=row.digest, path=str(folder))
        return Target(model, f"{owner}/{row.name}", row.id, ref)


async def resolve_target(gw: Gateway, principal: Principal, model: str) -> Target:
    """The base model or the adapter ``model`` names; AdapterNotFoundError (404) when the
    caller may not see it, whether or not it exists."""
    if model == gw.served_model_name:
        return Target(model, BASE_LABEL)
    return await run_in_threadpool(_resolve, gw, gw.sessions, principal.tenant_id, model)


class Observation:
    """Labels of one request's metrics sample, recorded once."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw
        self.tenant = "unauthenticated"
        self.adapter = "none"
        # Set once a Job owns the request: it records the sample when the request really
        # ends, which for a stream is long after the handler returned.
        self.delegated = False
        self._done = False

    def record(self, status: str, metrics: RequestMetrics | None = None) -> None:
        if self._done:
            return
        self._done = True
        self._gw.metrics.observe_request(
            self.tenant, self.adapter, status,
            ttft_s=metrics.ttft if metrics else None,
            tpot_s=metrics.tpot if metrics else None,
            e2e_s=metrics.e2e if metrics else None)

    def record_http(self, status_code: int) -> None:
        self.record(status_for_http(status_code))


class Job:
    """One admitted generation: lease, engine stream, and their cleanup."""

    def __init__(self, gw: Gateway, principal: Principal, target: Target,
                 prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 observation: Observation) -> None:
        self.gw = gw
        self.principal = principal
        self.target = target
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.request_id = request_id
        self.obs = observation
        observation.delegated = True
        self.created = int(time.time())
        self.num_completion_tokens = 0
        self.metrics: RequestMetrics | None = None
        self._lease: Lease | None = None
        self._stream: AsyncGenerator[SequenceDelta, None] | None = None
        self._first: SequenceDelta | None = None
        self._finished = False
        self._admitted = False
        # The metrics status of a stream that ended with an error event (its HTTP status,
        # 200, was already sent).
        self.stream_status = "ok"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    async def start(self) -> None:
        """Takes the lease and waits for the first output; raises what refuses the request
        (RateLimitExceeded, EngineOverloadedError, PromptTooLongError...), leaving nothing
        held behind."""
        gw, principal = self.gw, self.principal
        reserved = self.num_prompt_tokens + self.params.n * self.params.max_tokens
        try:
            self._lease = await gw.rate_limiter.acquire(
                str(principal.tenant_id), tenant_limits(principal), reserved)
        except InvalidRequestError as exc:
            raise InvalidRequestError(
                f"the prompt ({self.num_prompt_tokens} tokens) plus n * max_tokens "
                f"({self.params.n} * {self.params.max_tokens}) is {reserved} tokens, over "
                f"your limit of {principal.max_tokens_per_minute} tokens per window",
                param="max_tokens") from exc
        except (RedisError, OSError) as exc:
            raise DependencyUnavailableError(f"rate limiter: {exc}") from exc
        salt = (None if gw.config.allow_cross_tenant_cache_sharing
                else cache_salt(gw.salt_secret, principal.tenant_id))
        self._stream = gw.engine.generate(self.prompt_token_ids, self.params,
                                          self.target.ref, salt, self.request_id)
        try:
            self._first = await self._stream.__anext__()
        except StopAsyncIteration:
            self._first = None
        self._admitted = True

    async def deltas(self) -> AsyncIterator[SequenceDelta]:
        """Every output of the request, the first (already received) included."""
        if self._first is not None:
            first, self._first = self._first, None
            self._count(first)
            yield first
        if self._stream is None:
            return
        async for delta in self._stream:
            self._count(delta)
            yield delta

    def _count(self, delta: SequenceDelta) -> None:
        self.num_completion_tokens += len(delta.new_token_ids)
        if delta.finished and delta.index == 0 and delta.metrics is not None:
            self.metrics = delta.metrics

    async def finish(self, status: str) -> None:
        """Ends the request (aborting it in the engine if it still runs), releases the
        lease with the real count, meters usage, records metrics. Idempotent; call it
        shielded from cancellation."""
        if self._finished:
            return
        self._finished = True
        if self._stream is not None:
            await self._stream.aclose()  # aborts the engine request if it is unfinished
        used = self.num_prompt_tokens + self.num_completion_tokens if self._admitted else 0
        if self._lease is not None:
            try:
                await self.gw.rate_limiter.release(self._lease, used)
            except (RedisError, OSError):
                # The lease expires on its own (its TTL); the request itself went fine.
                logger.warning("could not release rate-limit lease %s", self._lease.lease_id,
                               exc_info=True)
        if self._admitted:
            self.gw.meter.add(UsageRecord(
                tenant_id=self.principal.tenant_id, adapter_id=self.target.adapter_id,
                at=datetime.now(UTC), requests=1, prompt_tokens=self.num_prompt_tokens,
                completion_tokens=self.num_completion_tokens))
        self.obs.record(status, self.metrics)


async def run_until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Runs ``work`` while watching the connection; cancels it and raises
    ClientDisconnected if the client goes away first."""
    outcome: list[T] = []
    failure: list[BaseException] = []
    disconnected = False

    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal disconnected
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    group.cancel_scope.cancel()
                    return

        async def main() -> None:
            try:
                outcome.append(await work())
            except Exception as exc:  # re-raised below, unwrapped from the task group
                failure.append(exc)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        group.start_soon(main)
    if failure:
        raise failure[0]
    if disconnected or not outcome:
        raise ClientDisconnected("the client closed the connection")
    return outcome[0]


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of encoded events.

    Unlike Starlette's StreamingResponse (which, on ASGI 2.4 servers, notices a gone client
    only at its next write), this watches for ``http.disconnect`` the whole time, so a
    request still queued or prefilling is aborted at once. ``on_close(disconnected)`` runs
    exactly once, shielded from cancellation, after the iterator is closed.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None],
                 on_close: Callable[[bool], Awaitable[None]]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    nonlocal disconnected
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            disconnected = True
                            group.cancel_scope.cancel()
                            return

                group.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})
                except OSError:  # ASGI 2.4: a write to a closed connection
                    disconnected = True
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
                await self.on_close(disconnected)


def sse(data: str) -> bytes:
    """One server-sent event."""
    return f"data: {data}\n\n".encode()


async def shielded(coro: Awaitable[None]) -> None:
    """Awaits ``coro`` even if the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        await coro

