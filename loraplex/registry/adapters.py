"""Adapter use cases: versions, visibility, and resolving a ``model`` name for a tenant.

A request names an adapter as ``name`` (the caller's own) or ``owner/name`` (another
tenant's public one, or the caller's own spelled in full). Either resolves to the latest
active version; its identity ``id@digest`` is what caches key on.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session, contains_eager

from loraplex.errors import AdapterNotFoundError, ConflictError, InvalidRequestError
from loraplex.registry.models import VISIBILITIES, Adapter, Tenant
from loraplex.registry.names import check_adapter_name, is_adapter_name, is_tenant_name
from loraplex.registry.quotas import storage_usage


def _check_visibility(visibility: str) -> str:
    if visibility not in VISIBILITIES:
        raise InvalidRequestError(f"visibility must be one of {', '.join(VISIBILITIES)}, "
                                  f"got {visibility!r}", param="visibility")
    return visibility


def register_adapter(
    session: Session,
    *,
    tenant_id: int,
    name: str,
    digest: str,
    size_bytes: int,
    storage_path: str,
    base_model: str,
    rank: int,
    alpha: float,
    use_rslora: bool,
    target_modules: Sequence[str],
    visibility: str = "private",
) -> Adapter:
    """Records a new version of the tenant's adapter ``name`` (max existing version + 1,
    deleted versions included, so a version number is never reused).

    Call it after the files are in the store, and commit after that. ConflictError if a
    concurrent upload took the same version: retry. QuotaExceededError if the version
    would take the tenant past a storage quota: checked under a lock on the tenant, so
    concurrent uploads cannot both fit in what is left (``registry.quotas``).
    """
    check_adapter_name(name)
    _check_visibility(visibility)
    if rank < 1:
        raise InvalidRequestError(f"rank must be >= 1, got {rank}", param="rank")
    # First statement of the transaction: the lock must come before any read (SQLite).
    storage_usage(session, tenant_id, lock=True).check(size_bytes)
    latest = session.scalar(
        sa.select(sa.func.max(Adapter.version))
        .where(Adapter.tenant_id == tenant_id, Adapter.name == name))
    adapter = Adapter(
        tenant_id=tenant_id, name=name, version=(latest or 0) + 1, base_model=base_model,
        rank=rank, alpha=float(alpha), use_rslora=use_rslora,
        target_modules=sorted(target_modules), digest=digest, size_bytes=size_bytes,
        storage_path=storage_path, visibility=visibility, status="active",
    )
    session.add(adapter)
    try:
        session.flush()
    except sa.exc.IntegrityError as exc:
        raise ConflictError(f"adapter {name!r} was uploaded concurrently; retry") from exc
    return adapter


def get_adapter(session: Session, adapter_id: int) -> Adapter:
    """The adapter version with that id (any status); AdapterNotFoundError if none."""
    adapter = session.get(Adapter, adapter_id)
    if adapter is None:
        raise AdapterNotFoundError(f"no adapter with id {adapter_id}")
    return adapter


def resolve_adapter(session: Session, tenant_id: int, model_name: str) -> Adapter:
    """The adapter version that ``model_name`` means for the calling tenant.

    ``name`` is the caller's own adapter; ``owner/name`` is the owner's latest active
    version, visible if the caller is the owner, or if that version is public and the
    owner is active. Anything else raises AdapterNotFoundError with the same message, so a
    private adapter's existence is not revealed.
    """
    not_found = AdapterNotFoundError(f"the model {model_name!r} does not exist or you do not "
                                     "have access to it")
    owner_name, sep, name = model_name.rpartition("/")
    # A name no tenant or adapter can have is not looked up (nor sent to the database).
    if not is_adapter_name(name) or (sep and not is_tenant_name(owner_name)):
        raise not_found
    # One statement whatever exists: a missing owner, a missing adapter and a private one
    # cost the same queries, so the answer's timing does not tell them apart.
    owner = Tenant.name == owner_name if sep else Tenant.id == tenant_id
    adapter = session.scalar(
        sa.select(Adapter).join(Adapter.tenant).options(contains_eager(Adapter.tenant))
        .where(owner, Adapter.name == name, Adapter.status == "active")
        .order_by(Adapter.version.desc()).limit(1)
        # A long-lived session must still see a deletion or visibility change made elsewhere.
        .execution_options(populate_existing=True))
    if adapter is None or not (adapter.tenant_id == tenant_id or (
            adapter.visibility == "public" and adapter.tenant.status == "active")):
        raise not_found
    return adapter


def list_visible_adapters(
    session: Session, tenant_id: int, *, latest_only: bool = True
) -> list[Adapter]:
    """Active adapters the tenant can call: its own, and other active tenants' public ones.

    With ``latest_only`` (the default), one row per name: the version a bare name or
    ``owner/name`` resolves to, listed only if that version is visible. Rows come with
    ``tenant`` loaded, ordered by owner name, adapter name, version.
    """
    visible = sa.or_(Adapter.tenant_id == tenant_id,
                     sa.and_(Adapter.visibility == "public", Tenant.status == "active"))
    stmt = (sa.select(Adapter).join(Adapter.tenant).options(contains_eager(Adapter.tenant))
            .where(Adapter.status == "active", visible)
            .order_by(Tenant.name, Adapter.name, Adapter.version))
    if latest_only:
        latest = (sa.select(Adapter.tenant_id, Adapter.name,
                            sa.func.max(Adapter.version).label("version"))
                  .where(Adapter.status == "active")
                  .group_by(Adapter.tenant_id, Adapter.name).subquery())
        stmt = stmt.join(latest, sa.and_(Adapter.tenant_id == latest.c.tenant_id,
                                         Adapter.name == latest.c.name,
                                         Adapter.version == latest.c.version))
    return list(session.scalars(stmt))


def list_adapters(
    session: Session, tenant_id: int | None = None, *, include_deleted: bool = False
) -> list[Adapter]:
    """Every version of every adapter (of one tenant, or all): the operator's view."""
    stmt = (sa.select(Adapter).join(Adapter.tenant).options(contains_eager(Adapter.tenant))
            .order_by(Tenant.name, Adapter.name, Adapter.version))
    if tenant_id is not None:
        stmt = stmt.where(Adapter.tenant_id == tenant_id)
    if not include_deleted:
        stmt = stmt.where(Adapter.status == "active")
    return list(session.scalars(stmt))


def shadowed_names(session: Session, model_names: Sequence[str]) -> list[str]:
    """``owner/name`` of every active adapter named like one of ``model_names`` (any
    case): requests naming it reach the base model, so it can never be called."""
    names = sorted({n.casefold() for n in model_names if n})
    if not names:
        return []
    stmt = (sa.select(Tenant.name, Adapter.name).join(Adapter.tenant)
            .where(Adapter.status == "active", sa.func.lower(Adapter.name).in_(names))
            .distinct().order_by(Tenant.name, Adapter.name))
    return [f"{owner}/{name}" for owner, name in session.execute(stmt)]


def _own_versions(session: Session, tenant_id: int, name: str,
                  version: int | None) -> list[Adapter]:
    which = name if version is None else f"{name} version {version}"
    if not is_adapter_name(name):  # none can exist: nothing to look up
        raise AdapterNotFoundError(f"no active adapter {which}")
    stmt = sa.select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name,
                                    Adapter.status == "active")
    if version is not None:
        stmt = stmt.where(Adapter.version == version)
    rows = list(session.scalars(stmt.order_by(Adapter.version)))
    if not rows:
        raise AdapterNotFoundError(f"no active adapter {which}")
    return rows


def delete_adapter(
    session: Session, tenant_id: int, name: str, *, version: int | None = None
) -> list[Adapter]:
    """Marks the tenant's adapter deleted: every version, or just ``version``.

    Rows stay (usage refers to them, and version numbers are never reused); files stay in
    the store until no active row needs them (see ``is_digest_referenced``).
    """
    rows = _own_versions(session, tenant_id, name, version)
    for row in rows:
        row.status = "deleted"
    session.flush()
    return rows


def set_visibility(session: Session, tenant_id: int, name: str, visibility: str) -> list[Adapter]:
    """Makes every active version of the tenant's adapter ``public`` or ``private``."""
    _check_visibility(visibility)
    rows = _own_versions(session, tenant_id, name, None)
    for row in rows:
        row.visibility = visibility
    session.flush()
    return rows


def is_digest_referenced(session: Session, digest: str) -> bool:
    """Whether an active adapter row still needs the stored files of ``digest``."""
    return session.scalar(
        sa.select(sa.exists().where(Adapter.digest == digest, Adapter.status == "active"))
    ) is True
