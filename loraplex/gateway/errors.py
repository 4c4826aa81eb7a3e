"""The one place where errors become HTTP responses, in OpenAI's JSON shape.

Every handler raises domain errors (``loraplex.errors``) or the few gateway errors below;
``describe`` maps each to an ``ErrorInfo``: its status, headers (``Retry-After``,
``Allow``) and ``{"error": {"message", "type", "param", "code"}}``, which
``handle_exception`` answers with ``error_response``. Streaming responses, whose status
is already sent, write the same object (``describe(exc).payload()``) as a last
server-sent event.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route

from loraplex.errors import (
    AdapterError,
    AdapterNotFoundError,
    ConfigError,
    ConflictError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    LoraplexError,
    NotFoundError,
    PromptTooLongError,
    QuotaExceededError,
    StoreNotOwnedError,
    TenantSuspendedError,
    UploadTooLargeError,
)
from loraplex.gateway.ratelimit import RateLimitExceeded

logger = logging.getLogger("loraplex.gateway")

# How long a client should wait before retrying when the engine queue is full.
OVERLOADED_RETRY_AFTER_S = 1


class AuthenticationError(LoraplexError):
    """No key, a malformed header, or a key that is unknown, revoked or suspended (401)."""


class PermissionDeniedError(LoraplexError):
    """A valid key without the role the route needs (403)."""


class PayloadTooLargeError(LoraplexError):
    """The request body is over the server's limit (413)."""


class RequestTimeoutError(LoraplexError):
    """The request's body stopped arriving (408; the connection is not kept)."""


class AdapterRejectedError(AdapterError):
    """An uploaded adapter was refused; the message names the reason (422)."""


class ClientDisconnected(LoraplexError):
    """The client went away before the response was sent (nobody reads the answer)."""


class DependencyUnavailableError(LoraplexError):
    """The database or the rate limiter's Redis cannot be reached (503, retry later)."""


@dataclass(frozen=True)
class ErrorInfo:
    """Everything needed to answer one error."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None
    allow: str | None = None  # the methods of the path, on a 405

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="loraplex"'
        if self.allow is not None:
            headers["Allow"] = self.allow
        return headers


def describe(exc: BaseException) -> ErrorInfo:
    """The status and OpenAI error object for an exception (500 for anything unexpected)."""
    if isinstance(exc, PromptTooLongError):
        # 400 as OpenAI and vLLM answer it (the openai client raises BadRequestError); the
        # body is not too large, its tokens are.
        return ErrorInfo(400, str(exc), "invalid_request_error", exc.param,
                         "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return ErrorInfo(400, str(exc), "invalid_request_error", exc.param, None)
    if isinstance(exc, AuthenticationError):
        return ErrorInfo(401, str(exc), "invalid_request_error", None, "invalid_api_key")
    if isinstance(exc, TenantSuspendedError):
        return ErrorInfo(403, str(exc), "permission_error", None, "tenant_suspended")
    if isinstance(exc, PermissionDeniedError):
        return ErrorInfo(403, str(exc), "permission_error", None, "insufficient_permissions")
    if isinstance(exc, AdapterNotFoundError):
        return ErrorInfo(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, NotFoundError):
        return ErrorInfo(404, str(exc), "invalid_request_error", None, "not_found")
    if isinstance(exc, ConflictError):
        return ErrorInfo(409, str(exc), "invalid_request_error", None, "conflict")
    if isinstance(exc, RequestTimeoutError):
        return ErrorInfo(408, str(exc), "invalid_request_error", None, "request_timeout")
    if isinstance(exc, PayloadTooLargeError):
        return ErrorInfo(413, str(exc), "invalid_request_error", None, "payload_too_large")
    if isinstance(exc, UploadTooLargeError):
        return ErrorInfo(413, str(exc), "invalid_request_error", None, "payload_too_large")
    if isinstance(exc, QuotaExceededError):
        # Bytes: the upload is too large for what is left (413, as the byte cap answers).
        # Versions: the tenant's state refuses one more, whatever its size (409).
        status = 413 if exc.param == "max_storage_bytes" else 409
        return ErrorInfo(status, str(exc), "invalid_request_error", exc.param,
                         "quota_exceeded")
    if isinstance(exc, AdapterRejectedError):
        return ErrorInfo(422, f"the adapter was refused: {exc}", "invalid_request_error",
                         "file", "invalid_adapter")
    if isinstance(exc, AdapterError):
        # The adapter exists and is visible but cannot run on this base model.
        return ErrorInfo(422, f"the adapter cannot be served: {exc}", "invalid_request_error",
                         "model", "adapter_unusable")
    if isinstance(exc, RateLimitExceeded):
        return ErrorInfo(429, f"Rate limit reached for {exc.limit}: retry after "
                              f"{exc.retry_after:.1f}s", exc.limit, None,
                         "rate_limit_exceeded", retry_after=max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, EngineOverloadedError):
        return ErrorInfo(503, f"The server is overloaded: {exc}", "server_error", None,
                         "engine_overloaded", retry_after=OVERLOADED_RETRY_AFTER_S)
    if isinstance(exc, DependencyUnavailableError):
        return ErrorInfo(503, f"The service is temporarily unavailable: {exc}", "server_error",
                         None, "dependency_unavailable", retry_after=OVERLOADED_RETRY_AFTER_S)
    if isinstance(exc, StoreNotOwnedError):  # moved to another registry while serving
        return ErrorInfo(503, "The adapter store is unavailable to this server",
                         "server_error", None, "dependency_unavailable",
                         retry_after=OVERLOADED_RETRY_AFTER_S)
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError):
        return ErrorInfo(503, "The registry database is unavailable", "server_error", None,
                         "dependency_unavailable", retry_after=OVERLOADED_RETRY_AFTER_S)
    if isinstance(exc, ClientDisconnected):
        # Nginx's "client closed request": only logs and metrics ever see it.
        return ErrorInfo(499, str(exc), "invalid_request_error", None, "client_disconnected")
    if isinstance(exc, EngineDeadError):
        return ErrorInfo(503, "The engine is not running", "server_error", None,
                         "engine_unavailable")
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return ErrorInfo(exc.status_code, str(exc.detail), kind,
                         allow=(exc.headers or {}).get("Allow"))
    if isinstance(exc, ConfigError):
        return ErrorInfo(500, "The server is misconfigured", "server_error")
    return ErrorInfo(500, "The server had an error while processing your request",
                     "server_error")


def allowed_methods(request: Request) -> str | None:
    """Every method some route serves at the request's path (Starlette's 405 names only
    those of the first route that matched the path, one of several)."""
    # Matched as the app's router matches (PARTIAL: the path, not the method), from the
    # app's root: inside the /admin mount the scope's root_path is the mount's.
    scope = {"type": "http", "path": request.scope["path"], "root_path": "",
             "method": request.method}
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods \
                and route.matches(scope)[0] is not Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods)) or None


def error_response(info: ErrorInfo) -> Response:
    return JSONResponse(info.payload(), status_code=info.status, headers=info.headers())


async def handle_exception(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for every exception a route lets escape."""
    info = describe(exc)
    if isinstance(exc, HTTPException) and exc.status_code in (404, 405):
        # One rule for every path (the /admin mount included): a path some route serves
        # answers another method with 405 and Allow, any other path is 404.
        allow = allowed_methods(request)
        if allow is not None and request.method not in allow.split(", "):
            info = replace(info, status=405, message="Method Not Allowed", allow=allow)
    # Unexpected exceptions are re-raised by Starlette after this answer, and logged by the
    # server with their traceback; only our own 500s would otherwise go unnoticed.
    if info.status == 500 and isinstance(exc, LoraplexError):
        logger.error("error in %s %s", request.method, request.url.path, exc_info=exc)
    elif info.code == "dependency_unavailable":
        logger.warning("%s %s: %s", request.method, request.url.path, exc)
    return error_response(info)


def exception_handlers() -> dict[Any, Any]:
    """The mapping to pass as ``Starlette(exception_handlers=...)``."""
    return {LoraplexError: handle_exception, HTTPException: handle_exception,
            sa.exc.OperationalError: handle_exception, sa.exc.InterfaceError: handle_exception,
            Exception: handle_exception}
