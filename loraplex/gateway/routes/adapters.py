"""The tenant's own adapters: ``/v1/adapters`` upload, list and delete; a name's versions,
promote, canary split and its cancel.

A tenant sees and deletes only its own adapters; another tenant's is reported as not found
(404), public or not, so names are not revealed.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.gateway import adapter_versions
from loraplex.gateway.adapter_uploads import (
    adapter_service,
    deleted_json,
    storage_json,
    upload_json,
    versions_json,
)
from loraplex.gateway.auth import authenticate
from loraplex.gateway.http import query_flag, query_version
from loraplex.gateway.state import Gateway, gateway
from loraplex.registry import quotas, service
from loraplex.registry.api_keys import Principal
from loraplex.registry.db import transaction


def _own_versions(gw: Gateway, principal: Principal,
                  include_deleted: bool) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        rows = service.list_adapters(session, principal.tenant_id,
                                     include_deleted=include_deleted)
        usage = quotas.storage_usage(session, principal.tenant_id)
        return {"object": "list",
                "data": versions_json(session, rows, lambda _: principal.tenant_name),
                "storage": storage_json(usage)}


async def list_adapters(request: Request) -> Response:
    """Every version of the caller's adapters with its status (deleted ones with
    ``?include_deleted=true``), and under ``storage`` what it stores against its quotas."""
    gw = gateway(request)
    principal = await authenticate(request, gw.sessions)
    return JSONResponse(await run_in_threadpool(_own_versions, gw, principal,
                                                query_flag(request, "include_deleted")))


async def upload_adapter(request: Request) -> Response:
    """A new version of one of the caller's adapters (multipart; see adapter_uploads)."""
    gw = gateway(request)
    principal = await authenticate(request, gw.sessions)
    adapters = adapter_service(request)
    result = await adapters.upload(request, principal.tenant_id)
    outcome = await adapters.probe(result)
    return JSONResponse(upload_json(result, outcome, principal.tenant_name), status_code=201)


async def delete_adapter(request: Request) -> Response:
    """Deletes the caller's adapter (every version, or ``?version=N``)."""
    gw = gateway(request)
    principal = await authenticate(request, gw.sessions)
    version = query_version(request)
    deleted = await adapter_service(request).delete(principal.tenant_id,
                                                    request.path_params["name"], version)
    return JSONResponse(deleted_json(deleted, principal.tenant_name))


async def get_name(request: Request) -> Response:
    """The caller's adapter name: its versions, the current one, the split in progress."""
    gw = gateway(request)
    principal = await authenticate(request, gw.sessions)
    return JSONResponse(await run_in_threadpool(
        adapter_versions.show, gw, principal.tenant_id, principal.tenant_name,
        request.path_params["name"]))


async def promote(request: Request) -> Response:
    """``{"version": N}`` becomes the name's current version (rollback: an older one);
    a split in progress ends."""
    gw = gateway(request)
    principal = await authenticate(request, gw.sessions)
    body = await adapter_versions.read_body(request, gw, adapter_versions.PROMOTE_FIELDS)
    return JSONResponse(await run_in_threadpool(
        adapter_versions.promote, gw, principal.tenant_id, principal.tenant_name,
        request.path_params["name"], body))


async def split(request: Request) -> Response:
    """``{"version": N, "percent": P}``: P percent of the name's requests go to version N."""
    gw = gateway(request)
    principal = await authenticate(request, gw.sessions)
    body = await adapter_versions.read_body(request, gw, adapter_versions.SPLIT_FIELDS)
    return JSONResponse(await run_in_threadpool(
        adapter_versions.split, gw, principal.tenant_id, principal.tenant_name,
        request.path_params["name"], body))


async def cancel_split(request: Request) -> Response:
    """Ends the name's split: every request goes to the current version."""
    gw = gateway(request)
    principal = await authenticate(request, gw.sessions)
    return JSONResponse(await run_in_threadpool(
        adapter_versions.cancel, gw, principal.tenant_id, principal.tenant_name,
        request.path_params["name"]))


def routes() -> list[Route]:
    """The routes of this module, for ``create_app``."""
    return [
        Route("/v1/adapters", list_adapters, methods=["GET"]),
        Route("/v1/adapters", upload_adapter, methods=["POST"]),
        Route("/v1/adapters/{name}", get_name, methods=["GET"]),
        Route("/v1/adapters/{name}", delete_adapter, methods=["DELETE"]),
        Route("/v1/adapters/{name}/promote", promote, methods=["POST"]),
        Route("/v1/adapters/{name}/split", split, methods=["POST"]),
        Route("/v1/adapters/{name}/split", cancel_split, methods=["DELETE"]),
    ]
