"""Tenant use cases. Each takes a Session and never commits: the caller owns the transaction."""

from __future__ import annotations

import enum
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.registry.models import TENANT_STATUSES, Tenant
from loraplex.registry.names import check_tenant_name, is_tenant_name


class _Unset(enum.Enum):
    UNSET = enum.auto()


# Marks a limit the caller does not want to change (None means "unlimited").
UNSET: Final = _Unset.UNSET
# Limits are 32-bit integer columns: a larger value would be a database error on PostgreSQL.
MAX_LIMIT: Final = 2**31 - 1


def _check_limit(value: int | None, param: str) -> int | None:
    if value is not None and (isinstance(value, bool) or value <= 0):
        raise InvalidRequestError(f"{param} must be a positive integer or unset, got {value!r}",
                                  param=param)
    if value is not None and value > MAX_LIMIT:
        raise InvalidRequestError(f"{param} must be at most {MAX_LIMIT}", param=param)
    return value


def create_tenant(
    session: Session,
    name: str,
    *,
    max_requests_per_minute: int | None = None,
    max_tokens_per_minute: int | None = None,
    max_concurrent_requests: int | None = None,
) -> Tenant:
    """Adds an active tenant. Limits of ``None`` mean unlimited. ConflictError if the name
    is taken."""
    check_tenant_name(name)
    tenant = Tenant(
        name=name,
        status="active",
        max_requests_per_minute=_check_limit(max_requests_per_minute, "max_requests_per_minute"),
        max_tokens_per_minute=_check_limit(max_tokens_per_minute, "max_tokens_per_minute"),
        max_concurrent_requests=_check_limit(max_concurrent_requests, "max_concurrent_requests"),
    )
    if session.scalar(sa.select(Tenant.id).where(Tenant.name == name)) is not None:
        raise ConflictError(f"tenant {name!r} already exists")
    session.add(tenant)
    try:
        session.flush()
    except sa.exc.IntegrityError as exc:  # a concurrent create won the race
        raise ConflictError(f"tenant {name!r} already exists") from exc
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    """Every tenant, by name."""
    return list(session.scalars(sa.select(Tenant).order_by(Tenant.name)))


def get_tenant(session: Session, tenant_id: int) -> Tenant:
    """The tenant with that id; NotFoundError if none."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFoundError(f"no tenant with id {tenant_id}")
    return tenant


def get_tenant_by_name(session: Session, name: str) -> Tenant:
    """The tenant with that name; NotFoundError if none."""
    # A name no tenant can have is not looked up (nor its NUL bytes sent to the database).
    tenant = session.scalar(sa.select(Tenant).where(Tenant.name == name)) \
        if is_tenant_name(name) else None
    if tenant is None:
        raise NotFoundError(f"no tenant named {name!r}")
    return tenant


def update_tenant_limits(
    session: Session,
    tenant_id: int,
    *,
    max_requests_per_minute: int | None | _Unset = UNSET,
    max_tokens_per_minute: int | None | _Unset = UNSET,
    max_concurrent_requests: int | None | _Unset = UNSET,
) -> Tenant:
    """Changes the limits given (``None`` removes a limit; omitted ones stay as they are)."""
    tenant = get_tenant(session, tenant_id)
    if max_requests_per_minute is not UNSET:
        tenant.max_requests_per_minute = _check_limit(max_requests_per_minute,
                                                      "max_requests_per_minute")
    if max_tokens_per_minute is not UNSET:
        tenant.max_tokens_per_minute = _check_limit(max_tokens_per_minute,
                                                    "max_tokens_per_minute")
    if max_concurrent_requests is not UNSET:
        tenant.max_concurrent_requests = _check_limit(max_concurrent_requests,
                                                      "max_concurrent_requests")
    session.flush()
    return tenant


def set_tenant_status(session: Session, tenant_id: int, status: str) -> Tenant:
    """Suspends (``suspended``) or reactivates (``active``) a tenant.

    A suspended tenant's keys stop authenticating and its public adapters stop resolving
    for others, from the next request on.
    """
    if status not in TENANT_STATUSES:
        raise InvalidRequestError(f"status must be one of {', '.join(TENANT_STATUSES)}, "
                                  f"got {status!r}", param="status")
    tenant = get_tenant(session, tenant_id)
    tenant.status = status
    session.flush()
    return tenant
