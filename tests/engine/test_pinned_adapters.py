"""Adapters pinned by the operator: under a workload that thrashes the slots and the host
cache, a pinned adapter keeps its slot and its host copy at every step, its requests never
wait for a load, outputs stay those of HF + PEFT; pins never take more than their share of
the slots; a deleted adapter's pin goes with it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import AdapterError, ConfigError
from loraplex.llm import LoRARequest
from loraplex.testing import load_reference, reference_greedy

NAMES = ("r4", "r8qv", "r16rs", "r8mlp")
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    return [5 + (11 * i) % 200, 17, 3 + i, 42]


@pytest.fixture(scope="module")
def refs(llama_adapters: dict[str, Path]) -> dict[str, AdapterRef]:
    return {name: LoRARequest(name, str(llama_adapters[name])).to_ref() for name in NAMES}


@pytest.fixture
def engine(tiny_llama_dir: Path) -> Iterator[LLMEngine]:
    # 2 slots, 2 host entries, half of the slots for pins: one pinned adapter, one slot and
    # one host entry left for the three others, so every other request loads from disk.
    eng = LLMEngine(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=4, num_kv_blocks=64),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_pinned_fraction=0.5),
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)), progress=False)
    yield eng
    eng.close()


def identity(ref: AdapterRef) -> str:
    return f"{ref.adapter_id}@{ref.digest[:12]}"


def thrash(engine: LLMEngine, refs: dict[str, AdapterRef], watched: AdapterRef,
           rounds: int = 3) -> tuple[dict[tuple[str, int], list[int]], list[tuple[bool, bool]]]:
    """Requests over all four adapters, two at a time, the watched one every other pair;
    returns each request's output and, at every step, whether the watched adapter was in a
    slot and in the host cache."""
    order = [n for r in range(rounds) for n in ("r8qv", "r16rs", "r8mlp")
             for n in ((n, watched.adapter_id) if r % 2 == 0 else (n,))]
    outputs: dict[tuple[str, int], list[int]] = {}
    seen: list[tuple[bool, bool]] = []
    ids: dict[str, tuple[str, int]] = {}
    for i, name in enumerate(order):
        request_id = f"{name}-{i}"
        ids[request_id] = (name, i)
        engine.add_request(request_id, _prompt(i), PARAMS, refs[name])
        if i % 2 == 1 or i == len(order) - 1:
            while engine.has_unfinished():
                for delta in engine.step():
                    outputs.setdefault(ids[delta.request_id], []).extend(delta.new_token_ids)
                stats = engine.stats()
                seen.append((identity(watched) in stats.adapter_slots,
                             identity(watched) in stats.host_adapters))
    return outputs, seen


def test_a_pinned_adapter_keeps_its_slot_and_host_copy_under_thrashing(
        engine: LLMEngine, refs: dict[str, AdapterRef], tiny_llama_dir: Path,
        llama_adapters: dict[str, Path]) -> None:
    pinned = refs["r4"]
    engine.set_pinned_adapters([pinned])
    while engine.has_unfinished():  # no request: the pin alone installs it
        engine.step()
    stats = engine.stats()
    assert stats.pinned_adapters == (identity(pinned),)
    assert identity(pinned) in stats.adapter_slots and identity(pinned) in stats.host_adapters
    slot = stats.adapter_slots.index(identity(pinned))
    loads_before = stats.adapter_disk_loads

    outputs, seen = thrash(engine, refs, pinned)
    assert seen and all(in_slot and in_host for in_slot, in_host in seen)
    after = engine.stats()
    assert after.adapter_slots[slot] == identity(pinned)  # never moved
    # Every request of the other three loaded from disk (one host entry for three); the
    # pinned one's never (it was in the host cache at every step, above). A pair's second
    # prefetch may evict the first's copy before its install, which then reads it again:
    # at most once more per request, as the loader thread and the steps interleave.
    others = sum(1 for name, _ in outputs if name != "r4")
    assert others <= after.adapter_disk_loads - loads_before <= 2 * others
    for (name, i), tokens in outputs.items():
        ref_model = load_reference(tiny_llama_dir, llama_adapters[name])
        assert tokens == reference_greedy(ref_model, _prompt(i), PARAMS.max_tokens)[0], name


def test_without_the_pin_the_same_workload_evicts_it(engine: LLMEngine,
                                                      refs: dict[str, AdapterRef]) -> None:
    """The control: what the pin prevents does happen without it."""
    _, seen = thrash(engine, refs, refs["r4"])
    assert not all(in_slot for in_slot, _ in seen)
    assert not all(in_host for _, in_host in seen)


def test_pins_beyond_their_share_are_refused(engine: LLMEngine,
                                             refs: dict[str, AdapterRef]) -> None:
    engine.set_pinned_adapters([refs["r4"]])
    with pytest.raises(AdapterError, match=r"at most 1 of the 2 adapter slots"):
        engine.set_pinned_adapters([refs["r4"], refs["r8qv"]])
    assert engine.stats().pinned_adapters == (identity(refs["r4"]),)  # unchanged
    engine.set_pinned_adapters([])  # unpinned: its slot serves the working set again
    assert engine.stats().pinned_adapters == ()
    for bad in (1.0, -0.1, 2):
        with pytest.raises(ConfigError, match="max_pinned_fraction"):
            LoRAConfig(max_pinned_fraction=bad)
    assert LoRAConfig(max_loras=4, max_pinned_fraction=0.5).max_pinned == 2
    assert LoRAConfig(max_loras=1, max_pinned_fraction=0.5).max_pinned == 0


def test_a_deleted_adapters_pin_goes_with_it(engine: LLMEngine,
                                             refs: dict[str, AdapterRef]) -> None:
    pinned = refs["r4"]
    engine.set_pinned_adapters([pinned])
    while engine.has_unfinished():
        engine.step()
    engine.forget_adapter(pinned.adapter_id, pinned.digest)
    stats = engine.stats()
    assert stats.pinned_adapters == ()
    assert identity(pinned) not in stats.adapter_slots + stats.host_adapters
    engine.set_pinned_adapters([pinned])  # a deleted version is never pinned again
    assert engine.stats().pinned_adapters == ()
    assert not engine.has_unfinished()
