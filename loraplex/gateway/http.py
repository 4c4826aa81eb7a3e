"""The HTTP plumbing every route shares: reading bodies under a byte cap, JSON bodies and
query parameters parsed into values or 400s that name them, and the transport of long
responses (server-sent events, work that stops when the client goes away).

``EventStreamResponse`` and ``run_until_disconnect`` watch the connection while the engine
works, so a request is ended as soon as its client hangs up.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loraplex.errors import InvalidRequestError
from loraplex.gateway.errors import ClientDisconnected, PayloadTooLargeError
from loraplex.registry.db import MAX_INT32

T = TypeVar("T")


# --- bodies ------------------------------------------------------------------------------


def declared_length(request: Request) -> int | None:
    """The request's Content-Length, if it sent one (400 when it is not an integer)."""
    declared = request.headers.get("content-length")
    return None if declared is None else parse_int(declared, "Content-Length", 0, 2**63 - 1)


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


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; InvalidRequestError (400) otherwise.

    NaN and Infinity are refused: they are not JSON, though Python's parser accepts them.
    """

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        raise InvalidRequestError(
            f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return data


async def read_json_object(request: Request, max_bytes: int,
                           allowed: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object body; unknown fields are refused so a typo is not silently dropped."""
    body = parse_json_body(await read_body(request, max_bytes))
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidRequestError(f"unknown field {unknown[0]!r}; expected one of "
                                  f"{', '.join(allowed)}", param=unknown[0])
    return body


# --- query parameters --------------------------------------------------------------------


def parse_time_param(params: Mapping[str, str], name: str) -> datetime | None:
    """An ISO 8601 query parameter (UTC when it has no offset); 400 naming it if bad."""
    raw = params.get(name)
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be an ISO 8601 time, got {raw!r}",
                                  param=name) from None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:  # in UTC here, so that no later step meets the calendar's ends
        return value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:00-14:00 is past year 9999 in UTC: its end
        return (datetime.max if value.year > 1 else datetime.min).replace(tzinfo=UTC)


def query_flag(request: Request, name: str) -> bool:
    """A ``true``/``false`` (or ``1``/``0``) query parameter, false when absent."""
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidRequestError(f"{name} must be true or false, got {raw!r}", param=name)
    return raw in ("true", "1")


def parse_int(raw: str, name: str, lo: int = 1, hi: int = MAX_INT32) -> int:
    """``raw`` as an integer in [lo, hi] written in ASCII digits; 400 naming ``name`` if not.

    Neither ``str.isdigit`` (true for "¹") nor ``int`` (accepts "٣", " 3", "+3", "3_0")
    alone decides: every integer parameter is read here, so all agree on what one is.
    """
    if not raw.isascii() or not raw.isdigit() or len(raw) > len(str(hi)) \
            or not lo <= int(raw) <= hi:
        shown = repr(raw) if len(raw) <= 40 else f"{raw[:40]!r}..."  # a huge one, cut
        raise InvalidRequestError(f"{name} must be an integer from {lo} to {hi}, got {shown}",
                                  param=name)
    return int(raw)


def query_version(request: Request) -> int | None:
    """The ``version`` query parameter: one version of an adapter, or None for all."""
    raw = request.query_params.get("version")
    return None if raw is None else parse_int(raw, "version")


# --- long responses ----------------------------------------------------------------------


async def run_until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Runs ``work`` while watching the connection; cancels it and raises
    ClientDisconnected if the client goes away first."""
    outcome: list[T] = []
    failure: list[BaseException] = []
    disconnected = False

    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal disconnected
            disconnected = await _watch_disconnect(request.receive, group.cancel_scope)

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


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> bool:
    # Returns (after cancelling ``scope``) once the client has gone away.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return True


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of encoded events.

    Unlike Starlette's StreamingResponse (which, on ASGI 2.4 servers, notices a gone client
    only at its next write), this watches for ``http.disconnect`` the whole time, so a
    request still queued or prefilling is aborted at once. ``on_close(cut_short)`` runs
    exactly once, shielded from cancellation, after the iterator is closed; ``cut_short``
    is false only when the whole response was sent.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None],
                 on_close: Callable[[bool], Awaitable[None]],
                 headers: Mapping[str, str] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                           **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_watch_disconnect, receive, group.cancel_scope)
                try:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})
                    completed = True
                except OSError:  # ASGI 2.4: a write to a closed connection
                    pass
                group.cancel_scope.cancel()
        finally:
            # Only a response that did not reach its end was cut short. Once it is complete
            # the server reports http.disconnect too, which is no hang-up; a stream the
            # server cancels (shutdown) is cut short like one whose client left.
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
                await self.on_close(not completed)


def sse(data: str) -> bytes:
    """One server-sent event."""
    return f"data: {data}\n\n".encode()


async def shielded(coro: Awaitable[None]) -> None:
    """Awaits ``coro`` even if the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        await coro
