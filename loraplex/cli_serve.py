"""``loraplex serve``: the gateway and the engine in one process.

Startup: take the port (a busy one fails at once, before anything slow), resolve the model
(the demo model, prepared if needed, when none is given), migrate the registry database
(unless ``--no-migrate``), make sure an admin key exists (``LORAPLEX_ADMIN_KEY``, or one
created on the first start), load the engine, print a banner with the admin UI's address
(and the new key, shown once), then serve with uvicorn until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.cli_engine import (
    HelpFormatter,
    add_engine_args,
    engine_config_from_args,
    kv_disk_dir,
    model_arg,
)
from loraplex.cli_registry import add_registry_options, registry_config_from_args
from loraplex.config import ENV_API_KEY, ENV_METRICS_TOKEN, RayConfig, RegistryConfig
from loraplex.errors import ConfigError
from loraplex.gateway.lora_modules import LoRAModule, parse_lora_module
from loraplex.registry.upload import UploadLimits

if TYPE_CHECKING:
    from loraplex.config import EngineConfig, ServerConfig
    from loraplex.engine.client import EngineClient
    from loraplex.engine.ray_backend import RayEngineBackend

ENV_REDIS_URL = "LORAPLEX_REDIS_URL"
ENV_CACHE_SALT_SECRET = "LORAPLEX_CACHE_SALT_SECRET"


def add_serve_command(subparsers: Any) -> None:
    """Registers ``serve`` on the main parser's subparsers."""
    from loraplex.config import ServerConfig

    defaults = ServerConfig()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API (gateway + engine)",
        formatter_class=HelpFormatter,
        description="Serve the OpenAI-compatible API: the gateway and the engine in one "
                    "process.")
    add_registry_options(p, json_flag=False)
    p.add_argument("--host", default=defaults.host, help="address to listen on")
    p.add_argument("--port", type=_port, default=defaults.port,
                   help="port to listen on (0: any free port)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help=f"Redis for rate limits shared by all processes (env {ENV_REDIS_URL}; "
                        "default: an in-process limiter)")
    p.add_argument("--redis-key-prefix", default="loraplex:",
                   help="prefix of every Redis key (rate limits, replica state): deployments "
                        "sharing one Redis need different ones")
    p.add_argument("--served-model-name", default=None,
                   help="the base model's name in 'model' (default: the model folder's name)")
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                   help="largest JSON request body")
    p.add_argument("--max-upload-bytes", type=int, default=UploadLimits().max_upload_bytes,
                   help="largest adapter upload (files or archive), and largest unpacked archive")
    p.add_argument("--max-tokens-limit", type=int, default=defaults.max_tokens_limit,
                   help="largest max_tokens a request may ask for (default: the model's "
                        "context length, as vLLM)")
    p.add_argument("--max-n", type=int, default=defaults.max_n,
                   help="largest n a request may ask for")
    p.add_argument("--slo-ttft-ms", type=int, default=defaults.slo_ttft_ms,
                   help="time-to-first-token objective; a tenant's own wins (default: "
                        "%(default)s)")
    p.add_argument("--slo-tpot-ms", type=int, default=defaults.slo_tpot_ms,
                   help="time-per-output-token objective; a tenant's own wins (default: "
                        "%(default)s)")
    g = p.add_argument_group("connection limits (see docs/operations.md: which belong to a "
                             "proxy)")
    g.add_argument("--max-header-bytes", type=int, default=defaults.max_header_bytes,
                   help="request line and headers together (default: %(default)s)")
    g.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s,
                   help="time to send a request's headers, from the connection or the "
                        "previous response (default: %(default)s)")
    g.add_argument("--body-timeout-s", type=float, default=defaults.body_timeout_s,
                   help="a request body (uploads included) that sends nothing this long is "
                        "answered 408 (default: %(default)s)")
    g.add_argument("--keep-alive-timeout-s", type=float,
                   default=defaults.keep_alive_timeout_s,
                   help="an idle keep-alive connection closes after this (default: "
                        "%(default)s)")
    g.add_argument("--max-pending-connections", type=int,
                   default=defaults.max_pending_connections,
                   help="connections still sending their headers at once; more are closed "
                        "(default: %(default)s)")
    p.add_argument("--no-migrate", action="store_true",
                   help="do not migrate the registry database; refuse to start if it is "
                        "not at the newest revision")
    p.add_argument("--sweep-grace-s", type=float, default=RegistryConfig.sweep_grace_s,
                   help="crash leftovers in the adapter store older than this are removed")
    p.add_argument("--sweep-interval-s", type=float, default=RegistryConfig.sweep_interval_s,
                   help="how often the adapter store is swept after the start")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    _add_vllm_args(p)
    add_engine_args(p)
    _add_backend_args(p)
    p.set_defaults(func=_serve)


def _lora_module(text: str) -> LoRAModule:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_vllm_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "vLLM's flags", "what `vllm serve` users type, for the tenant named 'default' "
        "(created on first use; see docs/vllm.md)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"one static API key of the 'default' tenant (env {ENV_API_KEY}); a "
                        "static key of an earlier start is revoked")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[],
                   metavar="NAME=PATH|JSON",
                   help='adapters registered for the \'default\' tenant at the start: '
                        'name=path or {"name": .., "path": ..}; the same files again '
                        "register nothing, other files a new version")
    g.add_argument("--allowed-lora-dir", action="append", default=[], metavar="DIR",
                   help="a folder whose adapters tenants may register by path with "
                        "/v1/load_lora_adapter (repeatable; default: none, the route is "
                        "refused)")
    g.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's sake: LoRA is always on")


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "scale-out", "engine replicas on Ray Serve (needs the loraplex[ray] extra, PostgreSQL, "
        "Redis and LORAPLEX_CACHE_SALT_SECRET; see docs/scale-out.md)")
    g.add_argument("--backend", default="local", choices=["local", "ray"],
                   help="local: the engine in this process; ray: engine replicas on Ray Serve")
    g.add_argument("--replicas", type=int, default=None,
                   help=f"engine replicas to deploy (ray; default {RayConfig.replicas})")
    g.add_argument("--prefill-replicas", type=int, default=0, metavar="P",
                   help="prefill/decode disaggregation (ray): P replicas compute prompts and "
                        "hand their KV blocks to the decode replicas (default 0: every "
                        "replica does both)")
    g.add_argument("--decode-replicas", type=int, default=None, metavar="D",
                   help="with --prefill-replicas: the replicas that decode (instead of "
                        "--replicas)")
    g.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster to join (env LORAPLEX_RAY_ADDRESS; default: start a "
                        "local one on loopback)")
    g.add_argument("--replica-cpus", type=float, default=RayConfig.replica_cpus,
                   help="CPUs Ray reserves for each replica")
    g.add_argument("--replica-gpus", type=float, default=RayConfig.replica_gpus,
                   help="GPUs Ray reserves for each replica")
    g.add_argument("--no-adapter-affinity", action="store_true",
                   help="route adapter requests like base ones, ignoring which replica holds "
                        "the adapter (for comparison)")
    g.add_argument("--no-prefix-routing", action="store_true",
                   help="route without regard to which replica caches a request's prefix "
                        "for its adapter and tenant: adapter affinity and load only (for "
                        "comparison; the gateway that deploys the replicas sets it for all)")
    g.add_argument("--max-queued-requests", type=int, default=RayConfig.max_queued_requests,
                   help="requests each gateway holds for busy replicas before answering 503 "
                        "(a setting of the deployment: the gateway that deploys the replicas "
                        "sets it for all)")


def _salt_secret(args: argparse.Namespace) -> str | None:
    """LORAPLEX_CACHE_SALT_SECRET; else, with a KV disk tier in this process, the secret
    kept in its folder (its blocks stay reachable for their tenants after a restart); else
    None (a random one for this process; the ray backend refuses that)."""
    configured = os.environ.get(ENV_CACHE_SALT_SECRET) or None
    folder = kv_disk_dir(args)
    if configured is not None or folder is None or args.backend != "local":
        return configured
    from loraplex.gateway.auth import kept_salt_secret

    return kept_salt_secret(Path(folder))


def _prepare_registry(args: argparse.Namespace) -> None:
    """Migrates (or, with --no-migrate, checks) the registry database, and opens its
    adapter store (claiming it, or refusing another registry's)."""
    from loraplex.cli_registry import warn_shadowed
    from loraplex.registry import db
    from loraplex.registry.ownership import open_store

    config = registry_config_from_args(args)
    if not args.no_migrate:
        db.upgrade(config.database_url, adapter_dir=config.adapter_dir)
    engine = db.make_engine(config.database_url)
    try:
        db.check_schema(engine)
        # Before the model loads: a store another registry owns is refused in one line.
        sessions = db.make_session_factory(engine)
        open_store(sessions, config.adapter_dir, config.database_url)
        with db.transaction(sessions) as session:
            warn_shadowed(session, [args.served_model_name
                                    or Path(model_arg(args.model)).name])
    finally:
        engine.dispose()


def _ensure_admin_key(args: argparse.Namespace, admin_key: str | None) -> str | None:
    """Registers LORAPLEX_ADMIN_KEY, or creates an admin key when none is active; returns a
    key that was just created."""
    from loraplex.gateway.auth import ensure_admin_key
    from loraplex.registry import db

    engine = db.make_engine(registry_config_from_args(args).database_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            return ensure_admin_key(session, admin_key)
    finally:
        engine.dispose()


def _ensure_static_key(args: argparse.Namespace, key: str) -> None:
    """Registers ``--api-key`` as the ``default`` tenant's static key."""
    from loraplex.gateway.auth import ensure_static_key
    from loraplex.registry import db

    engine = db.make_engine(registry_config_from_args(args).database_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            ensure_static_key(session, key)
    finally:
        engine.dispose()


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535: {value}")
    return value


def _allowed_dirs(dirs: list[str]) -> list[str]:
    for d in dirs:
        if not Path(d).is_dir():
            raise ConfigError(f"--allowed-lora-dir {d}: not a folder")
    return [str(Path(d).resolve()) for d in dirs]


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, as uvicorn would bind it; ConfigError in one line
    if the address is taken or cannot be used."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another "
                          "server running there? choose another --port)") from None
    return sock


def admin_url(host: str, port: int) -> str:
    """The admin UI's address for a browser on this machine."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/admin/"


def admin_banner(url: str, created_key: str | None) -> str:
    """The framed notice printed once the model is loaded: where the admin UI is, the admin
    key created on this start (shown only this once), and how to get a new one."""
    lines = [f"Admin UI: {url}", ""]
    if created_key is not None:
        lines += ["Created the admin key; it is shown only this once:", f"  {created_key}", ""]
    lines += ["Lost the admin key? Create another (same --database-url or",
              "LORAPLEX_DATABASE_URL / LORAPLEX_HOME as this server):",
              "  loraplex keys create --admin"]
    width = max(len(line) for line in lines)
    rule = "+" + "-" * (width + 2) + "+"
    return "\n".join([rule, *(f"| {line.ljust(width)} |" for line in lines), rule])


def _ray_config(args: argparse.Namespace) -> RayConfig | None:
    """The replicas the flags ask for (None: the engine in this process); ConfigError in
    one line for flags that do not go together."""
    if args.backend == "local":
        if args.prefill_replicas or args.decode_replicas is not None:
            raise ConfigError("--prefill-replicas and --decode-replicas need --backend ray")
        return None
    if args.decode_replicas is not None and args.replicas is not None:
        raise ConfigError("--replicas and --decode-replicas: give one (with "
                          "--prefill-replicas, --decode-replicas says how many decode)")
    if args.decode_replicas is not None and not args.prefill_replicas:
        raise ConfigError("--decode-replicas needs --prefill-replicas (without it, "
                          "--replicas says how many replicas do both)")
    replicas = next(n for n in (args.decode_replicas, args.replicas, RayConfig.replicas)
                    if n is not None)
    if replicas < 1:
        flag = "--decode-replicas" if args.decode_replicas is not None else "--replicas"
        raise ConfigError(f"{flag} must be at least 1, not {replicas}")
    if args.prefill_replicas < 0:
        raise ConfigError(f"--prefill-replicas must be at least 0, not {args.prefill_replicas}")
    return RayConfig(address=args.ray_address, replicas=replicas,
                     prefill_replicas=args.prefill_replicas,
                     replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
                     max_queued_requests=args.max_queued_requests,
                     sync_key_prefix=f"{args.redis_key_prefix}replicas:",
                     adapter_affinity=not args.no_adapter_affinity,
                     prefix_routing=not args.no_prefix_routing)


def _make_backend(args: argparse.Namespace, engine_config: EngineConfig,
                  server_config: ServerConfig, ray_config: RayConfig | None,
                  ) -> EngineClient | RayEngineBackend:
    """The engine in this process, or the Ray Serve replicas (deployed or attached to)."""
    if ray_config is None:
        from loraplex.engine.client import EngineClient

        return EngineClient.from_config(engine_config, progress=True)
    registry = registry_config_from_args(args)
    try:
        from loraplex.engine.ray_backend import RayEngineBackend
    except ImportError:
        raise ConfigError("the ray backend needs Ray Serve: pip install 'loraplex[ray]'") \
            from None
    from loraplex.engine.engine import model_description
    from loraplex.model.args import ModelArgs
    from loraplex.model.loader import load_hf_config

    expected = model_description(engine_config, ModelArgs.from_hf_config(
        load_hf_config(engine_config.model.model)))
    assert server_config.redis_url is not None  # check_shared_state refused it otherwise
    return RayEngineBackend.deploy(engine_config, ray_config, registry.adapter_dir,
                                   server_config.redis_url, expected)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.config import ENV_ADMIN_KEY, ServerConfig
    from loraplex.gateway.app import create_app
    from loraplex.gateway.connections import uvicorn_config

    # First, so a busy port fails in a second instead of after loading the model.
    sock = listen_socket(args.host, args.port)
    try:
        server_config = ServerConfig(
            host=args.host, port=sock.getsockname()[1],
            redis_url=args.redis_url or os.environ.get(ENV_REDIS_URL) or None,
            admin_key=os.environ.get(ENV_ADMIN_KEY) or None,
            served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
            max_tokens_limit=args.max_tokens_limit, max_n=args.max_n,
            cache_salt_secret=_salt_secret(args),
            rate_limit_key_prefix=f"{args.redis_key_prefix}rl:",
            max_header_bytes=args.max_header_bytes, header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s, keep_alive_timeout_s=args.keep_alive_timeout_s,
            max_pending_connections=args.max_pending_connections,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            metrics_token=os.environ.get(ENV_METRICS_TOKEN) or None,
            allowed_lora_dirs=tuple(_allowed_dirs(args.allowed_lora_dir)))
        # vLLM's flags are checked before anything is written or loaded.
        api_key = args.api_key or os.environ.get(ENV_API_KEY) or None
        if api_key is not None:
            from loraplex.gateway.auth import check_static_key

            warning = check_static_key(api_key)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        from loraplex.gateway.lora_modules import check_lora_modules

        check_lora_modules(args.lora_modules)
        ray_config = _ray_config(args)
        if args.backend == "ray":  # before anything is migrated or loaded
            from loraplex.config import check_shared_state
            from loraplex.engine.ray_address import check_reachable, ray_address

            check_shared_state(server_config, registry_config_from_args(args))
            address = ray_address(args.ray_address)
            if address is not None:  # in seconds, not after the registry and Ray's import
                check_reachable(address)
        # Checked before anything is written: a key created before a refusal is never shown.
        limits = UploadLimits(max_upload_bytes=args.max_upload_bytes,
                              max_unpacked_bytes=args.max_upload_bytes)
        registry = replace(registry_config_from_args(args), sweep_grace_s=args.sweep_grace_s,
                           sweep_interval_s=args.sweep_interval_s)
        model = model_arg(args.model)
        _prepare_registry(args)
        if server_config.admin_key is not None:  # a bad LORAPLEX_ADMIN_KEY fails before loading
            _ensure_admin_key(args, server_config.admin_key)
        if api_key is not None:  # so is one that is another tenant's
            _ensure_static_key(args, api_key)
        engine_config = engine_config_from_args(args, model)
        client = _make_backend(args, engine_config, server_config, ray_config)
        try:
            app = create_app(server_config, registry, client, upload_limits=limits)
            if args.lora_modules:  # checked against the loaded model's shapes
                from loraplex.gateway.lora_modules import register_lora_modules

                for line in register_lora_modules(app.state.adapters.uploader,
                                                  app.state.gateway.sessions,
                                                  args.lora_modules):
                    print(line, file=sys.stderr, flush=True)
            # Created only now: a key created before a failed load or app would never have
            # been shown.
            created = (_ensure_admin_key(args, None) if server_config.admin_key is None
                       else None)
            # After the model's progress bars, so nothing is drawn over it.
            print(admin_banner(admin_url(server_config.host, server_config.port), created),
                  file=sys.stderr, flush=True)
            server = uvicorn.Server(uvicorn_config(
                app, server_config, log_level=args.log_level, lifespan="on",
                timeout_graceful_shutdown=10))
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on
                pass
        finally:
            client.close()  # the in-process engine: a no-op after the lifespan; Ray: a
            # local cluster this process started goes with it
    finally:
        sock.close()
    return 0 if server.started else 1
