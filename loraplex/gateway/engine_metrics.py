"""The engine's Prometheus metrics, one series per replica, from ``EngineStats`` snapshots.

Every series carries a ``replica`` label: the replica's ordinal (0..N-1, "0" in process),
which a replacement replica inherits, so the label set stays bounded however often replicas
are replaced. The engine keeps running totals; counters here get what happened since the
previous snapshot of the same replica, and a total that went down means the replica was
replaced (or restarted): its new totals are counted from zero, never as a negative step.

``lora_requests_info`` follows vLLM's ``vllm:lora_requests_info`` (the series an external
router such as llm-d's LoRA-affinity scorer reads): labels ``running_lora_adapters`` and
``waiting_lora_adapters`` (comma-joined ``id@digest12``, sorted, at most
``MAX_INFO_ADAPTERS`` each), ``max_lora``, and its value the Unix time of the snapshot.
Unlike vLLM, a replica keeps one series: the previous label set is removed when it changes.

Speculative decoding: ``spec_decode_num_drafts``, ``_num_draft_tokens`` and
``_num_accepted_tokens`` (counters, as vLLM's) by replica and adapter (``id@digest12``, or
``base``; capped like the replica label), and each replica's acceptance rate.

``adapter_residency``: 1 for each adapter resident on a replica, by ``level`` (``device``
slot or ``host`` cache) and ``pinned`` ("true" for a version the operator pinned, which
stays resident), ``adapter`` as ``id@digest12`` capped like the other adapter labels.

The prefix cache's disk tier: ``kv_disk_blocks`` and ``kv_disk_bytes`` (gauges) and
``kv_disk_hit_tokens``, ``_writes``, ``_evictions``, ``_refused`` (counters), by replica.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from loraplex.engine.stats import EngineStats

ADAPTER_LOAD_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Adapters named per list in lora_requests_info: keeps the label value short (each name is
# ``id@digest12``) when many requests queue for different adapters.
MAX_INFO_ADAPTERS: Final = 32
RESIDENCY_LEVELS: Final = ("device", "host")


@dataclass(frozen=True)
class _Totals:
    """A replica's cumulative counters as of its previous snapshot."""

    loads: int = 0
    evictions: int = 0
    load_seconds: float = 0.0

    @classmethod
    def of(cls, stats: EngineStats) -> _Totals:
        return cls(stats.adapter_slot_loads, stats.adapter_slot_evictions,
                   stats.adapter_load_seconds)

    def since(self, before: _Totals) -> _Totals:
        """The increments from ``before`` (see ``increments``)."""
        loads, evictions, seconds = increments(
            (self.loads, self.evictions, self.load_seconds),
            (before.loads, before.evictions, before.load_seconds))
        return _Totals(int(loads), int(evictions), seconds)


def increments(now: tuple[float, ...], before: tuple[float, ...]) -> tuple[float, ...]:
    """What a replica's running totals gained since ``before``; all of ``now`` if any
    total went down (a new replica under the same ordinal started from zero)."""
    if any(n < b for n, b in zip(now, before, strict=True)):
        return now
    return tuple(n - b for n, b in zip(now, before, strict=True))


def _disk_totals(stats: EngineStats) -> tuple[int, ...]:
    return (stats.kv_disk_hit_tokens, stats.kv_disk_writes, stats.kv_disk_evictions,
            stats.kv_disk_refused)


def info_adapters(names: Sequence[str]) -> str:
    """A lora_requests_info label value: the first ``MAX_INFO_ADAPTERS`` names, joined."""
    return ",".join(names[:MAX_INFO_ADAPTERS])


class EngineMetrics:
    """The engine's gauges, counters and adapter-load histogram, labelled by replica."""

    def __init__(self, registry: CollectorRegistry, namespace: str,
                 replica_label: Callable[[str], str],
                 adapter_label: Callable[[str], str],
                 tenant_label: Callable[[str], str]) -> None:
        self._replica_label = replica_label
        self._adapter_label = adapter_label
        self._tenant_label = tenant_label
        # Service tokens as of the previous snapshot, by (replica, tenant id).
        self._service_totals: dict[tuple[str, str], tuple[int, int]] = {}
        self._tenant_series: dict[str, set[str]] = {}  # replica -> tenant labels set
        self._totals: dict[str, _Totals] = {}
        # Speculative counters as of the previous snapshot, by (replica, adapter identity).
        self._spec_totals: dict[tuple[str, str], tuple[int, int, int]] = {}
        self._info_labels: dict[str, tuple[str, str, str]] = {}
        self._lock = threading.Lock()

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, ["replica", *labels], namespace=namespace,
                         registry=registry)

        self.queue_depth = gauge("queue_depth", "Requests waiting to be scheduled.")
        self.running = gauge("running_requests", "Requests in the running batch.")
        self.kv_blocks_used = gauge("kv_blocks_used",
                                    "KV cache blocks referenced by live requests.")
        self.kv_blocks_free = gauge("kv_blocks_free",
                                    "KV cache blocks free or cached with no reference.")
        self.kv_pool_usage = gauge("kv_pool_usage",
                                   "Fraction of the KV block pool referenced (0..1).")
        self.prefix_cache_hit_rate = gauge(
            "prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.")
        self.adapters_resident = gauge(
            "adapter_resident", "Adapters resident, by level: device slot or host cache.",
            "level")
        self.adapter_capacity = gauge(
            "adapter_capacity", "Adapters that fit, by level: device slots or host cache.",
            "level")
        self.adapter_residency = gauge(
            "adapter_residency", "1 per adapter resident, by level and whether it is pinned.",
            "adapter", "level", "pinned")
        self._residency: dict[str, set[tuple[str, str, str]]] = {}
        self.lora_info = gauge(
            "lora_requests_info",
            "Adapters of running and waiting requests (as vLLM's vllm:lora_requests_info); "
            "the value is the Unix time of the snapshot.",
            "max_lora", "running_lora_adapters", "waiting_lora_adapters")
        self.adapter_loads = Counter("adapter_loads", "Adapters loaded into a device slot.",
                                     ["replica"], namespace=namespace, registry=registry)
        self.adapter_evictions = Counter("adapter_evictions",
                                         "Adapters evicted from a device slot.", ["replica"],
                                         namespace=namespace, registry=registry)
        self.adapter_load_time = Histogram(
            "adapter_load_seconds", "Time to load an adapter into a device slot.", ["replica"],
            namespace=namespace, registry=registry, buckets=ADAPTER_LOAD_BUCKETS)
        self.spec_acceptance_rate = gauge(
            "spec_decode_acceptance_rate",
            "Speculative tokens accepted / proposed since the replica started (0..1).")

        def spec_counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["replica", "adapter"], namespace=namespace,
                           registry=registry)

        # By adapter ("base" for the base model), as vLLM's spec_decode_num_* counters.
        self.spec_counters = (
            spec_counter("spec_decode_num_drafts", "Verify steps with speculative proposals."),
            spec_counter("spec_decode_num_draft_tokens", "Speculative tokens proposed."),
            spec_counter("spec_decode_num_accepted_tokens",
                         "Speculative tokens the target model accepted."))
        # The scheduler's view of each tenant (its opaque id: the registry's tenant id).
        self.tenant_waiting = gauge("tenant_waiting_requests",
                                    "Requests waiting, by tenant id.", "tenant_id")
        self.tenant_running = gauge("tenant_running_requests",
                                    "Requests in the running batch, by tenant id.",
                                    "tenant_id")
        self.tenant_kv_blocks = gauge("tenant_kv_blocks",
                                      "KV blocks the tenant's running requests hold.",
                                      "tenant_id")
        self.tenant_service = Counter(
            "tenant_service_tokens", "Tokens scheduled for the tenant (its service), by "
            "kind: prefill (prompt or recomputed) or decode.", ["replica", "tenant_id", "kind"],
            namespace=namespace, registry=registry)
        # The prefix cache's disk tier (--kv-disk-dir; zeros when off).
        self.kv_disk_blocks = gauge("kv_disk_blocks", "KV blocks kept in the disk tier.")
        self.kv_disk_bytes = gauge("kv_disk_bytes", "Bytes the disk tier's blocks take.")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["replica"], namespace=namespace, registry=registry)

        # In the order of _disk_totals.
        self.kv_disk_counters = (
            counter("kv_disk_hit_tokens", "Prompt tokens whose KV was loaded from disk."),
            counter("kv_disk_writes", "KV blocks written to the disk tier."),
            counter("kv_disk_evictions", "Disk-tier blocks deleted to stay within budget."),
            counter("kv_disk_refused", "Disk-tier files refused as damaged or foreign "
                    "(their tokens recomputed)."))
        self._disk_totals: dict[str, tuple[int, ...]] = {}
        self._per_replica = (self.queue_depth, self.running, self.kv_blocks_used,
                             self.kv_blocks_free, self.kv_pool_usage,
                             self.prefix_cache_hit_rate, self.spec_acceptance_rate,
                             self.kv_disk_blocks, self.kv_disk_bytes)

    def observe(self, replicas: Sequence[EngineStats]) -> None:
        """Sets every series from one snapshot of each replica; the gauges of a replica
        missing from it (the deployment shrank) are removed."""
        with self._lock:
            seen: set[str] = set()
            for stats in replicas:
                replica = self._replica_label(str(stats.replica))
                seen.add(replica)
                self._set_gauges(replica, stats)
                self._count(replica, _Totals.of(stats))
                self._count_spec(replica, stats)
                self._count_disk(replica, stats)
                self._observe_tenants(replica, stats)
            for replica in set(self._info_labels) - seen:
                self._forget(replica)

    def _set_gauges(self, replica: str, stats: EngineStats) -> None:
        values = (stats.num_waiting, stats.num_running, stats.kv_blocks_used,
                  stats.kv_blocks_free, stats.kv_pool_usage, stats.prefix_cache_hit_rate,
                  stats.spec_acceptance_rate, stats.kv_disk_blocks, stats.kv_disk_bytes_used)
        for metric, value in zip(self._per_replica, values, strict=True):
            metric.labels(replica).set(value)
        resident = (sum(slot is not None for slot in stats.adapter_slots),
                    len(stats.host_adapters))
        for level, count, capacity in zip(RESIDENCY_LEVELS, resident,
                                          (stats.max_loras, stats.max_cpu_loras), strict=True):
            self.adapters_resident.labels(replica, level).set(count)
            self.adapter_capacity.labels(replica, level).set(capacity)
        self._set_residency(replica, stats)
        labels = (str(stats.max_loras), info_adapters(stats.running_adapters),
                  info_adapters(stats.waiting_adapters))
        previous = self._info_labels.get(replica)
        if previous is not None and previous != labels:
            self.lora_info.remove(replica, *previous)
        self._info_labels[replica] = labels
        self.lora_info.labels(replica, *labels).set(time.time())

    def _set_residency(self, replica: str, stats: EngineStats) -> None:
        pinned = set(stats.pinned_adapters)
        now = {(self._adapter_label(name), level, "true" if name in pinned else "false")
               for level, names in zip(RESIDENCY_LEVELS, (stats.adapter_slots,
                                                          stats.host_adapters), strict=True)
               for name in names if name is not None}
        for labels in self._residency.get(replica, set()) - now:
            self.adapter_residency.remove(replica, *labels)
        for labels in now:
            self.adapter_residency.labels(replica, *labels).set(1)
        self._residency[replica] = now

    def _count(self, replica: str, totals: _Totals) -> None:
        step = totals.since(self._totals.get(replica, _Totals()))
        self._totals[replica] = totals
        self.adapter_loads.labels(replica).inc(step.loads)
        self.adapter_evictions.labels(replica).inc(step.evictions)
        load_time = self.adapter_load_time.labels(replica)
        for _ in range(step.loads):
            # Only the interval's total time is known: each of its loads gets the mean.
            load_time.observe(step.load_seconds / step.loads)

    def _count_disk(self, replica: str, stats: EngineStats) -> None:
        now = _disk_totals(stats)
        step = increments(now, self._disk_totals.get(replica, (0,) * len(now)))
        self._disk_totals[replica] = now
        for counter, increment in zip(self.kv_disk_counters, step, strict=True):
            counter.labels(replica).inc(increment)

    def _count_spec(self, replica: str, stats: EngineStats) -> None:
        for name, *counts in stats.spec_by_adapter:
            now = (counts[0], counts[1], counts[2])
            step = increments(now, self._spec_totals.get((replica, name), (0, 0, 0)))
            self._spec_totals[(replica, name)] = now
            adapter = self._adapter_label(name or "base")
            for counter, increment in zip(self.spec_counters, step, strict=True):
                counter.labels(replica, adapter).inc(increment)

    def _observe_tenants(self, replica: str, stats: EngineStats) -> None:
        shown: set[str] = set()
        for t in stats.tenants:
            tenant = self._tenant_label(t.tenant or "none")
            shown.add(tenant)
            self.tenant_waiting.labels(replica, tenant).set(t.num_waiting + t.num_swapped)
            self.tenant_running.labels(replica, tenant).set(t.num_running)
            self.tenant_kv_blocks.labels(replica, tenant).set(t.kv_blocks)
            now = (t.prefill_tokens, t.decode_tokens)
            step = increments(now, self._service_totals.get((replica, t.tenant), (0, 0)))
            self._service_totals[(replica, t.tenant)] = now
            for kind, increment in zip(("prefill", "decode"), step, strict=True):
                self.tenant_service.labels(replica, tenant, kind).inc(increment)
        for tenant in self._tenant_series.get(replica, set()) - shown:
            for gauge in (self.tenant_waiting, self.tenant_running, self.tenant_kv_blocks):
                gauge.remove(replica, tenant)
        self._tenant_series[replica] = shown

    def _forget(self, replica: str) -> None:
        for tenant in self._tenant_series.pop(replica, set()):
            for gauge in (self.tenant_waiting, self.tenant_running, self.tenant_kv_blocks):
                gauge.remove(replica, tenant)
        for metric in self._per_replica:
            metric.remove(replica)
        for labels in self._residency.pop(replica, set()):
            self.adapter_residency.remove(replica, *labels)
        for level in RESIDENCY_LEVELS:
            self.adapters_resident.remove(replica, level)
            self.adapter_capacity.remove(replica, level)
        self.lora_info.remove(replica, *self._info_labels.pop(replica))
