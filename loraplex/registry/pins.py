"""Adapter versions pinned by the operator.

A pinned version keeps a device slot and its host copy on every engine replica, so its
requests never wait for a load. Pins take at most the engine's share of the slots
(``LoRAConfig.max_pinned``): a server refuses a pin past it (``max_pins``), and applies
pins oldest first, so one recorded without a server (the CLI) beyond the share waits
until an older pin goes. A deleted version's pin no longer applies.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.errors import ConflictError
from loraplex.registry.models import Adapter, utcnow
from loraplex.registry.versions import active_version, check_version, name_versions


def pinned_adapters(session: Session) -> list[Adapter]:
    """Every active pinned version, oldest pin first (the order a server applies them)."""
    return list(session.scalars(
        sa.select(Adapter).where(Adapter.pinned_at.is_not(None), Adapter.status == "active")
        .order_by(Adapter.pinned_at, Adapter.id)))


def pin(session: Session, tenant_id: int, name: str, version: object,
        max_pins: int | None = None) -> Adapter:
    """Pins version ``version`` of the tenant's adapter ``name`` (already pinned: no
    change). ``max_pins``: the serving engine's share of slots for pins; ConflictError when
    that many versions are pinned already. The errors of ``versions.promote`` for an
    unknown or deleted version or a bad number."""
    number = check_version(version)
    row = active_version(session, name_versions(session, tenant_id, name), number, "pin")
    if row.pinned_at is not None:
        return row
    if max_pins is not None:
        others = pinned_adapters(session)
        if len(others) >= max_pins:
            held = ", ".join(f"{a.tenant.name}/{a.name}@{a.version}" for a in others)
            raise ConflictError(
                f"cannot pin adapter {name} version {number}: this server holds at most "
                f"{max_pins} pinned version{'s' if max_pins != 1 else ''} (its "
                "--max-pinned-fraction of the adapter slots)"
                + (f"; pinned now: {held}; unpin one first" if others else ""))
    row.pinned_at = utcnow()
    session.flush()
    return row


def unpin(session: Session, tenant_id: int, name: str, version: object) -> Adapter:
    """Unpins version ``version`` of the tenant's adapter ``name`` (not pinned: no change);
    the errors of ``pin``."""
    number = check_version(version)
    row = active_version(session, name_versions(session, tenant_id, name), number, "unpin")
    row.pinned_at = None
    session.flush()
    return row
