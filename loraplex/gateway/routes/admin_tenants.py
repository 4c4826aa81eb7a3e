"""Admin routes for tenants and their API keys (``/admin/api/tenants``, ``/admin/api/keys``).

Tenants are named in paths by name, keys by id. A new key's plaintext is in the creation
response only; lists show the key's first characters.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.gateway.adapter_uploads import storage_json
from loraplex.gateway.auth import (
    admin_principal,
    check_not_own_key,
    check_not_own_tenant,
    is_own,
)
from loraplex.gateway.http import MAX_INT32, read_json_object
from loraplex.gateway.state import Gateway
from loraplex.registry import quotas, service
from loraplex.registry.api_keys import Principal
from loraplex.registry.db import transaction
from loraplex.registry.models import ApiKey, Tenant

LIMITS: Final = ("max_requests_per_minute", "max_tokens_per_minute", "max_concurrent_requests")
# Weight, priority class, KV fraction and SLOs: the registry checks their types and ranges.
SETTINGS: Final = tuple(service.SCHEDULING_CHECKS)
# Storage quotas (max_storage_bytes, max_adapter_versions); null: unlimited.
QUOTAS: Final = tuple(service.QUOTA_CHECKS)


def _limit(body: dict[str, Any], field: str) -> int | None:
    value = body[field]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidRequestError(f"{field} must be a positive integer or null, got "
                                  f"{value!r}", param=field)
    if value is not None and value > MAX_INT32:
        raise InvalidRequestError(f"{field} must be at most {MAX_INT32}", param=field)
    return value  # the registry checks it is positive


def _limits_and_settings(body: dict[str, Any]) -> dict[str, Any]:
    """The limits and scheduling settings the body gives, as the registry takes them."""
    given: dict[str, Any] = {field: _limit(body, field) for field in LIMITS if field in body}
    return given | {field: body[field] for field in (*SETTINGS, *QUOTAS) if field in body}


def _string(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field} must be a string", param=field)
    return value


def tenant_json(tenant: Tenant, caller: Principal, num_keys: int = 0, num_adapters: int = 0,
                storage: dict[int, tuple[int, int]] | None = None) -> dict[str, Any]:
    # is_own: the tenant of the caller's admin key, which the caller may not suspend (the
    # admin UI offers no Suspend for it).
    return {"object": "tenant", "id": tenant.id, "name": tenant.name, "status": tenant.status,
            "is_own": is_own(caller, tenant.id),
            **{field: getattr(tenant, field) for field in (*LIMITS, *SETTINGS)},
            **storage_json(quotas.usage_of(tenant, storage or {})),
            "created_at": tenant.created_at.isoformat(),
            "num_active_keys": num_keys, "num_adapters": num_adapters}


def key_json(key: ApiKey, tenant_name: str) -> dict[str, Any]:
    return {"object": "api_key", "id": key.id, "tenant": tenant_name, "name": key.name,
            "role": key.role, "prefix": key.prefix,
            "status": "revoked" if key.revoked_at is not None else "active",
            "created_at": key.created_at.isoformat(),
            "last_used_at": key.last_used_at.isoformat() if key.last_used_at else None,
            "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None}


def _described(session: Session, tenant: Tenant, caller: Principal) -> dict[str, Any]:
    keys = [k for k in service.list_keys(session, tenant.id) if k.revoked_at is None]
    return tenant_json(tenant, caller, len(keys),
                       len({a.name for a in service.list_adapters(session, tenant.id)}),
                       quotas.storage_by_tenant(session, [tenant.id]))


# --- tenants -----------------------------------------------------------------------------


def _list_tenants(gw: Gateway, caller: Principal) -> list[dict[str, Any]]:
    with transaction(gw.sessions) as session:
        keys: dict[int, int] = {}
        for key in service.list_keys(session):
            if key.revoked_at is None:
                keys[key.tenant_id] = keys.get(key.tenant_id, 0) + 1
        adapters: dict[int, set[str]] = {}
        for row in service.list_adapters(session):
            adapters.setdefault(row.tenant_id, set()).add(row.name)
        storage = quotas.storage_by_tenant(session)
        return [tenant_json(t, caller, keys.get(t.id, 0), len(adapters.get(t.id, ())), storage)
                for t in service.list_tenants(session)]


async def list_tenants(request: Request) -> Response:
    gw, caller = await admin_principal(request)
    data = await run_in_threadpool(_list_tenants, gw, caller)
    return JSONResponse({"object": "list", "data": data})


def _create_tenant(gw: Gateway, caller: Principal, body: dict[str, Any]) -> dict[str, Any]:
    name = _string(body, "name")
    given = _limits_and_settings(body)
    with transaction(gw.sessions) as session:
        return tenant_json(service.create_tenant(session, name, **given), caller)


async def create_tenant(request: Request) -> Response:
    gw, caller = await admin_principal(request)
    body = await read_json_object(request, gw.config.max_body_bytes,
                                  ("name", *LIMITS, *SETTINGS, *QUOTAS))
    return JSONResponse(await run_in_threadpool(_create_tenant, gw, caller, body),
                        status_code=201)


def _get_tenant(gw: Gateway, caller: Principal, name: str) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        return _described(session, service.get_tenant_by_name(session, name), caller)


async def get_tenant(request: Request) -> Response:
    gw, caller = await admin_principal(request)
    return JSONResponse(await run_in_threadpool(_get_tenant, gw, caller,
                                                request.path_params["tenant"]))


def _update_tenant(gw: Gateway, caller: Principal, name: str,
                   body: dict[str, Any]) -> dict[str, Any]:
    limits = _limits_and_settings(body)
    status = _string(body, "status") if "status" in body else None
    with transaction(gw.sessions) as session:
        tenant = service.get_tenant_by_name(session, name)
        if status == "suspended":
            check_not_own_tenant(caller, tenant.id)
        if limits:
            service.update_tenant_limits(session, tenant.id, **limits)
        if status is not None:
            service.set_tenant_status(session, tenant.id, status)
        return _described(session, tenant, caller)


async def update_tenant(request: Request) -> Response:
    """Changes limits and storage quotas (null removes one), scheduling settings (null
    returns a KV fraction or SLO to the server's default) and/or ``status`` (``active``/``suspended``). One bad
    field changes nothing: the transaction is rolled back."""
    gw, caller = await admin_principal(request)
    body = await read_json_object(request, gw.config.max_body_bytes,
                                  (*LIMITS, *SETTINGS, *QUOTAS, "status"))
    data = await run_in_threadpool(_update_tenant, gw, caller, request.path_params["tenant"],
                                   body)
    return JSONResponse(data)


# --- keys --------------------------------------------------------------------------------


def _list_keys(gw: Gateway, tenant: str | None) -> list[dict[str, Any]]:
    with transaction(gw.sessions) as session:
        names = {t.id: t.name for t in service.list_tenants(session)}
        tenant_id = None if tenant is None else service.get_tenant_by_name(session, tenant).id
        return [key_json(k, names[k.tenant_id]) for k in service.list_keys(session, tenant_id)]


async def list_keys(request: Request) -> Response:
    """Every key, or one tenant's (``/admin/api/tenants/{tenant}/keys`` or ``?tenant=``)."""
    gw, _ = await admin_principal(request)
    tenant = request.path_params.get("tenant") or request.query_params.get("tenant") or None
    data = await run_in_threadpool(_list_keys, gw, tenant)
    return JSONResponse({"object": "list", "data": data})


def _create_key(gw: Gateway, tenant_name: str, body: dict[str, Any]) -> dict[str, Any]:
    name = _string(body, "name") if body.get("name") is not None else None
    role = _string(body, "role") if "role" in body else "tenant"
    with transaction(gw.sessions) as session:
        tenant = service.get_tenant_by_name(session, tenant_name)
        row, plaintext = service.create_key(session, tenant.id, role=role, name=name or None)
        return key_json(row, tenant.name) | {"key": plaintext}


async def create_key(request: Request) -> Response:
    """A new key for the tenant; the plaintext ``key`` is in this response only."""
    gw, _ = await admin_principal(request)
    body = await read_json_object(request, gw.config.max_body_bytes, ("name", "role"))
    data = await run_in_threadpool(_create_key, gw, request.path_params["tenant"], body)
    return JSONResponse(data, status_code=201, headers={"Cache-Control": "no-store"})


def _revoke_key(gw: Gateway, caller: Principal, key_id: int) -> dict[str, Any]:
    check_not_own_key(caller, key_id)
    if key_id > MAX_INT32:
        raise NotFoundError(f"no API key with id {key_id}")
    with transaction(gw.sessions) as session:
        row = service.revoke_key(session, key_id)
        return key_json(row, service.get_tenant(session, row.tenant_id).name)


async def revoke_key(request: Request) -> Response:
    gw, caller = await admin_principal(request)
    data = await run_in_threadpool(_revoke_key, gw, caller, request.path_params["key_id"])
    return JSONResponse(data)


def routes() -> list[Route]:
    """The routes of this module, for ``create_app``."""
    return [
        Route("/admin/api/tenants", list_tenants, methods=["GET"]),
        Route("/admin/api/tenants", create_tenant, methods=["POST"]),
        Route("/admin/api/tenants/{tenant}", get_tenant, methods=["GET"]),
        Route("/admin/api/tenants/{tenant}", update_tenant, methods=["PATCH"]),
        Route("/admin/api/tenants/{tenant}/keys", list_keys, methods=["GET"]),
        Route("/admin/api/tenants/{tenant}/keys", create_key, methods=["POST"]),
        Route("/admin/api/keys", list_keys, methods=["GET"]),
        Route("/admin/api/keys/{key_id:int}", revoke_key, methods=["DELETE"]),
    ]
