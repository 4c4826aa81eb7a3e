"""Loading a model folder: dtypes, the KV memory budget, and what is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from loraplex.config import CacheConfig, LoRAConfig, ModelConfig
from loraplex.errors import ConfigError, ModelLoadError
from loraplex.model.runner import BatchInputs, ModelRunner, SeqInput
from loraplex.model.sampler import SamplingRow
from loraplex.testing import runner_logits
from loraplex_kernels import cpu_native

LORA = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_is_close_to_float32(tiny_llama_dir: Path, dtype: str) -> None:
    prompt = list(range(5, 30))
    batch = BatchInputs([SeqInput(prompt, 0, [0, 1], -1, [SamplingRow()])])
    full = runner_logits(ModelRunner(ModelConfig(str(tiny_llama_dir)),
                                     CacheConfig(num_kv_blocks=4), LORA, progress=False), batch)
    half_runner = ModelRunner(ModelConfig(str(tiny_llama_dir), dtype=dtype),  # type: ignore[arg-type]
                              CacheConfig(num_kv_blocks=4), LORA, progress=False)
    assert half_runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    half = runner_logits(half_runner, batch)
    assert (half - full).abs().max().item() < 0.1


def test_kv_blocks_from_a_memory_budget(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir)),
                         CacheConfig(kv_cache_memory=1 << 20), LORA, progress=False)
    # 2 (K, V) x 2 layers x 16 slots x 2 kv heads x 16 dims x 4 bytes per block
    assert runner.block_bytes == 2 * 2 * 16 * 2 * 16 * 4
    assert runner.num_blocks == (1 << 20) // runner.block_bytes
    assert runner.kv_caches[0][0].shape == (runner.num_blocks, 16, 2, 16)
    with pytest.raises(ConfigError, match="holds no block"):
        ModelRunner(ModelConfig(str(tiny_llama_dir)), CacheConfig(kv_cache_memory=100), LORA,
                    progress=False)


def test_bad_cpu_gemm_setting_is_refused(tiny_llama_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "blas")
    with pytest.raises(ConfigError, match="LORAPLEX_CPU_GEMM must be one of auto, onednn, onednn-mkl, "):
        ModelRunner(ModelConfig(str(tiny_llama_dir)), CacheConfig(num_kv_blocks=4), LORA,
                    progress=False)


def test_bad_cpu_bf16_setting_is_refused(tiny_llama_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_BF16", "fastest")
    with pytest.raises(ConfigError, match="LORAPLEX_CPU_BF16 must be auto or portable"):
        ModelRunner(ModelConfig(str(tiny_llama_dir), dtype="bfloat16"),
                    CacheConfig(num_kv_blocks=4), LORA, progress=False)


def test_pickle_only_checkpoints_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04 not opened")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        ModelRunner(ModelConfig(str(model)), CacheConfig(num_kv_blocks=4), LORA,
                    progress=False)


# config.json edits a family cannot serve exactly, and what the one-line refusal names
REFUSED_CONFIGS = [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: llama, "),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported; supported: silu, "
                             "gelu_pytorch_tanh"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0}},
     "rope_type 'proportional' is not supported; supported: default, linear, llama3, yarn"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.3125}},
     "partial_rotary_factor 0.3125 gives a rotated width of 5 of head_dim 16"),
    ({"layer_types": ["chunked_attention", "full_attention"]},
     "layer_types entry 'chunked_attention' is not supported; supported: full_attention, "
     "sliding_attention"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
]


@pytest.mark.parametrize("edit,message", REFUSED_CONFIGS)
def test_what_cannot_be_served_exactly_is_refused_by_name(
        tiny_llama_dir: Path, tmp_path: Path, edit: dict[str, object], message: str) -> None:
    import json

    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(edit)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as info:
        ModelRunner(ModelConfig(str(model)), CacheConfig(num_kv_blocks=4), LORA,
                    progress=False)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.usefixtures("amx_restored")
def test_amx_setting_is_applied_by_the_runner_and_a_bad_one_refused(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LORAPLEX_CPU_AMX`` is read when a runner is built (the library may have loaded
    long before): 0 turns the tiles off, auto back on where the CPU has them; anything
    else is refused before the model loads."""
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "0")
    ModelRunner(ModelConfig(str(tiny_llama_dir), dtype="bfloat16"),
                CacheConfig(num_kv_blocks=4), LORA, progress=False)
    assert not cpu_native.skinny_amx()
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "auto")
    ModelRunner(ModelConfig(str(tiny_llama_dir), dtype="bfloat16"),
                CacheConfig(num_kv_blocks=4), LORA, progress=False)
    assert cpu_native.skinny_amx() == cpu_native.skinny_amx(True)
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "yes")
    with pytest.raises(ConfigError, match="LORAPLEX_CPU_AMX must be auto or 0"):
        ModelRunner(ModelConfig(str(tiny_llama_dir), dtype="bfloat16"),
                    CacheConfig(num_kv_blocks=4), LORA, progress=False)


def test_lora_read_ahead_setting_is_applied_by_the_runner_and_a_bad_one_refused(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LORAPLEX_CPU_LORA_READ_AHEAD`` is read when a runner is built: 0 off, 1 on
    where the build has it (AVX-512), auto the CPU's default; anything else is refused
    before the model loads."""
    built = cpu_native.lora_read_ahead(True)
    cpu_native.lora_read_ahead("auto")
    default = cpu_native.lora_read_ahead()
    try:
        for value, expected in (("0", False), ("1", built), ("auto", default)):
            monkeypatch.setenv("LORAPLEX_CPU_LORA_READ_AHEAD", value)
            ModelRunner(ModelConfig(str(tiny_llama_dir)), CacheConfig(num_kv_blocks=4), LORA,
                        progress=False)
            assert cpu_native.lora_read_ahead() == expected, value
        monkeypatch.setenv("LORAPLEX_CPU_LORA_READ_AHEAD", "yes")
        with pytest.raises(ConfigError, match="LORAPLEX_CPU_LORA_READ_AHEAD must be auto, "
                                              "0 or 1"):
            ModelRunner(ModelConfig(str(tiny_llama_dir)), CacheConfig(num_kv_blocks=4), LORA,
                        progress=False)
    finally:
        cpu_native.lora_read_ahead("auto")


@pytest.mark.parametrize("damage", ["truncated", "not safetensors", "empty"])
def test_a_damaged_weights_file_is_one_line_naming_it(tiny_llama_dir: Path, tmp_path: Path,
                                                      damage: str) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2],
                         "not safetensors": b"\x80\x04 a pickle, say" * 64,
                         "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as info:
        ModelRunner(ModelConfig(str(model)), CacheConfig(num_kv_blocks=4), LORA,
                    progress=False)
    assert str(info.value).startswith(f"{weights}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize(("config", "expected"), [
    ("{not json", "not a valid JSON file"),
    ('{"model_type": "no-such-architecture"}', "no-such-architecture"),
    ("{}", "model_type"),
])
def test_a_bad_config_is_one_line_naming_it(tiny_llama_dir: Path, tmp_path: Path,
                                            config: str, expected: str) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    (model / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match=expected) as info:
        ModelRunner(ModelConfig(str(model)), CacheConfig(num_kv_blocks=4), LORA,
                    progress=False)
    assert str(info.value).startswith(f"{model}: unreadable config.json (")
    assert "\n" not in str(info.value)
