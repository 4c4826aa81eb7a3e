"""The engine's figures at one moment, as one typed, frozen object, and how the figures of
several replicas add up to those of the deployment."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from loraplex.engine.fairness import TenantStats

# The replica ordinal of figures that add up every replica of a deployment.
ALL_REPLICAS = -1


@dataclass(frozen=True)
class EngineStats:
    """Queue, KV pool, prefix cache and adapter slots; counters are running totals since
    the engine started. The admin API shows these fields under the same names.

    Adapters are spelled ``id@digest12`` everywhere (``adapter_slots``, ``host_adapters``,
    ``running_adapters``, ``waiting_adapters``).
    """

    # Which replica: an ordinal 0..N-1 that a replacement replica inherits (0 in process,
    # ALL_REPLICAS for a sum made by ``combine_stats``).
    replica: int
    num_preemptions: int
    num_swap_outs: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached_free: int
    kv_pool_usage: float  # kv_blocks_used / kv_blocks_total: how full the pool is
    # Tokens stored / token slots of the blocks live requests hold (1 minus the padding of
    # their last blocks): the fill of held blocks, not how much of the pool is in use.
    kv_utilization: float
    host_blocks_total: int
    host_blocks_used: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_unfinished: int  # requests accepted and not yet retired, queued ones included
    num_steps: int
    adapter_slot_loads: int
    adapter_slot_evictions: int
    adapter_disk_loads: int
    adapter_load_seconds: float
    max_loras: int  # device slots
    max_cpu_loras: int  # capacity of the host-memory cache
    adapter_slots: tuple[str | None, ...]  # per device slot: ``id@digest12`` or empty
    host_adapters: tuple[str, ...]  # in the host-memory cache, least recently used first
    # Distinct adapters of the requests in the running batch, and of those waiting for it
    # (queued, or swapped out to host memory), sorted.
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    # Speculative decoding (zeros when off): verify steps with proposals, tokens proposed,
    # tokens accepted; accepted / proposed; tokens a verify step yields on average
    # (accepted / drafts + the target's own one).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    # The three counters per adapter, ``(id@digest12 or "" for the base model, drafts,
    # draft tokens, accepted tokens)``, sorted by name.
    spec_by_adapter: tuple[tuple[str, int, int, int], ...] = ()
    # The draft model's forwards (method draft_model, zeros otherwise): how many, the tokens
    # they ran (catch-up and fed proposals), and the longest one, in tokens (at most the
    # step's token budget: a long prompt's catch-up is spread over steps).
    spec_draft_forwards: int = 0
    spec_draft_forward_tokens: int = 0
    spec_draft_max_forward_tokens: int = 0
    # The prefix cache's disk tier (zeros when off): its byte budget (0: no tier); prompt
    # tokens whose KV was loaded from it; blocks and bytes on disk; files written, deleted
    # for the budget, and refused (corrupt, truncated, another model's, or not the block
    # asked for).
    kv_disk_max_bytes: int = 0
    kv_disk_hit_tokens: int = 0
    kv_disk_blocks: int = 0
    kv_disk_bytes_used: int = 0
    kv_disk_writes: int = 0
    kv_disk_evictions: int = 0
    kv_disk_refused: int = 0
    kv_disk_read_ahead: int = 0  # blocks loaded that were read off the step loop before
    # Prefill/decode transfers (kv_transfer.py): blocks exported after a prefill, placed in
    # the pool for a decode, and refused (malformed, another model's, not the request's).
    kv_transfer_exported: int = 0
    kv_transfer_imported: int = 0
    kv_transfer_refused: int = 0
    # The replica's pool with prefill/decode disaggregation ("prefill" or "decode"; "" for
    # an engine that does both, and for a sum over pools).
    role: str = ""
    # The scheduler's view of each tenant it has served (opaque ids, sorted): queues,
    # service received and KV blocks held.
    tenants: tuple[TenantStats, ...] = ()
    # Adapters the operator pinned (kept in a slot and in the host cache), as given.
    pinned_adapters: tuple[str, ...] = ()

    @classmethod
    def spec_rates(cls, num_drafts: int, num_draft_tokens: int,
                   num_accepted: int) -> tuple[float, float]:
        """``spec_acceptance_rate`` and ``spec_mean_accepted_length`` of those counters."""
        return (num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
                1.0 + num_accepted / num_drafts if num_drafts else 0.0)


# Fields recomputed from the summed counters of a deployment, never summed themselves.
RATES = ("prefix_cache_hit_rate", "kv_pool_usage", "kv_utilization", "spec_acceptance_rate",
         "spec_mean_accepted_length")
# Fields whose deployment figure is the largest of the replicas'.
MAXIMA = ("spec_draft_max_forward_tokens",)
# Fields whose deployment figure is the sum of the replicas' (counters, sizes, counts).
_SUMMED = tuple(f.name for f in fields(EngineStats)
                if f.type in ("int", "float") and f.name != "replica"
                and f.name not in RATES and f.name not in MAXIMA)


def _distinct(groups: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(sorted({name for group in groups for name in group}))


def _combine_tenants(stats: Sequence[EngineStats]) -> tuple[TenantStats, ...]:
    """Per tenant, the sums over replicas (``service`` too: each replica's counter is the
    service it gave, lifted when the tenant came back to it)."""
    by_tenant: dict[str, list[TenantStats]] = {}
    for s in stats:
        for t in s.tenants:
            by_tenant.setdefault(t.tenant, []).append(t)
    return tuple(TenantStats(
        tenant=name, weight=parts[0].weight,
        **{f.name: sum(getattr(p, f.name) for p in parts)
           for f in fields(TenantStats) if f.name not in ("tenant", "weight")})
        for name, parts in sorted(by_tenant.items()))


def combine_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The figures of a deployment from those of its replicas.

    Counters, block counts and capacities are summed and rates recomputed from the sums, maxima
    (``spec_draft_max_forward_tokens``) are the largest; ``kv_utilization`` is the replicas' weighted by the blocks they hold. ``adapter_slots``
    and ``host_adapters`` are concatenated in replica order (one entry per slot or cache
    entry, so their lengths still count capacity and residency); running and waiting
    adapters are the distinct union; ``spec_by_adapter`` and ``tenants`` sum per adapter
    and per tenant. ``replica`` is ``ALL_REPLICAS``. No replica at all (none
    is live) gives zeros and empty tuples: a deployment that has nothing now.
    """
    sums = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    used = sums["kv_blocks_used"]
    by_adapter: dict[str, list[int]] = {}
    for s in stats:
        for name, *counts in s.spec_by_adapter:
            totals = by_adapter.setdefault(name, [0, 0, 0])
            for i, count in enumerate(counts):
                totals[i] += count
    acceptance, mean_length = EngineStats.spec_rates(
        sums["spec_num_drafts"], sums["spec_num_draft_tokens"], sums["spec_num_accepted_tokens"])
    return EngineStats(
        replica=ALL_REPLICAS,
        prefix_cache_hit_rate=(sums["prefix_cache_hit_tokens"]
                               / sums["prefix_cache_queried_tokens"]
                               if sums["prefix_cache_queried_tokens"] else 0.0),
        kv_pool_usage=used / sums["kv_blocks_total"] if sums["kv_blocks_total"] else 0.0,
        kv_utilization=(sum(s.kv_utilization * s.kv_blocks_used for s in stats) / used
                        if used else 0.0),
        adapter_slots=tuple(slot for s in stats for slot in s.adapter_slots),
        host_adapters=tuple(name for s in stats for name in s.host_adapters),
        pinned_adapters=_distinct(s.pinned_adapters for s in stats),
        running_adapters=_distinct(s.running_adapters for s in stats),
        waiting_adapters=_distinct(s.waiting_adapters for s in stats),
        spec_acceptance_rate=acceptance,
        spec_mean_accepted_length=mean_length,
        spec_draft_max_forward_tokens=max((s.spec_draft_max_forward_tokens for s in stats),
                                          default=0),
        spec_by_adapter=tuple((name, *counts) for name, counts in  # type: ignore[misc]
                              sorted(by_adapter.items())),
        tenants=_combine_tenants(stats),
        **sums,
    )
