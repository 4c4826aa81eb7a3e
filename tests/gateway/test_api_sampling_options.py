"""Sampling options through the official ``openai`` client against a live server:
penalties, ``logit_bias``, ``min_tokens``, ``echo`` with prompt logprobs, and
``include_stop_str_in_output``. The oracle is the offline ``LLM`` on the same model, whose
processing the engine tests check against the definitions; greedy streams concatenate to
the whole answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.engine.sampling_params import SamplingParams
from loraplex.llm import LLM
from loraplex.testing import load_reference

LiveServer = Any  # tests/gateway/conftest.py's LiveServer
SERVED_NAME = "tiny-llama"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, progress=False)
    try:
        yield llm
    finally:
        llm.close()


def _offline(llm: LLM, prompt: str | list[int], **params: Any) -> list[str]:
    [out] = llm.generate([prompt], SamplingParams(**params))
    return [o.text for o in out.outputs]


OPTIONS: list[dict[str, Any]] = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    {"frequency_penalty": -1.0, "n": 2},
    {"logit_bias": {"5": 100, "9": -100}},
    {"extra_body": {"repetition_penalty": 1.7, "min_tokens": 12}},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["presence+frequency", "n2", "bias",
                                                  "repetition+min_tokens"])
def test_completion_options_match_offline_stream_and_not(
        live: LiveServer, offline: LLM, options: dict[str, Any]) -> None:
    extra = options.get("extra_body", {})
    direct = {k: v for k, v in options.items() if k != "extra_body"}
    engine = dict(direct, **extra)
    if "logit_bias" in engine:
        engine["logit_bias"] = {int(k): float(v) for k, v in engine["logit_bias"].items()}
    expected = _offline(offline, PROMPT, max_tokens=16, temperature=0.0, **engine)
    with live.openai("alice") as client:
        whole = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16,
                                          temperature=0.0, **options)
        stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16,
                                           temperature=0.0, stream=True, **options)
        texts = [""] * len(expected)
        with stream:
            for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert texts == expected
    plain = _offline(offline, PROMPT, max_tokens=16, temperature=0.0)
    assert expected[0] != plain[0]  # the option did something


@pytest.mark.parametrize("options", [{"temperature": 1e-300}, {"temperature": 5e-6},
                                     {"temperature": 1.0, "top_p": 1e-300}],
                         ids=["temperature-1e-300", "temperature-5e-6", "top_p-1e-300"])
def test_vanishing_temperature_or_top_p_samples_the_greedy_tokens(
        live: LiveServer, offline: LLM, options: dict[str, Any]) -> None:
    # 1e-300 is 0 in float32, the sampler's tensors: a temperature that small (or under
    # GREEDY_TEMPERATURE) samples greedily, and a top_p that small keeps the top token.
    expected = _offline(offline, PROMPT, max_tokens=16, temperature=0.0)
    with live.openai("alice") as client:
        got = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16,
                                        seed=3, **options)
    assert [c.text for c in got.choices] == expected


def test_chat_penalties_and_bias(live: LiveServer, offline: LLM) -> None:
    messages = [{"role": "user", "content": "hello world, how are you today?"}]
    text = offline.tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
    ids = list(offline.tokenizer.encode(text, add_special_tokens=False))
    expected = _offline(offline, ids, max_tokens=12, temperature=0.0, presence_penalty=2.0,
                        logit_bias={7: 3.0})
    with live.openai("alice") as client:
        result = client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=12,  # type: ignore[arg-type]
            temperature=0.0, presence_penalty=2.0, logit_bias={"7": 3})
        stream = client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=12,  # type: ignore[arg-type]
            temperature=0.0, presence_penalty=2.0, logit_bias={"7": 3}, stream=True)
        streamed = ""
        with stream:
            for chunk in stream:
                for choice in chunk.choices:
                    streamed += choice.delta.content or ""
    assert result.choices[0].message.content == expected[0] == streamed


def test_echo_with_prompt_logprobs(live: LiveServer, offline: LLM,
                                   tiny_llama_dir: Path) -> None:
    prompt_ids = list(offline.tokenizer.encode(PROMPT))
    with live.openai("alice") as client:
        plain = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5,
                                          temperature=0.0)
        echoed = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5,
                                           temperature=0.0, echo=True, logprobs=2)
        by_ids = client.completions.create(model=SERVED_NAME, prompt=prompt_ids,
                                           max_tokens=5, temperature=0.0, echo=True)
        stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5,
                                           temperature=0.0, echo=True, logprobs=2,
                                           stream=True)
        streamed, tokens, logprobs = "", [], []
        with stream:
            for chunk in stream:
                choice = chunk.choices[0]
                streamed += choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens or []
                    logprobs += choice.logprobs.token_logprobs or []
    completion = plain.choices[0].text
    assert echoed.choices[0].text == PROMPT + completion == streamed
    assert by_ids.choices[0].text == offline.tokenizer.decode(prompt_ids) + completion
    lp = echoed.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(prompt_ids) + echoed.usage.completion_tokens  # type: ignore[union-attr]
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None
    oracle = load_reference(tiny_llama_dir)
    with torch.no_grad():
        ref = torch.log_softmax(oracle(input_ids=torch.tensor([prompt_ids])).logits[0], -1)
    want = [float(ref[p, prompt_ids[p + 1]]) for p in range(len(prompt_ids) - 1)]
    assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx(want, abs=1e-4)
    assert tokens == lp.tokens
    assert logprobs == pytest.approx(lp.token_logprobs)
    assert lp.text_offset is not None and lp.text_offset[len(prompt_ids)] == len(
        "".join(lp.tokens[:len(prompt_ids)]))


def test_include_stop_str_in_output(live: LiveServer) -> None:
    with live.openai("alice") as client:
        free = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=30,
                                         temperature=0.0)
        text = free.choices[0].text
        assert len(text) > 4
        stop = text[2:4]
        kept = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=30,
                                         temperature=0.0, stop=[stop],
                                         extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"


def test_top_logprobs_up_to_20(live: LiveServer) -> None:
    with live.openai("alice") as client:
        chat = client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            temperature=0.0, logprobs=True, top_logprobs=20)
        comp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=3,
                                         temperature=0.0, logprobs=20)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(e.top_logprobs) == 20 for e in content)
    top = comp.choices[0].logprobs.top_logprobs  # type: ignore[union-attr]
    # One entry per distinct text: byte tokens of this tiny vocabulary share one.
    assert top and all(1 <= len(t) <= 20 for t in top)


def test_out_of_range_logit_bias_is_400_and_the_engine_keeps_serving(
        live: LiveServer) -> None:
    import openai

    with live.openai("alice") as client:
        for bias in ({"999999": 1}, {"3": 101}):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=3,
                                          logit_bias=bias)
            assert info.value.body["param"] == "logit_bias"  # type: ignore[index]
        ok = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=3,
                                       temperature=0.0)
    assert ok.usage is not None and ok.usage.completion_tokens == 3


def test_chat_echo_opens_the_answer_with_the_last_assistant_message(live: LiveServer) -> None:
    """vLLM's echo on chat: when the last message is the assistant's, the answer opens with
    its content (streamed as the first content delta); otherwise it changes nothing."""
    partial = "The fox is"
    messages: list[Any] = [{"role": "user", "content": "Tell me about the fox."},
                           {"role": "assistant", "content": partial}]
    with live.openai("alice") as client:
        kwargs: dict[str, Any] = {"model": SERVED_NAME, "messages": messages,
                                  "max_tokens": 8, "temperature": 0.0}
        plain = client.chat.completions.create(**kwargs).choices[0].message.content
        echoed = client.chat.completions.create(extra_body={"echo": True},
                                                **kwargs).choices[0].message.content
        assert echoed == partial + (plain or "")
        chunks = [c.choices[0].delta for c in client.chat.completions.create(
            stream=True, extra_body={"echo": True}, **kwargs) if c.choices]
        assert chunks[0].role == "assistant" and chunks[1].content == partial
        assert "".join(d.content or "" for d in chunks) == echoed
        user_last = client.chat.completions.create(
            model=SERVED_NAME, messages=messages[:1], max_tokens=8, temperature=0.0,
            extra_body={"echo": True}).choices[0].message.content
        again = client.chat.completions.create(
            model=SERVED_NAME, messages=messages[:1], max_tokens=8,
            temperature=0.0).choices[0].message.content
        assert user_last == again
