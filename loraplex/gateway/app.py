"""``create_app``: the Starlette application of the gateway, wired to one engine.

The app's lifespan starts the engine's step loop, the rate limiter (Redis or in-process),
the usage flusher and the adapter store's sweeper, and stops them in the reverse order: the engine first, so requests
cut short by the shutdown are still metered by the last flush.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from loraplex.config import RegistryConfig, ServerConfig
from loraplex.engine.client import EngineClient
from loraplex.gateway import adapter_routes, admin_routes, openai_routes
from loraplex.gateway.adapter_uploads import AdapterService
from loraplex.gateway.auth import authenticate, require_admin, salt_secret
from loraplex.gateway.errors import exception_handlers
from loraplex.gateway.metrics import GatewayMetrics
from loraplex.gateway.openapi import openapi_document
from loraplex.gateway.ratelimit import make_rate_limiter
from loraplex.gateway.state import Gateway, Tokenizers, gateway
from loraplex.gateway.usage import UsageMeter
from loraplex.model.adapter_loader import validate_adapter_dir
from loraplex.registry import db
from loraplex.registry.store import AdapterStore
from loraplex.registry.sweep import StoreSweeper
from loraplex.registry.upload import AdapterUploader, UploadLimits


async def health(request: Request) -> Response:
    """The process is up and serving HTTP."""
    return JSONResponse({"status": "ok"})


def _database_ok(gw: Gateway) -> bool:
    try:
        with gw.db_engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError:
        return False
    return True


async def ready(request: Request) -> Response:
    """The engine is loaded and running, and the registry database answers."""
    gw = gateway(request)
    engine_ok = gw.engine.is_running
    database_ok = await run_in_threadpool(_database_ok, gw)
    ok = engine_ok and database_ok
    return JSONResponse({"status": "ready" if ok else "not ready", "engine": engine_ok,
                         "database": database_ok}, status_code=200 if ok else 503)


async def _refresh_engine_metrics(gw: Gateway) -> None:
    stats = await gw.engine.stats()
    gw.metrics.set_engine_gauges(
        queue_depth=stats["num_waiting"], running=stats["num_running"],
        kv_blocks_used=stats["kv_blocks_used"], kv_blocks_free=stats["kv_blocks_free"],
        prefix_cache_hit_rate=stats["prefix_cache_hit_rate"])
    # The engine keeps running totals; the counters get what happened since the last scrape.
    seen = gw.exported
    loads = int(stats["adapter_slot_loads"]) - int(seen.get("loads", 0))
    seconds = float(stats["adapter_load_seconds"]) - seen.get("load_seconds", 0.0)
    evictions = int(stats["adapter_slot_evictions"]) - int(seen.get("evictions", 0))
    for _ in range(max(loads, 0)):
        # Only the total time is known: each load of the interval gets the mean.
        gw.metrics.record_adapter_load(max(seconds, 0.0) / loads)
    for _ in range(max(evictions, 0)):
        gw.metrics.record_adapter_eviction()
    seen.update(loads=stats["adapter_slot_loads"], load_seconds=stats["adapter_load_seconds"],
                evictions=stats["adapter_slot_evictions"])


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus exposition. Admin only: labels name tenants and their adapters."""
    gw = gateway(request)
    require_admin(await authenticate(request, gw.sessions))
    await _refresh_engine_metrics(gw)
    body, content_type = gw.metrics.render()
    return Response(body, media_type=content_type)


def create_app(server_config: ServerConfig, registry_config: RegistryConfig,
               engine_client: EngineClient, *, metrics: GatewayMetrics | None = None,
               upload_limits: UploadLimits | None = None) -> Starlette:
    """The gateway app for ``engine_client`` (not started yet: the lifespan starts it, and
    shuts it down at exit). The registry database must already be migrated.
    ``upload_limits`` caps adapter uploads (default: ``UploadLimits()``)."""
    db_engine = db.make_engine(registry_config.database_url)
    engine = engine_client.engine
    served = server_config.served_model_name or os.path.basename(
        os.path.normpath(engine.config.model.model))
    gw = Gateway(
        config=server_config, registry=registry_config, db_engine=db_engine,
        sessions=db.make_session_factory(db_engine), engine=engine_client,
        store=AdapterStore(registry_config.adapter_dir),
        metrics=metrics or GatewayMetrics(),
        meter=UsageMeter(db.make_session_factory(db_engine),
                         server_config.usage_flush_interval_s),
        tokenizers=Tokenizers(engine.tokenizer), served_model_name=served,
        salt_secret=salt_secret(server_config.cache_salt_secret),
        max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
    )
    document = openapi_document(server_config)
    adapters = _adapter_service(gw, engine_client, upload_limits)
    sweeper = StoreSweeper(gw.sessions, gw.store, grace_s=registry_config.sweep_grace_s,
                           interval_s=registry_config.sweep_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gw.limiter = make_rate_limiter(server_config.redis_url,
                                       key_prefix=server_config.rate_limit_key_prefix,
                                       window_s=server_config.rate_limit_window_s)
        engine_client.start()
        gw.meter.start()
        sweeper.start()  # crash leftovers of any process sharing the store
        try:
            yield
        finally:
            await sweeper.stop()
            await engine_client.shutdown()
            await gw.meter.stop()
            await gw.limiter.close()
            db_engine.dispose()

    routes: list[BaseRoute] = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", lambda request: JSONResponse(document), methods=["GET"]),
        *openai_routes.routes(),
        *adapter_routes.routes(),
        *admin_routes.routes(),
    ]
    ui = admin_routes.admin_ui_mount()
    if ui is not None:
        routes.append(ui)
    app = Starlette(routes=routes, exception_handlers=exception_handlers(),
                    lifespan=lifespan)
    app.state.gateway = gw
    app.state.adapters = adapters
    return app


def _adapter_service(gw: Gateway, engine_client: EngineClient,
                     limits: UploadLimits | None) -> AdapterService:
    engine = engine_client.engine
    target, max_rank = engine.target_shapes, engine.config.lora.max_lora_rank
    # Only the shapes are checked, not base_model_name_or_path (paths and hub ids of one
    # model rarely agree): the shapes decide whether the adapter can be served at all.
    uploader = AdapterUploader(gw.store, lambda path: validate_adapter_dir(path, target,
                                                                           max_rank),
                               base_model=engine.config.model.model, limits=limits)
    return AdapterService(uploader, gw.sessions, gw.store, engine_client)
