"""`loraplex generate` as a user runs it: a real subprocess."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_generate_prints_the_completion(tiny_llama_dir: Path,
                                        llama_adapters: dict[str, Path]) -> None:
    adapter = llama_adapters["r4"]
    options = ("generate", "--model", str(tiny_llama_dir), "--prompt", "hello world",
               "--adapter", str(adapter), "--max-tokens", "6", "--num-kv-blocks", "16")
    chat = _cli(*options)  # the tiny model has a chat template: used by default
    raw = _cli(*options, "--raw")
    assert chat.returncode == 0 and raw.returncode == 0, chat.stderr + raw.stderr
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, progress=False)
    wrapped = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}],
                                                tokenize=False, add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    lora = LoRARequest("r4", str(adapter))
    expected_chat = llm.generate(llm.tokenizer.encode(wrapped, add_special_tokens=False),
                                 params, lora)[0].outputs[0].text
    expected_raw = llm.generate("hello world", params, lora)[0].outputs[0].text
    assert expected_chat != expected_raw  # the two modes are told apart
    assert chat.stdout == expected_chat + "\n"
    assert raw.stdout == expected_raw + "\n"
    assert "loading" in chat.stderr  # model loading shows progress


def test_chat_on_a_model_without_template_is_one_line(tiny_llama_dir: Path,
                                                       tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_llama_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (plain / name).unlink(missing_ok=True)
    proc = _cli("generate", "--model", str(plain), "--prompt", "hi", "--chat",
                "--max-tokens", "2", "--num-kv-blocks", "16")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "loraplex: error: the model has no chat template: leave out --chat")
    auto = _cli("generate", "--model", str(plain), "--prompt", "hi", "--max-tokens", "2",
                "--num-kv-blocks", "16")
    assert auto.returncode == 0, auto.stderr  # without a template, the default is raw


def test_help_shows_defaults_and_every_engine_option_is_explained() -> None:
    from loraplex.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "serve"):
        help_text = " ".join(sub.choices[command].format_help().split())
        assert "(default: 64)" in help_text  # --max-tokens / --max-lora-rank
        if command == "generate":
            assert "(default: on when the model has a chat template" in help_text
        for action in sub.choices[command]._actions:
            assert action.help, f"{command} {action.option_strings} has no help"


def test_generate_refuses_a_bad_adapter_in_one_line(tiny_llama_dir: Path,
                                                    llama_adapters: dict[str, Path],
                                                    tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["r4"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["r"] = 128
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    proc = _cli("generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--adapter",
                str(bad), "--max-lora-rank", "64", "--num-kv-blocks", "16")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loraplex: error:") and "128" in last and "64" in last
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("option", "words"), [
    (("--device", "bogus"), "device must be cpu, cuda or cuda:N"),
    (("--seed", "9" * 23), "seed must be a 64-bit integer"),
    (("--num-kv-blocks", str(10**12)), "cannot allocate the KV cache"),
    (("--max-model-len", str(10**8)), "above the model's max_position_embeddings"),
    (("--temperature", "nan"), "temperature"),
])
def test_engine_options_this_machine_cannot_honour_are_one_line(
        tiny_llama_dir: Path, option: tuple[str, str], words: str) -> None:
    # Each had ended in a traceback (--max-model-len 10**8 built its rotary tables for
    # minutes first).
    proc = _cli("generate", "--model", str(tiny_llama_dir), "--prompt", "hi",
                "--max-tokens", "2", *option)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loraplex: error:") and words in last, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_cuda_device_is_one_line(tiny_llama_dir: Path) -> None:
    proc = _cli("generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--device",
                "cuda")
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_refuses_a_missing_model(tmp_path: Path) -> None:
    proc = _cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_draft_refuses_bad_input_in_one_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    for args, expected in (
            (("--model", str(tiny_llama_dir), "--layers", "0"), "num_layers must be in [1, "),
            (("--model", str(tmp_path / "absent"), "--layers", "1"), "no readable config.json")):
        result = _cli("draft", *args, "--out", str(tmp_path / "out"))
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(("option", "words"), [
    (("--max-tokens", "-5"), "max_tokens"),
    (("--temperature", "-1"), "temperature"),
    (("--top-p", "2"), "top_p"),
])
def test_sampling_values_are_refused_before_the_model_loads(tmp_path: Path,
                                                            option: tuple[str, str],
                                                            words: str) -> None:
    """Checked before anything loads: named even with a model folder that does not exist
    (which would otherwise be the first error, after a demo model's download at worst)."""
    proc = _cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi", *option)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loraplex: error:") and words in last, proc.stderr
    assert "config.json" not in proc.stderr and "Traceback" not in proc.stderr
