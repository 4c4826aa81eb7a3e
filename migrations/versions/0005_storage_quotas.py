"""Tenants' storage quotas, and when a deleted version's bytes stopped counting.

``tenants.max_storage_bytes`` (bigint) and ``tenants.max_adapter_versions`` (integer) are
NULL for unlimited (every existing tenant), else >= 1, held by CHECK constraints as the
service layer holds them. What a tenant stores is already on its rows
(``adapters.size_bytes``, the bytes of the stored files, recorded since 0001).

``adapters.reclaimed_at`` marks a deleted version whose bytes no longer count against the
quota: its stored copy was removed, or an active row holds the same content. Backfill for
existing deleted rows: reclaimed now where an active row holds the digest, or, when the
adapter store is known (``--adapter-dir``, as for 0002), where its folder is gone. The
rest stay NULL (counted) until the store's sweep, which runs when a server starts, looks.

Batch mode, as ``env.py`` configures it, so SQLite rebuilds the tables to add the
constraints; the bounds are written out here so this revision stays what it was.

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-04
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from alembic import context, op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CHECKS = (
    ("ck_tenants_max_storage_bytes", "max_storage_bytes IS NULL OR max_storage_bytes >= 1"),
    ("ck_tenants_max_adapter_versions",
     "max_adapter_versions IS NULL OR max_adapter_versions >= 1"),
)

adapters = sa.table("adapters", sa.column("id", sa.Integer), sa.column("digest", sa.String),
                    sa.column("status", sa.String),
                    sa.column("reclaimed_at", sa.DateTime(timezone=True)))


def _store_root() -> Path | None:
    configured = (context.config.attributes.get("adapter_dir")
                  or context.get_x_argument(as_dictionary=True).get("adapter_dir")
                  or os.environ.get("LORAPLEX_ADAPTER_DIR"))
    return Path(configured).expanduser().resolve() if configured else None


def _now() -> datetime:
    now = datetime.now(UTC)
    # SQLite keeps no offset: the models' UTCDateTime stores naive UTC there.
    return now.replace(tzinfo=None) if op.get_bind().dialect.name == "sqlite" else now


def _backfill_reclaimed() -> None:
    conn = op.get_bind()
    active = sa.select(adapters.c.digest).where(adapters.c.status == "active")
    conn.execute(adapters.update()
                 .where(adapters.c.status == "deleted", adapters.c.digest.in_(active))
                 .values(reclaimed_at=_now()))
    root = _store_root()
    if root is None:
        return
    pending = conn.execute(sa.select(adapters.c.id, adapters.c.digest).where(
        adapters.c.status == "deleted", adapters.c.reclaimed_at.is_(None))).all()
    gone = [row_id for row_id, digest in pending
            if not (root / digest[:2] / digest).is_dir()]
    if gone:
        conn.execute(adapters.update().where(adapters.c.id.in_(gone))
                     .values(reclaimed_at=_now()))


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("max_storage_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("max_adapter_versions", sa.Integer(), nullable=True))
        for name, condition in _CHECKS:
            batch.create_check_constraint(op.f(name), condition)
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("reclaimed_at", sa.DateTime(timezone=True), nullable=True))
    _backfill_reclaimed()


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("reclaimed_at")
    with op.batch_alter_table("tenants") as batch:
        for name, _ in reversed(_CHECKS):
            batch.drop_constraint(op.f(name), type_="check")
        batch.drop_column("max_adapter_versions")
        batch.drop_column("max_storage_bytes")
