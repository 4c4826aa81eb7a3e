"""The draft_model method: a separate draft on its own paged KV cache. A draft that is a copy
of the target proposes exactly the target's greedy tokens wherever its KV cache is right, so
its acceptance rate checks the draft pool's bookkeeping (catch-up after prefill chunks,
prefix hits, both kinds of preemption, copy-on-write for n > 1) while outputs stay the
oracle's. Bad drafts are refused at start, in one line on the CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.model.truncate import save_first_layers
from loraplex.testing import build_tiny_model, load_reference, reference_greedy

CASES: dict[str, dict[str, Any]] = {
    "chunked_prefill": {"max_num_batched_tokens": 7, "block_size": 4, "num_kv_blocks": 400},
    "prefix_hits": {"block_size": 4, "num_kv_blocks": 400},
    "preempt_recompute": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16},
    "preempt_swap": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16,
                     "preemption_mode": "swap", "swap_space_blocks": 48},
    "n3": {"block_size": 4, "num_kv_blocks": 400, "n": 3},
}
NUM_REQUESTS = 24


@pytest.fixture(scope="module")
def self_draft_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both layers of the tiny Llama, saved as a separate model: the draft is the target."""
    return save_first_layers(tiny_llama_dir, tmp_path_factory.mktemp("self_draft"), 2)


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path,
             llama_adapters: dict[str, Path]) -> tuple[list[Any], list[list[int]]]:
    """Random prompts, half behind one shared system prefix; every third uses adapter r4."""
    rng = random.Random(21)
    system = [rng.randrange(3, 300) for _ in range(13)]
    base, adapted = load_reference(tiny_llama_dir), load_reference(tiny_llama_dir,
                                                                   llama_adapters["r4"])
    items, expected = [], []
    for i in range(NUM_REQUESTS):
        own = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 20))]
        prompt = system + own if i % 2 == 0 else own
        adapter = "r4" if i % 3 == 0 else None
        max_tokens = rng.randrange(8, 24)
        items.append((prompt, adapter, max_tokens, rng.randrange(0, 20)))
        expected.append(reference_greedy(adapted if adapter else base, prompt, max_tokens)[0])
    return items, expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_copy_of_the_target_as_draft_is_always_accepted(
        case: str, tiny_llama_dir: Path, llama_adapters: dict[str, Path], self_draft_dir: Path,
        workload: tuple[list[Any], list[list[int]]]) -> None:
    items, expected = workload
    kwargs = dict(CASES[case])
    n = kwargs.pop("n", 1)
    llm = LLM(str(tiny_llama_dir), progress=False, max_lora_rank=16,
              speculative_config={"method": "draft_model", "model": str(self_draft_dir),
                                  "num_speculative_tokens": 3, "disable_by_batch_size": None},
              **kwargs)
    lora = LoRARequest("r4", str(llama_adapters["r4"]))
    outs = llm.generate([p for p, *_ in items],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
                         for _, _, m, _ in items],
                        [lora if a else None for _, a, _, _ in items],
                        arrival_steps=[s for *_, s in items])
    for i, out in enumerate(outs):
        assert [s.token_ids for s in out.outputs] == [expected[i]] * n, f"request {i}"
    stats = llm.stats()
    by_adapter = {name: (drafted, accepted)
                  for name, _, drafted, accepted in stats.spec_by_adapter}
    drafted, accepted = by_adapter[""]
    # Base requests: the draft is the target, so every proposal is kept (a stale or
    # missing draft KV entry anywhere would show here as a rejection).
    assert drafted > 100 and accepted == drafted
    # Adapter requests: the draft runs base-only, the target with the adapter.
    adapter_drafted, adapter_accepted = next(v for k, v in by_adapter.items() if k)
    assert adapter_drafted > 0 and adapter_accepted < adapter_drafted
    if case.startswith("preempt"):
        assert stats.num_preemptions > 0
    if case == "preempt_swap":
        assert stats.num_swap_outs > 0
    if case == "prefix_hits":
        assert stats.prefix_cache_hit_tokens > 0
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.all_free_or_cached()
    llm.close()


def test_a_long_prompts_draft_catch_up_is_spread_over_steps(
        tiny_llama_dir: Path, self_draft_dir: Path) -> None:
    """A prompt four times the step's token budget: the draft catches up over several
    steps, never running a forward longer than the budget, and proposes once caught up;
    the proposals are all kept (a copy of the target as draft: its KV is right after the
    split catch-up) and outputs are the oracle's and those with speculation off."""
    budget = 16
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 300) for _ in range(4 * budget)],
               [rng.randrange(3, 300) for _ in range(5)]]
    ref = load_reference(tiny_llama_dir)
    expected = [reference_greedy(ref, p, 24)[0] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs: dict[str, Any] = dict(progress=False, block_size=4, num_kv_blocks=200,
                                  max_num_batched_tokens=budget)
    plain = LLM(str(tiny_llama_dir), **kwargs)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == expected
    plain.close()
    llm = LLM(str(tiny_llama_dir), **kwargs,
              speculative_config={"method": "draft_model", "model": str(self_draft_dir),
                                  "num_speculative_tokens": 3, "disable_by_batch_size": None})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.stats()
    # The draft ran over the whole long prompt, but never more than the budget at once.
    assert stats.spec_draft_forward_tokens >= len(prompts[0])
    assert 1 < stats.spec_draft_max_forward_tokens <= budget
    drafter = llm.engine.runner.drafter
    assert drafter is not None and drafter.max_forward_tokens == budget
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.all_free_or_cached()
    llm.close()


def test_the_kv_budget_pays_for_both_pools(tiny_llama_dir: Path,
                                          tiny_llama_draft_dir: Path) -> None:
    """Every block lives in both pools: a memory budget buys fewer blocks with a draft."""
    budget = 1 << 20
    # K and V x layers x block_size 16 x 2 KV heads x head_dim 16 x 4 bytes (float32)
    target_block, draft_block = 2 * 2 * 16 * 2 * 16 * 4, 2 * 1 * 16 * 2 * 16 * 4
    plain = LLM(str(tiny_llama_dir), progress=False, kv_cache_memory=budget)
    spec = LLM(str(tiny_llama_dir), progress=False, kv_cache_memory=budget,
               speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)})
    assert plain.engine.kv.num_blocks == budget // target_block
    assert spec.engine.kv.num_blocks == budget // (target_block + draft_block)
    drafter = spec.engine.runner.drafter
    assert drafter is not None and len(drafter.kv_caches) == 1
    assert drafter.kv_caches[0][0].shape[0] == spec.engine.kv.num_blocks


def test_a_draft_of_another_shape_keeps_its_own_pool(tiny_llama_dir: Path,
                                                     tmp_path: Path) -> None:
    """Another width, head count and depth than the target's: its pool takes its shape, with
    the target's block count; outputs stay the oracle's."""
    draft = build_tiny_model(tmp_path / "narrow", hidden_size=32, intermediate_size=64,
                             num_layers=3, num_heads=2, num_kv_heads=1, seed=5)
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_kv_blocks=64,
              speculative_config={"method": "draft_model", "model": str(draft),
                                  "disable_by_batch_size": None})
    drafter = llm.engine.runner.drafter
    assert drafter is not None and len(drafter.kv_caches) == 3
    assert tuple(drafter.kv_caches[0][0].shape) == (64, 4, 1, 16)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 15))] for _ in range(6)]
    ref = load_reference(tiny_llama_dir)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(ref, prompt, 12)[0]
    assert llm.stats().spec_num_draft_tokens > 0
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.all_free_or_cached()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def _generate(model: Path, draft: Path | str, *extra: str) -> subprocess.CompletedProcess[str]:
    spec = json.dumps({"method": "draft_model", "model": str(draft)})
    return _cli("generate", "--model", str(model), "--prompt", "hello world", "--raw",
                "--max-tokens", "4", "--num-kv-blocks", "32", "--speculative-config", spec,
                *extra)


def test_the_cli_refuses_a_bad_draft_in_one_line(tiny_llama_dir: Path, tiny_llama_draft_dir: Path,
                                                tmp_path: Path) -> None:
    other_vocab = build_tiny_model(tmp_path / "other_vocab", num_layers=1,
                                   tokenizer_vocab_size=320)
    # Same vocabulary size, another tokenizer: two token ids swapped.
    swapped = save_first_layers(tiny_llama_dir, tmp_path / "swapped", 1)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[100], sorted(vocab)[200]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    short = build_tiny_model(tmp_path / "short", num_layers=1, max_position_embeddings=64)
    garbled = save_first_layers(tiny_llama_dir, tmp_path / "garbled", 1)
    (garbled / "config.json").write_text("{not json")
    no_tokenizer = save_first_layers(tiny_llama_dir, tmp_path / "no_tokenizer", 1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    cases = [(tmp_path / "missing", "no such folder"),
             (tmp_path, "no config.json"),
             (garbled, "unreadable config.json"),
             (other_vocab, "vocabulary of 320 tokens, the target's has 384"),
             (swapped, "tokenizer differs from the target's"),
             (no_tokenizer, "no tokenizer files"),
             (short, "context of 64 tokens is shorter than the target's max_model_len (512)")]
    for draft, message in cases:
        result = _generate(tiny_llama_dir, draft)
        err = result.stderr.strip().splitlines()
        assert result.returncode == 2 and result.stdout == "", (draft, result.stderr)
        assert err[-1].startswith("loraplex: error: draft model") and message in err[-1], err
        assert not any("Traceback" in line for line in err)
    # The short draft is fine once the target's context is cut to the draft's.
    ok = _generate(tiny_llama_dir, short, "--max-model-len", "64")
    plain = _cli("generate", "--model", str(tiny_llama_dir), "--prompt", "hello world", "--raw",
                 "--max-tokens", "4", "--num-kv-blocks", "32", "--max-model-len", "64")
    assert ok.returncode == 0 and plain.returncode == 0, ok.stderr + plain.stderr
    assert ok.stdout == plain.stdout
    ok = _generate(tiny_llama_dir, tiny_llama_draft_dir)
    assert ok.returncode == 0 and ok.stdout == plain.stdout, ok.stderr
