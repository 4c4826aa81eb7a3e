"""Connection limits: what a client must send, how much, and how fast, before it costs
the server anything more than a socket.

Ours, enforced here (a proxy in front may enforce the same, tighter):

- **header size**: the request line and headers together at most ``max_header_bytes``
  (64 KiB), counted as they arrive, else 431 and the connection closed; this also bounds
  the header count;
- **header timeout**: a connection must complete its request's headers within
  ``header_timeout_s`` (10 s) of being opened, or of its previous response, else 408 and
  closed (partial-header slowloris connections held forever before);
- **pending connections**: at most ``max_pending_connections`` (256) may be waiting for
  their headers at once; a connection past that is closed at once, so unauthenticated
  clients cannot take every file descriptor;
- **body timeout**: a body (JSON or an adapter upload) that sends nothing for
  ``body_timeout_s`` (30 s) is answered 408 and what it staged is removed (``http.py``,
  ``read_chunks``);
- **keep-alive**: an idle connection closes after ``keep_alive_timeout_s`` (5 s).

Left to a proxy: TLS, per-IP connection and request rates, total bandwidth.
"""

from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass
from typing import Any, Final

import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from loraplex.config import ServerConfig
from loraplex.gateway.errors import RequestTimeoutError


def _plain(status: bytes, text: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: " + str(len(text)).encode() + b"\r\n\r\n"
            + text)


_TIMEOUT_RESPONSE: Final = _plain(b"408 Request Timeout", b"the request headers took too long")
_TOO_LARGE_RESPONSE: Final = _plain(b"431 Request Header Fields Too Large",
                                    b"the request line and headers are too large")


@dataclass
class PendingConnections:
    """The connections of one server still waiting for a request's headers, and what
    those headers may cost."""

    max_pending: int
    header_timeout_s: float
    max_header_bytes: int
    num_pending: int = 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request's headers and a cap on the
    connections waiting for them."""

    def __init__(self, *args: Any, pending: PendingConnections, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending = pending
        self._header_timer: asyncio.TimerHandle | None = None
        self._head = bytearray()  # this request's bytes so far, up to the header limit

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._pending.num_pending >= self._pending.max_pending:
            transport.abort()  # no byte read: it costs nothing more
            return
        self._wait_for_headers()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            # a keep-alive connection's next request begins (not the rest of a body its
            # answer came before, which is no header)
            self._wait_for_headers()
        if self._header_timer is not None:
            # Counted before h11 buffers it: h11 bounds only headers that arrive in pieces.
            limit = self._pending.max_header_bytes
            self._head += data[:limit + 4 - len(self._head)]
            end = self._head.find(b"\r\n\r\n")
            if end > limit or (end < 0 and len(self._head) > limit):
                self._refuse(_TOO_LARGE_RESPONSE)
                return
        super().data_received(data)
        if self._in_request():
            self._headers_arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _wait_for_headers(self) -> None:
        self._head = bytearray()
        self._pending.num_pending += 1
        self._header_timer = self.loop.call_later(self._pending.header_timeout_s,
                                                  self._headers_too_slow)

    def _headers_arrived(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
            self._pending.num_pending -= 1

    def _headers_too_slow(self) -> None:
        if not self._in_request():
            self._refuse(_TIMEOUT_RESPONSE)

    def _refuse(self, response: bytes) -> None:
        self._headers_arrived()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()


def uvicorn_config(app: Any, config: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn configuration that serves ``app`` under ``config``'s connection limits
    (``kwargs``: uvicorn's other options, e.g. ``log_level``)."""
    pending = PendingConnections(config.max_pending_connections, config.header_timeout_s,
                                 config.max_header_bytes)
    return uvicorn.Config(
        app, host=config.host, port=config.port,
        http=functools.partial(GuardedH11Protocol, pending=pending),  # type: ignore[arg-type]
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_keep_alive=math.ceil(config.keep_alive_timeout_s), **kwargs)


class BodyTimeout:
    """ASGI middleware: while a request's body is incomplete, each ``receive`` waits at most
    ``timeout_s``, then RequestTimeoutError (408) is raised where the body is read, so the
    route stops and what it staged is removed. Once the body is whole, ``receive`` waits
    for a disconnect as long as the response runs."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def bounded() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the request body sent nothing for {self.timeout_s:g} s (the server's "
                    "limit)") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, bounded, send)
