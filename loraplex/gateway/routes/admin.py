"""Operator views under ``/admin/api``: the engine, each tenant's recent latency, and
usage. Every one needs an admin key (403 otherwise); tenants and keys are in
``admin_tenants``, adapters in ``admin_adapters``.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.engine.stats import EngineStats, combine_stats
from loraplex.errors import AdapterNotFoundError, InvalidRequestError, NotFoundError
from loraplex.gateway.adapter_uploads import storage_json
from loraplex.gateway.auth import admin_principal
from loraplex.gateway.http import MAX_INT32, parse_time_param
from loraplex.gateway.latency import TenantLatency
from loraplex.gateway.state import Gateway
from loraplex.registry import quotas, service
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


def _tenant_names(gw: Gateway, tenant_ids: set[str]) -> dict[str, str | None]:
    """Each scheduler tenant (the registry id as text; "" for none) with the registry
    tenant's name, ``None`` where the registry does not know it."""
    out: dict[str, str | None] = {}
    with transaction(gw.sessions) as session:
        for raw_id in tenant_ids:
            out[raw_id] = None
            # ASCII digits only (int() also reads "٣"), and few enough that int() accepts
            # them and SQL's integer holds the value.
            if raw_id.isascii() and raw_id.isdigit() and len(raw_id) <= 10 \
                    and int(raw_id) <= MAX_INT32:
                try:
                    out[raw_id] = service.get_tenant(session, int(raw_id)).name
                except NotFoundError:
                    pass
    return out


def _named(tenants: list[dict[str, Any]], names: dict[str, str | None]) -> list[dict[str, Any]]:
    return [t | {"name": names.get(t["tenant"])} for t in tenants]


def _slots(stats: EngineStats,
           entries: dict[str, dict[str, Any]]) -> list[dict[str, Any] | None]:
    pinned = set(stats.pinned_adapters)
    return [None if slot is None else {"slot": index} | entries[slot]
            | {"pinned": slot in pinned} for index, slot in enumerate(stats.adapter_slots)]


async def engine_stats(request: Request) -> Response:
    """The engine's figures: queue, running requests, KV blocks, adapter slots (each
    saying whether its adapter is ``pinned``), the pins held (``pinned_adapters``) and the
    most there may be (``max_pinned``), tenants (each with its registry ``name``), the KV
    disk tier (``kv_disk_*``; ``kv_disk_max_bytes`` 0 where it is off); at the top level
    for the whole deployment, under ``replicas`` for each replica (its ``role``, with
    prefill/decode disaggregation), and under ``pools`` for each role's replicas together
    (empty without disaggregation)."""
    gw, _ = await admin_principal(request)
    replicas = await gw.backend.replica_stats()
    total = combine_stats(replicas)
    entries = await run_in_threadpool(
        _adapter_entries, gw, {slot for slot in total.adapter_slots if slot is not None})
    names = await run_in_threadpool(
        _tenant_names, gw, {t.tenant for r in replicas for t in r.tenants})

    def view(stats: EngineStats) -> dict[str, Any]:
        out = asdict(stats)
        return out | {"slots": _slots(stats, entries),
                      "tenants": _named(out["tenants"], names)}

    roles = sorted({r.role for r in replicas if r.role}, reverse=True)  # prefill, decode
    pools = [view(combine_stats(group)) | {"role": role, "num_replicas": len(group)}
             for role in roles for group in [[r for r in replicas if r.role == role]]]
    return JSONResponse(view(total) | {"served_model": gw.served_model_name,
                                       "architecture": gw.backend.description.architecture,
                                       "max_pinned": gw.backend.description.max_pinned,
                                       "replicas": [view(r) for r in replicas],
                                       "pools": pools})


def _latency_row(t: TenantLatency) -> dict[str, Any]:
    return {"tenant": t.tenant, "requests": t.requests,
            "ttft_p50_s": t.ttft.p50, "ttft_p99_s": t.ttft.p99,
            "tpot_p50_s": t.tpot.p50, "tpot_p99_s": t.tpot.p99,
            "e2e_p50_s": t.e2e.p50, "e2e_p99_s": t.e2e.p99,
            "queue_p50_s": t.queue.p50, "queue_p99_s": t.queue.p99,
            "ttft_steps_p50": t.ttft_steps.p50, "ttft_steps_p99": t.ttft_steps.p99,
            "slo_ttft_ms": t.slo.ttft_ms if t.slo else None,
            "slo_tpot_ms": t.slo.tpot_ms if t.slo else None,
            "slo_attainment": t.slo_attainment}


async def tenant_latency(request: Request) -> Response:
    """Per tenant, over its latest ``window`` finished requests in this gateway process:
    p50/p99 of TTFT, TPOT, end-to-end and queue time (seconds) and of TTFT in engine steps,
    and the fraction that met the tenant's SLO."""
    gw, _ = await admin_principal(request)
    metrics = gw.metrics
    return JSONResponse({"object": "tenant_latency", "window": metrics.latency_window,
                         "data": [_latency_row(t) for t in metrics.tenant_latency()]})


def _usage(gw: Gateway, tenant: str | None, since: datetime,
           until: datetime) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        tenants = service.list_tenants(session)
        if tenant is not None:
            tenants = [service.get_tenant_by_name(session, tenant)]
        adapters = {row.id: row for row in service.list_adapters(session, include_deleted=True)}
        # Storage is a level now, not a sum over the window.
        stored = quotas.storage_by_tenant(session, [t.id for t in tenants])
        storage = [{"tenant": t.name} | storage_json(quotas.usage_of(t, stored))
                   for t in tenants]
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
            "totals": totals, "storage": storage, "data": data}


async def usage(request: Request) -> Response:
    """Hourly requests and tokens per tenant and model over ``since``..``until`` (default:
    the last 48 hours), optionally for one ``tenant``; and each tenant's storage now
    against its quotas (``storage``)."""
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
        Route("/admin/api/latency", tenant_latency, methods=["GET"]),
        Route("/admin/api/usage", usage, methods=["GET"]),
    ]
