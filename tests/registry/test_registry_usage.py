"""Usage counters: upserts that add, per tenant, adapter (or base model) and hour."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import InvalidRequestError
from loraplex.registry import service
from loraplex.registry.models import Tenant
from loraplex.registry.usage import UsageRecord

T0 = datetime(2025, 11, 29, 10, 0, tzinfo=UTC)


@pytest.fixture
def setup(session: Session) -> tuple[Tenant, Tenant, int]:
    a = service.create_tenant(session, "a")
    b = service.create_tenant(session, "b")
    adapter = service.register_adapter(
        session, tenant_id=a.id, name="x", digest="0" * 64, size_bytes=1, storage_path="p",
        base_model="m", rank=1, alpha=1.0, use_rslora=False, target_modules=["q_proj"])
    session.commit()
    return a, b, adapter.id


def test_batches_add_up(session: Session, session_factory: sessionmaker[Session],
                        setup: tuple[Tenant, Tenant, int]) -> None:
    a, b, adapter_id = setup
    batch = [
        UsageRecord(a.id, adapter_id, T0 + timedelta(minutes=5), 1, 10, 20),
        UsageRecord(a.id, adapter_id, T0 + timedelta(minutes=59), 2, 5, 5),  # same hour
        UsageRecord(a.id, None, T0 + timedelta(minutes=1), 1, 3, 4),  # base model
        UsageRecord(a.id, adapter_id, T0 + timedelta(hours=1), 1, 1, 1),  # next hour
        UsageRecord(b.id, None, T0, 1, 100, 0),
    ]
    assert service.record_usage(session, batch) == 4
    session.commit()
    # A second writer (another gateway process) adds to the same counters.
    with session_factory() as other:
        service.record_usage(other, batch[:3])
        service.record_usage(other, [UsageRecord(a.id, None, T0, 1, 0, 0)])
        other.commit()

    rows = service.list_usage(session, a.id)
    got = [(r.hour, r.adapter_id, r.requests, r.prompt_tokens, r.completion_tokens)
           for r in rows]
    assert sorted(got, key=lambda g: (g[0], g[1] or 0)) == [
        (T0, None, 3, 6, 8),
        (T0, adapter_id, 6, 30, 50),
        (T0 + timedelta(hours=1), adapter_id, 1, 1, 1),
    ]
    totals = service.usage_totals(session, a.id)
    assert (totals.requests, totals.prompt_tokens, totals.completion_tokens) == (10, 37, 59)
    assert totals.total_tokens == 96
    b_totals = service.usage_totals(session, b.id)
    assert (b_totals.requests, b_totals.prompt_tokens) == (1, 100)


def test_ranges(session: Session, setup: tuple[Tenant, Tenant, int]) -> None:
    a, _, adapter_id = setup
    service.record_usage(session, [UsageRecord(a.id, adapter_id, T0 + timedelta(hours=h), 1)
                                   for h in range(5)])
    since, until = T0 + timedelta(hours=1, minutes=30), T0 + timedelta(hours=3)
    hours = [r.hour for r in service.list_usage(session, a.id, since=since, until=until)]
    assert hours == [T0 + timedelta(hours=1), T0 + timedelta(hours=2)]
    assert service.usage_totals(session, a.id, since=since, until=until).requests == 2
    assert service.list_usage(session, a.id, adapter_id=987654) == []
    empty = service.usage_totals(session, a.id, since=T0 + timedelta(days=1))
    assert (empty.requests, empty.prompt_tokens, empty.completion_tokens) == (0, 0, 0)


def test_hours_are_utc(session: Session, setup: tuple[Tenant, Tenant, int]) -> None:
    a, _, _ = setup
    plus2 = timezone(timedelta(hours=2))
    service.record_usage(session, [UsageRecord(a.id, None, datetime(2025, 11, 29, 12, 30,
                                                                     tzinfo=plus2))])
    (row,) = service.list_usage(session, a.id)
    assert row.hour == T0 and row.hour.tzinfo is UTC
    assert service.hour_start(datetime(2025, 1, 1, 0, 59, 59, tzinfo=UTC)) == datetime(
        2025, 1, 1, tzinfo=UTC)


def test_bad_records_refused(session: Session, setup: tuple[Tenant, Tenant, int]) -> None:
    a, _, _ = setup
    with pytest.raises(InvalidRequestError):
        service.record_usage(session, [UsageRecord(a.id, None, datetime(2025, 1, 1))])
    with pytest.raises(InvalidRequestError):
        service.record_usage(session, [UsageRecord(a.id, None, T0, requests=-1)])
    with pytest.raises(InvalidRequestError):
        service.list_usage(session, a.id, until=datetime(2025, 1, 1))
    assert service.record_usage(session, []) == 0
