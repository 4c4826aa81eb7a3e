"""Adapter use cases: versions, visibility, and resolving a ``model`` name for a tenant.

A request names an adapter as ``name`` (the caller's own) or ``owner/name`` (another
tenant's public one, or the caller's own spelled in full), either with ``@N`` for version
N. A name resolves to its current version (``registry.versions``: the latest active one
unless a promote chose another); its identity ``id@digest`` is what caches key on.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session, contains_eager

from loraplex.errors import AdapterNotFoundError, ConflictError, InvalidRequestError
from loraplex.registry.models import VISIBILITIES, Adapter, Tenant, utcnow
from loraplex.registry.names import check_adapter_name, is_adapter_name
from loraplex.registry.quotas import storage_usage
from loraplex.registry.versions import after_delete, list_current_versions, resolve_versions


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


def record_effect(session: Session, adapter_id: int, kl: float, changed: float) -> None:
    """Stores the version's measured effect (gateway/adapter_effect.py), measured now; a
    version deleted since (its row stays) is updated all the same."""
    adapter = get_adapter(session, adapter_id)
    adapter.effect_kl = kl
    adapter.effect_changed = changed
    adapter.effect_measured_at = utcnow()


def resolve_adapter(session: Session, tenant_id: int, model_name: str) -> Adapter:
    """The adapter version that ``model_name`` means for the calling tenant: version N
    for ``[owner/]name@N``, else the name's current version (a split's canary aside: the
    gateway chooses per request, see ``versions.resolve_versions``).

    ``owner/name`` is visible if the caller is the owner, or if that version is public
    and the owner is active. Anything else raises AdapterNotFoundError with the same
    message, so a private adapter's existence is not revealed.
    """
    return resolve_versions(session, tenant_id, model_name).current


def list_visible_adapters(
    session: Session, tenant_id: int, *, current_only: bool = True
) -> list[Adapter]:
    """Active adapters the tenant can call: its own, and other active tenants' public ones.

    With ``current_only`` (the default), one row per name: the version a bare name or
    ``owner/name`` resolves to, listed only if that version is visible; else every
    visible version. Rows come with ``tenant`` loaded, ordered by owner name, adapter
    name, version.
    """
    if current_only:
        return list_current_versions(session, tenant_id)
    visible = sa.or_(Adapter.tenant_id == tenant_id,
                     sa.and_(Adapter.visibility == "public", Tenant.status == "active"))
    stmt = (sa.select(Adapter).join(Adapter.tenant).options(contains_eager(Adapter.tenant))
            .where(Adapter.status == "active", visible)
            .order_by(Tenant.name, Adapter.name, Adapter.version))
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
    """Marks the tenant's adapter deleted: every version, or just ``version``. A deleted
    current version hands over to the previous active one, a deleted canary ends its
    split (``versions.after_delete``).

    Rows stay (usage refers to them, and version numbers are never reused); files stay in
    the store until no active row needs them (see ``is_digest_referenced``).
    """
    rows = _own_versions(session, tenant_id, name, version)
    for row in rows:
        row.status = "deleted"
    session.flush()
    after_delete(session, tenant_id, name, rows)
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
