"""Tenants' storage quotas: what a tenant keeps in the adapter store, and the check an
upload passes before its row is written.

What counts: every version's ``size_bytes`` (the bytes of its two stored files), per
version, even where the store holds identical content once (what a tenant is charged
never depends on what others uploaded). An active version counts; a deleted one counts
until its bytes are reclaimed (``reclaimed_at``): its stored copy was removed (at deletion
when nothing else needs it, otherwise by the store's sweep), or an active row holds the
same content. ``max_adapter_versions`` counts active versions only: deleting one frees it
at once.

Concurrent uploads of one tenant: ``register_adapter`` checks under a lock on the tenant's
row (``SELECT ... FOR UPDATE`` on PostgreSQL; on SQLite the transaction's first statement
is a write, which takes the database's one writer lock), so two uploads cannot both fit
under what is left.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.errors import QuotaExceededError
from loraplex.registry.models import Adapter, Tenant, utcnow
from loraplex.registry.tenants import get_tenant


@dataclass(frozen=True)
class StorageUsage:
    """A tenant's stored bytes and active versions, and its quotas (``None``: unlimited)."""

    tenant_id: int
    num_bytes: int
    num_versions: int
    max_storage_bytes: int | None
    max_adapter_versions: int | None

    @property
    def bytes_left(self) -> int | None:
        """Bytes the tenant may still store (0 when at or over its quota); None: no quota."""
        if self.max_storage_bytes is None:
            return None
        return max(0, self.max_storage_bytes - self.num_bytes)

    @property
    def versions_left(self) -> int | None:
        if self.max_adapter_versions is None:
            return None
        return max(0, self.max_adapter_versions - self.num_versions)

    def check_version(self) -> None:
        """QuotaExceededError unless one more version fits."""
        if self.versions_left == 0:
            assert self.max_adapter_versions is not None
            raise QuotaExceededError(
                f"adapter version quota exceeded: the tenant has {self.num_versions} active "
                f"adapter versions and its quota is {self.max_adapter_versions} "
                "(max_adapter_versions); delete a version first",
                "max_adapter_versions", self.max_adapter_versions)

    def check_bytes(self, size_bytes: int | None = None, *, at_least: bool = False) -> None:
        """QuotaExceededError unless ``size_bytes`` more fit (None: unless any byte does;
        ``at_least``: the upload is still arriving, and is that large so far)."""
        left = self.bytes_left
        if left is None or (size_bytes is not None and size_bytes <= left) \
                or (size_bytes is None and left > 0):
            return
        assert self.max_storage_bytes is not None
        what = "" if size_bytes is None else \
            f" of {'more than ' if at_least else ''}{size_bytes} bytes"
        raise QuotaExceededError(
            f"storage quota exceeded: the upload{what} does not fit in the {left} bytes left "
            f"of the tenant's quota of {self.max_storage_bytes} bytes (max_storage_bytes; "
            f"{self.num_bytes} bytes stored); delete adapter versions to free space",
            "max_storage_bytes", self.max_storage_bytes)

    def check(self, size_bytes: int | None = None) -> None:
        """Both quotas for one more version of ``size_bytes`` (None: of unknown size)."""
        self.check_version()
        self.check_bytes(size_bytes)


def _counted() -> sa.ColumnElement[bool]:
    # Active, or deleted with its bytes not reclaimed yet.
    return sa.or_(Adapter.status == "active", Adapter.reclaimed_at.is_(None))


def _totals(session: Session, tenant_ids: Collection[int] | None,
            ) -> dict[int, tuple[int, int]]:
    stmt = (sa.select(Adapter.tenant_id,
                      sa.func.coalesce(sa.func.sum(Adapter.size_bytes), 0),
                      sa.func.count().filter(Adapter.status == "active"))
            .where(_counted()).group_by(Adapter.tenant_id))
    if tenant_ids is not None:
        stmt = stmt.where(Adapter.tenant_id.in_(list(tenant_ids)))
    return {tid: (int(num_bytes), int(num)) for tid, num_bytes, num in session.execute(stmt)}


def usage_of(tenant: Tenant, totals: dict[int, tuple[int, int]]) -> StorageUsage:
    num_bytes, num_versions = totals.get(tenant.id, (0, 0))
    return StorageUsage(tenant_id=tenant.id, num_bytes=num_bytes, num_versions=num_versions,
                        max_storage_bytes=tenant.max_storage_bytes,
                        max_adapter_versions=tenant.max_adapter_versions)


def lock_tenant(session: Session, tenant_id: int) -> Tenant:
    """The tenant, locked until the transaction ends against another upload of its own.

    Call it first in the transaction: on SQLite the no-op write then waits for the writer
    lock (``busy_timeout``) instead of failing on a snapshot an earlier read took.
    """
    if session.get_bind().dialect.name == "sqlite":
        session.execute(sa.text("UPDATE tenants SET id = id WHERE id = :id"),
                        {"id": tenant_id})
    else:
        session.execute(sa.select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    return get_tenant(session, tenant_id)


def storage_usage(session: Session, tenant_id: int, *, lock: bool = False) -> StorageUsage:
    """The tenant's storage and quotas; with ``lock``, under ``lock_tenant`` (to check and
    insert in one transaction). NotFoundError if there is no such tenant."""
    tenant = lock_tenant(session, tenant_id) if lock else get_tenant(session, tenant_id)
    return usage_of(tenant, _totals(session, [tenant_id]))


def storage_by_tenant(session: Session, tenant_ids: Collection[int] | None = None,
                      ) -> dict[int, tuple[int, int]]:
    """tenant id -> (stored bytes, active versions), for tenants (of ``tenant_ids``, or
    all) that have any."""
    return _totals(session, tenant_ids)


def unreclaimed_digests(session: Session, digests: Collection[str] | None = None,
                        ) -> list[str]:
    """Digests of deleted versions whose bytes still count (of ``digests``, or all)."""
    stmt = (sa.select(Adapter.digest).distinct()
            .where(Adapter.status == "deleted", Adapter.reclaimed_at.is_(None)))
    if digests is not None:
        stmt = stmt.where(Adapter.digest.in_(list(digests)))
    return sorted(session.scalars(stmt))


def mark_reclaimed(session: Session, digest: str) -> int:
    """Deleted versions of ``digest`` stop counting; how many rows that was."""
    result = session.execute(
        sa.update(Adapter)
        .where(Adapter.digest == digest, Adapter.status == "deleted",
               Adapter.reclaimed_at.is_(None))
        .values(reclaimed_at=utcnow())
        .execution_options(synchronize_session=False))
    return int(getattr(result, "rowcount", 0) or 0)
