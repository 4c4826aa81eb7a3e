"""What a request's ``model`` field names for its caller: the base model or an adapter
version the caller may see."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from loraplex.engine.request import AdapterRef
from loraplex.gateway.state import Gateway
from loraplex.registry import service
from loraplex.registry.api_keys import Principal
from loraplex.registry.db import transaction

BASE_LABEL: Final = "base"


@dataclass(frozen=True)
class ResolvedModel:
    """What a ``model`` field resolved to for the caller."""

    model: str  # as the caller spelled it, echoed in responses
    label: str  # bounded metrics label: "base" or owner/name
    adapter_id: int | None = None
    ref: AdapterRef | None = None


def _resolve(gw: Gateway, factory: sessionmaker[Session], tenant_id: int, model: str) -> ResolvedModel:
    with transaction(factory) as session:
        row = service.resolve_adapter(session, tenant_id, model)
        owner = row.tenant.name
        folder = gw.store.resolve(row.storage_path)
        # The id names the version, the digest the bytes: caches key on both.
        ref = AdapterRef(adapter_id=str(row.id), digest=row.digest, path=str(folder))
        return ResolvedModel(model, f"{owner}/{row.name}", row.id, ref)


async def resolve_model(gw: Gateway, principal: Principal, model: str) -> ResolvedModel:
    """The base model or the adapter ``model`` names; AdapterNotFoundError (404) when the
    caller may not see it, whether or not it exists."""
    if model == gw.served_model_name:
        return ResolvedModel(model, BASE_LABEL)
    return await run_in_threadpool(_resolve, gw, gw.sessions, principal.tenant_id, model)
