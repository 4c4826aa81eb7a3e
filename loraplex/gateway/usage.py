"""Usage metering: finished requests are buffered and written to the registry in batches.

A request adds one ``UsageRecord`` to an in-memory buffer (no I/O); a background task
writes the whole buffer in one transaction every ``interval_s`` and once more at shutdown,
so the database sees one upsert per (tenant, adapter, hour) per interval, never one write
per request or token. A failed write keeps its records for the next attempt.

Requests in flight are counted (``open_request``/``close_request``): at shutdown the last
flush waits, up to ``close_grace_s``, for those still ending (streams cut by the shutdown
are closed after the server stops waiting for them), so what they delivered is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from loraplex.registry import service
from loraplex.registry.db import transaction
from loraplex.registry.usage import UsageRecord

logger = logging.getLogger("loraplex.gateway.usage")


class UsageMeter:
    """Buffers usage records and flushes them to the registry in batches."""

    def __init__(self, factory: sessionmaker[Session], interval_s: float = 1.0,
                 close_grace_s: float = 10.0) -> None:
        self._factory = factory
        self._interval_s = interval_s
        self._close_grace_s = close_grace_s
        self._num_open = 0
        self._all_closed = asyncio.Event()
        self._all_closed.set()
        self._lock = threading.Lock()
        self._pending: list[UsageRecord] = []
        # One flush at a time: a periodic flush and a read-your-writes flush must not
        # write the same records twice or interleave their retries.
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def add(self, record: UsageRecord) -> None:
        """Queues one record; never blocks on I/O."""
        with self._lock:
            self._pending.append(record)

    def open_request(self) -> None:
        """A request that will end with ``close_request`` began (event loop only)."""
        self._num_open += 1
        self._all_closed.clear()

    def close_request(self, record: UsageRecord | None) -> None:
        """The request ended; ``record`` is its usage (None when nothing is owed)."""
        if record is not None:
            self.add(record)
        self._num_open -= 1
        if self._num_open == 0:
            self._all_closed.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _write(self, batch: list[UsageRecord]) -> None:
        with transaction(self._factory) as session:
            service.record_usage(session, batch)

    async def flush(self) -> None:
        """Writes every pending record now; on failure they stay pending and this raises.
        Cancelled while the write runs (a request's read-your-writes flush whose client
        left), the write goes on in its thread and its own outcome settles the batch: put
        back for the next flush had it been written twice once it committed."""
        async with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            write = asyncio.ensure_future(run_in_threadpool(self._write, batch))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                write.add_done_callback(functools.partial(self._settle, batch))
                raise
            except BaseException:
                self._restore(batch)
                raise

    def _restore(self, batch: list[UsageRecord]) -> None:
        with self._lock:
            self._pending[:0] = batch

    def _settle(self, batch: list[UsageRecord], write: asyncio.Future[None]) -> None:
        if write.cancelled() or write.exception() is not None:
            self._restore(batch)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # stop() ends the wait, never a write
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.flush()
            except Exception:
                logger.exception("usage flush failed; %d records kept for the next try",
                                 self.num_pending)

    def start(self) -> None:
        """Starts the periodic flusher on the running event loop."""
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="loraplex-usage")

    async def stop(self) -> None:
        """Stops the flusher and writes what is left, once the requests still open have
        ended (or ``close_grace_s`` has passed)."""
        if self._task is not None:
            self._stopping.set()  # a flush under way ends first
            await self._task
            self._task = None
        try:
            await asyncio.wait_for(self._all_closed.wait(), self._close_grace_s)
        except TimeoutError:
            logger.warning("%d requests still open at the final usage flush; their usage "
                           "is lost", self._num_open)
        try:
            await self.flush()
        except Exception:
            logger.exception("final usage flush failed; %d records lost", self.num_pending)
