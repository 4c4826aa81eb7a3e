"""The engine's figures: adapters by residency level and by request state, and how the
figures of two real engines (two replicas) combine."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.stats import ALL_REPLICAS, EngineStats, combine_stats
from loraplex.llm import LoRARequest

PROMPT = [11, 42, 7, 99, 100, 3, 58]
LONG = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(model_dir: Path, max_loras: int, max_cpu_loras: int,
                max_num_seqs: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(str(model_dir)), CacheConfig(block_size=16, num_kv_blocks=64),
        LoRAConfig(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256)),
        progress=False)


@pytest.fixture(scope="module")
def refs(llama_adapters: dict[str, Path]) -> dict[str, AdapterRef]:
    return {name: LoRARequest(name, str(llama_adapters[name])).to_ref()
            for name in ("r4", "r8qv", "r16rs")}


def identity(ref: AdapterRef) -> str:
    return f"{ref.adapter_id}@{ref.digest[:12]}"


@pytest.fixture
def one_seq_engine(tiny_llama_dir: Path) -> Iterator[LLMEngine]:
    """One device slot, two host-cache entries, one running sequence at a time."""
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=2, max_num_seqs=1)
    yield engine
    engine.close()


def submit(engine: LLMEngine, request_id: str, prompt: list[int],
           ref: AdapterRef | None = None) -> None:
    """Queues a request, its adapter loaded first (as the offline API does), so the next
    step can schedule it."""
    if ref is not None:
        engine.adapters.load_now(ref)
    engine.add_request(request_id, prompt, LONG, ref)


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_stats_name_adapters_by_state_and_level(one_seq_engine: LLMEngine,
                                                refs: dict[str, AdapterRef]) -> None:
    engine = one_seq_engine
    idle = engine.stats()
    assert (idle.replica, idle.max_loras, idle.max_cpu_loras) == (0, 1, 2)
    assert idle.adapter_slots == (None,)
    assert idle.host_adapters == idle.running_adapters == idle.waiting_adapters == ()

    first, second = refs["r4"], refs["r8qv"]
    submit(engine, "a", PROMPT, first)
    submit(engine, "b", PROMPT, second)
    submit(engine, "base", PROMPT)  # the base model is no adapter
    engine.step()
    busy = engine.stats()
    assert busy.running_adapters == (identity(first),)
    assert busy.waiting_adapters == (identity(second),)
    assert busy.adapter_slots == (identity(first),)
    assert identity(first) in busy.host_adapters
    drain(engine)

    done = engine.stats()
    assert done.running_adapters == done.waiting_adapters == ()
    # The one slot went to the second adapter; both passed through the host cache.
    assert done.adapter_slots == (identity(second),)
    assert set(done.host_adapters) == {identity(first), identity(second)}
    submit(engine, "c", PROMPT, refs["r16rs"])
    drain(engine)
    # The host cache keeps two, least recently used first.
    assert engine.stats().host_adapters == (identity(second), identity(refs["r16rs"]))


def test_combine_stats_of_two_engines(tiny_llama_dir: Path,
                                      refs: dict[str, AdapterRef]) -> None:
    engines = [make_engine(tiny_llama_dir, max_loras=2, max_cpu_loras=4, max_num_seqs=4),
               make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=2, max_num_seqs=1)]
    try:
        zero, one = engines
        submit(zero, "z1", PROMPT * 3, refs["r4"])
        submit(zero, "z2", PROMPT * 3)
        drain(zero)
        submit(zero, "z3", PROMPT * 3, refs["r4"])  # a prefix-cache hit
        zero.step()
        submit(one, "o1", PROMPT, refs["r8qv"])
        submit(one, "o2", PROMPT, refs["r4"])
        one.step()
        parts = (zero.stats(), dataclasses.replace(one.stats(), replica=1))
        total = combine_stats(parts)
    finally:
        for engine in engines:
            engine.close()

    assert total.replica == ALL_REPLICAS
    for name in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "num_running",
                 "num_waiting", "num_steps", "prefix_cache_queried_tokens",
                 "prefix_cache_hit_tokens", "adapter_slot_loads", "adapter_disk_loads",
                 "max_loras", "max_cpu_loras", "num_unfinished"):
        assert getattr(total, name) == sum(getattr(p, name) for p in parts), name
    assert total.adapter_load_seconds == pytest.approx(
        sum(p.adapter_load_seconds for p in parts))
    assert total.prefix_cache_hit_tokens > 0
    assert total.prefix_cache_hit_rate == pytest.approx(
        total.prefix_cache_hit_tokens / total.prefix_cache_queried_tokens)
    assert total.kv_pool_usage == pytest.approx(total.kv_blocks_used / total.kv_blocks_total)
    assert total.kv_utilization == pytest.approx(
        sum(p.kv_utilization * p.kv_blocks_used for p in parts) / total.kv_blocks_used)
    # Slots and host entries keep one entry each per replica; adapters of requests are the
    # distinct union.
    assert total.adapter_slots == parts[0].adapter_slots + parts[1].adapter_slots
    assert len(total.adapter_slots) == 3
    assert total.host_adapters == parts[0].host_adapters + parts[1].host_adapters
    assert total.running_adapters == tuple(sorted({identity(refs["r4"]),
                                                   identity(refs["r8qv"])}))
    assert parts[1].waiting_adapters == (identity(refs["r4"]),)
    assert total.waiting_adapters == (identity(refs["r4"]),)


def test_combine_stats_of_one_replica_keeps_its_figures(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=2, max_num_seqs=1)
    try:
        submit(engine, "x", PROMPT * 3)
        engine.step()
        alone = engine.stats()
    finally:
        engine.close()
    assert combine_stats([alone]) == dataclasses.replace(alone, replica=ALL_REPLICAS)


def test_combine_stats_of_no_replica_is_nothing() -> None:
    """A deployment whose replicas are all gone (or not yet up) has nothing now."""
    empty = combine_stats([])
    assert empty.replica == ALL_REPLICAS
    assert empty.kv_blocks_total == empty.num_running == empty.max_loras == 0
    assert empty.kv_pool_usage == empty.prefix_cache_hit_rate == empty.kv_utilization == 0.0
    assert empty.adapter_slots == empty.host_adapters == empty.running_adapters == ()


def test_every_numeric_field_is_combined() -> None:
    """A field added to EngineStats later is summed unless it is a rate or a maximum."""
    numeric = {f.name for f in dataclasses.fields(EngineStats) if f.type in ("int", "float")}
    rates = {"prefix_cache_hit_rate", "kv_pool_usage", "kv_utilization",
             "spec_acceptance_rate", "spec_mean_accepted_length"}
    maxima = {"spec_draft_max_forward_tokens"}
    ones = EngineStats(**{f.name: (1 if f.type in ("int", "float") else ())
                          for f in dataclasses.fields(EngineStats)})
    total = combine_stats([ones, ones])
    for name in numeric - rates - maxima - {"replica"}:
        assert getattr(total, name) == 2, name
    threes = dataclasses.replace(ones, spec_draft_max_forward_tokens=3)
    assert combine_stats([ones, threes, ones]).spec_draft_max_forward_tokens == 3


def test_speculation_figures_combine_per_adapter() -> None:
    zero = EngineStats(**{f.name: (0 if f.type in ("int", "float") else ())
                          for f in dataclasses.fields(EngineStats)})
    a = dataclasses.replace(zero, spec_num_drafts=2, spec_num_draft_tokens=6,
                            spec_num_accepted_tokens=3,
                            spec_by_adapter=(("", 1, 3, 1), ("a@1", 1, 3, 2)))
    b = dataclasses.replace(zero, spec_num_drafts=2, spec_num_draft_tokens=4,
                            spec_num_accepted_tokens=4, spec_by_adapter=(("a@1", 2, 4, 4),))
    total = combine_stats([a, b])
    assert total.spec_by_adapter == (("", 1, 3, 1), ("a@1", 3, 7, 6))
    assert total.spec_acceptance_rate == 0.7
    assert total.spec_mean_accepted_length == 1.0 + 7 / 4
