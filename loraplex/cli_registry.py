"""The registry's command groups of the ``loraplex`` CLI: ``db``, ``tenants``, ``keys``,
``adapters``.

``add_registry_commands(subparsers)`` registers them on the main parser; every leaf command
sets ``func(args) -> int`` (the exit status), prints errors as one line on stderr, and exits 2
on failure. ``add_registry_options`` and ``registry_config_from_args`` give ``serve`` the same
``--database-url``/``--adapter-dir``/``--model`` options, environment variables and defaults,
so what the CLI writes is what a running server reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from loraplex.config import LoRAConfig, RegistryConfig
from loraplex.errors import (
    AdapterError,
    InvalidRequestError,
    LoraplexError,
    ModelLoadError,
    first_line,
)
from loraplex.registry import db, pins, quotas, service, upload
from loraplex.registry.db import transaction
from loraplex.registry.move import move_registry
from loraplex.registry.names import check_adapter_name
from loraplex.registry.ownership import describe_database, open_store
from loraplex.registry.store import AdapterStore

ENV_DATABASE_URL = "LORAPLEX_DATABASE_URL"
ENV_ADAPTER_DIR = "LORAPLEX_ADAPTER_DIR"
ENV_MODEL = "LORAPLEX_MODEL"
EXIT_ERROR = 2
PROGRESS_MIN_BYTES = 16 << 20  # smaller uploads finish before a counter is read

Handler = Callable[[argparse.Namespace], int]


def add_registry_options(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    """Adds ``--database-url``, ``--adapter-dir``, ``--model`` (and ``--json``) to a parser.

    Defaults are resolved when the command runs (flag, then environment variable, then
    ``RegistryConfig.default()``), see ``registry_config_from_args``.
    """
    parser.add_argument("--database-url", default=None, metavar="URL",
                        help=f"registry database (env {ENV_DATABASE_URL}; default: a SQLite "
                             "file under LORAPLEX_HOME)")
    parser.add_argument("--adapter-dir", default=None, metavar="DIR",
                        help=f"adapter file store (env {ENV_ADAPTER_DIR}; default: "
                             "LORAPLEX_HOME/adapters)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help=f"base model folder adapters are validated against (env "
                             f"{ENV_MODEL}; default: the demo model folder)")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print JSON")


def registry_config_from_args(args: argparse.Namespace) -> RegistryConfig:
    """The registry config of a parsed command line: flag, else environment, else default."""
    default = RegistryConfig.default()
    return RegistryConfig(
        database_url=(getattr(args, "database_url", None) or os.environ.get(ENV_DATABASE_URL)
                      or default.database_url),
        adapter_dir=(getattr(args, "adapter_dir", None) or os.environ.get(ENV_ADAPTER_DIR)
                     or default.adapter_dir),
    )


def model_dir_from_args(args: argparse.Namespace) -> str:
    """The base model folder: ``--model``, else ``LORAPLEX_MODEL``, else the demo model."""
    model = getattr(args, "model", None) or os.environ.get(ENV_MODEL)
    if model:
        return model
    from loraplex.model.demo import default_demo_dir

    return str(default_demo_dir())


# --- output ------------------------------------------------------------------------------


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _tenant_json(t: Any, storage: dict[int, tuple[int, int]] | None = None,
                 ) -> dict[str, Any]:
    num_bytes, num_versions = (storage or {}).get(t.id, (0, 0))
    return {"id": t.id, "name": t.name, "status": t.status,
            "max_requests_per_minute": t.max_requests_per_minute,
            "max_tokens_per_minute": t.max_tokens_per_minute,
            "max_concurrent_requests": t.max_concurrent_requests,
            **{field: getattr(t, field) for _, _, field, _ in _SETTING_FLAGS},
            **{field: getattr(t, field) for _, _, field, _ in _QUOTA_FLAGS},
            "storage_bytes": num_bytes, "num_adapter_versions": num_versions,
            "created_at": _iso(t.created_at)}


def _key_json(k: Any, tenant_name: str) -> dict[str, Any]:
    return {"id": k.id, "tenant": tenant_name, "role": k.role, "name": k.name,
            "prefix": k.prefix, "created_at": _iso(k.created_at),
            "last_used_at": _iso(k.last_used_at), "revoked_at": _iso(k.revoked_at)}


def _adapter_json(a: Any, tenant_name: str) -> dict[str, Any]:
    return {"id": a.id, "tenant": tenant_name, "name": a.name, "version": a.version,
            "model": f"{tenant_name}/{a.name}", "identity": a.identity, "digest": a.digest,
            "base_model": a.base_model, "rank": a.rank, "alpha": a.alpha,
            "use_rslora": a.use_rslora, "target_modules": list(a.target_modules),
            "size_bytes": a.size_bytes, "storage_path": a.storage_path,
            "visibility": a.visibility, "status": a.status, "created_at": _iso(a.created_at),
            "pinned": a.pinned_at is not None and a.status == "active",
            "pinned_at": _iso(a.pinned_at) if a.status == "active" else None}


def _print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    if not rows:
        print("(none)")
        return
    cells = [[("-" if r[c] is None else str(r[c])) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        text()


# --- plumbing ----------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    return first_line(getattr(exc, "orig", None) or exc)


def _guarded(handler: Handler) -> Handler:
    """Turns expected failures into one line on stderr and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except LoraplexError as exc:
            print(f"loraplex: error: {exc}", file=sys.stderr)
        except sa_exc.SQLAlchemyError as exc:
            print(f"loraplex: error: database: {_one_line(exc)}", file=sys.stderr)
        except OSError as exc:
            print(f"loraplex: error: {exc}", file=sys.stderr)
        return EXIT_ERROR

    return run


@contextmanager
def _sessions(args: argparse.Namespace) -> Iterator[sessionmaker[Session]]:
    """A session factory on the configured database (migrated to head), disposed of when the
    command ends."""
    engine = db.make_engine(registry_config_from_args(args).database_url)
    try:
        db.check_schema(engine)
        yield db.make_session_factory(engine)
    finally:
        engine.dispose()


# --- db ----------------------------------------------------------------------------------


def _db_upgrade(args: argparse.Namespace) -> int:
    config = registry_config_from_args(args)
    url = config.database_url
    db.upgrade(url, args.revision, adapter_dir=config.adapter_dir)
    if args.revision == "head":  # the registry's identity exists from 0003 on
        with _sessions(args) as factory:
            _owned_store(args, factory)  # claims an unowned store; refuses another's
            with transaction(factory) as session:
                warn_shadowed(session, [Path(model_dir_from_args(args)).name])
    return _db_report(args, url, "upgraded")


def warn_shadowed(session: Session, model_names: Sequence[str]) -> None:
    """Says on stderr which adapters are named like the served model (uploads refuse such
    names now; older rows may have them): no request can reach them."""
    shadowed = service.shadowed_names(session, model_names)
    if shadowed:
        print(f"loraplex: warning: {len(shadowed)} adapter(s) named like the served model "
              f"({', '.join(model_names)}) cannot be called, a request naming it reaches the "
              f"base model: {', '.join(shadowed)}; upload each under another name and "
              "delete it", file=sys.stderr)


def _owned_store(args: argparse.Namespace, factory: sessionmaker[Session], *,
                 claim_any: bool = False) -> AdapterStore:
    config = registry_config_from_args(args)
    return open_store(factory, config.adapter_dir, config.database_url, claim_any=claim_any)


def _db_claim_store(args: argparse.Namespace) -> int:
    with _sessions(args) as factory:
        store = _owned_store(args, factory, claim_any=True)
    shown = describe_database(registry_config_from_args(args).database_url)
    _emit(args, {"adapter_dir": str(store.root), "registry_id": store.registry_id,
                 "database_url": shown},
          lambda: print(f"the adapter store {store.root} belongs to {shown}"))
    return 0


def _db_migrate(args: argparse.Namespace) -> int:
    config = registry_config_from_args(args)
    result = move_registry(config.database_url, args.to, config.adapter_dir)
    source, target = describe_database(config.database_url), describe_database(args.to)
    rows = result.num_rows
    _emit(args, {"from": source, "to": target, "rows": rows,
                 "adapter_dir": result.adapter_dir},
          lambda: print(
              f"moved {rows['tenants']} tenants, {rows['api_keys']} API keys, "
              f"{rows['adapters']} adapter versions and {rows['usage']} usage rows from "
              f"{source} to {target}; the adapter store {result.adapter_dir} now belongs to "
              f"it: serve with --database-url {target} --adapter-dir {result.adapter_dir}"))
    return 0


def _db_downgrade(args: argparse.Namespace) -> int:
    config = registry_config_from_args(args)
    url = config.database_url
    db.downgrade(url, args.revision, adapter_dir=config.adapter_dir)
    return _db_report(args, url, "downgraded")


def _db_current(args: argparse.Namespace) -> int:
    return _db_report(args, registry_config_from_args(args).database_url, None)


def _db_report(args: argparse.Namespace, url: str, action: str | None) -> int:
    engine = db.make_engine(url)
    try:
        current = db.current_revision(engine)
    finally:
        engine.dispose()
    head = db.head_revision()
    shown = make_url(url).render_as_string(hide_password=True)
    data = {"database_url": shown, "revision": current, "head": head}
    verb = f"{action} " if action else ""
    _emit(args, data, lambda: print(f"{shown}: {verb}at revision {current or 'base'} "
                                    f"(head {head})"))
    return 0


# --- tenants -----------------------------------------------------------------------------


def _tenants_create(args: argparse.Namespace) -> int:
    # Refused before the database opens.
    given = _limits_given(args) | _settings_given(args) | _quotas_given(args)
    with _sessions(args) as factory, transaction(factory) as session:
        tenant = service.create_tenant(session, args.name, **given)
        data = _tenant_json(tenant)
    _emit(args, data, lambda: print(f"created tenant {data['name']} (id {data['id']})"))
    return 0


def _tenants_status(status: str, verb: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        with _sessions(args) as factory, transaction(factory) as session:
            tenant = service.get_tenant_by_name(session, args.name)
            data = _tenant_json(service.set_tenant_status(session, tenant.id, status))
        _emit(args, data, lambda: print(f"{verb} tenant {data['name']}"))
        return 0

    return run


def _tenants_limits(args: argparse.Namespace) -> int:
    limits = _limits_given(args) | _settings_given(args) | _quotas_given(args)
    with _sessions(args) as factory, transaction(factory) as session:
        tenant = service.get_tenant_by_name(session, args.name)
        if limits:
            tenant = service.update_tenant_limits(session, tenant.id, **limits)
        data = _tenant_json(tenant, quotas.storage_by_tenant(session, [tenant.id]))

    def text() -> None:
        shown = [f"{flag} {'unlimited' if data[field] is None else data[field]}"
                 for flag, _, field, _ in (*_LIMIT_FLAGS, *_QUOTA_FLAGS)]
        shown += [f"{flag} {'default' if data[field] is None else data[field]}"
                  for flag, _, field, _ in _SETTING_FLAGS]
        print(f"tenant {data['name']}: {', '.join(shown)}; stores {data['storage_bytes']} "
              f"bytes in {data['num_adapter_versions']} adapter versions")

    _emit(args, data, text)
    return 0


def _tenants_list(args: argparse.Namespace) -> int:
    with _sessions(args) as factory, transaction(factory) as session:
        storage = quotas.storage_by_tenant(session)
        data = [_tenant_json(t, storage) for t in service.list_tenants(session)]
    _emit(args, data, lambda: _print_table(data, (
        "id", "name", "status", "max_requests_per_minute", "max_tokens_per_minute",
        "max_concurrent_requests", *(field for _, _, field, _ in _SETTING_FLAGS),
        "storage_bytes", "max_storage_bytes", "num_adapter_versions",
        "max_adapter_versions")))
    return 0


# --- keys --------------------------------------------------------------------------------


def _keys_create(args: argparse.Namespace) -> int:
    if args.tenant is None and not args.admin:
        raise InvalidRequestError("keys create needs --tenant NAME (or --admin, for an admin "
                                  f"key of the {service.ADMIN_TENANT!r} tenant)")
    with _sessions(args) as factory, transaction(factory) as session:
        if args.tenant is None:
            row, plaintext = service.create_admin_key(session, name=args.key_name)
            tenant = row.tenant
        else:
            tenant = service.get_tenant_by_name(session, args.tenant)
            row, plaintext = service.create_key(session, tenant.id,
                                                role="admin" if args.admin else "tenant",
                                                name=args.key_name)
        data = _key_json(row, tenant.name) | {"key": plaintext}

    def text() -> None:
        print(f"created key {data['id']} (role {data['role']}) for tenant {data['tenant']}; "
              "it is shown only this once:", file=sys.stderr)
        print(plaintext)

    _emit(args, data, text)
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    with _sessions(args) as factory, transaction(factory) as session:
        row = service.revoke_key(session, args.id)
        data = _key_json(row, row.tenant.name)
    _emit(args, data, lambda: print(f"revoked key {data['id']} ({data['prefix']}…)"))
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    with _sessions(args) as factory, transaction(factory) as session:
        tenant_id = (service.get_tenant_by_name(session, args.tenant).id
                     if args.tenant else None)
        data = [_key_json(k, k.tenant.name) for k in service.list_keys(session, tenant_id)]
    _emit(args, data, lambda: _print_table(data, (
        "id", "tenant", "role", "name", "prefix", "created_at", "last_used_at", "revoked_at")))
    return 0


# --- adapters ----------------------------------------------------------------------------


def _progress_printer(total: int) -> Callable[[int], None] | None:
    """A byte counter on stderr for big uploads, only on a terminal (a log is not a
    terminal, and error output stays one line)."""
    if total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        return None
    return _ByteCounter(total, sys.stderr)


class _ByteCounter:
    def __init__(self, total: int, out: TextIO, every_s: float = 0.2) -> None:
        self.total = total
        self.out = out
        self.every_s = every_s
        self._last = -math.inf  # the first call always shows

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if done < self.total and now - self._last < self.every_s:
            return
        self._last = now
        mib = 1 << 20
        end = "\n" if done >= self.total else ""
        self.out.write(f"\ruploading {done / mib:.1f} / {self.total / mib:.1f} MiB{end}")
        self.out.flush()


def _source_bytes(path: Path) -> int:
    if path.is_dir():
        return sum((path / n).stat().st_size for n in (
            upload.CONFIG_FILE, upload.WEIGHTS_FILE, upload.README_FILE) if (path / n).is_file())
    return path.stat().st_size if path.is_file() else 0


def _adapters_upload(args: argparse.Namespace) -> int:
    # Lazy: the loader pulls in torch, which no other registry command needs.
    from loraplex.model.adapter_loader import TargetShapes, validate_adapter_dir

    model_dir = str(Path(model_dir_from_args(args)).expanduser().resolve())
    check_adapter_name(args.name)
    source = Path(args.path).expanduser()
    if not source.exists():
        raise AdapterError(f"{source}: no such file or folder")
    with _sessions(args) as factory:
        with transaction(factory) as session:  # fail fast, before reading any file
            tenant = service.get_tenant_by_name(session, args.tenant)
            tenant_id, tenant_name = tenant.id, tenant.name
        try:
            target = TargetShapes.from_model_dir(model_dir)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{exc} (the base model adapters are checked against: "
                                 f"pass --model DIR or set {ENV_MODEL})") from exc
        max_rank = args.max_lora_rank
        uploader = upload.AdapterUploader(
            _owned_store(args, factory),
            lambda path: validate_adapter_dir(path, target, max_rank),
            base_model=model_dir, base_model_names=args.served_model_name or (),
            # What `serve --model DIR` calls the base model unless told another name.
            reserved_names=[*(args.served_model_name or ()), Path(model_dir).name])
        result = uploader.upload_path(
            factory, tenant_id=tenant_id, name=args.name, path=source,
            visibility="public" if args.public else "private",
            progress=_progress_printer(_source_bytes(source)))
        data = _adapter_json(result.adapter, tenant_name) | {"created": result.created}
    stored = "stored" if data["created"] else "identical content already stored"
    _emit(args, data, lambda: print(
        f"added {data['model']} version {data['version']} ({data['visibility']}), "
        f"identity {data['identity']} ({stored})"))
    return 0


def _adapters_delete(args: argparse.Namespace) -> int:
    with _sessions(args) as factory:
        with transaction(factory) as session:
            tenant = service.get_tenant_by_name(session, args.tenant)
            tenant_id, tenant_name = tenant.id, tenant.name
        # A running server learns of it through the database: resolve_adapter stops
        # finding the name at once; its in-memory copies finish the running requests.
        deleted = upload.delete_adapter(factory, _owned_store(args, factory),
                                        tenant_id=tenant_id, name=args.name,
                                        version=args.version)
    data = [{"id": d.id, "tenant": tenant_name, "name": d.name, "version": d.version,
             "identity": d.identity, "digest": d.digest, "status": "deleted"} for d in deleted]
    _emit(args, data, lambda: print(
        f"deleted {tenant_name}/{args.name} version(s) "
        f"{', '.join(str(d['version']) for d in data)}"))
    return 0


def _adapters_list(args: argparse.Namespace) -> int:
    with _sessions(args) as factory, transaction(factory) as session:
        if args.tenant:
            tenant = service.get_tenant_by_name(session, args.tenant)
            rows = (service.list_adapters(session, tenant.id, include_deleted=True)
                    if args.all else service.list_visible_adapters(session, tenant.id))
        else:
            rows = service.list_adapters(session, include_deleted=args.all)
        data = [_adapter_json(a, a.tenant.name) for a in rows]
    _emit(args, data, lambda: _print_table(data, (
        "id", "model", "version", "rank", "visibility", "status", "digest")))
    return 0


def _name_state_json(state: service.NameVersions, tenant_name: str) -> dict[str, Any]:
    traffic = state.traffic
    return {"tenant": tenant_name, "name": state.name, "model": f"{tenant_name}/{state.name}",
            "current_version": state.version(traffic.current_id),
            "latest_version": state.versions[-1].version, "promoted": traffic.promoted,
            "split": None if traffic.canary_id is None else {
                "version": state.version(traffic.canary_id),
                "percent": traffic.canary_percent},
            "versions": [_adapter_json(a, tenant_name) | {
                "current": a.id == traffic.current_id,
                "traffic_percent": traffic.percent_of(a.id)} for a in state.versions]}


def _print_name_state(data: dict[str, Any]) -> None:
    split = data["split"]
    text = f"{data['model']}: current version {data['current_version']}"
    if split is not None:
        text += (f", {split['percent']:g}% of requests split to version {split['version']} "
                 f"({100 - split['percent']:g}% stay on {data['current_version']})")
    print(text)


def _number(text: str, check: Callable[[object, str], Any], flag: str) -> Any:
    """A number on the command line, checked by the registry's own rule (naming the
    flag), so a bad one is one line on stderr like every other refusal."""
    value: object = text
    with suppress(ValueError):
        value = int(text) if check is service.check_version else float(text)
    return check(value, flag)


def _adapters_promote(args: argparse.Namespace) -> int:
    version = _number(args.version, service.check_version, "VERSION")
    with _sessions(args) as factory, transaction(factory) as session:
        tenant = service.get_tenant_by_name(session, args.tenant)
        data = _name_state_json(service.promote(session, tenant.id, args.name, version),
                                tenant.name)
    _emit(args, data, lambda: _print_name_state(data))
    return 0


def _adapters_pin(args: argparse.Namespace) -> int:
    """Records the pin (or unpin); a server applies it (see registry/pins.py)."""
    version = _number(args.version, service.check_version, "--version")
    with _sessions(args) as factory, transaction(factory) as session:
        tenant = service.get_tenant_by_name(session, args.tenant)
        (pins.pin if args.pin else pins.unpin)(session, tenant.id, args.name, version)
        data = _name_state_json(service.name_versions(session, tenant.id, args.name),
                                tenant.name)
        held = [f"{a.tenant.name}/{a.name}@{a.version}" for a in pins.pinned_adapters(session)]
    lora = LoRAConfig()
    _emit(args, data, lambda: print(
        f"{data['model']} version {version} {'pinned' if args.pin else 'unpinned'}; pinned, "
        f"oldest first: {', '.join(held) or 'none'}. A server holds the oldest "
        f"floor(--max-pinned-fraction x --max-loras) of them (default "
        f"{lora.max_pinned_fraction:g} x {lora.max_loras} = {lora.max_pinned}) in its "
        "adapter slots, from within about 2 s"))
    return 0


def _adapters_split(args: argparse.Namespace) -> int:
    if args.cancel:
        if args.to is not None or args.percent is not None:
            raise InvalidRequestError("adapters split --cancel takes neither --to nor "
                                      "--percent")
    elif args.to is None or args.percent is None:
        raise InvalidRequestError("adapters split needs --to N and --percent P (or --cancel, "
                                  "to end the split)")
    else:
        version = _number(args.to, service.check_version, "--to")
        percent = _number(args.percent, service.check_percent, "--percent")
    with _sessions(args) as factory, transaction(factory) as session:
        tenant = service.get_tenant_by_name(session, args.tenant)
        state = (service.cancel_split(session, tenant.id, args.name) if args.cancel
                 else service.start_split(session, tenant.id, args.name, version, percent))
        data = _name_state_json(state, tenant.name)
    _emit(args, data, lambda: _print_name_state(data))
    return 0


# --- wiring ------------------------------------------------------------------------------


# flag, its dest, the tenant's field, help: the limits the admin UI and API set too.
_LIMIT_FLAGS = (("--rpm", "rpm", "max_requests_per_minute", "max requests per minute"),
                ("--tpm", "tpm", "max_tokens_per_minute", "max tokens per minute"),
                ("--max-concurrency", "max_concurrency", "max_concurrent_requests",
                 "max concurrent requests"))


def _limits_given(args: argparse.Namespace) -> dict[str, Any]:
    return {field: getattr(args, dest) for _, dest, field, _ in _LIMIT_FLAGS
            if getattr(args, dest) is not service.UNSET}


# The scheduling settings, in the same shape. Read as text and checked when the command runs
# (by the registry's own checks, naming the flag), so a bad value is one line on stderr.
_SETTING_FLAGS = (("--weight", "weight", "weight",
                   "share of a busy engine relative to other tenants, >= 0.01 and <= 1000"),
                  ("--priority-class", "priority_class", "priority_class",
                   "interactive (admitted first) or batch"),
                  ("--max-kv-fraction", "max_kv_fraction", "max_kv_fraction",
                   "most of the KV block pool its running requests may hold, > 0 and <= 1"),
                  ("--slo-ttft-ms", "slo_ttft_ms", "slo_ttft_ms",
                   "time-to-first-token objective in ms, 1..3600000"),
                  ("--slo-tpot-ms", "slo_tpot_ms", "slo_tpot_ms",
                   "time-per-output-token objective in ms, 1..3600000"))
# Settings where None means "the server's default", which these words ask for.
_NULLABLE_SETTINGS = ("max_kv_fraction", "slo_ttft_ms", "slo_tpot_ms")
_DEFAULT_WORDS = ("default", "none")
_SETTING_METAVARS = {"weight": "W", "priority_class": "CLASS", "max_kv_fraction": "F",
                     "slo_ttft_ms": "MS", "slo_tpot_ms": "MS"}


def _settings_given(args: argparse.Namespace) -> dict[str, Any]:
    return {field: _setting(flag, field, getattr(args, dest))
            for flag, dest, field, _ in _SETTING_FLAGS
            if getattr(args, dest) is not service.UNSET}


def _setting(flag: str, field: str, text: str) -> Any:
    """A setting's text as the registry stores it; InvalidRequestError naming the flag."""
    value: object = text
    if field in _NULLABLE_SETTINGS and text.strip().lower() in _DEFAULT_WORDS:
        value = None
    elif field in ("slo_ttft_ms", "slo_tpot_ms"):
        with suppress(ValueError):  # left as text, which the check refuses
            value = int(text)
    elif field != "priority_class":
        with suppress(ValueError):
            value = float(text)
    return service.SCHEDULING_CHECKS[field](value, flag)


# The storage quotas, in the same shape; 'none' (or 'unlimited', 'default') removes one.
_QUOTA_FLAGS = (("--max-storage-bytes", "max_storage_bytes", "max_storage_bytes",
                 "most bytes of adapter files the tenant keeps, e.g. 500M or 2G (K, M, G, T: "
                 "powers of 1024)"),
                ("--max-adapter-versions", "max_adapter_versions", "max_adapter_versions",
                 "most active adapter versions the tenant has"))
_SIZE_RE = re.compile(r"\s*([0-9]+)\s*(?:([kmgt])(?:i?b)?|b)?\s*", re.IGNORECASE)
_COUNT_RE = re.compile(r"\s*([0-9]+)\s*")


def _quotas_given(args: argparse.Namespace) -> dict[str, Any]:
    return {field: _quota(flag, field, getattr(args, dest))
            for flag, dest, field, _ in _QUOTA_FLAGS
            if getattr(args, dest) is not service.UNSET}


def _quota(flag: str, field: str, text: str) -> int | None:
    """A quota's text as the registry stores it; InvalidRequestError naming the flag."""
    if text.strip().lower() in ("none", "unlimited", "default"):
        return None
    value: object = text  # left as text where it is no number, which the check refuses
    match = (_SIZE_RE if field == "max_storage_bytes" else _COUNT_RE).fullmatch(text)
    if match and len(match[1]) <= 40:  # int() refuses 4300 digits; 40 is past any quota
        unit = (match[2] or "") if match.re is _SIZE_RE else ""
        value = int(match[1]) << (10 * " kmgt".index(unit.lower() or " "))
    return service.QUOTA_CHECKS[field](value, flag)


def _limit(text: str) -> int | None:
    """A limit on the command line: a positive integer, or ``none`` for unlimited."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    return _positive_int(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return value


def _row_id(text: str) -> int:
    """An id or version: a positive integer that fits the database's integer columns."""
    value = _positive_int(text)
    if value > db.MAX_INT32:
        raise argparse.ArgumentTypeError(f"must be at most {db.MAX_INT32}: {value}")
    return value


def _add_setting_flags(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    initial = {"weight": "1", "priority_class": "interactive"}
    for flag, dest, field, help_ in _SETTING_FLAGS:
        nullable = field in _NULLABLE_SETTINGS
        if creating:
            default = initial.get(field, "the server's")
        else:
            default = "unchanged" + ("; 'default': back to the server's" if nullable else "")
        metavar = _SETTING_METAVARS[field] + ("|default" if nullable else "")
        parser.add_argument(flag, dest=dest, default=service.UNSET, metavar=metavar,
                            help=f"{help_} (default: {default})")


def add_registry_commands(subparsers: Any) -> None:
    """Registers ``db``, ``tenants``, ``keys`` and ``adapters`` on the main parser's
    subparsers. Each leaf sets ``func``: call ``args.func(args)`` and exit with its result."""
    common = argparse.ArgumentParser(add_help=False)
    add_registry_options(common)

    def leaf(group: Any, name: str, handler: Handler, help_: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = group.add_parser(name, parents=[common], help=help_,
                                                           description=help_)
        parser.set_defaults(func=_guarded(handler))
        return parser

    def group(name: str, help_: str) -> Any:
        parser = subparsers.add_parser(name, help=help_, description=help_)
        return parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND", required=True)

    db = group("db", "migrate the registry database")
    p = leaf(db, "upgrade", _db_upgrade, "migrate the database up (creates it if needed)")
    p.add_argument("--revision", default="head", help="target revision (default: head)")
    p = leaf(db, "downgrade", _db_downgrade, "migrate the database down")
    p.add_argument("revision", help="target revision, e.g. base or -1")
    leaf(db, "current", _db_current, "show the database's revision")
    p = leaf(db, "migrate", _db_migrate,
             "move this registry (tenants, key hashes, adapters and their versions, usage) "
             "into an empty database, e.g. SQLite to PostgreSQL, and hand it the adapter "
             "store")
    p.add_argument("--to", required=True, metavar="URL", help="the target database")
    leaf(db, "claim-store", _db_claim_store,
         "make this registry the owner of an adapter store nobody owns yet, even one holding "
         "folders it does not name (a store that another registry owns is refused)")

    tenants = group("tenants", "manage tenants")
    p = leaf(tenants, "create", _tenants_create, "create a tenant")
    p.add_argument("name")
    for flag, _, _, help_ in _LIMIT_FLAGS:
        p.add_argument(flag, type=_positive_int, metavar="N", help=f"{help_} (default: none)")
    _add_setting_flags(p, creating=True)
    for flag, dest, _, help_ in _QUOTA_FLAGS:
        p.add_argument(flag, dest=dest, default=service.UNSET, metavar="N",
                       help=f"{help_} (default: unlimited)")
    leaf(tenants, "list", _tenants_list, "list tenants")
    p = leaf(tenants, "suspend", _tenants_status("suspended", "suspended"),
             "suspend a tenant: its keys stop working and its public adapters stop "
             "resolving, from the next request on")
    p.add_argument("name")
    p = leaf(tenants, "reactivate", _tenants_status("active", "reactivated"),
             "reactivate a suspended tenant")
    p.add_argument("name")
    p = leaf(tenants, "limits", _tenants_limits,
             "change a tenant's limits, scheduling settings and storage quotas (the ones "
             "given; 'none' removes a limit or quota) and show them")
    p.add_argument("name")
    for flag, _, _, help_ in _LIMIT_FLAGS:
        p.add_argument(flag, type=_limit, default=service.UNSET, metavar="N|none",
                       help=f"{help_} (none: unlimited; default: unchanged)")
    _add_setting_flags(p, creating=False)
    for flag, dest, _, help_ in _QUOTA_FLAGS:
        p.add_argument(flag, dest=dest, default=service.UNSET, metavar="N|none",
                       help=f"{help_} (none: unlimited; default: unchanged)")

    keys = group("keys", "manage API keys")
    p = leaf(keys, "create", _keys_create,
             "create an API key (printed once); 'keys create --admin' replaces a lost admin "
             "key")
    p.add_argument("--tenant", metavar="NAME",
                   help="the key's tenant (needed unless --admin: then the admin tenant)")
    p.add_argument("--admin", action="store_true", help="an admin key (default: tenant)")
    p.add_argument("--name", dest="key_name", metavar="LABEL", help="a label for humans")
    p = leaf(keys, "revoke", _keys_revoke, "revoke an API key")
    p.add_argument("id", type=_row_id)
    p = leaf(keys, "list", _keys_list, "list API keys (prefixes only)")
    p.add_argument("--tenant", metavar="NAME")

    adapters = group("adapters", "manage LoRA adapters")
    for command, metavar, help_ in (
            ("upload", "PATH", "validate a PEFT adapter (a folder, .zip or .tar.gz), store it, "
                               "and record a new version"),
            ("add", "DIR", "the same as upload")):
        p = leaf(adapters, command, _adapters_upload, help_)
        p.add_argument("--tenant", required=True, metavar="NAME")
        p.add_argument("--name", required=True, metavar="NAME")
        p.add_argument("path", metavar=metavar, help="adapter folder or archive")
        p.add_argument("--public", action="store_true", help="callable by other tenants")
        p.add_argument("--max-lora-rank", type=_positive_int,
                       default=LoRAConfig().max_lora_rank,
                       help="largest rank accepted (default: %(default)s)")
        p.add_argument("--served-model-name", action="append", metavar="NAME",
                       help="a name the base model is known by (repeatable); when given, an "
                            "adapter whose base_model_name_or_path names another model is "
                            "refused")
    p = leaf(adapters, "delete", _adapters_delete,
             "delete an adapter: new requests stop at once, running ones finish")
    p.add_argument("--tenant", required=True, metavar="NAME")
    p.add_argument("--name", required=True, metavar="NAME")
    p.add_argument("--version", type=_row_id, help="only this version (default: all)")
    p = leaf(adapters, "promote", _adapters_promote,
             "make VERSION the current version of an adapter, the one its bare name "
             "reaches (rollback: promote an older one); ends a split in progress")
    p.add_argument("--tenant", required=True, metavar="NAME")
    p.add_argument("name", metavar="NAME")
    p.add_argument("version", metavar="VERSION")
    for command, help_ in (
            ("pin", "pin a version: every server keeps it in a device slot and its host "
                    "cache, so its requests never wait for a load; a server applies the "
                    "oldest pins that fit its share of slots (--max-pinned-fraction)"),
            ("unpin", "unpin a version: its slot joins the working set again")):
        p = leaf(adapters, command, _adapters_pin, help_)
        p.set_defaults(pin=command == "pin")
        p.add_argument("--tenant", required=True, metavar="NAME")
        p.add_argument("name", metavar="NAME")
        p.add_argument("--version", required=True, metavar="N", help=f"the version to {command}")
    p = leaf(adapters, "split", _adapters_split,
             "split the requests naming an adapter: --percent of them go to version --to "
             "(the canary), the rest to the current version; the same request 'user' always "
             "gets the same side. Ended by promote or --cancel")
    p.add_argument("--tenant", required=True, metavar="NAME")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--to", metavar="N", help="the canary version")
    p.add_argument("--percent", metavar="P", help="its share of requests, 0 to 100")
    p.add_argument("--cancel", action="store_true",
                   help="end the split: every request goes to the current version")
    p = leaf(adapters, "list", _adapters_list, "list adapters")
    p.add_argument("--tenant", metavar="NAME",
                   help="what this tenant can call (own and public, current versions)")
    p.add_argument("--all", action="store_true",
                   help="every version, deleted ones included")


def build_registry_parser() -> argparse.ArgumentParser:
    """A parser with only the registry's commands (tests, ``python -m``)."""
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_registry_commands(subparsers)
    return parser


def run_registry_cli(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` with the registry's commands and runs one; returns the exit status."""
    args = build_registry_parser().parse_args(argv)
    handler: Handler = args.func
    return handler(args)


if __name__ == "__main__":
    sys.exit(run_registry_cli())
