"""The usage buffer: many finished requests become one batched write, failures are kept."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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
