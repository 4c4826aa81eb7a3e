"""The real demo model (SmolLM2-135M-Instruct) with a random adapter against PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.model.demo import prepare_demo_model
from loraplex.testing import build_adapter, load_reference, reference_greedy


@pytest.mark.slow
def test_demo_model_with_adapter_matches_peft(tmp_path: Path) -> None:
    model_dir = prepare_demo_model(progress=False)
    adapter = build_adapter(tmp_path / "adapter", model_dir, rank=8, alpha=16.0, seed=3,
                            weight_scale=0.2)
    llm = LLM(str(model_dir), max_loras=1, max_lora_rank=8, num_kv_blocks=64, progress=False)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        [LoRARequest("demo-adapter", str(adapter)), None])
    peft_model = load_reference(model_dir, adapter)
    base = load_reference(model_dir)
    for prompt, out, ref in zip(prompts, outs, (peft_model, base), strict=True):
        ids = llm.tokenizer.encode(prompt)
        expected, _ = reference_greedy(ref, ids, 8)
        assert out.outputs[0].token_ids == expected
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "layer_skip", "num_draft_layers": 24}])
def test_demo_model_with_speculation_matches_peft(tmp_path: Path, spec: dict[str, object]) -> None:
    """Copy-heavy chat prompts, an adapter and the base model in one batch: greedy outputs
    with speculation on equal the oracle's, and proposals were really kept."""
    model_dir = prepare_demo_model(progress=False)
    adapter = build_adapter(tmp_path / "adapter", model_dir, rank=8, alpha=16.0, seed=3,
                            weight_scale=0.2)
    llm = LLM(str(model_dir), max_loras=1, max_lora_rank=8, num_kv_blocks=64, progress=False,
              speculative_config=spec)
    passage = "The bridge on Mill Street will be repaired before winter, the committee said."
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{ask}\n\n{passage}"}], add_generation_prompt=True)
        for ask in ("Repeat this exactly:", "Quote this sentence:")]
    prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        [LoRARequest("demo-adapter", str(adapter)), None])
    for prompt, out, ref in zip(prompts, outs, (load_reference(model_dir, adapter),
                                                load_reference(model_dir)), strict=True):
        assert out.outputs[0].token_ids == reference_greedy(ref, prompt, 20)[0]
    assert llm.stats().spec_num_accepted_tokens > 0
    llm.close()
