"""An adapter version's measured effect.

``adapters.effect_kl``: the mean KL divergence (nats) of the next-token distribution with
the adapter from the base model's, over the gateway's fixed probe prompts;
``adapters.effect_changed``: the fraction of those prompts whose greedy continuation the
adapter changed; ``adapters.effect_measured_at``: when. NULL while not measured (every
existing row, a probe still running, or one that failed).

Revision ID: 0008
Revises: 0007
Create Date: 2027-02-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("effect_kl", sa.Float, nullable=True))
        batch.add_column(sa.Column("effect_changed", sa.Float, nullable=True))
        batch.add_column(sa.Column("effect_measured_at", sa.DateTime(timezone=True),
                                   nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("effect_measured_at")
        batch.drop_column("effect_changed")
        batch.drop_column("effect_kl")
