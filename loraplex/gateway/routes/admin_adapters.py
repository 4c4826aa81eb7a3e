"""Admin routes for any tenant's adapters: list versions, upload, visibility, delete; a
name's versions, promote, canary split and its cancel, pin and unpin."""

from __future__ import annotations

import logging
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.errors import InvalidRequestError
from loraplex.gateway import adapter_versions
from loraplex.gateway.adapter_uploads import (
    adapter_json,
    adapter_service,
    deleted_json,
    upload_json,
    versions_json,
)
from loraplex.gateway.auth import admin_principal
from loraplex.gateway.http import query_flag, query_version, read_json_object
from loraplex.gateway.state import Gateway
from loraplex.registry import service
from loraplex.registry.db import transaction

logger = logging.getLogger(__name__)


def list_versions(gw: Gateway, tenant: str | None, include_deleted: bool,
                  ) -> list[dict[str, Any]]:
    """Every version of the adapters of one tenant (by name) or of all tenants."""
    with transaction(gw.sessions) as session:
        tenant_id = None if tenant is None else service.get_tenant_by_name(session, tenant).id
        rows = service.list_adapters(session, tenant_id, include_deleted=include_deleted)
        return versions_json(session, rows, lambda row: row.tenant.name)


async def list_adapters(request: Request) -> Response:
    """``/admin/api/adapters[?tenant=&include_deleted=true]`` or per tenant."""
    gw, _ = await admin_principal(request)
    tenant = request.path_params.get("tenant") or request.query_params.get("tenant") or None
    data = await run_in_threadpool(list_versions, gw, tenant,
                                   query_flag(request, "include_deleted"))
    return JSONResponse({"object": "list", "data": data})


def _tenant_id(gw: Gateway, name: str) -> int:
    with transaction(gw.sessions) as session:
        return service.get_tenant_by_name(session, name).id


async def upload_adapter(request: Request) -> Response:
    """A new version of the tenant's adapter from a multipart upload (see adapter_uploads)."""
    gw, _ = await admin_principal(request)
    tenant = request.path_params["tenant"]
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    adapters = adapter_service(request)
    result = await adapters.upload(request, tenant_id)
    outcome = await adapters.probe(result)
    return JSONResponse(upload_json(result, outcome, tenant), status_code=201)


def _set_visibility(gw: Gateway, tenant: str, name: str, visibility: Any,
                    ) -> list[dict[str, Any]]:
    if not isinstance(visibility, str):
        raise InvalidRequestError("visibility must be 'private' or 'public'", param="visibility")
    with transaction(gw.sessions) as session:
        owner = service.get_tenant_by_name(session, tenant)
        rows = service.set_visibility(session, owner.id, name, visibility)
        return [adapter_json(row, owner.name) for row in rows]


async def update_adapter(request: Request) -> Response:
    """``{"visibility": "public"|"private"}`` for every active version of the adapter."""
    gw, _ = await admin_principal(request)
    body = await read_json_object(request, gw.config.max_body_bytes, ("visibility",))
    data = await run_in_threadpool(_set_visibility, gw, request.path_params["tenant"],
                                   request.path_params["name"], body.get("visibility"))
    return JSONResponse({"object": "list", "data": data})


async def delete_adapter(request: Request) -> Response:
    """Deletes every version (or ``?version=N``); new requests for it get 404 at once."""
    gw, _ = await admin_principal(request)
    tenant = request.path_params["tenant"]
    version = query_version(request)
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    deleted = await adapter_service(request).delete(tenant_id, request.path_params["name"],
                                                    version)
    return JSONResponse(deleted_json(deleted, tenant))


async def get_name(request: Request) -> Response:
    """A tenant's adapter name: its versions, the current one, the split in progress."""
    gw, _ = await admin_principal(request)
    tenant = request.path_params["tenant"]
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    return JSONResponse(await run_in_threadpool(adapter_versions.show, gw, tenant_id, tenant,
                                                request.path_params["name"]))


async def promote(request: Request) -> Response:
    """``{"version": N}`` becomes the name's current version; a split in progress ends."""
    gw, _ = await admin_principal(request)
    body = await adapter_versions.read_body(request, gw, adapter_versions.PROMOTE_FIELDS)
    tenant = request.path_params["tenant"]
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    return JSONResponse(await run_in_threadpool(adapter_versions.promote, gw, tenant_id,
                                                tenant, request.path_params["name"], body))


async def split(request: Request) -> Response:
    """``{"version": N, "percent": P}``: P percent of the name's requests go to version N."""
    gw, _ = await admin_principal(request)
    body = await adapter_versions.read_body(request, gw, adapter_versions.SPLIT_FIELDS)
    tenant = request.path_params["tenant"]
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    return JSONResponse(await run_in_threadpool(adapter_versions.split, gw, tenant_id,
                                                tenant, request.path_params["name"], body))


async def cancel_split(request: Request) -> Response:
    """Ends the name's split: every request goes to the current version."""
    gw, _ = await admin_principal(request)
    tenant = request.path_params["tenant"]
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    return JSONResponse(await run_in_threadpool(adapter_versions.cancel, gw, tenant_id,
                                                tenant, request.path_params["name"]))


async def _apply_pins(gw: Gateway) -> None:
    # The pin is committed whatever happens here: a failure to apply it now is retried by
    # the next round of the gateway's pin sync.
    try:
        await gw.pins.sync()
    except Exception as exc:
        logger.warning("cannot apply the pinned adapters now: %s", exc)


async def pin(request: Request) -> Response:
    """``{"version": N}`` keeps that version in a device slot and the host cache on every
    replica; 409 past the server's share of slots for pins."""
    gw, _ = await admin_principal(request)
    body = await adapter_versions.read_body(request, gw, adapter_versions.PIN_FIELDS)
    tenant = request.path_params["tenant"]
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    data = await run_in_threadpool(adapter_versions.pin, gw, tenant_id, tenant,
                                   request.path_params["name"], body["version"],
                                   gw.backend.description.max_pinned)
    await _apply_pins(gw)
    return JSONResponse(data)


async def unpin(request: Request) -> Response:
    """``?version=N``: that version is no longer pinned (its slot joins the working set)."""
    gw, _ = await admin_principal(request)
    version = query_version(request)
    if version is None:
        raise InvalidRequestError("version is required (?version=N)", param="version")
    tenant = request.path_params["tenant"]
    tenant_id = await run_in_threadpool(_tenant_id, gw, tenant)
    data = await run_in_threadpool(adapter_versions.unpin, gw, tenant_id, tenant,
                                   request.path_params["name"], version)
    await _apply_pins(gw)
    return JSONResponse(data)


def routes() -> list[Route]:
    """The routes of this module, for ``create_app``."""
    name = "/admin/api/tenants/{tenant}/adapters/{name}"
    return [
        Route(name, get_name, methods=["GET"]),
        Route(f"{name}/promote", promote, methods=["POST"]),
        Route(f"{name}/split", split, methods=["POST"]),
        Route(f"{name}/split", cancel_split, methods=["DELETE"]),
        Route(f"{name}/pin", pin, methods=["POST"]),
        Route(f"{name}/pin", unpin, methods=["DELETE"]),
        Route("/admin/api/adapters", list_adapters, methods=["GET"]),
        Route("/admin/api/tenants/{tenant}/adapters", list_adapters, methods=["GET"]),
        Route("/admin/api/tenants/{tenant}/adapters", upload_adapter, methods=["POST"]),
        Route("/admin/api/tenants/{tenant}/adapters/{name}", update_adapter,
              methods=["PATCH"]),
        Route("/admin/api/tenants/{tenant}/adapters/{name}", delete_adapter,
              methods=["DELETE"]),
    ]
