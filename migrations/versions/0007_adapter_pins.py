"""Adapters pinned by the operator.

``adapters.pinned_at``: when an operator pinned that version (it then keeps a device slot
and its host copy on every engine replica, within the engine's share for pins), NULL when
not pinned (every existing row). A deleted version's pin no longer applies.

Revision ID: 0007
Revises: 0006
Create Date: 2027-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("pinned_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("pinned_at")
