"""The OpenAI-compatible API through the official ``openai`` client, against a live server.

The oracle for text is the offline ``LLM`` on the same model, adapter, prompt and seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.engine.sampling_params import SamplingParams
from loraplex.llm import LLM, LoRARequest

LiveServer = Any  # tests/gateway/conftest.py's LiveServer
SERVED_NAME = "tiny-llama"

PROMPT = "the quick brown fox"
SEED = 1234


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_loras=2, max_lora_rank=16,
              max_cpu_loras=4, progress=False)
    try:
        yield llm
    finally:
        llm.close()


def offline_texts(llm: LLM, live: LiveServer, prompt: str | list[int], adapter: str | None,
                  **params: object) -> list[str]:
    lora = (LoRARequest(adapter.replace("/", "-"), str(live.adapter_dirs[adapter]))
            if adapter else None)
    [out] = llm.generate([prompt], SamplingParams(**params), lora_request=lora)  # type: ignore[arg-type]
    return [o.text for o in out.outputs]


def chat_prompt_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    return list(llm.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("model", [SERVED_NAME, "sql", "alice/summarizer"])
def test_completion_matches_offline_llm(live: LiveServer, offline: LLM, model: str) -> None:
    adapter = None if model == SERVED_NAME else ("alice/" + model.split("/")[-1])
    with live.openai("alice") as client:
        result = client.completions.create(model=model, prompt=PROMPT, max_tokens=20,
                                           temperature=0.9, seed=SEED)
    expected = offline_texts(offline, live, PROMPT, adapter, max_tokens=20, temperature=0.9,
                             seed=SEED)
    assert [c.text for c in result.choices] == expected
    assert result.model == model
    assert result.object == "text_completion"
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert result.usage.completion_tokens == len(offline.tokenizer.encode(expected[0])) or \
        result.usage.completion_tokens <= 20
    assert result.usage.total_tokens == (result.usage.prompt_tokens
                                         + result.usage.completion_tokens)


def test_completion_n2_stream_and_usage(live: LiveServer, offline: LLM) -> None:
    params = dict(max_tokens=16, temperature=1.0, seed=SEED, n=2)
    expected = offline_texts(offline, live, PROMPT, "alice/sql", **params)
    with live.openai("alice") as client:
        whole = client.completions.create(model="sql", prompt=PROMPT, **params)  # type: ignore[arg-type]
        stream = client.completions.create(model="sql", prompt=PROMPT, stream=True,
                                           stream_options={"include_usage": True},
                                           **params)  # type: ignore[arg-type]
        texts = ["", ""]
        usage = None
        with stream:
            for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                if chunk.usage is not None:
                    assert chunk.choices == []
                    usage = chunk.usage
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert texts == expected
    assert whole.usage is not None and usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_matches_offline_llm_stream_and_not(live: LiveServer, offline: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello world, how are you today?"}]
    ids = chat_prompt_ids(offline, messages)
    expected = offline_texts(offline, live, ids, "alice/summarizer", max_tokens=24,
                             temperature=0.7, seed=SEED)
    with live.openai("bob") as client:  # a public adapter of another tenant
        result = client.chat.completions.create(
            model="alice/summarizer", messages=messages, max_tokens=24,  # type: ignore[arg-type]
            temperature=0.7, seed=SEED)
        stream = client.chat.completions.create(
            model="alice/summarizer", messages=messages, max_tokens=24,  # type: ignore[arg-type]
            temperature=0.7, seed=SEED, stream=True, stream_options={"include_usage": True})
        roles, text, reasons, usage = [], "", [], None
        with stream:
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.role:
                        roles.append(choice.delta.role)
                    text += choice.delta.content or ""
                    if choice.finish_reason:
                        reasons.append(choice.finish_reason)
                if chunk.usage is not None:
                    usage = chunk.usage
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected[0]
    assert text == expected[0]
    assert roles == ["assistant"]
    assert reasons == [result.choices[0].finish_reason]
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)
    assert usage is not None and usage.total_tokens == result.usage.total_tokens


def test_stop_strings(live: LiveServer, offline: LLM) -> None:
    with live.openai("alice") as client:
        free = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=30,
                                         temperature=0.0)
        text = free.choices[0].text
        assert len(text) > 4
        stop = text[2:4]
        stopped = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=30,
                                            temperature=0.0, stop=[stop, "\u2603"])
    expected = offline_texts(offline, live, PROMPT, None, max_tokens=30, temperature=0.0,
                             stop=(stop, "\u2603"))
    assert stopped.choices[0].text == expected[0] == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_greedy_logprobs(live: LiveServer) -> None:
    with live.openai("alice") as client:
        comp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5,
                                         temperature=0.0, logprobs=3)
        chat = client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            temperature=0.0, logprobs=True, top_logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == comp.choices[0].text
    assert len(lp.token_logprobs) == comp.usage.completion_tokens  # type: ignore[union-attr]
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(t) <= 3 for t in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert max(top, key=lambda k: top[k]) == token
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content


def test_usage_is_metered(live: LiveServer) -> None:
    with live.openai("erin") as client:
        completions = [client.completions.create(model=SERVED_NAME, prompt=PROMPT,
                                                 max_tokens=3, temperature=0.0)
                       for _ in range(3)]
        client.completions.create(model="alice/summarizer", prompt=PROMPT, max_tokens=2,
                                  n=2)
        report = client.get("/usage", cast_to=object)
    assert isinstance(report, dict)
    assert report["tenant"] == "erin"
    assert report["totals"]["requests"] == 4
    rows = {row["model"]: row for row in report["data"]}
    assert set(rows) == {SERVED_NAME, "alice/summarizer@v1"}
    base = rows[SERVED_NAME]
    assert base["requests"] == 3
    assert base["completion_tokens"] == sum(c.usage.completion_tokens  # type: ignore[union-attr]
                                            for c in completions)
    assert base["prompt_tokens"] == 3 * completions[0].usage.prompt_tokens  # type: ignore[union-attr]
    assert rows["alice/summarizer@v1"]["completion_tokens"] <= 4
