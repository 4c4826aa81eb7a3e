"""The engine's figures at one moment, as one typed, frozen object."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """Queue, KV pool, prefix cache and adapter slots; counters are running totals since
    the engine started. The admin API shows these fields under the same names."""

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
    adapter_slots: tuple[str | None, ...]  # per device slot: ``id@digest12`` or empty
