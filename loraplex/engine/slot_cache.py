"""Which adapters sit in which device slot, and the host-memory cache in front of disk.

Pure bookkeeping: loading from disk and writing a slot's tensors are callbacks, so the
policy is testable without a model. An adapter pinned by an in-flight request is never
evicted from its slot; unpinned slots are reused least-recently-used first. Disk loads
run on one background thread so the step loop keeps serving other adapters meanwhile.

A deleted adapter (``forget``) is never read from disk again; the requests that were
already in flight on it keep its weights until the last of them ends
(``release_deleted``).

Operators pin adapters (``set_pinned``; "held" here, to tell them from the per-request
pins above): a held adapter keeps its host copy, is installed into a slot as soon as its
weights are in memory (``install_pinned``, each step), and its slot is never reused for
another adapter. Held adapters take at most ``max_pinned`` slots.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from loraplex.engine.request import AdapterKey, AdapterRef
from loraplex.errors import AdapterError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterStats:
    num_slot_loads: int
    num_slot_evictions: int
    num_disk_loads: int
    total_load_seconds: float
    slots: tuple[AdapterKey | None, ...]
    pins: tuple[int, ...]
    host: tuple[AdapterKey, ...]  # in the host-memory cache, least recently used first
    held: tuple[AdapterKey, ...]  # pinned by the operator, in the order given


def _closed(*_: Any) -> None:
    raise RuntimeError("the engine is closed")


def deleted_error() -> AdapterError:
    """The error of a request that reached the engine after its adapter version was
    deleted (it resolved the version just before the delete)."""
    return AdapterError("this adapter version was deleted as the request arrived; send it "
                        "again to get the adapter's current version")


class AdapterSlotCache:
    def __init__(self, max_loras: int, max_cpu_loras: int,
                 load_from_disk: Callable[[AdapterRef], Any],
                 install: Callable[[int, Any], None], max_pinned: int = 0) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_pinned = max_pinned
        self._held: dict[AdapterKey, AdapterRef] = {}
        self._load_from_disk = load_from_disk
        self._install = install
        self._slots: list[AdapterKey | None] = [None] * max_loras
        self._pins = [0] * max_loras
        self._slot_of: dict[AdapterKey, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self._host: OrderedDict[AdapterKey, Any] = OrderedDict()
        self._loading: dict[AdapterKey, Future[Any]] = {}
        self._failed: dict[AdapterKey, AdapterError] = {}
        # Deleted versions, never loaded again; of those, the weights kept for requests
        # that were in flight at the delete (dropped by ``release_deleted``).
        self._deleted: set[AdapterKey] = set()
        self._retained: dict[AdapterKey, Any] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-adapter")
        self.num_slot_loads = 0
        self.num_slot_evictions = 0
        self.num_disk_loads = 0
        self.total_load_seconds = 0.0

    def close(self) -> None:
        """Stops the loader and lets go of the engine: the callbacks are the engine's bound
        methods, and with them held the engine (model, KV cache, host adapters) outlived
        ``LLM.close()`` until the cycle collector ran (a benchmark making engines one after
        another grew past 16 GB)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._load_from_disk = _closed
        self._install = _closed
        with self._lock:
            self._host.clear()
            self._retained.clear()

    # --- host cache -------------------------------------------------------------------

    def is_ready(self, ref: AdapterRef) -> bool:
        """In a slot or in the host cache: can be installed without touching disk."""
        with self._lock:
            return (ref.key in self._slot_of or ref.key in self._host
                    or ref.key in self._retained)

    def failure(self, ref: AdapterRef) -> AdapterError | None:
        """The error of a failed background load (then forgotten, so a retry reloads)."""
        with self._lock:
            return self._failed.pop(ref.key, None)

    def prefetch(self, ref: AdapterRef) -> None:
        """Starts loading an adapter from disk into the host cache in the background."""
        with self._lock:
            if ref.key in self._host or ref.key in self._loading or ref.key in self._slot_of \
                    or ref.key in self._retained:
                return
            self._loading[ref.key] = self._pool.submit(self._load, ref)

    def load_now(self, ref: AdapterRef) -> Any:
        """Loads synchronously (validating); used at admission to fail fast on bad files."""
        with self._lock:
            if ref.key in self._retained:
                return self._retained[ref.key]
            if ref.key in self._host:
                self._host.move_to_end(ref.key)
                return self._host[ref.key]
        return self._load(ref)

    def _load(self, ref: AdapterRef) -> Any:
        start = time.perf_counter()
        with self._lock:
            if ref.key in self._retained:  # deleted after this load was queued
                self._loading.pop(ref.key, None)
                return self._retained[ref.key]
        try:
            if ref.key in self._deleted:
                raise deleted_error()  # its files are gone, or about to go
            adapter = self._load_from_disk(ref)
        except Exception as exc:
            # Any failure (a bad file, or one deleted mid-read) is remembered for the
            # scheduler to report; a waiting request must never hang on it.
            error = exc if isinstance(exc, AdapterError) else AdapterError(
                f"cannot load adapter {ref.adapter_id!r}: {exc}")
            with self._lock:
                self._failed[ref.key] = error
                self._loading.pop(ref.key, None)
            if error is exc:
                raise
            raise error from exc
        with self._lock:
            self.num_disk_loads += 1
            self.total_load_seconds += time.perf_counter() - start
            self._loading.pop(ref.key, None)
            if ref.key in self._deleted:  # deleted while it was being read: not cached
                return adapter
            self._host[ref.key] = adapter
            self._host.move_to_end(ref.key)
            self._trim_host()
        return adapter

    def _trim_host(self) -> None:
        """Least recently used first, never a held adapter's copy (under the lock)."""
        over = len(self._host) - self.max_cpu_loras
        for key in [k for k in self._host if k not in self._held][:max(over, 0)]:
            del self._host[key]

    # --- pinned by the operator ---------------------------------------------------------

    def set_pinned(self, refs: list[AdapterRef]) -> None:
        """Makes ``refs`` the held adapters (replacing the previous set); a deleted one is
        left out. Their disk loads start now; ``install_pinned`` puts them in slots."""
        held = {r.key: r for r in refs if r.key not in self._deleted}
        if len(held) > self.max_pinned:
            raise AdapterError(
                f"{len(held)} pinned adapters, but pins may take at most {self.max_pinned} "
                f"of the {self.max_loras} adapter slots (max_pinned_fraction)")
        with self._lock:
            self._held = held
            self._trim_host()
        for ref in held.values():
            self.prefetch(ref)

    def install_pinned(self) -> None:
        """Puts held adapters whose weights are in memory into slots (called between
        steps); one still loading, or with every other slot in use, waits for a later
        step."""
        for key, ref in list(self._held.items()):
            if key in self._slot_of:
                continue
            if not self.is_ready(ref):
                failure = self.failure(ref)
                if failure is not None:  # unreadable: not retried until pinned again
                    logger.warning("pinned adapter %s: %s", ref.adapter_id, failure)
                    del self._held[key]
                else:
                    self.prefetch(ref)
                continue
            if self.can_acquire(key):
                self.acquire(ref)
                self.release(key)

    def has_pinned_to_install(self) -> bool:
        return any(key not in self._slot_of for key in self._held)

    # --- device slots -----------------------------------------------------------------

    def _reusable(self, slot: int) -> bool:
        """No request uses the slot and no held adapter sits in it."""
        key = self._slots[slot]
        return self._pins[slot] == 0 and (key is None or key not in self._held)

    def can_acquire(self, key: AdapterKey) -> bool:
        """Resident already, or some slot is empty or reusable."""
        return key in self._slot_of or any(self._reusable(s) for s in range(self.max_loras))

    def acquire(self, ref: AdapterRef) -> int:
        """Pins the adapter in a slot, installing it (host cache → device) if needed."""
        key = ref.key
        slot = self._slot_of.get(key)
        if slot is None:
            slot = next((s for s in self._slot_lru if self._reusable(s)), None)
            if slot is None:
                raise RuntimeError("no free adapter slot (scheduler must check can_acquire)")
            old = self._slots[slot]
            if old is not None:
                del self._slot_of[old]
                self.num_slot_evictions += 1
            adapter = self.load_now(ref)
            start = time.perf_counter()
            self._install(slot, adapter)
            self.total_load_seconds += time.perf_counter() - start
            self._slots[slot] = key
            self._slot_of[key] = slot
            self.num_slot_loads += 1
        self._pins[slot] += 1
        self._slot_lru.move_to_end(slot)
        return slot

    def release(self, key: AdapterKey) -> None:
        slot = self._slot_of.get(key)
        if slot is None or self._pins[slot] == 0:
            raise RuntimeError(f"adapter {key} released more often than acquired")
        self._pins[slot] -= 1

    def is_deleted(self, key: AdapterKey) -> bool:
        return key in self._deleted

    def forget(self, key: AdapterKey, in_flight: AdapterRef | None = None) -> None:
        """Drops an adapter (deleted): from the host cache, and its slot once unpinned; it
        is never read from disk again. ``in_flight``: the ref of a request still using it,
        whose weights (the host copy, else read now: the files go only after this) are
        then kept for such requests, wherever they are (running, queued, preempted, swapped
        out), until ``release_deleted``."""
        with self._lock:
            self._deleted.add(key)
            self._held.pop(key, None)
            adapter = self._host.pop(key, None)
        if in_flight is not None and key not in self._retained:
            if adapter is None:
                try:
                    adapter = self._load_from_disk(in_flight)
                except Exception:  # its files went first: its requests fail as deleted
                    adapter = None
            if adapter is not None:
                with self._lock:
                    self._retained[key] = adapter
                    self._failed.pop(key, None)  # a load that raced the delete
                return
        self._drop_slot(key)

    def release_deleted(self, in_use: set[AdapterKey]) -> None:
        """Lets go of the kept weights of deleted adapters no request in ``in_use`` has."""
        for key in [k for k in self._retained if k not in in_use]:
            with self._lock:
                del self._retained[key]
            self._drop_slot(key)

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def _drop_slot(self, key: AdapterKey) -> None:
        slot = self._slot_of.get(key)
        if slot is not None and self._pins[slot] == 0:
            del self._slot_of[key]
            self._slots[slot] = None
            self._install(slot, None)

    def stats(self) -> AdapterStats:
        with self._lock:
            host = tuple(self._host)
        return AdapterStats(self.num_slot_loads, self.num_slot_evictions, self.num_disk_loads,
                            self.total_load_seconds, tuple(self._slots), tuple(self._pins),
                            host, tuple(self._held))
