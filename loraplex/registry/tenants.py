"""Tenant use cases. Each takes a Session and never commits: the caller owns the transaction."""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Callable
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.registry.models import (
    DEFAULT_PRIORITY_CLASS,
    DEFAULT_WEIGHT,
    MAX_ADAPTER_VERSIONS,
    MAX_SLO_MS,
    MAX_STORAGE_BYTES,
    MAX_WEIGHT,
    MIN_WEIGHT,
    PRIORITY_CLASSES,
    TENANT_STATUSES,
    Tenant,
)
from loraplex.registry.names import check_tenant_name, is_tenant_name


class _Unset(enum.Enum):
    UNSET = enum.auto()


# Marks a limit or setting the caller does not want to change (None means "unlimited", or
# "the server's default" for a KV fraction or SLO).
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


# --- scheduling settings -----------------------------------------------------------------
# Each check takes the value and the name to report (the field, or a CLI flag), and returns
# the value as stored. Types are checked too: the admin API hands over whatever JSON held.
# The range tests are written so NaN (every comparison false) and huge integers (compared
# exactly, never converted to float) fail them as well.


def _shown(value: object) -> str:
    return reprlib.repr(value)  # a 400-digit integer is cut, not copied into the message


def check_weight(value: object, param: str = "weight") -> float:
    """The tenant's share of a busy engine relative to other tenants: a finite number in
    [MIN_WEIGHT, MAX_WEIGHT]."""
    if isinstance(value, int | float) and not isinstance(value, bool) \
            and MIN_WEIGHT <= value <= MAX_WEIGHT:
        return float(value)
    raise InvalidRequestError(f"{param} must be a finite number >= {MIN_WEIGHT} and <= "
                              f"{MAX_WEIGHT}, "
                              f"got {_shown(value)}", param=param)


def check_priority_class(value: object, param: str = "priority_class") -> str:
    """``interactive`` (admitted first) or ``batch``."""
    if isinstance(value, str) and value in PRIORITY_CLASSES:
        return value
    raise InvalidRequestError(f"{param} must be one of {', '.join(PRIORITY_CLASSES)}, "
                              f"got {_shown(value)}", param=param)


def check_kv_fraction(value: object, param: str = "max_kv_fraction") -> float | None:
    """The fraction of the KV pool the tenant's running requests may hold, in (0, 1];
    ``None``: the server's default."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1:
        return float(value)
    raise InvalidRequestError(f"{param} must be a finite number > 0 and <= 1, got "
                              f"{_shown(value)}", param=param)


def check_slo_ms(value: object, param: str) -> int | None:
    """A latency objective in whole milliseconds, 1..MAX_SLO_MS; ``None``: the server's
    default."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SLO_MS:
        return value
    raise InvalidRequestError(f"{param} must be an integer from 1 to {MAX_SLO_MS} "
                              f"(milliseconds), got {_shown(value)}", param=param)


# field -> its check: the settings the CLI, the admin API and the admin UI set.
SCHEDULING_CHECKS: Final[dict[str, Callable[[Any, str], Any]]] = {
    "weight": check_weight,
    "priority_class": check_priority_class,
    "max_kv_fraction": check_kv_fraction,
    "slo_ttft_ms": check_slo_ms,
    "slo_tpot_ms": check_slo_ms,
}


# --- storage quotas ----------------------------------------------------------------------
# Same shape as the settings: value and name to report in, value as stored out.


def check_quota(value: object, param: str, *, maximum: int) -> int | None:
    """A storage quota: an integer from 1 to ``maximum``; ``None``: unlimited."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum:
        return value
    raise InvalidRequestError(f"{param} must be an integer from 1 to {maximum}, or null for "
                              f"unlimited, got {_shown(value)}", param=param)


def check_storage_bytes(value: object, param: str = "max_storage_bytes") -> int | None:
    """The most bytes of adapter files the tenant may keep; ``None``: unlimited."""
    return check_quota(value, param, maximum=MAX_STORAGE_BYTES)


def check_adapter_versions(value: object, param: str = "max_adapter_versions") -> int | None:
    """The most active adapter versions the tenant may have; ``None``: unlimited."""
    return check_quota(value, param, maximum=MAX_ADAPTER_VERSIONS)


# field -> its check: the quotas the CLI, the admin API and the admin UI set.
QUOTA_CHECKS: Final[dict[str, Callable[[Any, str], Any]]] = {
    "max_storage_bytes": check_storage_bytes,
    "max_adapter_versions": check_adapter_versions,
}


def create_tenant(
    session: Session,
    name: str,
    *,
    max_requests_per_minute: int | None = None,
    max_tokens_per_minute: int | None = None,
    max_concurrent_requests: int | None = None,
    weight: float = DEFAULT_WEIGHT,
    priority_class: str = DEFAULT_PRIORITY_CLASS,
    max_kv_fraction: float | None = None,
    slo_ttft_ms: int | None = None,
    slo_tpot_ms: int | None = None,
    max_storage_bytes: int | None = None,
    max_adapter_versions: int | None = None,
) -> Tenant:
    """Adds an active tenant. Limits and quotas of ``None`` mean unlimited; a KV fraction
    or SLO of ``None``, the server's default. ConflictError if the name is taken."""
    check_tenant_name(name)
    tenant = Tenant(
        name=name,
        status="active",
        max_requests_per_minute=_check_limit(max_requests_per_minute, "max_requests_per_minute"),
        max_tokens_per_minute=_check_limit(max_tokens_per_minute, "max_tokens_per_minute"),
        max_concurrent_requests=_check_limit(max_concurrent_requests, "max_concurrent_requests"),
        **_checked_settings({
            "weight": weight, "priority_class": priority_class,
            "max_kv_fraction": max_kv_fraction, "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "max_storage_bytes": max_storage_bytes,
            "max_adapter_versions": max_adapter_versions}),
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


def _checked_settings(values: dict[str, Any]) -> dict[str, Any]:
    checks = SCHEDULING_CHECKS | QUOTA_CHECKS
    return {field: checks[field](value, field) for field, value in values.items()}


def update_tenant_limits(
    session: Session,
    tenant_id: int,
    *,
    max_requests_per_minute: int | None | _Unset = UNSET,
    max_tokens_per_minute: int | None | _Unset = UNSET,
    max_concurrent_requests: int | None | _Unset = UNSET,
    weight: float | _Unset = UNSET,
    priority_class: str | _Unset = UNSET,
    max_kv_fraction: float | None | _Unset = UNSET,
    slo_ttft_ms: int | None | _Unset = UNSET,
    slo_tpot_ms: int | None | _Unset = UNSET,
    max_storage_bytes: int | None | _Unset = UNSET,
    max_adapter_versions: int | None | _Unset = UNSET,
) -> Tenant:
    """Changes the limits, scheduling settings and storage quotas given; omitted ones stay
    as they are. ``None`` removes a limit or quota, or returns a KV fraction or SLO to the
    server's default. A quota below what the tenant already stores is allowed: its next
    upload is refused until it deletes enough.

    Every value is checked before any is set: one bad value changes nothing.
    """
    limits = {field: _check_limit(value, field) for field, value in (
        ("max_requests_per_minute", max_requests_per_minute),
        ("max_tokens_per_minute", max_tokens_per_minute),
        ("max_concurrent_requests", max_concurrent_requests)) if value is not UNSET}
    settings = _checked_settings({field: value for field, value in (
        ("weight", weight), ("priority_class", priority_class),
        ("max_kv_fraction", max_kv_fraction), ("slo_ttft_ms", slo_ttft_ms),
        ("slo_tpot_ms", slo_tpot_ms), ("max_storage_bytes", max_storage_bytes),
        ("max_adapter_versions", max_adapter_versions)) if value is not UNSET})
    tenant = get_tenant(session, tenant_id)
    for field, value in (limits | settings).items():
        setattr(tenant, field, value)
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
