"""Operator views under ``/admin/api``: the engine and usage. Every one needs an admin key
(403 otherwise); tenants and keys are in ``admin_tenants``, adapters in ``admin_adapters``.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.engine.stats import combine_stats
from loraplex.errors import AdapterNotFoundError, InvalidRequestError
from loraplex.gateway.auth import admin_principal
from loraplex.gateway.http import MAX_INT32, parse_time_param
from loraplex.gateway.state import Gateway
from loraplex.registry import service
from loraplex.registry.db import transaction

DEFAULT_USAGE_WINDOW: Final = timedelta(hours=48)
MAX_USAGE_WINDOW: Final = timedelta(days=366)


def _adapter_entries(gw: Gateway, identities: set[str]) -> dict[str, dict[str, Any]]:
    """Each engine identity (``id@digest12``) with the adapter it is, by owner and name
    (``None`` where the registry does not know the id)."""
    out: dict[str, dict[str, Any]] = {}
    with transaction(gw.sessions) as session:
        for identity in identities:
            raw_id = identity.partition("@")[0]
            entry: dict[str, Any] = {"identity": identity, "model": None, "version": None,
                                     "status": None}
            if raw_id.isdigit() and int(raw_id) <= MAX_INT32:
                try:
                    row = service.get_adapter(session, int(raw_id))
                except AdapterNotFoundError:
                    pass
                else:
                    entry |= {"model": f"{row.tenant.name}/{row.name}",
                              "version": row.version, "status": row.status}
            out[identity] = entry
    return out


def _slots(slots: tuple[str | None, ...],
           entries: dict[str, dict[str, Any]]) -> list[dict[str, Any] | None]:
    return [None if slot is None else {"slot": index} | entries[slot]
            for index, slot in enumerate(slots)]


async def engine_stats(request: Request) -> Response:
    """The engine's figures: queue, running requests, KV blocks, adapter slots; at the top
    level for the whole deployment, and under ``replicas`` for each replica."""
    gw, _ = await admin_principal(request)
    replicas = await gw.backend.replica_stats()
    total = combine_stats(replicas)
    entries = await run_in_threadpool(
        _adapter_entries, gw, {slot for slot in total.adapter_slots if slot is not None})
    return JSONResponse(asdict(total) | {
        "slots": _slots(total.adapter_slots, entries),
        "served_model": gw.served_model_name,
        "replicas": [asdict(r) | {"slots": _slots(r.adapter_slots, entries)}
                     for r in replicas]})


def _usage(gw: Gateway, tenant: str | None, since: datetime,
           until: datetime) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        tenants = service.list_tenants(session)
        if tenant is not None:
            tenants = [service.get_tenant_by_name(session, tenant)]
        adapters = {row.id: row for row in service.list_adapters(session, include_deleted=True)}
        data, totals = [], []
        for t in tenants:
            rows = service.list_usage(session, t.id, since=since, until=until)
            for row in rows:
                adapter = adapters.get(row.adapter_id) if row.adapter_id is not None else None
                data.append({
                    "hour": row.hour.isoformat(), "tenant": t.name,
                    "model": (f"{adapter.tenant.name}/{adapter.name}" if adapter
                              else gw.served_model_name),
                    "version": adapter.version if adapter else None,
                    "requests": row.requests, "prompt_tokens": row.prompt_tokens,
                    "completion_tokens": row.completion_tokens,
                    "total_tokens": row.prompt_tokens + row.completion_tokens})
            if rows:
                sums = service.usage_totals(session, t.id, since=since, until=until)
                totals.append({"tenant": t.name, "requests": sums.requests,
                               "prompt_tokens": sums.prompt_tokens,
                               "completion_tokens": sums.completion_tokens,
                               "total_tokens": sums.total_tokens})
    data.sort(key=lambda r: (r["hour"], r["tenant"], r["model"]))
    return {"object": "usage", "since": since.isoformat(), "until": until.isoformat(),
            "totals": totals, "data": data}


async def usage(request: Request) -> Response:
    """Hourly requests and tokens per tenant and model over ``since``..``until`` (default:
    the last 48 hours), optionally for one ``tenant``."""
    gw, _ = await admin_principal(request)
    now = datetime.now(UTC)
    until = parse_time_param(request.query_params, "until") or now + timedelta(hours=1)
    since = parse_time_param(request.query_params, "since") or now - DEFAULT_USAGE_WINDOW
    if since >= until:
        raise InvalidRequestError("since must be before until", param="since")
    if until - since > MAX_USAGE_WINDOW:
        raise InvalidRequestError("the usage window is limited to 366 days", param="since")
    tenant = request.query_params.get("tenant") or None
    # Read-your-writes: what this process metered so far is written before reading.
    await gw.meter.flush()
    return JSONResponse(await run_in_threadpool(_usage, gw, tenant, since, until))


def routes() -> list[Route]:
    """The routes of this module, for ``create_app``."""
    return [
        Route("/admin/api/engine", engine_stats, methods=["GET"]),
        Route("/admin/api/usage", usage, methods=["GET"]),
    ]
