"""What a request's ``model`` field names for its caller: the base model or an adapter
version the caller may see (during a canary split, the side this request takes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from loraplex.engine.request import AdapterRef
from loraplex.gateway.splits import choose_version
from loraplex.gateway.state import Gateway
from loraplex.registry import service
from loraplex.registry.api_keys import Principal
from loraplex.registry.db import transaction

BASE_LABEL: Final = "base"
# The adapter version a response came from, so a client can tell a split's sides apart.
VERSION_HEADER: Final = "X-Loraplex-Adapter-Version"


@dataclass(frozen=True)
class ResolvedModel:
    """What a ``model`` field resolved to for the caller."""

    model: str  # as the caller spelled it, echoed in responses
    label: str  # bounded metrics label: "base" or owner/name@version
    adapter_id: int | None = None
    ref: AdapterRef | None = None
    version: int | None = None

    @property
    def headers(self) -> dict[str, str]:
        """Response headers naming the version that served the request."""
        return {} if self.version is None else {VERSION_HEADER: str(self.version)}


def _resolve(gw: Gateway, factory: sessionmaker[Session], tenant_id: int, model: str,
             user: str | None) -> ResolvedModel:
    with transaction(factory) as session:
        row = choose_version(service.resolve_versions(session, tenant_id, model), tenant_id,
                             user)
        owner = row.tenant.name
        folder = gw.store.resolve(row.storage_path)
        # The id names the version, the digest the bytes: caches key on both.
        ref = AdapterRef(adapter_id=str(row.id), digest=row.digest, path=str(folder))
        return ResolvedModel(model, f"{owner}/{row.name}@{row.version}", row.id, ref,
                             row.version)


async def resolve_model(gw: Gateway, principal: Principal, model: str,
                        user: str | None = None) -> ResolvedModel:
    """The base model or the adapter version ``model`` names (``user`` keeps a split's
    side sticky); AdapterNotFoundError (404) when the caller may not see it, whether or
    not it exists, and for an ``@`` form that names no version (saying what one is)."""
    if model == gw.served_model_name:
        return ResolvedModel(model, BASE_LABEL)
    return await run_in_threadpool(_resolve, gw, gw.sessions, principal.tenant_id, model,
                                   user)
