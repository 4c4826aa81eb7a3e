"""The engine's Prometheus series from the figures of real engines, one per replica: two
engines stand for two replicas, and a fresh engine under a used ordinal for a replaced one."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import Share
from loraplex.engine.stats import EngineStats
from loraplex.gateway.engine_metrics import MAX_INFO_ADAPTERS, info_adapters
from loraplex.gateway.metrics import OTHER_LABEL, GatewayMetrics
from loraplex.llm import LoRARequest

PROMPT = [11, 42, 7, 99, 100, 3, 58]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
INFO = "loraplex_lora_requests_info"


def samples(metrics: GatewayMetrics, name: str) -> list[Sample]:
    payload, _ = metrics.render()
    return [s for family in text_string_to_metric_families(payload.decode())
            for s in family.samples if s.name == name]


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    found = [s.value for s in samples(metrics, name) if s.labels == labels]
    assert len(found) == 1, (name, labels, samples(metrics, name))
    return found[0]


@pytest.fixture(scope="module")
def refs(llama_adapters: dict[str, Path]) -> dict[str, AdapterRef]:
    return {name: LoRARequest(name, str(llama_adapters[name])).to_ref()
            for name in ("r4", "r8qv", "r16rs")}


def identity(ref: AdapterRef) -> str:
    return f"{ref.adapter_id}@{ref.digest[:12]}"


@pytest.fixture
def make_engine(tiny_llama_dir: Path) -> Iterator[Callable[[], LLMEngine]]:
    """Builds engines with one device slot and one running sequence; closes them after."""
    made: list[LLMEngine] = []

    def make() -> LLMEngine:
        engine = LLMEngine(EngineConfig(
            ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=64),
            LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=2),
            SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256)), progress=False)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def submit(engine: LLMEngine, request_id: str, ref: AdapterRef | None) -> None:
    if ref is not None:
        engine.adapters.load_now(ref)  # as the offline API does: ready for the next step
    engine.add_request(request_id, PROMPT, PARAMS, ref)


def run_all(engine: LLMEngine, *adapters: AdapterRef) -> None:
    """Runs one request per adapter to the end: each takes the one slot in turn."""
    for i, ref in enumerate(adapters):
        submit(engine, f"run-{i}-{ref.adapter_id}", ref)
        while engine.has_unfinished():
            engine.step()


def as_replica(stats: EngineStats, ordinal: int) -> EngineStats:
    return dataclasses.replace(stats, replica=ordinal)


def test_each_replica_has_its_own_series(make_engine: Callable[[], LLMEngine],
                                         refs: dict[str, AdapterRef]) -> None:
    idle, busy = make_engine(), make_engine()
    run_all(idle, refs["r16rs"])
    submit(busy, "running", refs["r8qv"])
    submit(busy, "waiting", refs["r4"])
    busy.step()
    replicas = (idle.stats(), as_replica(busy.stats(), 1))
    metrics = GatewayMetrics()
    before = time.time()
    metrics.observe_engine(replicas)

    for stats in replicas:
        replica = str(stats.replica)
        assert value(metrics, "loraplex_queue_depth", replica=replica) == stats.num_waiting
        assert value(metrics, "loraplex_running_requests", replica=replica) == stats.num_running
        assert value(metrics, "loraplex_kv_blocks_used", replica=replica) == stats.kv_blocks_used
        assert value(metrics, "loraplex_kv_pool_usage", replica=replica) == stats.kv_pool_usage
        assert value(metrics, "loraplex_adapter_capacity", replica=replica,
                     level="device") == 1
        assert value(metrics, "loraplex_adapter_capacity", replica=replica, level="host") == 2
    assert value(metrics, "loraplex_queue_depth", replica="1") == 1
    assert value(metrics, "loraplex_running_requests", replica="1") == 1
    assert value(metrics, "loraplex_adapter_resident", replica="0", level="device") == 1
    assert value(metrics, "loraplex_adapter_resident", replica="0", level="host") == 1
    assert value(metrics, "loraplex_adapter_resident", replica="1", level="device") == 1
    assert value(metrics, "loraplex_adapter_resident", replica="1", level="host") == 2

    info = {s.labels["replica"]: s for s in samples(metrics, INFO)}
    assert set(info) == {"0", "1"}
    assert info["0"].labels == {"replica": "0", "max_lora": "1", "running_lora_adapters": "",
                                "waiting_lora_adapters": ""}
    assert info["1"].labels == {"replica": "1", "max_lora": "1",
                                "running_lora_adapters": identity(refs["r8qv"]),
                                "waiting_lora_adapters": identity(refs["r4"])}
    assert before <= info["1"].value <= time.time()  # a timestamp, as vLLM's
    # Another GatewayMetrics (another app in this process) has none of it.
    assert not samples(GatewayMetrics(), INFO)


def test_counters_survive_a_replaced_replica(make_engine: Callable[[], LLMEngine],
                                             refs: dict[str, AdapterRef]) -> None:
    metrics = GatewayMetrics()
    first = make_engine()
    run_all(first, refs["r4"], refs["r8qv"])  # 2 loads, 1 eviction
    metrics.observe_engine([as_replica(first.stats(), 1)])
    assert value(metrics, "loraplex_adapter_loads_total", replica="1") == 2
    assert value(metrics, "loraplex_adapter_evictions_total", replica="1") == 1
    metrics.observe_engine([as_replica(first.stats(), 1)])  # nothing new: no increment
    assert value(metrics, "loraplex_adapter_loads_total", replica="1") == 2

    # Replica 1 is replaced: the new engine's totals start again from zero.
    second = make_engine()
    run_all(second, refs["r16rs"])
    replaced = as_replica(second.stats(), 1)
    assert replaced.adapter_slot_loads < first.stats().adapter_slot_loads
    metrics.observe_engine([replaced])
    assert value(metrics, "loraplex_adapter_loads_total", replica="1") == 3
    assert value(metrics, "loraplex_adapter_evictions_total", replica="1") == 1
    run_all(second, refs["r4"])
    metrics.observe_engine([as_replica(second.stats(), 1)])
    assert value(metrics, "loraplex_adapter_loads_total", replica="1") == 4
    assert value(metrics, "loraplex_adapter_evictions_total", replica="1") == 2
    assert value(metrics, "loraplex_adapter_load_seconds_count", replica="1") == 4
    assert value(metrics, "loraplex_adapter_load_seconds_sum", replica="1") > 0


def test_one_info_series_per_replica_and_gone_replicas_are_dropped(
        make_engine: Callable[[], LLMEngine], refs: dict[str, AdapterRef]) -> None:
    zero, one = make_engine(), make_engine()
    metrics = GatewayMetrics()
    submit(one, "x", refs["r4"])
    one.step()
    metrics.observe_engine([zero.stats(), as_replica(one.stats(), 1)])
    while one.has_unfinished():
        one.step()
    metrics.observe_engine([zero.stats(), as_replica(one.stats(), 1)])
    # The adapter stopped running: the replica's one series says so (no stale label set).
    assert [s.labels["running_lora_adapters"] for s in samples(metrics, INFO)
            if s.labels["replica"] == "1"] == [""]

    metrics.observe_engine([zero.stats()])  # the deployment shrank to one replica
    for name in (INFO, "loraplex_queue_depth", "loraplex_adapter_resident"):
        assert {s.labels["replica"] for s in samples(metrics, name)} == {"0"}, name
    # Counters keep what they counted.
    assert value(metrics, "loraplex_adapter_loads_total", replica="1") == 1


def test_replica_label_is_capped(make_engine: Callable[[], LLMEngine]) -> None:
    stats = make_engine().stats()
    metrics = GatewayMetrics(max_label_values=2)
    metrics.observe_engine([as_replica(stats, i) for i in range(4)])
    replicas = {s.labels["replica"] for s in samples(metrics, "loraplex_queue_depth")}
    assert replicas == {"0", "1", OTHER_LABEL}


def test_info_names_at_most_a_bounded_number_of_adapters() -> None:
    names = [f"{i}@{i:012x}" for i in range(MAX_INFO_ADAPTERS + 5)]
    assert info_adapters(names).split(",") == names[:MAX_INFO_ADAPTERS]
    assert info_adapters([]) == ""


def test_speculative_counters_by_replica_and_adapter(tiny_llama_dir: Path,
                                                     refs: dict[str, AdapterRef]) -> None:
    engine = LLMEngine(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=64),
        LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=2),
        speculative=SpeculativeConfig(prompt_lookup_min=1)), progress=False)
    metrics = GatewayMetrics()
    copy_heavy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        for round_ in range(2):
            engine.adapters.load_now(refs["r4"])
            engine.add_request(f"a{round_}", PROMPT * 3, copy_heavy, refs["r4"])
            engine.add_request(f"b{round_}", PROMPT * 3, copy_heavy)
            while engine.has_unfinished():
                engine.step()
            stats = engine.stats()
            metrics.observe_engine([stats])
            for name, drafts, draft_tokens, accepted in stats.spec_by_adapter:
                adapter = name or "base"
                for metric, total in (("drafts", drafts), ("draft_tokens", draft_tokens),
                                      ("accepted_tokens", accepted)):
                    assert value(metrics, f"loraplex_spec_decode_num_{metric}_total",
                                 replica="0", adapter=adapter) == total
        assert {name for name, *_ in stats.spec_by_adapter} == {"", identity(refs["r4"])}
        assert stats.spec_num_accepted_tokens > 0
        assert value(metrics, "loraplex_spec_decode_acceptance_rate",
                     replica="0") == stats.spec_acceptance_rate
    finally:
        engine.close()


def test_the_schedulers_view_of_each_tenant_by_replica(
        make_engine: Callable[[], LLMEngine]) -> None:
    """Waiting, running, KV blocks and service per tenant id; the service counters add what
    changed, and a replaced replica's lower totals count from zero."""
    engine = make_engine()
    engine.add_request("a", PROMPT, PARAMS, share=Share("7"))
    engine.add_request("b", PROMPT, PARAMS, share=Share("8", 2.0))
    engine.step()  # one sequence runs (max_num_seqs 1): a's prompt; b waits
    metrics = GatewayMetrics()
    metrics.observe_engine((engine.stats(),))
    assert value(metrics, "loraplex_tenant_running_requests", replica="0", tenant_id="7") == 1
    assert value(metrics, "loraplex_tenant_waiting_requests", replica="0", tenant_id="8") == 1
    assert value(metrics, "loraplex_tenant_kv_blocks", replica="0", tenant_id="7") == 1
    service = "loraplex_tenant_service_tokens_total"
    assert value(metrics, service, replica="0", tenant_id="7", kind="prefill") == len(PROMPT)
    while engine.has_unfinished():
        engine.step()
    metrics.observe_engine((engine.stats(),))
    # a: its prompt, then 3 decodes (the first token came with the prompt); b the same
    for tenant in ("7", "8"):
        assert value(metrics, service, replica="0", tenant_id=tenant,
                     kind="prefill") == len(PROMPT)
        assert value(metrics, service, replica="0", tenant_id=tenant, kind="decode") == 3
        assert value(metrics, "loraplex_tenant_running_requests", replica="0",
                     tenant_id=tenant) == 0
    fresh = make_engine()  # the replica replaced: its totals start again
    fresh.add_request("c", PROMPT, PARAMS, share=Share("7"))
    fresh.step()
    metrics.observe_engine((fresh.stats(),))
    assert value(metrics, service, replica="0", tenant_id="7", kind="prefill") \
        == 2 * len(PROMPT)
    assert not [s for s in samples(metrics, "loraplex_tenant_running_requests")
                if s.labels["tenant_id"] == "8"]


def test_the_disk_tier_has_its_series(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A pool of 10 four-token blocks evicts a shared 16-token prefix to the disk tier; the
    prefix's next request loads it back. The disk series equal the engine's figures, and a
    replacement engine under the same ordinal adds to the counters from zero."""
    system = [(7 * i) % 290 + 5 for i in range(16)]

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(
            ModelConfig(str(tiny_llama_dir)),
            CacheConfig(block_size=4, num_kv_blocks=10, kv_disk_dir=str(tmp_path),
                        kv_disk_gib=0.01),
            LoRAConfig(max_loras=1, max_lora_rank=16),
            SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256)), progress=False)

    def run(eng: LLMEngine, prompt: list[int]) -> None:
        eng.add_request(f"r{eng.num_steps}-{prompt[0]}", prompt, PARAMS)
        while eng.has_unfinished():
            eng.step()

    def disk_series(metrics: GatewayMetrics) -> dict[str, float]:
        return {name: value(metrics, f"loraplex_kv_disk_{name}", replica="0")
                for name in ("blocks", "bytes", "hit_tokens_total", "writes_total",
                             "evictions_total", "refused_total")}

    def figures(*snapshots: EngineStats) -> dict[str, float]:
        last = snapshots[-1]
        return {"blocks": last.kv_disk_blocks, "bytes": last.kv_disk_bytes_used,
                **{f"{name}_total": sum(getattr(s, f"kv_disk_{name}") for s in snapshots)
                   for name in ("hit_tokens", "writes", "evictions", "refused")}}

    metrics = GatewayMetrics()
    first = engine()
    run(first, system + [11, 23, 37])
    for j in range(3):  # 3 x 6 blocks through a pool of 10: the prefix goes to disk
        run(first, [300 + 13 * j + k for k in range(20)])
    run(first, system + [12, 24, 38])
    assert first.disk is not None
    first.disk.flush()
    before = first.stats()
    assert before.kv_disk_hit_tokens >= 16 and before.kv_disk_writes > 0
    metrics.observe_engine([before])
    assert disk_series(metrics) == figures(before)
    metrics.observe_engine([first.stats()])  # nothing new: no increment
    assert disk_series(metrics) == figures(before)
    first.close()

    second = engine()  # the same folder: its index is rebuilt, its counters start at 0
    run(second, system + [13, 25, 39])
    after = second.stats()
    assert after.kv_disk_hit_tokens >= 16
    assert after.kv_disk_hit_tokens < before.kv_disk_hit_tokens or \
        after.kv_disk_writes < before.kv_disk_writes
    metrics.observe_engine([after])
    assert disk_series(metrics) == figures(before, after)
    second.close()


def test_residency_names_each_adapter_and_whether_it_is_pinned(
        tiny_llama_dir: Path, refs: dict[str, AdapterRef]) -> None:
    engine = LLMEngine(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=64),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2),
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256)), progress=False)
    try:
        engine.set_pinned_adapters([refs["r4"]])
        run_all(engine, refs["r8qv"], refs["r16rs"])  # the pin installs with the first step
        metrics = GatewayMetrics()
        metrics.observe_engine([engine.stats()])
        series = {(s.labels["adapter"], s.labels["level"], s.labels["pinned"])
                  for s in samples(metrics, "loraplex_adapter_residency") if s.value == 1}
        pinned, last = identity(refs["r4"]), identity(refs["r16rs"])
        assert series == {(pinned, "device", "true"), (pinned, "host", "true"),
                          (last, "device", "false"), (last, "host", "false")}

        engine.set_pinned_adapters([])  # unpinned, then pushed out by two others
        run_all(engine, refs["r8qv"], refs["r16rs"])
        metrics.observe_engine([engine.stats()])
        series = {(s.labels["adapter"], s.labels["pinned"])
                  for s in samples(metrics, "loraplex_adapter_residency")}
        assert (pinned, "true") not in series and (pinned, "false") not in series
    finally:
        engine.close()
