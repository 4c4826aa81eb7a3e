"""Which adapters sit in which device slot, and the host-memory cache in front of disk.

Pure bookkeeping: loading from disk and writing a slot's tensors are callbacks, so the
policy is testable without a model. An adapter pinned by an in-flight request is never
evicted from its slot; unpinned slots are reused least-recently-used first. Disk loads
run on one background thread so the step loop keeps serving other adapters meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from loraplex.engine.request import AdapterKey, AdapterRef
from loraplex.errors import AdapterError


@dataclass(frozen=True)
class AdapterStats:
    num_slot_loads: int
    num_slot_evictions: int
    num_disk_loads: int
    total_load_seconds: float
    slots: tuple[AdapterKey | None, ...]
    pins: tuple[int, ...]
    host: tuple[AdapterKey, ...]  # in the host-memory cache, least recently used first


def _closed(*_: Any) -> None:
    raise RuntimeError("the engine is closed")


class AdapterSlotCache:
    def __init__(self, max_loras: int, max_cpu_loras: int,
                 load_from_disk: Callable[[AdapterRef], Any],
                 install: Callable[[int, Any], None]) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._load_from_disk = load_from_disk
        self._install = install
        self._slots: list[AdapterKey | None] = [None] * max_loras
        self._pins = [0] * max_loras
        self._slot_of: dict[AdapterKey, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self._host: OrderedDict[AdapterKey, Any] = OrderedDict()
        self._loading: dict[AdapterKey, Future[Any]] = {}
        self._failed: dict[AdapterKey, AdapterError] = {}
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

    # --- host cache -------------------------------------------------------------------

    def is_ready(self, ref: AdapterRef) -> bool:
        """In a slot or in the host cache: can be installed without touching disk."""
        with self._lock:
            return ref.key in self._slot_of or ref.key in self._host

    def failure(self, ref: AdapterRef) -> AdapterError | None:
        """The error of a failed background load (then forgotten, so a retry reloads)."""
        with self._lock:
            return self._failed.pop(ref.key, None)

    def prefetch(self, ref: AdapterRef) -> None:
        """Starts loading an adapter from disk into the host cache in the background."""
        with self._lock:
            if ref.key in self._host or ref.key in self._loading or ref.key in self._slot_of:
                return
            self._loading[ref.key] = self._pool.submit(self._load, ref)

    def load_now(self, ref: AdapterRef) -> Any:
        """Loads synchronously (validating); used at admission to fail fast on bad files."""
        with self._lock:
            if ref.key in self._host:
                self._host.move_to_end(ref.key)
                return self._host[ref.key]
        return self._load(ref)

    def _load(self, ref: AdapterRef) -> Any:
        start = time.perf_counter()
        try:
            adapter = self._load_from_disk(ref)
        except Exception as exc:
            # Any failure (a bad file, or one deleted mid-read) is remembered for the
            # scheduler to report; a waiting request must never hang on it.
            error = exc if isinstance(exc, AdapterError) else AdapterError(
                f"cannot load adapter {ref.adapter_id!r}: {exc}")
            with self._lock:
                self._failed[ref.key] = error
                self._loading.pop(ref.key, None)
            raise error from exc
        with self._lock:
            self.num_disk_loads += 1
            self.total_load_seconds += time.perf_counter() - start
            self._host[ref.key] = adapter
            self._host.move_to_end(ref.key)
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
            self._loading.pop(ref.key, None)
        return adapter

    # --- device slots -----------------------------------------------------------------

    def can_acquire(self, key: AdapterKey) -> bool:
        """Resident already, or some slot is empty or unpinned."""
        return key in self._slot_of or any(p == 0 for p in self._pins)

    def acquire(self, ref: AdapterRef) -> int:
        """Pins the adapter in a slot, installing it (host cache → device) if needed."""
        key = ref.key
        slot = self._slot_of.get(key)
        if slot is None:
            slot = next((s for s in self._slot_lru if self._pins[s] == 0), None)
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

    def forget(self, key: AdapterKey) -> None:
        """Drops an adapter (deleted): from the host cache, and its slot once unpinned."""
        with self._lock:
            self._host.pop(key, None)
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
                            host)
