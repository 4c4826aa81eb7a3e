"""Usage accounting: requests and tokens per tenant, adapter and hour, added by upserts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.errors import ConfigError, InvalidRequestError
from loraplex.registry.models import Usage

_usage = cast(sa.Table, Usage.__table__)
# Must match the expression of the unique index uq_usage_tenant_adapter_hour exactly, or
# PostgreSQL cannot infer the conflict target; written as text for that reason.
_CONFLICT_TARGET: list[Any] = [_usage.c.tenant_id, sa.text("coalesce(adapter_id, 0)"),
                               _usage.c.hour]


@dataclass(frozen=True)
class UsageRecord:
    """Usage to add: ``adapter_id`` None for base-model requests; ``at`` any aware time in
    the hour it belongs to."""

    tenant_id: int
    adapter_id: int | None
    at: datetime
    requests: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class UsageTotals:
    """Sums over a range of hours."""

    requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _aware(at: datetime) -> datetime:
    if at.tzinfo is None:
        raise InvalidRequestError("usage times must be timezone-aware", param="at")
    return at.astimezone(UTC)


def hour_start(at: datetime) -> datetime:
    """The start of the UTC hour holding ``at`` (which must be timezone-aware)."""
    return _aware(at).replace(minute=0, second=0, microsecond=0)


def record_usage(session: Session, records: Iterable[UsageRecord]) -> int:
    """Adds a batch of usage to the hourly counters; returns how many counters changed.

    Records for the same (tenant, adapter, hour) are summed first; each counter is then one
    upsert that adds, so concurrent writers (several gateway processes) never lose counts.
    Counters are written in a fixed order so two writers cannot deadlock on PostgreSQL.
    """
    sums: dict[tuple[int, int | None, datetime], list[int]] = {}
    for rec in records:
        if min(rec.requests, rec.prompt_tokens, rec.completion_tokens) < 0:
            raise InvalidRequestError("usage counts must be >= 0", param="usage")
        key = (rec.tenant_id, rec.adapter_id, hour_start(rec.at))
        acc = sums.setdefault(key, [0, 0, 0])
        acc[0] += rec.requests
        acc[1] += rec.prompt_tokens
        acc[2] += rec.completion_tokens
    if not sums:
        return 0
    rows = [
        {"tenant_id": t, "adapter_id": a, "hour": h,
         "requests": c[0], "prompt_tokens": c[1], "completion_tokens": c[2]}
        for (t, a, h), c in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0,
                                                               kv[0][2]))
    ]
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        pg_stmt = pg_insert(_usage)
        pg_stmt = pg_stmt.on_conflict_do_update(
            index_elements=_CONFLICT_TARGET, set_=_adding(pg_stmt.excluded))
        for row in rows:
            session.execute(pg_stmt, row)
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        lite_stmt = sqlite_insert(_usage)
        lite_stmt = lite_stmt.on_conflict_do_update(
            index_elements=_CONFLICT_TARGET, set_=_adding(lite_stmt.excluded))
        for row in rows:
            session.execute(lite_stmt, row)
    else:
        raise ConfigError(f"usage metering supports SQLite and PostgreSQL databases, not {dialect}")
    return len(rows)


def _adding(excluded: sa.ColumnCollection[str, sa.ColumnElement[object]]) -> dict[str, object]:
    return {name: _usage.c[name] + excluded[name]
            for name in ("requests", "prompt_tokens", "completion_tokens")}


def list_usage(
    session: Session, tenant_id: int, *, since: datetime | None = None,
    until: datetime | None = None, adapter_id: int | None = None,
) -> list[Usage]:
    """The tenant's hourly counters with ``since <= hour < until``, by hour then adapter.

    ``since`` is rounded down to its hour, so the hour holding it is included.
    """
    stmt = sa.select(Usage).where(Usage.tenant_id == tenant_id)
    if since is not None:
        stmt = stmt.where(Usage.hour >= hour_start(since))
    if until is not None:
        stmt = stmt.where(Usage.hour < _aware(until))
    if adapter_id is not None:
        stmt = stmt.where(Usage.adapter_id == adapter_id)
    return list(session.scalars(stmt.order_by(Usage.hour, Usage.adapter_id)))


def usage_totals(
    session: Session, tenant_id: int, *, since: datetime | None = None,
    until: datetime | None = None,
) -> UsageTotals:
    """Sums of the tenant's counters with ``since <= hour < until``."""
    stmt = sa.select(sa.func.coalesce(sa.func.sum(Usage.requests), 0),
                     sa.func.coalesce(sa.func.sum(Usage.prompt_tokens), 0),
                     sa.func.coalesce(sa.func.sum(Usage.completion_tokens), 0),
                     ).where(Usage.tenant_id == tenant_id)
    if since is not None:
        stmt = stmt.where(Usage.hour >= hour_start(since))
    if until is not None:
        stmt = stmt.where(Usage.hour < _aware(until))
    requests, prompt, completion = session.execute(stmt).one()
    return UsageTotals(requests=int(requests), prompt_tokens=int(prompt),
                       completion_tokens=int(completion))
