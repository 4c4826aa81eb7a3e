"""Crash recovery of the adapter store: what a killed upload left behind is removed.

A process killed mid-receive or mid-copy leaves a folder under the store's ``.tmp``; one
killed between the store's rename and the registry's commit leaves a complete folder that
no row names. ``sweep_store`` removes both once they are older than the grace period and,
for temporary folders, no live process holds their lock (see ``registry.store``), so an
upload in progress in this or any other process sharing the store is never touched.

Deleted versions whose stored copy is gone (or held for an active row) stop counting
against their tenants' storage quotas here too (``upload.reclaim_deleted``): deletion
usually removes the files and reclaims at once; the sweep catches what it left.

Only the registry that owns the store sweeps it (``registry.ownership``): a folder another
registry's rows name is no orphan, whatever this registry's rows say.

``StoreSweeper`` runs it at start and then every ``interval_s`` in a worker thread; the
gateway's lifespan starts and stops it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from loraplex.registry.store import AdapterStore
from loraplex.registry.upload import reclaim_deleted, remove_unreferenced

logger = logging.getLogger("loraplex.registry")


@dataclass(frozen=True)
class SweepResult:
    """What one sweep removed: temporary entries, and digests of orphan folders; and how
    many deleted versions' bytes it reclaimed for their tenants' quotas."""

    num_tmp_removed: int
    orphans_removed: tuple[str, ...]
    num_reclaimed: int = 0


def sweep_store(factory: sessionmaker[Session], store: AdapterStore, *,
                grace_s: float) -> SweepResult:
    """Removes crash leftovers older than ``grace_s`` (blocking: disk and database); in a
    store this registry does not own (moved away while serving), nothing."""
    if not store.is_owned():
        logger.warning("the adapter store %s no longer belongs to this registry; not "
                       "sweeping it", store.root)
        return SweepResult(0, ())
    num_tmp = store.sweep_tmp(older_than_s=grace_s)
    orphans = remove_unreferenced(factory, store, older_than_s=grace_s)
    return SweepResult(num_tmp, tuple(orphans), reclaim_deleted(factory, store))


class StoreSweeper:
    """``sweep_store`` at ``start()`` and every ``interval_s`` until ``stop()``."""

    def __init__(self, factory: sessionmaker[Session], store: AdapterStore, *,
                 grace_s: float, interval_s: float) -> None:
        self.factory = factory
        self.store = store
        self.grace_s = grace_s
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the loop on the running event loop; the first sweep runs at once."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Cancels the loop; a sweep already running in its thread finishes on its own."""
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                result = await asyncio.to_thread(sweep_store, self.factory, self.store,
                                                 grace_s=self.grace_s)
            except Exception:
                # A full disk or a database outage must not end crash recovery for good.
                logger.exception("sweeping the adapter store failed; retrying later")
            else:
                if result.num_tmp_removed or result.orphans_removed or result.num_reclaimed:
                    logger.info("adapter store sweep removed %d temporary entries and %d "
                                "orphan folders; reclaimed %d deleted versions' bytes",
                                result.num_tmp_removed, len(result.orphans_removed),
                                result.num_reclaimed)
            await asyncio.sleep(self.interval_s)
