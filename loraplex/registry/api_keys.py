"""API key use cases: keys are random, shown once, stored only as their sha256."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.errors import InvalidRequestError, NotFoundError, TenantSuspendedError
from loraplex.registry.models import KEY_ROLES, ApiKey, Tenant, utcnow
from loraplex.registry.names import check_text
from loraplex.registry.tenants import create_tenant, get_tenant

# The tenant that holds the server's admin keys (created by the first ``loraplex serve``).
ADMIN_TENANT: Final = "admin"
# The tenant of ``loraplex serve --api-key`` and ``--lora-modules`` (vLLM's flags, which know
# no tenants), created on first use.
DEFAULT_TENANT: Final = "default"
KEY_PREFIX: Final = "lpx-"
KEY_RANDOM_BYTES: Final = 32
# How many leading characters of a key are kept in clear, to tell keys apart in lists.
DISPLAY_PREFIX_LEN: Final = len(KEY_PREFIX) + 8
# last_used_at is written at most this often per key, so authenticating is not a write
# on every request.
LAST_USED_RESOLUTION: Final = timedelta(minutes=1)
# Longer inputs are rejected before hashing: real keys are 47 characters.
_MAX_KEY_LEN: Final = 256


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant behind a valid key, its role, its limits and its
    scheduling settings (weight and priority class; KV fraction and SLOs, None where the
    server's default applies).

    Plain values, so it stays usable after the session closes. Built per request: caching
    it would let a revoked key or a suspended tenant through.
    """

    tenant_id: int
    tenant_name: str
    role: str
    key_id: int
    max_requests_per_minute: int | None
    max_tokens_per_minute: int | None
    max_concurrent_requests: int | None
    weight: float
    priority_class: str
    max_kv_fraction: float | None
    slo_ttft_ms: int | None
    slo_tpot_ms: int | None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def hash_key(key: str) -> str:
    """The sha256 hex digest under which a key is stored."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    """A new random key: ``lpx-`` then 32 random bytes, URL-safe base64."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def create_key(
    session: Session, tenant_id: int, *, role: str = "tenant", name: str | None = None
) -> tuple[ApiKey, str]:
    """Creates a key for the tenant; returns the row and the plaintext key.

    The plaintext exists only in this return value: show it once, never store or log it.
    """
    if role not in KEY_ROLES:
        raise InvalidRequestError(f"role must be one of {', '.join(KEY_ROLES)}, got {role!r}",
                                  param="role")
    if name is not None and len(check_text(name, "name")) > 128:
        raise InvalidRequestError("key name is longer than 128 characters", param="name")
    get_tenant(session, tenant_id)
    plaintext = generate_key()
    row = ApiKey(tenant_id=tenant_id, role=role, name=name,
                 prefix=plaintext[:DISPLAY_PREFIX_LEN], key_hash=hash_key(plaintext))
    session.add(row)
    session.flush()
    return row, plaintext


def admin_tenant(session: Session) -> Tenant:
    """The tenant that holds the server's admin keys, created if it does not exist yet."""
    tenant = session.scalar(sa.select(Tenant).where(Tenant.name == ADMIN_TENANT))
    return tenant if tenant is not None else create_tenant(session, ADMIN_TENANT)


def default_tenant(session: Session) -> Tenant:
    """The tenant of the static ``--api-key`` and the ``--lora-modules`` adapters, created
    if it does not exist yet."""
    tenant = session.scalar(sa.select(Tenant).where(Tenant.name == DEFAULT_TENANT))
    return tenant if tenant is not None else create_tenant(session, DEFAULT_TENANT)


def create_admin_key(session: Session, *, name: str | None = None) -> tuple[ApiKey, str]:
    """A new admin key of the admin tenant (created if missing): how a lost admin key is
    replaced without any other key. Returns the row and the plaintext (show it once).

    InvalidRequestError if the admin tenant is suspended: its keys would not authenticate.
    """
    tenant = admin_tenant(session)
    if tenant.status != "active":
        raise InvalidRequestError(f"tenant {ADMIN_TENANT!r} is suspended, so its keys would "
                                  "not authenticate; reactivate it first")
    return create_key(session, tenant.id, role="admin", name=name)


def authenticate(session: Session, key: str, *, now: datetime | None = None) -> Principal | None:
    """The principal of ``key``, or None if the key is unknown or revoked;
    TenantSuspendedError if the key is valid but its tenant is suspended.

    The lookup is by hash; the stored hash is then compared in constant time. ``last_used_at``
    moves at most once per LAST_USED_RESOLUTION, and is written when the caller commits.
    """
    # Generated keys start with KEY_PREFIX; an operator's static key (``--api-key``, as vLLM
    # takes it) may be any text, so only the length is judged before the lookup by hash.
    if not key or len(key) > _MAX_KEY_LEN:
        return None
    digest = hash_key(key)
    found = session.execute(
        sa.select(ApiKey, Tenant).join(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == digest)
        # A long-lived session must still see a revocation committed elsewhere.
        .execution_options(populate_existing=True)
    ).first()
    if found is None:
        return None
    api_key, tenant = found
    if not hmac.compare_digest(api_key.key_hash.encode(), digest.encode()):
        return None
    if api_key.revoked_at is not None:
        return None
    if tenant.status != "active":
        raise TenantSuspendedError(f"the tenant {tenant.name!r} of this API key is suspended: "
                                   "ask the operator to reactivate it")
    now = now or utcnow()
    if api_key.last_used_at is None or now - api_key.last_used_at >= LAST_USED_RESOLUTION:
        api_key.last_used_at = now
    return Principal(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        role=api_key.role,
        key_id=api_key.id,
        max_requests_per_minute=tenant.max_requests_per_minute,
        max_tokens_per_minute=tenant.max_tokens_per_minute,
        max_concurrent_requests=tenant.max_concurrent_requests,
        weight=tenant.weight,
        priority_class=tenant.priority_class,
        max_kv_fraction=tenant.max_kv_fraction,
        slo_ttft_ms=tenant.slo_ttft_ms,
        slo_tpot_ms=tenant.slo_tpot_ms,
    )


def revoke_key(session: Session, key_id: int, *, tenant_id: int | None = None) -> ApiKey:
    """Revokes a key; it fails authentication from the next request on. Idempotent.

    With ``tenant_id``, the key must belong to that tenant (a tenant revoking its own key);
    another tenant's key is reported as not found.
    """
    row = session.get(ApiKey, key_id)
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        raise NotFoundError(f"no API key with id {key_id}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.flush()
    return row


def list_keys(session: Session, tenant_id: int | None = None) -> list[ApiKey]:
    """Keys (of one tenant, or all), oldest first. Rows hold the hash and prefix only."""
    stmt = sa.select(ApiKey).order_by(ApiKey.id)
    if tenant_id is not None:
        stmt = stmt.where(ApiKey.tenant_id == tenant_id)
    return list(session.scalars(stmt))
