"""Who is calling, and what they may do: every principal check of the gateway.

Bearer keys are checked against the registry on every request.

Keys are looked up by their sha256 in the registry, which compares in constant time and
refuses revoked keys and suspended tenants; nothing is cached, so a revocation takes effect
on the next request. The lookup runs in a worker thread: SQLAlchemy sessions are blocking.

Also here: the admin key bootstrap of ``loraplex serve`` and the per-tenant cache salt.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import tempfile
from pathlib import Path
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from loraplex.config import ENV_ADMIN_KEY, ENV_API_KEY
from loraplex.errors import ConfigError, InvalidRequestError
from loraplex.gateway.errors import AuthenticationError, PermissionDeniedError
from loraplex.gateway.ratelimit import TenantLimits
from loraplex.gateway.state import Gateway, gateway
from loraplex.registry import service
from loraplex.registry.api_keys import DISPLAY_PREFIX_LEN, KEY_PREFIX, Principal
from loraplex.registry.db import transaction
from loraplex.registry.models import ApiKey, Tenant

# The name the static key is registered under, so the next start can tell it apart.
STATIC_KEY_NAME: Final = "--api-key"
# Shorter static keys are accepted, as vLLM does, with a warning.
MIN_STATIC_KEY_CHARS: Final = 32
MAX_STATIC_KEY_CHARS: Final = 256
# A key given by the operator must be as strong as a generated one: 32 random bytes are
# 43 URL-safe base64 characters.
MIN_KEY_RANDOM_CHARS: Final = 43


def bearer_key(conn: HTTPConnection) -> str:
    """The key of ``Authorization: Bearer <key>``; AuthenticationError if there is none,
    InvalidRequestError (400) if the header is sent more than once."""
    headers = conn.headers.getlist("authorization")
    if len(headers) > 1:
        # Servers and proxies disagree on which one wins: answering for either would let a
        # second key ride on the first's authority.
        raise InvalidRequestError("The Authorization header was sent more than once: send "
                                  "exactly one 'Authorization: Bearer <key>'")
    header = headers[0] if headers else None
    if not header:
        raise AuthenticationError("You didn't provide an API key: pass it as "
                                  "'Authorization: Bearer <key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthenticationError("The Authorization header must be 'Bearer <key>'")
    return key.strip()


def _lookup(factory: sessionmaker[Session], key: str) -> Principal | None:
    with transaction(factory) as session:
        return service.authenticate(session, key)


async def authenticate(conn: HTTPConnection, factory: sessionmaker[Session]) -> Principal:
    """The principal behind the request's key; AuthenticationError (401) otherwise."""
    key = bearer_key(conn)
    principal = await run_in_threadpool(_lookup, factory, key)
    if principal is None:
        raise AuthenticationError("Incorrect API key provided")
    return principal


def require_admin(principal: Principal) -> Principal:
    """PermissionDeniedError (403) unless the key has the admin role."""
    if not principal.is_admin:
        raise PermissionDeniedError("This route needs an admin key")
    return principal


async def metrics_principal(conn: HTTPConnection) -> Gateway:
    """The gateway, when the caller holds the configured metrics token or an admin key
    (401/403 otherwise). The token opens /metrics only: it names no tenant."""
    gw = gateway(conn)
    token = gw.config.metrics_token
    if token is not None:
        key = bearer_key(conn)
        if hmac.compare_digest(key.encode(), token.encode()):
            return gw
    require_admin(await authenticate(conn, gw.sessions))
    return gw


async def admin_principal(conn: HTTPConnection) -> tuple[Gateway, Principal]:
    """The gateway and the caller, who must hold an admin key (401/403 otherwise)."""
    gw = gateway(conn)
    return gw, require_admin(await authenticate(conn, gw.sessions))


def is_own(principal: Principal, tenant_id: int) -> bool:
    """Whether a record of ``tenant_id`` belongs to the caller's tenant (its adapters are
    named without the owner's prefix)."""
    return tenant_id == principal.tenant_id


def check_not_own_key(caller: Principal, key_id: int) -> None:
    """An admin may not revoke the key they are calling with (they would lock themselves
    out mid-session)."""
    if key_id == caller.key_id:
        raise InvalidRequestError("you cannot revoke the admin key you are using; sign in "
                                  "with another admin key first")


def check_not_own_tenant(caller: Principal, tenant_id: int) -> None:
    """An admin may not suspend the tenant of the key they are calling with."""
    if is_own(caller, tenant_id):
        raise InvalidRequestError("you cannot suspend the tenant of the admin key you "
                                  "are using", param="status")


def tenant_limits(principal: Principal) -> TenantLimits:
    """The principal's tenant limits as the rate limiter takes them."""
    return TenantLimits(requests_per_minute=principal.max_requests_per_minute,
                        tokens_per_minute=principal.max_tokens_per_minute,
                        max_concurrent=principal.max_concurrent_requests)


def cache_salt(secret: bytes, tenant_id: int) -> str:
    """The tenant's prefix-cache salt: HMAC-SHA256 of its id under the server's secret.

    A tenant cannot compute or choose another tenant's salt, so two tenants never hit each
    other's cached blocks (which would leak whether a prompt was seen, by timing).
    """
    return hmac.new(secret, f"tenant:{tenant_id}".encode(), hashlib.sha256).hexdigest()


def salt_secret(configured: str | None) -> bytes:
    """The configured secret, or a random one for this process (a prefix cache in this
    process's memory only needs salts for its lifetime; a disk tier's blocks need the
    secret kept with them: ``kept_salt_secret``)."""
    return configured.encode() if configured else secrets.token_bytes(32)


SALT_SECRET_FILE: Final = ".cache-salt-secret"


def kept_salt_secret(folder: Path) -> str:
    """The salt secret kept in ``folder`` (the KV disk tier's): made once (mode 0600),
    read on every later start, so each tenant's salt, and with it every block the tier
    keeps for the tenant, is the same after a restart. Deleting the folder resets both.
    ConfigError in one line if it cannot be read or made."""
    path = folder / SALT_SECRET_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            # Published whole or not at all: written aside, then linked into place (a
            # second server starting at once links nothing and reads the first one's).
            fd, temp = tempfile.mkstemp(prefix=".salt-", dir=folder)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(32))
                    f.flush()
                    os.fsync(f.fileno())
                with contextlib.suppress(FileExistsError):
                    os.link(temp, path)
            finally:
                os.unlink(temp)
        secret = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot keep the prefix-cache salt secret in {path}: "
                          f"{exc.strerror or exc}") from None
    if len(secret) < 32:
        raise ConfigError(f"{path} holds no salt secret: delete the KV disk folder's blocks "
                          "with it, or set LORAPLEX_CACHE_SALT_SECRET")
    return secret


def _check_admin_key_format(key: str) -> None:
    if not key.startswith(KEY_PREFIX) or len(key) - len(KEY_PREFIX) < MIN_KEY_RANDOM_CHARS:
        raise ConfigError(
            f"{ENV_ADMIN_KEY} must be '{KEY_PREFIX}' followed by at least "
            f"{MIN_KEY_RANDOM_CHARS} random characters, e.g. the output of: python -c "
            f"\"import secrets; print('{KEY_PREFIX}' + secrets.token_urlsafe(32))\"")


def ensure_admin_key(session: Session, admin_key: str | None) -> str | None:
    """Makes sure an admin can log in; returns a newly created key (to print once) or None.

    With ``admin_key`` (from LORAPLEX_ADMIN_KEY), that key is registered for the ``admin``
    tenant if it is not yet. Without it, a key is created only when no active admin key
    exists, i.e. on the first start.
    """
    tenant = service.admin_tenant(session)
    if admin_key is not None:
        _check_admin_key_format(admin_key)
        digest = service.hash_key(admin_key)
        row = session.scalar(sa.select(ApiKey).where(ApiKey.key_hash == digest))
        if row is None:
            session.add(ApiKey(tenant_id=tenant.id, role="admin", name=ENV_ADMIN_KEY,
                               prefix=admin_key[:DISPLAY_PREFIX_LEN], key_hash=digest))
            session.flush()
        elif row.revoked_at is not None or row.role != "admin":
            raise ConfigError(f"{ENV_ADMIN_KEY} names a key that is revoked or not an "
                              "admin key")
        return None
    active = session.scalar(
        sa.select(sa.func.count()).select_from(ApiKey).join(Tenant)
        .where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None),
               Tenant.status == "active"))
    if active:
        return None
    _, plaintext = service.create_key(session, tenant.id, role="admin", name="bootstrap")
    return plaintext


def check_static_key(key: str) -> str | None:
    """ConfigError for a static key that cannot work as a bearer key; a warning (to print)
    for a short one, which vLLM would take too."""
    if not key or len(key) > MAX_STATIC_KEY_CHARS or not key.isascii() or not key.isprintable() \
            or any(c.isspace() for c in key):
        raise ConfigError(f"--api-key ({ENV_API_KEY}) must be 1 to {MAX_STATIC_KEY_CHARS} "
                          "printable ASCII characters without spaces")
    if len(key) < MIN_STATIC_KEY_CHARS:
        return (f"warning: the --api-key is {len(key)} characters: anyone who guesses it calls "
                f"as tenant {service.DEFAULT_TENANT!r}; use at least {MIN_STATIC_KEY_CHARS} "
                "random ones")
    return None


def ensure_static_key(session: Session, key: str) -> None:
    """Makes ``key`` (``--api-key``) the one static key of the ``default`` tenant: registered
    if new, and any static key of an earlier start revoked (as restarting vLLM with another
    --api-key retires the old one). Keys created through the API are left alone.

    ConfigError if the key is already another tenant's, an admin key, or revoked.
    """
    check_static_key(key)
    tenant = service.default_tenant(session)
    digest = service.hash_key(key)
    row = session.scalar(sa.select(ApiKey).where(ApiKey.key_hash == digest))
    if row is not None and (row.tenant_id != tenant.id or row.role != "tenant"
                            or row.revoked_at is not None):
        raise ConfigError(f"--api-key ({ENV_API_KEY}) names a key that is revoked, an admin "
                          f"key, or another tenant's than {service.DEFAULT_TENANT!r}")
    earlier = session.scalars(sa.select(ApiKey.id).where(
        ApiKey.tenant_id == tenant.id, ApiKey.name == STATIC_KEY_NAME,
        ApiKey.revoked_at.is_(None), ApiKey.key_hash != digest)).all()
    for key_id in earlier:
        service.revoke_key(session, key_id)
    if row is None:
        # A quarter at most is kept in clear: a short key must not be stored whole.
        shown = key[:min(DISPLAY_PREFIX_LEN, len(key) // 4)]
        session.add(ApiKey(tenant_id=tenant.id, role="tenant", name=STATIC_KEY_NAME,
                           prefix=shown, key_hash=digest))
        session.flush()
