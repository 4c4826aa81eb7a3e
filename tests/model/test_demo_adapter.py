"""`loraplex demo adapter`: a short training run on the demo model gives a PEFT folder that
the upload check accepts and that changes greedy output, the same through loraplex's
engine as through transformers + PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.errors import ConfigError
from loraplex.model.adapter_loader import TargetShapes, validate_adapter_dir
from loraplex.model.demo import prepare_demo_model
from loraplex.model.demo_adapter import (
    STYLE_PREFIX,
    STYLE_SUFFIX,
    DemoAdapterOptions,
    make_prompts,
    styled,
    train_demo_adapter,
)

NUM_TOKENS = 8


def test_generated_data_is_varied_and_styled() -> None:
    prompts = make_prompts(48, seed=0)
    assert len(set(prompts)) == 48
    assert make_prompts(48, seed=0) == prompts and make_prompts(48, seed=1) != prompts
    answer = styled("The capital of France is Paris.")
    assert answer.startswith(STYLE_PREFIX) and answer.endswith(STYLE_SUFFIX)


def test_refuses_to_replace_a_folder_that_is_not_an_adapter(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="more than an adapter"):
        train_demo_adapter(tmp_path / "no-model", tmp_path, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_short_run_changes_greedy_output_as_peft_does(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = prepare_demo_model(progress=False)
    options = DemoAdapterOptions(steps=3, batch_size=2, learning_rate=1e-2)
    out = train_demo_adapter(model_dir, tmp_path / "adapter", options, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]  # no pickle
    # Readable by others, as the user's other files (safetensors had written it 0600).
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    checked = validate_adapter_dir(out, TargetShapes.from_model_dir(model_dir), 64)
    assert checked.base_model_name_or_path == model_dir.name  # what a server compares

    llm = LLM(str(model_dir), num_kv_blocks=64, progress=False)
    try:
        chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                                 tokenize=False, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(chat, add_special_tokens=False)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        base, tuned = (o.outputs[0].token_ids for o in llm.generate(
            [prompt, prompt], params, [None, LoRARequest("demo", str(out))]))
    finally:
        llm.close()
    assert tuned != base

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(out)).eval()
    with torch.no_grad():
        ids = peft_model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS,
                                  min_new_tokens=NUM_TOKENS, do_sample=False)
    assert ids[0, len(prompt):].tolist() == tuned
