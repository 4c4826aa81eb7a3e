"""Operations routes: liveness, readiness, Prometheus metrics, the OpenAPI document."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.gateway.auth import metrics_principal
from loraplex.gateway.state import Gateway, gateway


async def health(request: Request) -> Response:
    """The process is up and serving HTTP, and its engine has not failed for good (a dead
    step loop never comes back: a liveness probe must restart the server)."""
    if not gateway(request).backend.is_alive:
        return JSONResponse({"status": "engine failed"}, status_code=503)
    return JSONResponse({"status": "ok"})


def _database_ok(gw: Gateway) -> bool:
    try:
        with gw.db_engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError:
        return False
    return True


async def ready(request: Request) -> Response:
    """The engine is loaded and running, the registry database answers, and so does the
    rate limiter's Redis when one is configured (``redis`` is null otherwise). A backend of
    several replicas (Ray) also names those of its replicas that do not answer, by ordinal
    (``replicas``: ``{"configured", "missing"}``): any missing one makes it 503."""
    gw = gateway(request)
    engine_ok = gw.backend.is_ready
    database_ok = await run_in_threadpool(_database_ok, gw)
    redis_ok = await gw.rate_limiter.ping() if gw.config.redis_url else None
    body: dict[str, Any] = {"engine": engine_ok, "database": database_ok, "redis": redis_ok}
    configured = gw.backend.num_replicas
    missing = list(gw.backend.missing_replicas)
    if configured is not None:
        body["replicas"] = {"configured": configured, "missing": missing}
    ok = engine_ok and database_ok and redis_ok is not False and not missing
    return JSONResponse({"status": "ready" if ok else "not ready", **body},
                        status_code=200 if ok else 503)


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus exposition: labels name tenants and their adapters, so it takes an admin
    key, or the operator's scrape token (LORAPLEX_METRICS_TOKEN)."""
    gw = await metrics_principal(request)
    gw.metrics.observe_engine(await gw.backend.replica_stats())
    body, content_type = gw.metrics.render()
    return Response(body, media_type=content_type)


def routes(openapi_document: dict[str, Any]) -> list[Route]:
    """The routes of this module, for ``create_app``; ``openapi_document`` is served as
    ``/openapi.json``."""
    return [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", lambda request: JSONResponse(openapi_document),
              methods=["GET"]),
    ]
