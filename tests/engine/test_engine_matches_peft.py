"""Whole-engine workloads against the oracle (HF transformers + PEFT, float32, CPU).

Each workload has >= 50 requests that arrive over time, over four adapters of different
ranks plus the base model, from three tenants of different weights and classes (so fair
scheduling interleaves and preempts them); greedy outputs must equal the oracle's token
for token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.share import Share
from loraplex.testing import load_reference, reference_greedy

NUM_REQUESTS = 56
# The workload's tenants by cache salt: weights 1, 3 and 0.5, one of them batch class.
SHARES = {None: Share(), "tenant-a": Share("a", 3.0),
          "tenant-b": Share("b", 0.5, "batch")}
LONGER = 12  # extra output tokens for the preemption workloads


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    adapters: list[str | None]
    max_tokens: list[int]
    arrivals: list[int]
    salts: list[str | None]
    expected: list[list[int]]


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> Workload:
    rng = random.Random(1234)
    system = [rng.randrange(3, 300) for _ in range(21)]  # shared by many requests
    names: list[str | None] = [None, *sorted(llama_adapters)]
    prompts, adapters, max_tokens, arrivals, salts = [], [], [], [], []
    for i in range(NUM_REQUESTS):
        own = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
        prompts.append(system + own if i % 2 == 0 else own)
        adapters.append(names[rng.randrange(len(names))])
        max_tokens.append(rng.randrange(2, 10))
        arrivals.append(rng.randrange(0, 40))
        salts.append(rng.choice([None, "tenant-a", "tenant-b"]))
    refs: dict[str | None, Any] = {}
    expected = []
    for prompt, name, n in zip(prompts, adapters, max_tokens, strict=True):
        if name not in refs:
            refs[name] = load_reference(tiny_llama_dir,
                                        None if name is None else llama_adapters[name])
        # Greedy: the shorter workload's expected output is a prefix of the longer one's.
        expected.append(reference_greedy(refs[name], prompt, n + LONGER)[0])
    return Workload(prompts, adapters, max_tokens, arrivals, salts, expected)


def _longer(w: Workload) -> Workload:
    """The same requests, each generating LONGER more tokens: they hold blocks longer."""
    return Workload(w.prompts, w.adapters, [m + LONGER for m in w.max_tokens], w.arrivals,
                    w.salts, w.expected)


def _run(model_dir: Path, adapters: dict[str, Path], w: Workload, n: int = 1,
         **llm_kwargs: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(str(model_dir), progress=False, max_lora_rank=16, **llm_kwargs)
    loras = [None if a is None else LoRARequest(a, str(adapters[a])) for a in w.adapters]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
              for m in w.max_tokens]
    outs = llm.generate(w.prompts, params, loras, cache_salt=w.salts, arrival_steps=w.arrivals,
                        share=[SHARES[salt] for salt in w.salts])
    for i, out in enumerate(outs):
        for seq in out.outputs:
            expected = w.expected[i][:w.max_tokens[i]]
            assert seq.token_ids == expected, (
                f"request {i} ({w.adapters[i]}): {seq.token_ids} != {expected}")
            assert seq.finish_reason == "length"
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.all_free_or_cached()
    assert not llm.engine.scheduler.has_unfinished()
    return llm, outs


def test_chunked_prefill_budget_limited(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
                                        workload: Workload) -> None:
    llm, _ = _run(tiny_llama_dir, llama_adapters, workload, max_num_batched_tokens=7,
                  block_size=4, num_kv_blocks=400)
    assert llm.stats().num_preemptions == 0


def test_chunk_of_one_token(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
                            workload: Workload) -> None:
    _run(tiny_llama_dir, llama_adapters, workload, max_num_batched_tokens=1,
         num_kv_blocks=200)


def test_prefix_cache_hits_across_adapters_and_tenants(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], workload: Workload) -> None:
    llm, _ = _run(tiny_llama_dir, llama_adapters, workload, block_size=4, num_kv_blocks=400)
    stats = llm.stats()
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.prefix_cache_queried_tokens >= sum(len(p) for p in workload.prompts)


def test_forced_preemptions(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
                            workload: Workload) -> None:
    # 18 blocks of 4 tokens: the longest request fits, but barely two run side by side.
    llm, outs = _run(tiny_llama_dir, llama_adapters, _longer(workload), block_size=4,
                     num_kv_blocks=18, max_num_batched_tokens=16)
    preempted = sum(1 for o in outs if o.metrics[0] is not None
                    and o.metrics[0].num_preemptions > 0)
    assert preempted > NUM_REQUESTS // 2, f"only {preempted} requests were preempted"
    assert llm.stats().num_preemptions >= preempted


def test_swap_preemption_matches_recompute(tiny_llama_dir: Path,
                                           llama_adapters: dict[str, Path],
                                           workload: Workload) -> None:
    llm, outs = _run(tiny_llama_dir, llama_adapters, _longer(workload), block_size=4,
                     num_kv_blocks=18, max_num_batched_tokens=16, preemption_mode="swap",
                     swap_space_blocks=40)
    stats = llm.stats()
    assert stats.num_swap_outs > NUM_REQUESTS // 2  # the host pool really carried KV
    assert stats.host_blocks_used == 0 and stats.host_blocks_total == 40


def test_fewer_slots_than_adapters(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
                                   workload: Workload) -> None:
    llm, _ = _run(tiny_llama_dir, llama_adapters, workload, max_loras=2, max_cpu_loras=2,
                  num_kv_blocks=200)
    stats = llm.stats()
    assert stats.adapter_slot_evictions > 0
    assert stats.adapter_disk_loads > len(llama_adapters)  # host cache of 2 churned too


def test_parallel_sampling_shares_prompt_blocks(tiny_llama_dir: Path,
                                                llama_adapters: dict[str, Path],
                                                workload: Workload) -> None:
    """n = 3 greedy samples fork the prompt's blocks (copy-on-write) and must all equal
    the oracle's single greedy continuation."""
    _run(tiny_llama_dir, llama_adapters, workload, n=3, block_size=4, num_kv_blocks=400)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_disk_tier_under_preemption(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
                                    workload: Workload, tmp_path: Path, mode: str) -> None:
    # The preemption workload through a pool of 18 blocks with the disk tier on: shared
    # prefixes of every (adapter, tenant) domain are evicted and loaded back from disk
    # while other requests run, swap and get preempted; outputs stay the oracle's.
    llm, _ = _run(tiny_llama_dir, llama_adapters, _longer(workload), block_size=4,
                  num_kv_blocks=18, max_num_batched_tokens=16, preemption_mode=mode,
                  swap_space_blocks=40 if mode == "swap" else 0, kv_disk_dir=str(tmp_path))
    stats = llm.stats()
    assert stats.kv_disk_hit_tokens > 0 and stats.kv_disk_refused == 0
    llm.engine.close()
