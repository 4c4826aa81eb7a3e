"""Structured outputs through the whole engine: constrained and free requests, on different
adapters, in one batch; n > 1; forced preemption of both kinds; prefix hits. Every
constrained output that ends with "stop" must validate (``jsonschema``, ``re``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.sampling_params import GrammarSpec
from loraplex.errors import InvalidRequestError
from loraplex.llm import LoRARequest

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False}
REGEX = r"[a-f]{3}-[0-9]{2}"


def _constraint(i: int) -> GrammarSpec | None:
    return [GrammarSpec.json_schema(SCHEMA), None, GrammarSpec("regex", REGEX, "guided_regex"),
            None, GrammarSpec.choice(["red", "green", "blue"])][i % 5]


def _check(spec: GrammarSpec, text: str) -> None:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in ("red", "green", "blue"), text


@pytest.mark.parametrize("engine", [
    {"num_kv_blocks": 400},
    {"num_kv_blocks": 24, "max_num_batched_tokens": 16},
    {"num_kv_blocks": 24, "max_num_batched_tokens": 16, "preemption_mode": "swap",
     "swap_space_blocks": 80},
], ids=["plain", "recompute", "swap"])
def test_constrained_and_free_requests_share_batches(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], engine: dict[str, Any]) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, max_loras=2,
              max_lora_rank=16, **engine)
    adapters = [None, LoRARequest("r4", str(llama_adapters["r4"])),
                LoRARequest("r8qv", str(llama_adapters["r8qv"]))]
    rng = torch.Generator().manual_seed(3)
    prompts, params, loras = [], [], []
    for i in range(20):
        prompts.append(torch.randint(3, 300, (5 + (7 * i) % 19,), generator=rng).tolist())
        temperature = [0.0, 0.8, 1.3][i % 3]
        params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=60,
                                     n=2 if i % 4 == 0 else 1, grammar=_constraint(i)))
        loras.append(adapters[i % 3])
    outs = llm.generate(prompts, params, lora_request=loras,
                        arrival_steps=[i // 4 for i in range(len(prompts))])
    stopped = 0
    for p, out in zip(params, outs, strict=True):
        assert len(out.outputs) == p.n
        for seq in out.outputs:
            if p.grammar is not None and seq.finish_reason == "stop":
                _check(p.grammar, seq.text)
                stopped += 1
    assert stopped >= 10
    if engine["num_kv_blocks"] < 100:
        assert llm.stats().num_preemptions > 0
    assert llm.engine.kv.all_free_or_cached()


def test_greedy_constrained_output_is_the_same_on_a_prefix_hit(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_kv_blocks=200)
    prompt = list(range(10, 40))
    params = SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec.json_schema(
        SCHEMA))
    first = llm.generate([prompt], params)[0].outputs[0]
    second = llm.generate([prompt], params)[0].outputs[0]
    assert llm.stats().prefix_cache_hit_tokens > 0
    assert second.token_ids == first.token_ids
    if first.finish_reason == "stop":
        _check(params.grammar, first.text)  # type: ignore[arg-type]


def test_a_grammar_that_cannot_compile_is_refused_before_queueing(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[5, 6, 7]], SamplingParams(
            max_tokens=4, grammar=GrammarSpec("regex", "(", "guided_regex")))
    assert info.value.param == "guided_regex"
    assert not llm.engine.has_unfinished()
    ok = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(ok.outputs[0].token_ids) == 4
