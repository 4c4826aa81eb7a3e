"""Tenants' scheduling settings: weight, priority class, KV cap and SLOs.

The engine shares a busy server between tenants by weight within a priority class
(interactive before batch), may cap the KV blocks one tenant's running requests hold, and
judges goodput against per-tenant SLOs. Existing tenants get weight 1.0 and class
'interactive' from the server defaults (what every tenant had before: an equal share); the
cap and SLOs are NULL, meaning the server's defaults apply. CHECK constraints hold the
same bounds the service layer checks, so a raw write cannot store a weight of 0 or NaN.

Batch mode, as ``env.py`` configures it, so SQLite rebuilds the table to add the
constraints; the bounds are written out here rather than imported, so this revision stays
what it was when the models' constants move on.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-20
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Full names, marked final with op.f: Alembic would otherwise apply the models' naming
# convention to them again (0001's were stored that way, as ck_tenants_ck_tenants_status).
_CHECKS = (
    ("ck_tenants_weight", "weight > 0 AND weight <= 1000"),
    ("ck_tenants_priority_class", "priority_class IN ('interactive', 'batch')"),
    ("ck_tenants_max_kv_fraction",
     "max_kv_fraction IS NULL OR (max_kv_fraction > 0 AND max_kv_fraction <= 1)"),
    ("ck_tenants_slo_ttft_ms",
     "slo_ttft_ms IS NULL OR (slo_ttft_ms >= 1 AND slo_ttft_ms <= 3600000)"),
    ("ck_tenants_slo_tpot_ms",
     "slo_tpot_ms IS NULL OR (slo_tpot_ms >= 1 AND slo_tpot_ms <= 3600000)"),
)
_COLUMNS = ("weight", "priority_class", "max_kv_fraction", "slo_ttft_ms", "slo_tpot_ms")


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), nullable=False,
                                   server_default=sa.text("1.0")))
        batch.add_column(sa.Column("priority_class", sa.String(16), nullable=False,
                                   server_default="interactive"))
        batch.add_column(sa.Column("max_kv_fraction", sa.Float(), nullable=True))
        batch.add_column(sa.Column("slo_ttft_ms", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("slo_tpot_ms", sa.Integer(), nullable=True))
        for name, condition in _CHECKS:
            batch.create_check_constraint(op.f(name), condition)


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        for name, _ in reversed(_CHECKS):
            batch.drop_constraint(op.f(name), type_="check")
        for column in reversed(_COLUMNS):
            batch.drop_column(column)
