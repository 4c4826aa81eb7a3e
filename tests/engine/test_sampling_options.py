"""Penalties, logit_bias, min_tokens and prompt logprobs through the whole engine, against
the oracle model with the definitions' logit processing (``loraplex.testing``): mixed
batches, ``n > 1``, and forced preemption (recompute and swap)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex import LLM, SamplingParams
from loraplex.errors import InvalidRequestError
from loraplex.testing import load_reference, reference_greedy_processed

MAX_TOKENS = 10
# Request kinds of a mixed batch, as SamplingParams fields; the processing each implies.
KINDS: list[dict[str, Any]] = [
    {},
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.7, "presence_penalty": -1.0, "frequency_penalty": 0.5},
    {"logit_bias": {5: 100.0, 6: 8.0, 9: -100.0}},
    {"frequency_penalty": 2.0, "n": 2},
    {"repetition_penalty": 1.5, "logit_bias": {17: 4.0}, "n": 3},
]


def _processing(kind: dict[str, Any]) -> dict[str, Any]:
    return {"presence": kind.get("presence_penalty", 0.0),
            "frequency": kind.get("frequency_penalty", 0.0),
            "repetition": kind.get("repetition_penalty", 1.0),
            "logit_bias": tuple(kind.get("logit_bias", {}).items())}


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir: Path) -> Any:
    return load_reference(tiny_llama_dir)


@pytest.fixture(scope="module")
def small_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), progress=False, num_kv_blocks=64)


@pytest.fixture(scope="module")
def batch(oracle: Any) -> tuple[list[list[int]], list[dict[str, Any]], list[list[int]]]:
    rng = torch.Generator().manual_seed(7)
    prompts, kinds, expected = [], [], []
    for i in range(24):
        prompt = torch.randint(3, 300, (4 + (5 * i) % 23,), generator=rng).tolist()
        # Repeated tokens in the prompt give the repetition penalty something to do.
        prompts.append(prompt + prompt[:3])
        kinds.append(KINDS[i % len(KINDS)])
        expected.append(reference_greedy_processed(oracle, prompts[-1], MAX_TOKENS,
                                                   **_processing(kinds[-1])))
    return prompts, kinds, expected


def _params(kind: dict[str, Any]) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kind)


@pytest.mark.parametrize("engine", [
    {"num_kv_blocks": 400},
    {"num_kv_blocks": 400, "max_num_batched_tokens": 5},
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16},
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16, "preemption_mode": "swap",
     "swap_space_blocks": 40},
], ids=["plain", "chunked", "recompute", "swap"])
def test_penalties_and_bias_match_the_definitions(
        tiny_llama_dir: Path, batch: tuple[list[list[int]], list[dict[str, Any]],
                                           list[list[int]]],
        engine: dict[str, Any]) -> None:
    prompts, kinds, expected = batch
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, **engine)
    outs = llm.generate(prompts, [_params(k) for k in kinds],
                        arrival_steps=[i // 3 for i in range(len(prompts))])
    for i, out in enumerate(outs):
        assert len(out.outputs) == kinds[i].get("n", 1)
        for seq in out.outputs:
            assert seq.token_ids == expected[i], f"request {i}: {kinds[i]}"
    if "num_kv_blocks" in engine and engine["num_kv_blocks"] < 100:
        assert llm.stats().num_preemptions > 0
    assert llm.engine.kv.all_free_or_cached()
    # Penalties changed what greedy picks: the test would pass vacuously otherwise.
    assert sum(e != expected[0] for e in expected) > 0


def test_penalties_given_as_ints_match_the_definitions(small_llm: LLM, oracle: Any) -> None:
    """`presence_penalty=1` and the like, as vLLM's users write them, each request alone in
    its batch (a batch whose penalised rows all gave one penalty as an int had that
    penalty's tensor come out int64, and the step failed)."""
    kinds: list[dict[str, Any]] = [{"presence_penalty": 1}, {"frequency_penalty": 2},
                                   {"repetition_penalty": 2, "frequency_penalty": -1}]
    prompts = [[7, 8, 9, 7, 8, 9, 11], [20, 21, 20, 21, 22], [30, 31, 32, 30]]
    for prompt, kind in zip(prompts, kinds, strict=True):
        out = small_llm.generate([prompt], _params(kind))[0]
        assert out.outputs[0].token_ids == reference_greedy_processed(
            oracle, prompt, MAX_TOKENS, **_processing(kind)), kind


def test_min_tokens_holds_back_stop_tokens_and_strings(small_llm: LLM) -> None:
    llm = small_llm
    prompt = [11, 42, 7, 99, 100, 3, 58]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                 ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[1]
    early = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert len(early.outputs[0].token_ids) <= 2
    held = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
        min_tokens=6))[0].outputs[0]
    assert len(held.token_ids) >= 6
    assert stop_id not in held.token_ids[:6]
    stop = free.text[:2]
    assert stop
    stopped = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
        min_tokens=12))[0].outputs[0]
    assert len(stopped.token_ids) == 12


@pytest.mark.parametrize("engine", [
    {"num_kv_blocks": 200},
    {"num_kv_blocks": 200, "max_num_batched_tokens": 4},
], ids=["whole", "chunked"])
def test_prompt_logprobs_match_the_oracle_even_on_a_prefix_cache_hit(
        tiny_llama_dir: Path, oracle: Any, engine: dict[str, Any]) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, **engine)
    prompt = [11, 42, 7, 99, 100, 3, 58, 11, 42, 7, 99, 1, 2]
    with torch.no_grad():
        ref = torch.log_softmax(oracle(input_ids=torch.tensor([prompt])).logits[0].double(),
                                dim=-1)  # [len, vocab]
    # The first run fills the prefix cache; the second would hit it.
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, n=2)
    for _ in range(2):
        out = llm.generate([prompt], params)[0]
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            assert entry is not None
            logprob, top = entry
            assert logprob == pytest.approx(float(ref[pos, prompt[pos + 1]]), abs=1e-4)
            assert [t for t, _ in top] == ref[pos].topk(2).indices.tolist()
    assert llm.stats().prefix_cache_hit_tokens == 0
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None
    assert llm.stats().prefix_cache_hit_tokens > 0


def test_prompt_logprobs_survive_preemption(tiny_llama_dir: Path, oracle: Any) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_kv_blocks=14,
              max_num_batched_tokens=16)
    prompts = [[5 + i, 40 + i, 7, 99, 100 + i, 3, 58, 60 + i, 2] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                            prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    assert llm.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(oracle(input_ids=torch.tensor([prompt])).logits[0], -1)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        got = [e[0] for e in out.prompt_logprobs[1:] if e is not None]
        want = [float(ref[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(("fields", "param"), [
    ({"logit_bias": {384: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 10**400}, "top_p"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_bad_options_are_refused_and_the_engine_keeps_serving(
        small_llm: LLM, fields: dict[str, Any], param: str) -> None:
    llm = small_llm
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, **fields))
    assert info.value.param == param
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) >= 1


# Values of every Python type a caller might hand SamplingParams, right or wrong.
_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 24), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-3.0, 3.0),
    st.text(max_size=3), st.lists(st.one_of(st.integers(-2, 400), st.text(max_size=2),
                                            st.floats(-2, 2)), max_size=3),
    st.dictionaries(st.one_of(st.integers(-2, 400), st.text(max_size=3)),
                    st.one_of(st.floats(-150, 150), st.text(max_size=2)), max_size=3))
_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
           "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
           "include_stop_str_in_output", "skip_special_tokens")


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(_FIELDS), _ANY_VALUE, max_size=4))
def test_any_field_of_any_type_is_run_or_refused_naming_it(
        small_llm: LLM, fields: dict[str, Any]) -> None:
    """SamplingParams through the offline API with fields of every type: a request either
    runs (each of its n outputs has a token or more) or is refused with InvalidRequestError
    naming one of the fields it set; nothing else is raised, and the engine keeps serving
    (the next example runs on it). Wrong types had reached the sampler (``top_k=2.5``,
    ``logprobs=True``) and failed the step."""
    fields.setdefault("max_tokens", 3)
    try:
        out = small_llm.generate([[5, 6, 7, 5]], SamplingParams(**fields))[0]
    except InvalidRequestError as exc:
        assert exc.param in fields, (exc.param, fields)
        return
    assert len(out.outputs) == fields.get("n", 1)
    assert all(seq.token_ids for seq in out.outputs)
