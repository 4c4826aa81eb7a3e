"""An adapter name's versions over HTTP: show them, promote one, split traffic onto a
canary, cancel the split, pin or unpin one (admin only). Shared by the tenant's routes (its own names) and the admin
routes (any tenant's): the routes parse, these call the registry and shape the answer.

Every change commits in one transaction and answers the name as it now stands; a refusal
(unknown name or version 404, deleted version or no split 409, a version or percent out
of range 400) changes nothing.
"""

from __future__ import annotations

from typing import Any, Final

from starlette.requests import Request

from loraplex.errors import InvalidRequestError
from loraplex.gateway.adapter_uploads import adapter_json
from loraplex.gateway.http import read_json_object
from loraplex.gateway.state import Gateway
from loraplex.registry import pins, service
from loraplex.registry.db import transaction
from loraplex.registry.versions import NameVersions

PROMOTE_FIELDS: Final = ("version",)
SPLIT_FIELDS: Final = ("version", "percent")
PIN_FIELDS: Final = ("version",)


def name_json(state: NameVersions, owner: str) -> dict[str, Any]:
    """A name as the API shows it: its current and latest version, the split in
    progress (or null), and its active versions with their share of the requests."""
    traffic = state.traffic
    split = None
    if traffic.canary_id is not None:
        split = {"version": state.version(traffic.canary_id),
                 "percent": traffic.canary_percent}
    shares = {(state.tenant_id, state.name): traffic}
    return {"object": "adapter.name", "tenant": owner, "name": state.name,
            "model": f"{owner}/{state.name}",
            "current_version": state.version(traffic.current_id),
            "latest_version": state.versions[-1].version, "promoted": traffic.promoted,
            "split": split,
            "versions": [adapter_json(row, owner, shares) for row in state.versions]}


async def read_body(request: Request, gw: Gateway, fields: tuple[str, ...]) -> dict[str, Any]:
    """The JSON body of a promote or split; a missing field is a 400 naming it."""
    body = await read_json_object(request, gw.config.max_body_bytes, fields)
    for name in fields:
        if name not in body:
            raise InvalidRequestError(f"{name} is required", param=name)
    return body


def show(gw: Gateway, tenant_id: int, owner: str, name: str) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        return name_json(service.name_versions(session, tenant_id, name), owner)


def promote(gw: Gateway, tenant_id: int, owner: str, name: str,
            body: dict[str, Any]) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        return name_json(service.promote(session, tenant_id, name, body["version"]), owner)


def split(gw: Gateway, tenant_id: int, owner: str, name: str,
          body: dict[str, Any]) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        state = service.start_split(session, tenant_id, name, body["version"],
                                    body["percent"])
        return name_json(state, owner)


def cancel(gw: Gateway, tenant_id: int, owner: str, name: str) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        return name_json(service.cancel_split(session, tenant_id, name), owner)


def pin(gw: Gateway, tenant_id: int, owner: str, name: str, version: object,
        max_pins: int) -> dict[str, Any]:
    """Pins the version; ConflictError when ``max_pins`` versions are pinned already."""
    with transaction(gw.sessions) as session:
        pins.pin(session, tenant_id, name, version, max_pins)
        return name_json(service.name_versions(session, tenant_id, name), owner)


def unpin(gw: Gateway, tenant_id: int, owner: str, name: str,
          version: object) -> dict[str, Any]:
    with transaction(gw.sessions) as session:
        pins.unpin(session, tenant_id, name, version)
        return name_json(service.name_versions(session, tenant_id, name), owner)
