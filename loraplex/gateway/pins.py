"""The registry's pinned adapters, applied to the engine.

Pins are rows in the registry (``registry/pins.py``), written by the admin API, the
console or the CLI (which runs without a server). Each gateway applies them: at start,
right after a pin or unpin through its admin API, and every ``PIN_SYNC_S`` seconds for
pins written elsewhere (the CLI, another gateway). The oldest ``max_pinned`` pins apply;
the engine backend holds them on every replica. A failure to apply is logged and tried
again at the next round; it never fails a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from loraplex.engine.backend import EngineBackend
from loraplex.engine.request import AdapterRef
from loraplex.registry.db import transaction
from loraplex.registry.pins import pinned_adapters
from loraplex.registry.store import AdapterStore

logger = logging.getLogger(__name__)

PIN_SYNC_S = 2.0


class PinSync:
    """Applies the registry's pins to ``backend``; ``sync()`` after a change."""

    def __init__(self, sessions: sessionmaker[Session], store: AdapterStore,
                 backend: EngineBackend,
                 interval_s: float = PIN_SYNC_S) -> None:
        self._sessions = sessions
        self._store = store
        self._backend = backend
        self.interval_s = interval_s
        self.applied: tuple[AdapterRef, ...] = ()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def _pinned(self) -> tuple[AdapterRef, ...]:
        with transaction(self._sessions) as session:
            rows = pinned_adapters(session)[:self._backend.description.max_pinned]
            return tuple(AdapterRef(adapter_id=str(a.id), digest=a.digest,
                                    path=str(self._store.resolve(a.storage_path)))
                         for a in rows)

    async def sync(self) -> None:
        """Applies the pins now if they changed since the last time."""
        async with self._lock:
            pinned = await run_in_threadpool(self._pinned)
            if pinned != self.applied:
                await self._backend.set_pinned_adapters(pinned)
                self.applied = pinned

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as exc:  # a database or engine away: the next round tries again
                logger.warning("cannot apply the pinned adapters: %s", exc)
            await asyncio.sleep(self.interval_s)
