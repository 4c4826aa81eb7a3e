"""Usage metering: requests' usage is buffered and written to the registry in batches.

A running request holds an ``OpenUsage``: what it has delivered so far. Every
``interval_s`` a background task takes from each open request what it delivered since the
last take (its request and prompt tokens once, then new completion tokens), adds the
records of requests that ended, and writes the whole buffer in one transaction; once more
at shutdown. So the database sees one upsert per (tenant, adapter, hour) per interval,
never one write per request or token, and a server killed outright (``kill -9``) loses
at most what was delivered in the last interval and the write under way: usage is durable
one ``interval_s`` (1 s) plus one write behind delivery. A failed write keeps its records
for the next attempt.

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
from datetime import UTC, datetime

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from loraplex.registry import service
from loraplex.registry.db import transaction
from loraplex.registry.usage import UsageRecord

logger = logging.getLogger("loraplex.gateway.usage")


class OpenUsage:
    """One request's usage while it runs (event loop only): set ``num_prompt_tokens`` and
    ``admitted`` once the engine took it, ``num_sent_tokens`` as chunks reach the client;
    the meter takes the news at each flush and the rest at ``close_request``."""

    def __init__(self, tenant_id: int, adapter_id: int | None) -> None:
        self.tenant_id = tenant_id
        self.adapter_id = adapter_id
        self.admitted = False
        self.num_prompt_tokens = 0
        self.num_sent_tokens = 0
        self._taken_request = False
        self._num_taken_tokens = 0

    def take(self) -> UsageRecord | None:
        """What was delivered since the last take, as a record (None if nothing was)."""
        if not self.admitted:
            return None
        first = not self._taken_request
        completion = self.num_sent_tokens - self._num_taken_tokens
        if not first and completion <= 0:
            return None
        self._taken_request = True
        self._num_taken_tokens = self.num_sent_tokens
        return UsageRecord(self.tenant_id, self.adapter_id, datetime.now(UTC),
                           requests=int(first),
                           prompt_tokens=self.num_prompt_tokens if first else 0,
                           completion_tokens=max(completion, 0))


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
        self._open: set[OpenUsage] = set()
        # One flush at a time: a periodic flush and a read-your-writes flush must not
        # write the same records twice or interleave their retries.
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def add(self, record: UsageRecord) -> None:
        """Queues one record; never blocks on I/O."""
        with self._lock:
            self._pending.append(record)

    def open_request(self, usage: OpenUsage) -> None:
        """A request that will end with ``close_request`` began (event loop only); each
        flush meters what it delivered meanwhile."""
        self._open.add(usage)
        self._num_open += 1
        self._all_closed.clear()

    def close_request(self, usage: OpenUsage) -> None:
        """The request ended: what it delivered since the last flush is queued."""
        self._open.discard(usage)
        record = usage.take()
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
            for usage in list(self._open):  # what running requests delivered meanwhile
                record = usage.take()
                if record is not None:
                    self.add(record)
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
