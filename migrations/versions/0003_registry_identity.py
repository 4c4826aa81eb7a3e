"""The registry's identity: one row with a random id, so its adapter store can name it.

A store shared by two registries (a SQLite home and a PostgreSQL server on the same
``LORAPLEX_HOME``) had each one's sweep delete the other's folders as orphans. The store
now records the id of the registry that owns it (``registry.ownership``); this revision
gives every registry that id. Downgrade drops it (a store's record then names a registry
that no longer says who it is, and nothing writes there until it is claimed again).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "registry_identity",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("registry_id", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_registry_identity"),
        sa.CheckConstraint("id = 1", name="ck_registry_identity_single_row"),
    )
    # SQLite keeps no offset: the UTC time without one, as the models' UTCDateTime writes.
    now = datetime.now(UTC)
    if op.get_bind().dialect.name == "sqlite":
        now = now.replace(tzinfo=None)
    op.bulk_insert(table, [{"id": 1, "registry_id": uuid.uuid4().hex, "created_at": now}])


def downgrade() -> None:
    op.drop_table("registry_identity")
