"""Operator routes under ``/admin/api``; every one needs an admin key (403 otherwise)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.gateway.auth import authenticate, require_admin
from loraplex.gateway.state import gateway


async def engine_stats(request: Request) -> Response:
    """The engine's figures: queue, running requests, KV blocks, adapter slots."""
    gw = gateway(request)
    require_admin(await authenticate(request, gw.sessions))
    stats = await gw.engine.stats()
    return JSONResponse(stats | {"num_unfinished": gw.engine.num_unfinished})


def routes() -> list[Route]:
    """The routes of this module, for ``create_app``."""
    return [Route("/admin/api/engine", engine_stats, methods=["GET"])]
