"""``loraplex serve``: the gateway and the engine in one process.

Startup: resolve the model (the demo model, prepared if needed, when none is given),
migrate the registry database (unless ``--no-migrate``), make sure an admin key exists
(``LORAPLEX_ADMIN_KEY``, or one created and printed once on the first start), load the
engine, then serve with uvicorn until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any

from loraplex.cli_engine import add_engine_args, engine_config_from_args, model_arg
from loraplex.cli_registry import add_registry_options, registry_config_from_args
from loraplex.config import RegistryConfig
from loraplex.registry.upload import UploadLimits

ENV_REDIS_URL = "LORAPLEX_REDIS_URL"
ENV_CACHE_SALT_SECRET = "LORAPLEX_CACHE_SALT_SECRET"


def add_serve_command(subparsers: Any) -> None:
    """Registers ``serve`` on the main parser's subparsers."""
    from loraplex.config import ServerConfig

    defaults = ServerConfig()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API (gateway + engine)",
        description="Serve the OpenAI-compatible API: the gateway and the engine in one "
                    "process.")
    add_registry_options(p, json_flag=False)
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help=f"Redis for rate limits shared by all processes (env {ENV_REDIS_URL}; "
                        "default: an in-process limiter)")
    p.add_argument("--served-model-name", default=None,
                   help="the base model's name in 'model' (default: the model folder's name)")
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    p.add_argument("--max-upload-bytes", type=int, default=UploadLimits().max_upload_bytes,
                   help="largest adapter upload (files or archive), and largest unpacked archive")
    p.add_argument("--max-tokens-limit", type=int, default=defaults.max_tokens_limit,
                   help="largest max_tokens a request may ask for")
    p.add_argument("--max-n", type=int, default=defaults.max_n,
                   help="largest n a request may ask for")
    p.add_argument("--no-migrate", action="store_true",
                   help="do not migrate the registry database; refuse to start if it is "
                        "not at the newest revision")
    p.add_argument("--sweep-grace-s", type=float, default=RegistryConfig.sweep_grace_s,
                   help="crash leftovers in the adapter store older than this are removed")
    p.add_argument("--sweep-interval-s", type=float, default=RegistryConfig.sweep_interval_s,
                   help="how often the adapter store is swept after the start")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(func=_serve)


def _prepare_registry(args: argparse.Namespace, admin_key: str | None) -> str | None:
    """Migrates (or checks) the database and bootstraps the admin key; returns a key that
    was just created."""
    from loraplex.gateway.auth import ensure_admin_key
    from loraplex.registry import db

    config = registry_config_from_args(args)
    url = config.database_url
    if not args.no_migrate:
        db.upgrade(url, adapter_dir=config.adapter_dir)
    engine = db.make_engine(url)
    try:
        db.check_schema(engine)
        with db.transaction(db.make_session_factory(engine)) as session:
            return ensure_admin_key(session, admin_key)
    finally:
        engine.dispose()


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.config import ServerConfig
    from loraplex.engine.client import EngineClient
    from loraplex.gateway.app import create_app
    from loraplex.gateway.auth import ENV_ADMIN_KEY

    server_config = ServerConfig(
        host=args.host, port=args.port,
        redis_url=args.redis_url or os.environ.get(ENV_REDIS_URL) or None,
        admin_key=os.environ.get(ENV_ADMIN_KEY) or None,
        served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit, max_n=args.max_n,
        cache_salt_secret=os.environ.get(ENV_CACHE_SALT_SECRET) or None)
    model = model_arg(args.model)
    created = _prepare_registry(args, server_config.admin_key)
    if created is not None:
        print("loraplex: created the admin key; it is shown only this once:", file=sys.stderr)
        print(created, flush=True)
    engine_config = engine_config_from_args(args, model)
    client = EngineClient.from_config(engine_config, progress=True)
    try:
        limits = UploadLimits(max_upload_bytes=args.max_upload_bytes,
                              max_unpacked_bytes=args.max_upload_bytes)
        registry = replace(registry_config_from_args(args), sweep_grace_s=args.sweep_grace_s,
                           sweep_interval_s=args.sweep_interval_s)
        app = create_app(server_config, registry, client, upload_limits=limits)
        uvicorn.run(app, host=server_config.host, port=server_config.port,
                    log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=10)
    finally:
        client.close()  # a no-op after the app's lifespan shut it down
    return 0
