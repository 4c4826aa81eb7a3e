"""Addressable versions: each adapter name's current version and canary split.

``adapter_routes`` holds, per tenant and adapter name, the version a bare name reaches
(``current_id``, set by a promote; NULL: the latest active version) and a canary split
(``canary_id`` gets ``canary_percent`` of the name's requests). Existing databases get no
rows: every name keeps reaching its latest active version, as before this revision.

The bounds are written out here so this revision stays what it was.

Revision ID: 0006
Revises: 0005
Create Date: 2027-01-18
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_routes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("current_id", sa.Integer(), nullable=True),
        sa.Column("canary_id", sa.Integer(), nullable=True),
        sa.Column("canary_percent", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_adapter_routes"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_adapter_routes_tenant_id_tenants"),
        sa.ForeignKeyConstraint(["current_id"], ["adapters.id"],
                                name="fk_adapter_routes_current_id_adapters"),
        sa.ForeignKeyConstraint(["canary_id"], ["adapters.id"],
                                name="fk_adapter_routes_canary_id_adapters"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_adapter_routes_tenant_id_name"),
        sa.CheckConstraint("canary_percent IS NULL OR "
                           "(canary_percent >= 0 AND canary_percent <= 100)",
                           name="ck_adapter_routes_canary_percent"),
        sa.CheckConstraint("(canary_id IS NULL AND canary_percent IS NULL) OR "
                           "(canary_id IS NOT NULL AND canary_percent IS NOT NULL)",
                           name="ck_adapter_routes_canary"),
    )


def downgrade() -> None:
    op.drop_table("adapter_routes")
