"""Initial registry schema: tenants, API keys, adapters, hourly usage.

Revision ID: 0001
Revises:
Create Date: 2025-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("max_requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_concurrent_requests", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.CheckConstraint("status IN ('active', 'suspended')", name="ck_tenants_status"),
        sa.CheckConstraint("max_requests_per_minute IS NULL OR max_requests_per_minute > 0",
                           name="ck_tenants_max_requests_per_minute"),
        sa.CheckConstraint("max_tokens_per_minute IS NULL OR max_tokens_per_minute > 0",
                           name="ck_tenants_max_tokens_per_minute"),
        sa.CheckConstraint("max_concurrent_requests IS NULL OR max_concurrent_requests > 0",
                           name="ck_tenants_max_concurrent_requests"),
    )

    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("name", sa.String(128), nullable=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_api_keys_tenant_id_tenants"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
        sa.CheckConstraint("role IN ('tenant', 'admin')", name="ck_api_keys_role"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])

    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("use_rslora", sa.Boolean(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("storage_path", sa.String(512), nullable=False),
        sa.Column("visibility", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_adapters_tenant_id_tenants"),
        sa.UniqueConstraint("tenant_id", "name", "version",
                            name="uq_adapters_tenant_id_name_version"),
        sa.CheckConstraint("status IN ('active', 'deleted')", name="ck_adapters_status"),
        sa.CheckConstraint("visibility IN ('private', 'public')",
                           name="ck_adapters_visibility"),
        sa.CheckConstraint("version >= 1", name="ck_adapters_version"),
        sa.CheckConstraint("rank >= 1", name="ck_adapters_rank"),
    )
    op.create_index("ix_adapters_visibility_status", "adapters", ["visibility", "status"])
    op.create_index("ix_adapters_digest", "adapters", ["digest"])

    op.create_table(
        "usage",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=True),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_usage"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_usage_tenant_id_tenants"),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapters.id"],
                                name="fk_usage_adapter_id_adapters"),
        sa.CheckConstraint("requests >= 0 AND prompt_tokens >= 0 AND completion_tokens >= 0",
                           name="ck_usage_non_negative"),
    )
    # adapter_id is NULL for base-model requests; coalesce makes those rows unique too.
    op.create_index("uq_usage_tenant_adapter_hour", "usage",
                    ["tenant_id", sa.text("coalesce(adapter_id, 0)"), "hour"], unique=True)
    op.create_index("ix_usage_tenant_id_hour", "usage", ["tenant_id", "hour"])


def downgrade() -> None:
    op.drop_index("ix_usage_tenant_id_hour", table_name="usage")
    op.drop_index("uq_usage_tenant_adapter_hour", table_name="usage")
    op.drop_table("usage")
    op.drop_index("ix_adapters_digest", table_name="adapters")
    op.drop_index("ix_adapters_visibility_status", table_name="adapters")
    op.drop_table("adapters")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
