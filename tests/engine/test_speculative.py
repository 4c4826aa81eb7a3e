"""Speculative decoding: greedy outputs equal the oracle's (HF + PEFT) with speculation on,
across the engine's hard cases; the controller and per-token rules; bad configurations."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import SpeculativeConfig
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import GrammarSpec
from loraplex.engine.speculative import NgramProposer, SpecController, can_speculate
from loraplex.errors import ConfigError
from loraplex.testing import chi_square_fits, load_reference, reference_greedy

NUM_REQUESTS = 40
LONGER = 10
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": None}
# The tiny models have two layers: the draft is the first one.
LAYER_SKIP = {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 3,
              "disable_by_batch_size": None}
# A separate draft model (the first layer saved as its own folder, its own KV cache).
DRAFT_MODEL = {"method": "draft_model", "num_speculative_tokens": 3,
               "disable_by_batch_size": None}
METHODS = {"ngram": SPEC, "layer_skip": LAYER_SKIP, "draft_model": DRAFT_MODEL}


def _method_config(method: str, arch: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    if method != "draft_model":
        return METHODS[method]
    return {**DRAFT_MODEL, "model": str(request.getfixturevalue(f"tiny_{arch}_draft_dir"))}


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(1, 3)
    # [2, 3] last occurred before 8, but the older 3-gram [1, 2, 3] wins.
    assert proposer.propose([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3], 2) == [9, 4]
    assert proposer.propose([2, 3, 7, 5, 2, 3, 8, 1, 2, 3], 2) == [8, 1]  # the latest
    assert proposer.propose([5, 6, 7, 8, 5, 6, 7], 3) == [8, 5, 6]
    assert proposer.propose([1, 2, 3], 2) == []  # the last token never occurred before
    assert NgramProposer(2, 3).propose([1, 2, 3, 2], 2) == []  # only a 1-gram matches
    assert proposer.propose([4, 4], 3) == [4]  # a match may run into the suffix itself


def test_config_is_refused_in_one_line(tiny_llama_dir: Path) -> None:
    for bad, match in [('{"method": "eagle"}',
                        "method must be one of ngram, layer_skip, draft_model"),
                       ('{"method": "draft_model"}', "draft's folder\\) is required"),
                       ('{"model": "/tmp/x"}', "only by it"),
                       ('{"method": "draft_model", "model": 3}', "path to the draft"),
                       ('{"method": "layer_skip"}', "num_draft_layers is required"),
                       ('{"num_draft_layers": 2}', "only by it"),
                       ('{"method": "layer_skip", "num_draft_layers": 0}', "num_draft_layers"),
                       ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"num_speculative_tokens": "3"}', "num_speculative_tokens"),
                       ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup"),
                       ('{"model": "x", "draft": 1}', "unknown field"),
                       ("[3]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ConfigError, match=match):
            SpeculativeConfig.from_json(bad)
    with pytest.raises(ConfigError, match="context length"):
        LLM(str(tiny_llama_dir), progress=False, max_model_len=8,
            speculative_config={"num_speculative_tokens": 8})
    with pytest.raises(ConfigError, match="below the model's 2 layers"):
        LLM(str(tiny_llama_dir), progress=False,
            speculative_config={"method": "layer_skip", "num_draft_layers": 2})
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(str(tiny_llama_dir), progress=False, max_num_batched_tokens=4,
            speculative_config={"num_speculative_tokens": 4})


def test_requests_with_per_token_logic_do_not_speculate() -> None:
    def request(**params: Any) -> Request:
        r = Request("r", [1, 2, 1], SamplingParams(max_tokens=8, **params))
        r.output_token_ids = [2]
        r.num_computed_tokens = 3
        return r

    controller = SpecController(SpeculativeConfig(prompt_lookup_min=1), max_model_len=64)
    assert controller.propose([request()]) == {"r": [1, 2]}
    for params in ({"presence_penalty": 0.5}, {"repetition_penalty": 1.1},
                   {"logit_bias": {3: 1.0}}, {"logprobs": 0}, {"min_tokens": 2},
                   {"grammar": GrammarSpec("regex", "[0-9]+", "guided_regex")}):
        assert not can_speculate(request(**params))
        assert controller.propose([request(**params)]) == {}
    assert can_speculate(request(min_tokens=1))  # min_tokens already reached


def test_controller_turns_speculation_off_by_batch_size_and_acceptance() -> None:
    r = Request("r", [1, 2, 1], SamplingParams(max_tokens=8))
    r.output_token_ids = [2]
    r.num_computed_tokens = 3
    controller = SpecController(SpeculativeConfig(prompt_lookup_min=1,
                                                  disable_by_batch_size=2), max_model_len=64)
    assert controller.propose([r]) == {"r": [1, 2]}
    assert controller.propose([r, r]) == {}  # two running: the batch is full enough
    controller.record(r, 3, 0)
    controller.record(r, 3, 0)
    controller.record(r, 3, 0)
    controller.record(r, 3, 0)
    assert r.spec_pause_steps > 0  # a poor acceptance rate pauses it ...
    paused = r.spec_pause_steps
    for _ in range(paused):
        assert controller.propose([r]) == {}
    assert controller.propose([r]) == {"r": [1, 2]}  # ... then it is probed again
    controller.record(r, 3, 0)  # a failed probe: a pause twice as long
    assert r.spec_pause_steps == 2 * paused
    r.spec_pause_steps = 0
    controller.record(r, 3, 3)  # a good one resumes, and resets the pauses
    assert r.spec_pause_steps == 0 and r.spec_num_pauses == 0
    # Proposals never reach past max_tokens: 8 - 7 output tokens leaves room for none.
    r.output_token_ids = [2] * 7
    r.num_computed_tokens = r.num_tokens - 1
    assert controller.propose([r]) == {}


def test_draft_catch_up_fits_the_step_budget() -> None:
    """draft_model: a sequence proposes once its draft's backlog (its newest token
    included) fits what is left of the budget; one further behind catches up instead, with
    what is left, short of its newest token."""
    def request(request_id: str, num_computed: int, num_draft: int) -> Request:
        r = Request(request_id, list(range(3, 3 + num_computed)), SamplingParams(max_tokens=8))
        r.output_token_ids = [7]
        r.num_computed_tokens = num_computed
        r.num_draft_computed_tokens = num_draft
        return r

    controller = SpecController(SpeculativeConfig(method="draft_model", model="/d"), 64)
    long, caught_up, behind = request("long", 40, 0), request("a", 10, 9), request("b", 20, 5)
    running = [long, caught_up, behind]
    num_spec = controller.plan(running)
    assert num_spec == {"long": 3, "a": 3, "b": 3}
    # Backlogs 41, 2 and 16: "a" proposes (2 of 16), then "long" takes all that is left.
    assert controller.fit_draft_budget(running, num_spec, 16) == ({"a": 3}, {"long": 14})
    assert controller.fit_draft_budget(running, num_spec, 18) == ({"a": 3, "b": 3}, {})
    assert controller.fit_draft_budget(running, num_spec, 60) == (num_spec, {})
    long.num_draft_computed_tokens = 38  # two tokens short of its target KV, three backlog
    assert controller.fit_draft_budget(running, num_spec, 4) == ({"long": 3}, {"a": 1})


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    adapters: list[str | None]
    max_tokens: list[int]
    arrivals: list[int]
    salts: list[str | None]
    expected: list[list[int]]


def _workload(model_dir: Path, adapters: dict[str, Path], seed: int) -> Workload:
    """Copy-heavy prompts (a random passage said two or three times) so that prompt lookup
    proposes often; half share a system prefix (prefix hits)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(13)]
    names: list[str | None] = [None, *sorted(adapters)]
    prompts, chosen, max_tokens, arrivals, salts = [], [], [], [], []
    for i in range(NUM_REQUESTS):
        passage = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 8))]
        own = passage * rng.randrange(2, 4)
        prompts.append(system + own if i % 2 == 0 else own)
        chosen.append(names[rng.randrange(len(names))])
        max_tokens.append(rng.randrange(4, 14))
        arrivals.append(rng.randrange(0, 30))
        salts.append(rng.choice([None, "tenant-a"]))
    refs: dict[str | None, Any] = {}
    expected = []
    for prompt, name, n in zip(prompts, chosen, max_tokens, strict=True):
        if name not in refs:
            refs[name] = load_reference(model_dir, None if name is None else adapters[name])
        expected.append(reference_greedy(refs[name], prompt, n + LONGER)[0])
    return Workload(prompts, chosen, max_tokens, arrivals, salts, expected)


@pytest.fixture(scope="module")
def llama_workload(tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> Workload:
    return _workload(tiny_llama_dir, llama_adapters, 7)


@pytest.fixture(scope="module")
def qwen2_workload(tiny_qwen2_dir: Path, qwen2_adapters: dict[str, Path]) -> Workload:
    return _workload(tiny_qwen2_dir, qwen2_adapters, 8)


CASES: dict[str, dict[str, Any]] = {
    "chunked_prefill": {"max_num_batched_tokens": 7, "block_size": 4, "num_kv_blocks": 400},
    "prefix_hits": {"block_size": 4, "num_kv_blocks": 400},
    # 20 blocks of 4 tokens: the longest request fits, few run side by side.
    "preempt_recompute": {"block_size": 4, "num_kv_blocks": 20, "max_num_batched_tokens": 16},
    "preempt_swap": {"block_size": 4, "num_kv_blocks": 20, "max_num_batched_tokens": 16,
                     "preemption_mode": "swap", "swap_space_blocks": 40},
    "n3": {"block_size": 4, "num_kv_blocks": 400, "n": 3},
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_speculation_matches_the_oracle(arch: str, case: str, method: str,
                                                    request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    adapters: dict[str, Path] = request.getfixturevalue(f"{arch}_adapters")
    w: Workload = request.getfixturevalue(f"{arch}_workload")
    kwargs = dict(CASES[case])
    n = kwargs.pop("n", 1)
    extra = LONGER if case.startswith("preempt") else 0
    llm = LLM(str(model_dir), progress=False, max_lora_rank=16,
              speculative_config=_method_config(method, arch, request), **kwargs)
    loras = [None if a is None else LoRARequest(a, str(adapters[a])) for a in w.adapters]
    params = [SamplingParams(temperature=0.0, max_tokens=m + extra, ignore_eos=True, n=n)
              for m in w.max_tokens]
    outs = llm.generate(w.prompts, params, loras, cache_salt=w.salts, arrival_steps=w.arrivals)
    for i, out in enumerate(outs):
        assert len(out.outputs) == n
        for seq in out.outputs:
            assert seq.token_ids == w.expected[i][:w.max_tokens[i] + extra], f"request {i}"
            assert seq.finish_reason == "length"
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.all_free_or_cached()
    stats = llm.stats()
    assert stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    if case.startswith("preempt"):
        assert stats.num_preemptions > NUM_REQUESTS // 4
    if case == "preempt_swap":
        assert stats.num_swap_outs > 0
    if case == "prefix_hits":
        assert stats.prefix_cache_hit_tokens > 0
    llm.close()


def test_stop_strings_and_stop_ids_cut_the_accepted_tokens(tiny_llama_dir: Path) -> None:
    """A verify step may accept tokens past a stop: the engine drops them, so outputs (text,
    ids, finish reasons) equal those without speculation."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(6)] * 3 for _ in range(8)]
    off = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_kv_blocks=200)
    base = off.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    params = []
    for out in base:
        ids = out.outputs[0].token_ids
        text = off.tokenizer.decode(ids[8:12])
        params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                     stop=(text.strip()[:3],) if text.strip() else (),
                                     stop_token_ids=(ids[15],)))
    on = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_kv_blocks=200,
             speculative_config=SPEC)
    expected = off.generate(prompts, params)
    got = on.generate(prompts, params)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (
            e.outputs[0].finish_reason, e.outputs[0].stop_reason)
    assert on.stats().spec_num_accepted_tokens > 0
    on.engine.kv.check_invariants()
    assert on.engine.kv.all_free_or_cached()


def test_cli_refuses_a_bad_speculative_config(capsys: pytest.CaptureFixture[str],
                                              tiny_llama_dir: Path) -> None:
    from loraplex.cli import main

    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "hi",
                 "--speculative-config", json.dumps({"method": "medusa"})]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "method must be one of ngram, layer_skip" in err


@pytest.mark.parametrize("method", sorted(METHODS))
def test_sampled_tokens_follow_the_target_distribution(tiny_llama_dir: Path, method: str,
                                                       request: pytest.FixtureRequest) -> None:
    """temperature 1, top_k 3: the joint distribution of the first three tokens of 3000
    seeded samples (the second and third come from verify steps) fits the oracle's exact one
    (27 cells, p > 0.001; fixed seeds, so the outcome never changes)."""
    import torch

    rng = random.Random(5)
    passage = [rng.randrange(3, 300) for _ in range(12)]
    top_k, num = 3, 3000
    ref = load_reference(tiny_llama_dir)
    # The model's own greedy continuation in the prompt: likely tokens have occurred, so
    # prompt lookup proposes, and proposals are often kept.
    prompt = passage * 2 + reference_greedy(ref, passage * 2, 24)[0]

    def next_probs(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([ids])).logits[0, -1]
        values, order = logits.topk(top_k)
        return dict(zip(order.tolist(), values.softmax(-1).tolist(), strict=True))

    exact: dict[tuple[int, ...], float] = {}
    for t1, p1 in next_probs(prompt).items():
        for t2, p2 in next_probs(prompt + [t1]).items():
            for t3, p3 in next_probs(prompt + [t1, t2]).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_kv_blocks=1000,
              speculative_config=_method_config(method, "llama", request))
    counts = dict.fromkeys(exact, 0)
    for first in range(0, num, 1000):  # under the engine's queue limit
        params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, ignore_eos=True,
                                 seed=seed) for seed in range(first, first + 1000)]
        for out in llm.generate([prompt] * len(params), params):
            counts[tuple(out.outputs[0].token_ids[:3])] += 1
    fits, stat, critical = chi_square_fits(list(counts.values()), list(exact.values()))
    assert fits, (stat, critical)
    stats = llm.stats()
    assert stats.spec_num_drafts > num // 2 and stats.spec_num_accepted_tokens > num // 10
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.all_free_or_cached()


def test_requests_that_do_not_speculate_share_the_batch_unchanged(tiny_llama_dir: Path) -> None:
    """Penalties, logit_bias, logprobs, min_tokens and a grammar next to speculating
    requests: every output (ids, logprobs, text) equals the one without speculation."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(5)] * 3 for _ in range(7)]
    greedy: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    params = [SamplingParams(**greedy), SamplingParams(**greedy, presence_penalty=1.0),
              SamplingParams(**greedy, logit_bias={7: 5.0}), SamplingParams(**greedy, logprobs=2),
              SamplingParams(**greedy, min_tokens=12),
              SamplingParams(**greedy, grammar=GrammarSpec.choice(["red", "green", "blue"])),
              SamplingParams(**greedy, prompt_logprobs=1)]
    outs = {}
    for name, spec in (("off", None), ("on", SPEC)):
        llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_kv_blocks=200,
                  speculative_config=spec)
        outs[name] = llm.generate(prompts, params)
        if spec is not None:
            # The plain and the prompt-logprobs request speculated; nothing else did.
            assert llm.stats().spec_num_accepted_tokens > 0
        llm.engine.kv.check_invariants()
        llm.close()
    for on, off in zip(outs["on"], outs["off"], strict=True):
        assert (on.outputs[0].token_ids, on.outputs[0].text) == (off.outputs[0].token_ids,
                                                                 off.outputs[0].text)
        # Another batch shape may round differently in the last bits: compare the numbers.
        for got, want in ((on.outputs[0].logprobs, off.outputs[0].logprobs),
                          (on.prompt_logprobs, off.prompt_logprobs)):
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert _numbers(got) == pytest.approx(_numbers(want), abs=1e-5)


def _numbers(value: Any) -> list[float]:
    """Every number in nested logprob tuples and lists (None entries skipped), in order."""
    if isinstance(value, (int, float)):
        return [float(value)]
    return [] if value is None else [x for v in value for x in _numbers(v)]
