"""``create_app``: the Starlette application of the gateway, wired to one engine backend.

The app's lifespan starts the engine, the rate limiter (Redis or in-process), the usage
flusher and the adapter store's sweeper, and stops them in the reverse order: the engine
first, so requests cut short by the shutdown are still metered by the last flush.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from loraplex.config import RegistryConfig, ServerConfig
from loraplex.engine.backend import EngineBackend
from loraplex.engine.grammar import GrammarCompiler
from loraplex.gateway.adapter_effect import EffectProbes
from loraplex.gateway.adapter_uploads import AdapterService
from loraplex.gateway.auth import salt_secret
from loraplex.gateway.connections import BodyTimeout
from loraplex.gateway.errors import exception_handlers
from loraplex.gateway.metrics import GatewayMetrics
from loraplex.gateway.openapi import openapi_document
from loraplex.gateway.pins import PinSync
from loraplex.gateway.ratelimit import make_rate_limiter
from loraplex.gateway.routes import (
    adapters,
    admin,
    admin_adapters,
    admin_tenants,
    openai,
    ops,
    vllm,
)
from loraplex.gateway.routes.admin_ui import admin_ui_mount
from loraplex.gateway.state import Gateway, Tokenizers
from loraplex.gateway.usage import UsageMeter
from loraplex.model.adapter_loader import validate_adapter_dir
from loraplex.model.loader import load_tokenizer
from loraplex.registry import db
from loraplex.registry.ownership import open_store
from loraplex.registry.sweep import StoreSweeper
from loraplex.registry.upload import AdapterUploader, UploadLimits


def create_app(server_config: ServerConfig, registry_config: RegistryConfig,
               backend: EngineBackend, *, metrics: GatewayMetrics | None = None,
               upload_limits: UploadLimits | None = None) -> Starlette:
    """The gateway app for ``backend`` (not started yet: the lifespan starts it, and shuts
    it down at exit). The registry database must already be migrated.
    ``upload_limits`` caps adapter uploads (default: ``UploadLimits()``)."""
    db_engine = db.make_engine(registry_config.database_url)
    sessions = db.make_session_factory(db_engine)
    # Before anything is served: a store another registry owns is refused in one line.
    try:
        store = open_store(sessions, registry_config.adapter_dir, registry_config.database_url)
    except BaseException:
        db_engine.dispose()
        raise
    model = backend.description
    served = server_config.served_model_name or os.path.basename(
        os.path.normpath(model.model))
    gw = Gateway(
        config=server_config, registry=registry_config, db_engine=db_engine,
        sessions=sessions, backend=backend, store=store,
        metrics=metrics or GatewayMetrics(),
        meter=UsageMeter(db.make_session_factory(db_engine),
                         server_config.usage_flush_interval_s),
        tokenizers=Tokenizers(load_tokenizer(model.tokenizer)), served_model_name=served,
        salt_secret=salt_secret(server_config.cache_salt_secret),
        grammars=GrammarCompiler(None, 0, ()),
        pins=PinSync(sessions, store, backend),
    )
    sweeper = StoreSweeper(gw.sessions, gw.store, grace_s=registry_config.sweep_grace_s,
                           interval_s=registry_config.sweep_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gw.limiter = make_rate_limiter(server_config.redis_url,
                                       key_prefix=server_config.rate_limit_key_prefix,
                                       window_s=server_config.rate_limit_window_s)
        backend.start()
        gw.meter.start()
        sweeper.start()  # crash leftovers of any process sharing the store
        gw.pins.start()
        try:
            yield
        finally:
            await app.state.adapters.probes.stop()
            await gw.pins.stop()
            await sweeper.stop()
            await backend.shutdown()
            await gw.meter.stop()
            await gw.limiter.close()
            gw.grammars.close()
            db_engine.dispose()

    routes: list[BaseRoute] = [
        *ops.routes(openapi_document(server_config, model)),
        *openai.routes(),
        *vllm.routes(),
        *adapters.routes(),
        *admin.routes(),
        *admin_tenants.routes(),
        *admin_adapters.routes(),
    ]
    ui = admin_ui_mount()
    if ui is not None:
        routes.append(ui)
    app = Starlette(routes=routes, exception_handlers=exception_handlers(),
                    middleware=[Middleware(BodyTimeout,
                                           timeout_s=server_config.body_timeout_s)],
                    lifespan=lifespan)
    app.state.gateway = gw
    app.state.adapters = _adapter_service(gw, backend, upload_limits)
    return app


def _adapter_service(gw: Gateway, backend: EngineBackend,
                     limits: UploadLimits | None) -> AdapterService:
    model = backend.description
    target, max_rank = model.target_shapes, model.max_lora_rank
    # The shapes decide whether the adapter can be served at all; base_model_name_or_path
    # is judged only where it clearly names another family (validate_adapter_dir): paths
    # and hub ids of one model rarely agree.
    uploader = AdapterUploader(gw.store, lambda path: validate_adapter_dir(path, target,
                                                                           max_rank),
                               base_model=model.model,
                               reserved_names=(gw.served_model_name,), limits=limits)
    probes = EffectProbes(backend, gw.sessions, gw.store, gw.tokenizers.encode,
                          wait_s=gw.config.effect_probe_wait_s)
    return AdapterService(uploader, gw.sessions, gw.store, backend, probes)
