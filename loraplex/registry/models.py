"""SQLAlchemy 2 models of the registry: tenants, API keys, adapters and hourly usage.

Every timestamp is timezone-aware UTC in Python, whatever the backend stores. The schema is
created by the Alembic migrations in ``migrations/``, never by ``metadata.create_all`` in
production; a test compares the two so they cannot drift apart.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

TENANT_STATUSES: Final = ("active", "suspended")
KEY_ROLES: Final = ("tenant", "admin")
ADAPTER_STATUSES: Final = ("active", "deleted")
VISIBILITIES: Final = ("private", "public")
# Interactive work is admitted before batch work; within a class, tenants share by weight.
PRIORITY_CLASSES: Final = ("interactive", "batch")
DEFAULT_PRIORITY_CLASS: Final = "interactive"
DEFAULT_WEIGHT: Final = 1.0
# Bounds of the scheduling settings, mirrored by the CHECK constraints below and in
# migration 0004: a weight past 1000 would starve every other tenant in all but name.
MAX_WEIGHT: Final = 1000
# Below this, service divided by weight outgrows any counter: the scheduler's bound too.
MIN_WEIGHT: Final = 0.01
MAX_SLO_MS: Final = 3_600_000  # one hour
# Storage quotas: bytes fit PostgreSQL's bigint, versions its integer (migration 0005).
MAX_STORAGE_BYTES: Final = 2**63 - 1
MAX_ADAPTER_VERSIONS: Final = 2**31 - 1

# Named constraints: PostgreSQL and SQLite batch migrations both need names to drop them.
NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always aware UTC in Python.

    SQLite keeps no offset, PostgreSQL's ``timestamptz`` does; normalising on the way in and
    out makes both backends return the same values and compare equal in upserts.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; attach a timezone")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base of every registry table."""

    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Tenant(Base):
    """A customer of the platform. Limits of ``None`` mean unlimited; scheduling settings of
    ``None`` (KV fraction, SLOs) mean the server's default applies."""

    __tablename__ = "tenants"
    __table_args__ = (
        sa.UniqueConstraint("name"),
        sa.CheckConstraint(_in("status", TENANT_STATUSES), name="status"),
        sa.CheckConstraint("max_requests_per_minute IS NULL OR max_requests_per_minute > 0",
                           name="max_requests_per_minute"),
        sa.CheckConstraint("max_tokens_per_minute IS NULL OR max_tokens_per_minute > 0",
                           name="max_tokens_per_minute"),
        sa.CheckConstraint("max_concurrent_requests IS NULL OR max_concurrent_requests > 0",
                           name="max_concurrent_requests"),
        sa.CheckConstraint(f"weight > 0 AND weight <= {MAX_WEIGHT}", name="weight"),
        sa.CheckConstraint(_in("priority_class", PRIORITY_CLASSES), name="priority_class"),
        sa.CheckConstraint("max_kv_fraction IS NULL OR "
                           "(max_kv_fraction > 0 AND max_kv_fraction <= 1)",
                           name="max_kv_fraction"),
        sa.CheckConstraint(f"slo_ttft_ms IS NULL OR (slo_ttft_ms >= 1 AND "
                           f"slo_ttft_ms <= {MAX_SLO_MS})", name="slo_ttft_ms"),
        sa.CheckConstraint(f"slo_tpot_ms IS NULL OR (slo_tpot_ms >= 1 AND "
                           f"slo_tpot_ms <= {MAX_SLO_MS})", name="slo_tpot_ms"),
        sa.CheckConstraint("max_storage_bytes IS NULL OR max_storage_bytes >= 1",
                           name="max_storage_bytes"),
        sa.CheckConstraint("max_adapter_versions IS NULL OR max_adapter_versions >= 1",
                           name="max_adapter_versions"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64))
    status: Mapped[str] = mapped_column(sa.String(16), default="active")
    max_requests_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    max_tokens_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    max_concurrent_requests: Mapped[int | None] = mapped_column(sa.Integer)
    # Server defaults, so rows written before 0004 (or by raw SQL) get the neutral values.
    weight: Mapped[float] = mapped_column(sa.Float, default=DEFAULT_WEIGHT,
                                          server_default=sa.text("1.0"))
    priority_class: Mapped[str] = mapped_column(sa.String(16), default=DEFAULT_PRIORITY_CLASS,
                                                server_default=DEFAULT_PRIORITY_CLASS)
    max_kv_fraction: Mapped[float | None] = mapped_column(sa.Float)
    slo_ttft_ms: Mapped[int | None] = mapped_column(sa.Integer)
    slo_tpot_ms: Mapped[int | None] = mapped_column(sa.Integer)
    # Storage quotas (``None``: unlimited), enforced at upload (``registry.quotas``).
    max_storage_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    max_adapter_versions: Mapped[int | None] = mapped_column(sa.Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow,
                                                 onupdate=utcnow)

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")
    adapters: Mapped[list[Adapter]] = relationship(back_populates="tenant")

    def __repr__(self) -> str:
        return f"Tenant(id={self.id!r}, name={self.name!r}, status={self.status!r})"


class ApiKey(Base):
    """An API key. Only its sha256 is stored; the plaintext is shown once at creation."""

    __tablename__ = "api_keys"
    __table_args__ = (
        sa.UniqueConstraint("key_hash"),
        sa.CheckConstraint(_in("role", KEY_ROLES), name="role"),
        sa.Index(None, "tenant_id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(sa.ForeignKey("tenants.id"))
    role: Mapped[str] = mapped_column(sa.String(16), default="tenant")
    name: Mapped[str | None] = mapped_column(sa.String(128))
    # The first characters of the key, so humans can tell keys apart in lists and logs.
    prefix: Mapped[str] = mapped_column(sa.String(16))
    key_hash: Mapped[str] = mapped_column(sa.String(64))  # sha256 hex of the whole key
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")

    def __repr__(self) -> str:
        return f"ApiKey(id={self.id!r}, prefix={self.prefix!r}, role={self.role!r})"


class Adapter(Base):
    """One version of a tenant's LoRA adapter; a new upload under a name is a new row."""

    __tablename__ = "adapters"
    __table_args__ = (
        sa.UniqueConstraint("tenant_id", "name", "version"),
        sa.CheckConstraint(_in("status", ADAPTER_STATUSES), name="status"),
        sa.CheckConstraint(_in("visibility", VISIBILITIES), name="visibility"),
        sa.CheckConstraint("version >= 1", name="version"),
        sa.CheckConstraint("rank >= 1", name="rank"),
        sa.Index(None, "visibility", "status"),
        sa.Index(None, "digest"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(sa.ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(sa.String(128))
    version: Mapped[int] = mapped_column(sa.Integer)
    base_model: Mapped[str] = mapped_column(sa.String(512))
    rank: Mapped[int] = mapped_column(sa.Integer)
    alpha: Mapped[float] = mapped_column(sa.Float)
    use_rslora: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    target_modules: Mapped[list[str]] = mapped_column(sa.JSON)
    digest: Mapped[str] = mapped_column(sa.String(64))  # sha256 hex of the weights file
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    # Relative to the adapter store's root, so the store can be mounted elsewhere.
    storage_path: Mapped[str] = mapped_column(sa.String(512))
    visibility: Mapped[str] = mapped_column(sa.String(16), default="private")
    status: Mapped[str] = mapped_column(sa.String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # When a deleted version's bytes stopped counting against its tenant's storage quota:
    # its stored copy was removed, or another active row holds the same content. NULL
    # while active, and while a deleted version's copy is still kept for it.
    reclaimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # When an operator pinned this version (registry/pins.py); NULL: not pinned.
    pinned_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Its measured effect (gateway/adapter_effect.py), NULL until measured: the mean KL
    # (nats) of the next-token distribution from the base model's over the probe prompts,
    # and the fraction of their greedy continuations it changed.
    effect_kl: Mapped[float | None] = mapped_column(sa.Float)
    effect_changed: Mapped[float | None] = mapped_column(sa.Float)
    effect_measured_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    tenant: Mapped[Tenant] = relationship(back_populates="adapters")

    @property
    def identity(self) -> str:
        """``adapter_id@content_digest``: what caches key on, never the name alone."""
        return f"{self.id}@{self.digest}"

    @property
    def is_public(self) -> bool:
        return self.visibility == "public"

    def __repr__(self) -> str:
        return (f"Adapter(id={self.id!r}, tenant_id={self.tenant_id!r}, name={self.name!r}, "
                f"version={self.version!r}, digest={self.digest[:12]!r})")


class AdapterRoute(Base):
    """Where a tenant's adapter name sends requests that name no version: its current
    version (``current_id``; NULL: the latest active version) and, during a canary split,
    ``canary_percent`` of them to ``canary_id``. No row: the latest active version.

    The service layer keeps both ids on active versions of this tenant and name
    (``registry.versions``); a version's deletion moves them before it commits.
    """

    __tablename__ = "adapter_routes"
    __table_args__ = (
        sa.UniqueConstraint("tenant_id", "name"),
        sa.CheckConstraint("canary_percent IS NULL OR "
                           "(canary_percent >= 0 AND canary_percent <= 100)",
                           name="canary_percent"),
        sa.CheckConstraint("(canary_id IS NULL AND canary_percent IS NULL) OR "
                           "(canary_id IS NOT NULL AND canary_percent IS NOT NULL)",
                           name="canary"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(sa.ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(sa.String(128))
    current_id: Mapped[int | None] = mapped_column(sa.ForeignKey("adapters.id"))
    canary_id: Mapped[int | None] = mapped_column(sa.ForeignKey("adapters.id"))
    canary_percent: Mapped[float | None] = mapped_column(sa.Float)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow,
                                                 onupdate=utcnow)

    def __repr__(self) -> str:
        return (f"AdapterRoute(tenant_id={self.tenant_id!r}, name={self.name!r}, "
                f"current_id={self.current_id!r}, canary_id={self.canary_id!r}, "
                f"canary_percent={self.canary_percent!r})")


class Usage(Base):
    """Requests and tokens of one tenant on one adapter (or the base model) in one hour."""

    __tablename__ = "usage"
    __table_args__ = (
        # An expression index because adapter_id is NULL for base-model requests and unique
        # constraints treat NULLs as distinct; upserts name this same expression as target.
        sa.Index("uq_usage_tenant_adapter_hour", "tenant_id",
                 sa.text("coalesce(adapter_id, 0)"), "hour", unique=True),
        sa.Index(None, "tenant_id", "hour"),
        sa.CheckConstraint("requests >= 0 AND prompt_tokens >= 0 AND completion_tokens >= 0",
                           name="non_negative"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(sa.ForeignKey("tenants.id"))
    adapter_id: Mapped[int | None] = mapped_column(sa.ForeignKey("adapters.id"))
    hour: Mapped[datetime] = mapped_column(UTCDateTime())  # start of the hour, UTC
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)

    def __repr__(self) -> str:
        return (f"Usage(tenant_id={self.tenant_id!r}, adapter_id={self.adapter_id!r}, "
                f"hour={self.hour.isoformat()!r}, requests={self.requests!r})")



class RegistryIdentity(Base):
    """Which registry this database is: one row, a random id written by the migration that
    creates the table (``loraplex db upgrade``). The adapter store it owns records the same
    id (``registry.ownership``), so another registry never writes or sweeps there."""

    __tablename__ = "registry_identity"
    __table_args__ = (sa.CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    registry_id: Mapped[str] = mapped_column(sa.String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
