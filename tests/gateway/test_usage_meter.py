"""The usage buffer: many finished requests become one batched write, failures are kept."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from loraplex.gateway.usage import UsageMeter
from loraplex.registry import db, service
from loraplex.registry.usage import UsageRecord


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        yield db.make_session_factory(engine)
    finally:
        engine.dispose()


def test_records_are_written_in_one_batch(factory: sessionmaker[Session]) -> None:
    with db.transaction(factory) as session:
        tenant_id = service.create_tenant(session, "acme").id
    statements: list[str] = []
    engine = factory.kw["bind"]

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT"):
            statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    now = datetime.now(UTC)

    async def scenario() -> None:
        meter = UsageMeter(factory, interval_s=3600)
        meter.start()
        for i in range(200):
            meter.add(UsageRecord(tenant_id, None, now, prompt_tokens=3, completion_tokens=i))
        assert meter.num_pending == 200 and statements == []
        await meter.stop()  # the final flush
        assert meter.num_pending == 0

    asyncio.run(scenario())
    sa.event.remove(engine, "before_cursor_execute", count)
    assert len(statements) == 1  # one upsert for one (tenant, adapter, hour)
    with db.transaction(factory) as session:
        totals = service.usage_totals(session, tenant_id)
    assert (totals.requests, totals.prompt_tokens, totals.completion_tokens) == \
        (200, 600, sum(range(200)))


def test_a_failed_flush_keeps_the_records(factory: sessionmaker[Session]) -> None:
    now = datetime.now(UTC)

    async def scenario() -> None:
        meter = UsageMeter(factory)
        meter.add(UsageRecord(999, None, now))  # no such tenant: the insert fails
        with pytest.raises(sa.exc.IntegrityError):
            await meter.flush()
        assert meter.num_pending == 1

    asyncio.run(scenario())


def _one_record_while_the_write_is_locked(
        factory: sessionmaker[Session], interval_s: float,
        during: Callable[[UsageMeter, Callable[[], None]], Coroutine[Any, Any, None]],
) -> tuple[int, int]:
    """One record of 10 prompt tokens queued, then ``during(meter, release)`` with another
    connection holding SQLite's write lock (the meter's write waits on it, the registry's
    busy timeout) until ``release()``; then the meter stops (its final flush). Returns the
    tenant's (requests, prompt tokens) as written."""
    with db.transaction(factory) as session:
        tenant_id = service.create_tenant(session, "acme").id
    holder = sqlite3.connect(factory.kw["bind"].url.database, isolation_level=None)

    def release() -> None:
        if holder.in_transaction:
            holder.rollback()

    async def scenario() -> None:
        meter = UsageMeter(factory, interval_s=interval_s)
        meter.add(UsageRecord(tenant_id, None, datetime.now(UTC), prompt_tokens=10))
        holder.execute("BEGIN IMMEDIATE")
        try:
            await during(meter, release)
        finally:
            release()
        await meter.stop()
        assert meter.num_pending == 0

    try:
        asyncio.run(scenario())
    finally:
        holder.close()
    with db.transaction(factory) as session:
        totals = service.usage_totals(session, tenant_id)
    return totals.requests, totals.prompt_tokens


def test_a_flush_cancelled_while_writing_is_counted_once(
        factory: sessionmaker[Session]) -> None:
    # A read-your-writes flush whose request was cancelled mid-write: the thread committed
    # the batch, and the batch, put back, had been written again by the next flush.
    async def during(meter: UsageMeter, release: Callable[[], None]) -> None:
        flush = asyncio.create_task(meter.flush())
        await asyncio.sleep(0.3)  # the write waits on the lock
        flush.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flush
        release()
        await asyncio.sleep(0.5)  # the write commits in its thread

    assert _one_record_while_the_write_is_locked(factory, 3600, during) == (1, 10)


def test_stop_during_a_periodic_flush_writes_each_record_once(
        factory: sessionmaker[Session]) -> None:
    # stop() had cancelled the flusher inside its write, then written the batch again.
    async def during(meter: UsageMeter, release: Callable[[], None]) -> None:
        meter.start()
        await asyncio.sleep(0.4)  # the periodic flush is inside its write
        stopping = asyncio.create_task(meter.stop())
        await asyncio.sleep(0.2)
        release()
        await stopping

    assert _one_record_while_the_write_is_locked(factory, 0.1, during) == (1, 10)
