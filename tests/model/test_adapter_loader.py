"""Tests of the PEFT adapter loader: good adapters load exactly, bad ones are refused by name."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from loraplex.adapter_format import file_sha256, folder_digest
from loraplex.errors import AdapterError, ModelLoadError
from loraplex.model.adapter_loader import (
    SUPPORTED_MODULES,
    LoRAAdapter,
    TargetShapes,
    load_adapter,
    validate_adapter_dir,
)
from loraplex.testing import build_adapter

MAX_RANK = 16
ALL = SUPPORTED_MODULES
PREFIX = "base_model.model.model.layers"

Tensors = dict[str, torch.Tensor]


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def llama_target(tiny_llama_dir: Path) -> TargetShapes:
    return TargetShapes.from_model_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen2_target(tiny_qwen2_dir: Path) -> TargetShapes:
    return TargetShapes.from_model_dir(tiny_qwen2_dir)


# name -> (arch, build_adapter kwargs)
GOOD_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_r4_all": ("llama", dict(rank=4, alpha=8.0, target_modules=ALL, seed=1)),
    "llama_r8_qv": ("llama", dict(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"), seed=2)),
    "llama_r16_rslora": (
        "llama",
        dict(rank=16, alpha=32.0, target_modules=ALL, use_rslora=True, seed=3),
    ),
    "qwen2_r8_all": ("qwen2", dict(rank=8, alpha=12.0, target_modules=ALL, seed=4)),
}


@pytest.fixture(scope="module")
def good_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("good_adapters")
    bases = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}
    return {
        name: build_adapter(root / name, bases[arch], **kwargs)
        for name, (arch, kwargs) in GOOD_SPECS.items()
    }


@pytest.fixture
def r8(good_adapters: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the rank-8 q/v llama adapter, for a test to break."""
    return Path(shutil.copytree(good_adapters["llama_r8_qv"], tmp_path / "adapter"))


def edit_config(adapter: Path, **changes: Any) -> None:
    path = adapter / "adapter_config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def edit_tensors(adapter: Path, fn: Callable[[Tensors], Tensors | None]) -> None:
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    out = fn(tensors)
    save_file(out if out is not None else tensors, str(path), metadata={"format": "pt"})


def key(layer: int, module: str, ab: str) -> str:
    parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"{PREFIX}.{layer}.{parent}.{module}.lora_{ab}.weight"


def refused(adapter: Path, target: TargetShapes, max_rank: int = MAX_RANK) -> str:
    with pytest.raises(AdapterError) as info:
        load_adapter(adapter, target, max_rank)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- TargetShapes


def test_target_shapes_from_tiny_llama(llama_target: TargetShapes) -> None:
    # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128
    assert llama_target.num_layers == 2
    assert llama_target.shapes == {
        "q_proj": (64, 64),
        "k_proj": (64, 32),
        "v_proj": (64, 32),
        "o_proj": (64, 64),
        "gate_proj": (64, 128),
        "up_proj": (64, 128),
        "down_proj": (128, 64),
    }


def test_target_shapes_qwen2_dir_matches_config(
    tiny_qwen2_dir: Path, qwen2_target: TargetShapes
) -> None:
    config = transformers.AutoConfig.from_pretrained(str(tiny_qwen2_dir))
    assert config.model_type == "qwen2"
    assert TargetShapes.from_hf_config(config) == qwen2_target


def test_target_shapes_uses_explicit_head_dim() -> None:
    config = transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
    )
    shapes = TargetShapes.from_hf_config(config)
    assert shapes.num_layers == 3
    assert shapes.shapes["q_proj"] == (64, 128)
    assert shapes.shapes["k_proj"] == (64, 32)
    assert shapes.shapes["o_proj"] == (128, 64)
    assert shapes.shapes["down_proj"] == (96, 64)


def test_target_shapes_refuses_unknown_arch_and_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="gpt2"):
        TargetShapes.from_hf_config(transformers.GPT2Config())
    with pytest.raises(ModelLoadError, match="config.json"):
        TargetShapes.from_model_dir(tmp_path / "nowhere")


@pytest.mark.parametrize("change", [{"num_attention_heads": 0}, {"hidden_size": math.inf},
                                    {"intermediate_size": -5}])
def test_target_shapes_refuses_impossible_counts_in_one_error(
        tiny_llama_dir: Path, tmp_path: Path, change: dict[str, Any]) -> None:
    # a division by zero and int(Infinity) had escaped as tracebacks from `adapters upload`
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.pop("head_dim", None)
    (model / "config.json").write_text(json.dumps(config | change))  # Infinity: Python's JSON
    with pytest.raises(ModelLoadError, match="cannot read config.json"):
        TargetShapes.from_model_dir(model)


# ---------------------------------------------------------------- good adapters


@pytest.mark.parametrize("spec", list(GOOD_SPECS))
def test_good_adapter_loads_exactly_what_peft_saved(
    spec: str,
    good_adapters: dict[str, Path],
    tiny_llama_dir: Path,
    tiny_qwen2_dir: Path,
    llama_target: TargetShapes,
    qwen2_target: TargetShapes,
) -> None:
    import peft

    arch, kwargs = GOOD_SPECS[spec]
    base_dir, target = (
        (tiny_llama_dir, llama_target) if arch == "llama" else (tiny_qwen2_dir, qwen2_target)
    )
    path = good_adapters[spec]
    adapter = load_adapter(path, target, MAX_RANK, name="tenant-a/" + spec)

    weights_file = path / "adapter_model.safetensors"
    assert adapter.name == "tenant-a/" + spec
    assert adapter.path == str(path)
    assert adapter.digest == folder_digest(weights_file.parent)
    assert adapter.rank == kwargs["rank"]
    assert adapter.alpha == kwargs["alpha"]
    assert adapter.use_rslora == kwargs.get("use_rslora", False)
    assert adapter.target_modules == tuple(sorted(kwargs["target_modules"]))
    assert adapter.base_model_name_or_path == str(base_dir)

    saved = load_file(str(weights_file))
    assert len(adapter.weights) == target.num_layers * len(kwargs["target_modules"])
    assert 2 * len(adapter.weights) == len(saved)
    for (layer, module), w in adapter.weights.items():
        for ab, tensor in (("A", w.lora_a), ("B", w.lora_b)):
            assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
            assert torch.equal(tensor, saved[key(layer, module, ab)])
        in_features, out_features = target.shapes[module]
        assert w.lora_a.shape == (adapter.rank, in_features)
        assert w.lora_b.shape == (out_features, adapter.rank)
    assert adapter.num_bytes == sum(t.numel() * 4 for t in saved.values())

    # Scaling must be bit-identical to what PEFT applies.
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(path))
    checked = 0
    for module_name, module in peft_model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling:
            assert scaling["default"] == adapter.scaling, module_name
            checked += 1
    assert checked == len(adapter.weights)
    r, alpha = kwargs["rank"], kwargs["alpha"]
    expected = alpha / math.sqrt(r) if kwargs.get("use_rslora") else alpha / r
    assert adapter.scaling == expected


def test_name_defaults_to_folder_and_validate_is_same_check(
    good_adapters: dict[str, Path], llama_target: TargetShapes
) -> None:
    path = good_adapters["llama_r4_all"]
    adapter = validate_adapter_dir(path, llama_target, MAX_RANK)
    assert not isinstance(adapter, LoRAAdapter)  # no tensors: validation needs no torch
    assert adapter.name == "llama_r4_all"
    assert adapter.digest == load_adapter(path, llama_target, MAX_RANK).digest


@pytest.mark.parametrize(
    "rename",
    [
        pytest.param(lambda k: k.replace(".weight", ".default.weight"), id="default-suffix"),
        pytest.param(lambda k: k.removeprefix("base_model.model."), id="no-peft-prefix"),
        pytest.param(
            lambda k: k.replace("base_model.model.model.", "base_model.model."), id="bare-decoder"
        ),
    ],
)
def test_key_variants_are_tolerated(
    rename: Callable[[str], str], r8: Path, llama_target: TargetShapes
) -> None:
    original = load_adapter(r8, llama_target, MAX_RANK)
    edit_tensors(r8, lambda t: {rename(k): v for k, v in t.items()})
    variant = load_adapter(r8, llama_target, MAX_RANK)
    assert variant.weights.keys() == original.weights.keys()
    for slot, w in variant.weights.items():
        assert torch.equal(w.lora_a, original.weights[slot].lora_a)
        assert torch.equal(w.lora_b, original.weights[slot].lora_b)
    assert variant.digest != original.digest


def test_half_precision_weights_are_converted_to_float32(
    r8: Path, llama_target: TargetShapes
) -> None:
    edit_tensors(r8, lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    saved = load_file(str(r8 / "adapter_model.safetensors"))
    adapter = load_adapter(r8, llama_target, MAX_RANK)
    w = adapter.weights[(1, "v_proj")]
    assert w.lora_a.dtype == torch.float32
    assert torch.equal(w.lora_a, saved[key(1, "v_proj", "A")].float())


def test_tensors_beyond_the_config_targets_are_refused(
    r8: Path, llama_target: TargetShapes
) -> None:
    """The config names q/v; PEFT would load a k_proj pair into nothing (it wraps only the
    targets) and serve the adapter without it: refused, naming the module (issue 56)."""
    def add_k(t: Tensors) -> None:
        t[key(0, "k_proj", "A")] = torch.randn(8, 64)
        t[key(0, "k_proj", "B")] = torch.randn(32, 8)

    edit_tensors(r8, add_k)
    with pytest.raises(AdapterError, match="target_modules does not name: "
                                           "model.layers.0.self_attn.k_proj"):
        load_adapter(r8, llama_target, MAX_RANK)


def test_an_untrained_peft_adapter_is_refused(tiny_llama_dir: Path, tmp_path: Path,
                                               llama_target: TargetShapes) -> None:
    """Saved straight after PEFT's initialisation (lora_B zeros), it would serve the base
    model under an adapter's name: refused, saying why (issue 56)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    untrained = peft.get_peft_model(model, peft.LoraConfig(  # type: ignore[arg-type]
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    untrained.save_pretrained(str(tmp_path / "untrained"), safe_serialization=True)
    assert "every lora_B is zero" in refused(tmp_path / "untrained", llama_target)


@pytest.mark.parametrize("change,reason", [
    ("zero_a", "every lora_A is zero"),
    ("tiny", "too small to change any float32 weight"),
])
def test_an_adapter_that_changes_nothing_is_refused(
        r8: Path, llama_target: TargetShapes, change: str, reason: str) -> None:
    def edit(t: Tensors) -> None:
        for name in t:
            if change == "zero_a" and ".lora_A." in name:
                t[name] = torch.zeros_like(t[name])
            elif change == "tiny":
                t[name] = t[name] * 1e-7

    edit_tensors(r8, edit)
    assert reason in refused(r8, llama_target)


def test_file_sha256_streams_large_files(tmp_path: Path) -> None:
    data = bytes(range(256)) * 10_000  # > 2 chunks of 1 MiB
    (tmp_path / "blob").write_bytes(data)
    assert file_sha256(tmp_path / "blob") == hashlib.sha256(data).digest()


# ---------------------------------------------------------------- refused: files


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".pkl", ".ckpt", ".BIN"])
def test_pickle_file_next_to_safetensors_is_refused_unopened(
    suffix: str, r8: Path, llama_target: TargetShapes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", never)
    monkeypatch.setattr(pickle, "load", never)
    monkeypatch.setattr(pickle, "loads", never)
    name = "adapter_model" + suffix
    (r8 / name).write_bytes(b"\x80\x04not really a pickle")
    message = refused(r8, llama_target)
    assert "pickle" in message and name in message


def test_pickle_in_subfolder_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    (r8 / "checkpoint-10").mkdir()
    (r8 / "checkpoint-10" / "optimizer.pt").write_bytes(b"x")
    assert "optimizer.pt" in refused(r8, llama_target)


def test_pickle_only_adapter_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    (r8 / "adapter_model.safetensors").rename(r8 / "adapter_model.bin")
    message = refused(r8, llama_target)
    assert "pickle" in message and "adapter_model.bin" in message


def test_missing_safetensors_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    (r8 / "adapter_model.safetensors").unlink()
    assert "missing adapter_model.safetensors" in refused(r8, llama_target)


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda b: b"this is not a safetensors file at all", id="garbage"),
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b"", id="empty"),
    ],
)
def test_invalid_safetensors_is_refused(
    corrupt: Callable[[bytes], bytes], r8: Path, llama_target: TargetShapes
) -> None:
    path = r8 / "adapter_model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    assert "not a valid safetensors file" in refused(r8, llama_target)


def test_not_a_directory_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    assert "not a directory" in refused(r8 / "adapter_config.json", llama_target)


# ---------------------------------------------------------------- refused: config


def test_missing_config_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    (r8 / "adapter_config.json").unlink()
    assert "missing adapter_config.json" in refused(r8, llama_target)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe"])
def test_unparsable_config_is_refused(text: str, r8: Path, llama_target: TargetShapes) -> None:
    (r8 / "adapter_config.json").write_bytes(text.encode("latin-1"))
    assert "adapter_config.json" in refused(r8, llama_target)


@pytest.mark.parametrize("peft_type", ["LOHA", "PREFIX_TUNING", None])
def test_non_lora_peft_type_is_refused(
    peft_type: str | None, r8: Path, llama_target: TargetShapes
) -> None:
    edit_config(r8, peft_type=peft_type)
    message = refused(r8, llama_target)
    assert "peft_type" in message and repr(peft_type) in message


def test_rank_above_max_is_refused(
    good_adapters: dict[str, Path], llama_target: TargetShapes
) -> None:
    message = refused(good_adapters["llama_r16_rslora"], llama_target, max_rank=8)
    assert "16" in message and "8" in message and "max_lora_rank" in message


@pytest.mark.parametrize("rank", [0, -4, "8", True, 8.0])
def test_malformed_rank_is_refused(rank: Any, r8: Path, llama_target: TargetShapes) -> None:
    edit_config(r8, r=rank)
    assert "r must be a positive integer" in refused(r8, llama_target)


@pytest.mark.parametrize("alpha", ["16", None, True])
def test_malformed_alpha_is_refused(alpha: Any, r8: Path, llama_target: TargetShapes) -> None:
    edit_config(r8, lora_alpha=alpha)
    assert "lora_alpha" in refused(r8, llama_target)


@pytest.mark.parametrize("alpha", [1e308, -3e39])
def test_alpha_past_float32_once_scaled_is_refused(alpha: float, r8: Path,
                                                   llama_target: TargetShapes) -> None:
    # Finite in float64, but not the scaling (alpha / 8) or lora_B times it in float32,
    # which the engine keeps per slot: accepted, it stopped the engine at its first request.
    edit_config(r8, lora_alpha=alpha)
    assert "float32's range" in refused(r8, llama_target)


def test_lora_b_past_float32_once_scaled_is_refused(r8: Path,
                                                    llama_target: TargetShapes) -> None:
    path = r8 / "adapter_model.safetensors"
    tensors = load_file(path)
    assert max(float(t.abs().max()) for k, t in tensors.items() if "lora_B" in k) > 1e-3
    save_file({k: t * 1e35 if "lora_B" in k else t for k, t in tensors.items()}, path)
    edit_config(r8, lora_alpha=8e8)  # scaling 1e8, finite; lora_B * 1e8 is not
    assert "float32's range" in refused(r8, llama_target)


def test_large_alpha_within_float32_loads(r8: Path, llama_target: TargetShapes) -> None:
    edit_config(r8, lora_alpha=1e6)
    adapter = load_adapter(r8, llama_target, max_lora_rank=64)
    assert adapter.scaling == 1e6 / 8


def test_non_bool_rslora_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    edit_config(r8, use_rslora="yes")
    assert "use_rslora" in refused(r8, llama_target)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("bias", "all"),
        ("bias", "lora_only"),
        ("rank_pattern", {"q_proj": 4}),
        ("alpha_pattern", {"v_proj": 32}),
        ("layers_to_transform", [0]),
        ("fan_in_fan_out", True),
        ("lora_bias", True),
        ("target_parameters", ["mlp.experts.down_proj"]),
        ("trainable_token_indices", [1, 2]),
        ("alora_invocation_tokens", [5, 6]),
        ("use_qalora", True),
        ("layer_replication", [[0, 2]]),
        ("init_lora_weights", "pissa"),
        ("init_lora_weights", "pissa_niter_4"),
        ("init_lora_weights", "olora"),
        ("init_lora_weights", "loftq"),
        ("init_lora_weights", "mica"),
        ("some_future_option", {"enabled": True}),
    ],
)
def test_unsupported_peft_option_is_refused(
    option: str, value: Any, r8: Path, llama_target: TargetShapes
) -> None:
    edit_config(r8, **{option: value})
    assert f"unsupported PEFT option {option}" in refused(r8, llama_target)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("init_lora_weights", "gaussian"),
        ("init_lora_weights", True),
        ("use_dora", False),
        ("modules_to_save", []),
        ("layers_pattern", "layers"),
        ("lora_dropout", 0.1),
        ("some_old_option", None),
    ],
)
def test_harmless_or_unset_options_are_accepted(
    option: str, value: Any, r8: Path, llama_target: TargetShapes
) -> None:
    edit_config(r8, **{option: value})
    assert load_adapter(r8, llama_target, MAX_RANK).rank == 8


# ---------------------------------------------------------------- refused: tensors


@pytest.mark.parametrize(
    ("extra", "shape"),
    [
        ("base_model.model.lm_head.lora_A.weight", (8, 64)),
        ("base_model.model.model.embed_tokens.lora_embedding_A", (8, 384)),
        (f"{PREFIX}.2.self_attn.q_proj.lora_A.weight", (8, 64)),  # only layers 0..1
        (f"{PREFIX}.0.mlp.q_proj.lora_A.weight", (8, 64)),  # q_proj lives in self_attn
        (f"{PREFIX}.01.self_attn.q_proj.lora_A.weight", (8, 64)),  # non-canonical index
        (f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", (64,)),  # DoRA
        (f"{PREFIX}.0.self_attn.q_proj.lora_A.bias", (8,)),
    ],
)
def test_tensor_of_no_supported_module_is_refused(
    extra: str, shape: tuple[int, ...], r8: Path, llama_target: TargetShapes
) -> None:
    def add(t: Tensors) -> None:
        t[extra] = torch.zeros(shape)

    edit_tensors(r8, add)
    message = refused(r8, llama_target)
    assert "no supported module" in message and extra in message


def test_module_absent_from_target_is_refused(
    good_adapters: dict[str, Path], llama_target: TargetShapes
) -> None:
    attention_only = TargetShapes(num_layers=2, shapes={m: llama_target.shapes[m] for m in ALL[:4]})
    message = refused(good_adapters["llama_r4_all"], attention_only)
    assert "gate_proj" in message and "no supported module" in message


def test_wrong_shape_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    def widen(t: Tensors) -> None:
        t[key(1, "v_proj", "B")] = torch.zeros(64, 8)  # v_proj out is 32 (2 KV heads)

    edit_tensors(r8, widen)
    message = refused(r8, llama_target)
    assert "model.layers.1.self_attn.v_proj" in message
    assert "expected lora_A [8, 64] lora_B [32, 8]" in message
    assert "got lora_A [8, 64] lora_B [64, 8]" in message


def test_adapter_for_another_base_is_refused(
    good_adapters: dict[str, Path], llama_target: TargetShapes
) -> None:
    wider = TargetShapes(
        num_layers=2, shapes={m: (2 * i, 2 * o) for m, (i, o) in llama_target.shapes.items()}
    )
    message = refused(good_adapters["llama_r8_qv"], wider)
    assert "shape mismatch" in message and "q_proj" in message and "[8, 128]" in message


def test_non_2d_tensor_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    def flatten(t: Tensors) -> None:
        t[key(0, "q_proj", "A")] = t[key(0, "q_proj", "A")].reshape(8, 8, 8)

    edit_tensors(r8, flatten)
    assert "2-D" in refused(r8, llama_target)


@pytest.mark.parametrize("dropped", ["A", "B"])
def test_incomplete_pair_is_refused(dropped: str, r8: Path, llama_target: TargetShapes) -> None:
    edit_tensors(r8, lambda t: {k: v for k, v in t.items() if k != key(1, "q_proj", dropped)})
    message = refused(r8, llama_target)
    assert "incomplete" in message
    assert f"model.layers.1.self_attn.q_proj (no lora_{dropped})" in message


def test_rank_dim_not_equal_to_r_is_refused(
    good_adapters: dict[str, Path], tmp_path: Path, llama_target: TargetShapes
) -> None:
    adapter = Path(shutil.copytree(good_adapters["llama_r4_all"], tmp_path / "a"))
    edit_config(adapter, r=8)  # tensors still have rank 4
    message = refused(adapter, llama_target)
    assert "lora_A rank dim is 4 but adapter_config r is 8" in message


def test_rank_dim_of_b_not_equal_to_r_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    def shrink_b(t: Tensors) -> None:
        t[key(0, "v_proj", "B")] = torch.zeros(32, 4)

    edit_tensors(r8, shrink_b)
    assert "lora_B rank dim is 4 but adapter_config r is 8" in refused(r8, llama_target)


def test_duplicate_key_spellings_are_refused(r8: Path, llama_target: TargetShapes) -> None:
    def duplicate(t: Tensors) -> None:
        k = key(0, "q_proj", "A")
        t[k.replace(".weight", ".default.weight")] = t[k].clone()

    edit_tensors(r8, duplicate)
    assert "duplicate" in refused(r8, llama_target)


def test_integer_tensor_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    def to_int(t: Tensors) -> None:
        t[key(0, "q_proj", "A")] = t[key(0, "q_proj", "A")].to(torch.int32)

    edit_tensors(r8, to_int)
    message = refused(r8, llama_target)
    assert key(0, "q_proj", "A") in message and "I32" in message


@pytest.mark.parametrize(
    ("bad", "kind"), [(math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")]
)
def test_non_finite_weight_is_refused(
    bad: float, kind: str, r8: Path, llama_target: TargetShapes
) -> None:
    def poison(t: Tensors) -> None:
        t[key(1, "v_proj", "B")][3, 2] = bad

    edit_tensors(r8, poison)
    message = refused(r8, llama_target)
    assert key(1, "v_proj", "B") in message and kind in message


def test_no_tensors_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    edit_tensors(r8, lambda t: {})
    assert "adapter has no LoRA weights" in refused(r8, llama_target)


def test_config_target_without_weights_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    # PEFT would wrap v_proj with freshly initialised weights; serving base would differ.
    edit_tensors(r8, lambda t: {k: v for k, v in t.items() if ".v_proj." not in k})
    message = refused(r8, llama_target)
    assert "targets modules with no weights" in message
    assert "model.layers.0.self_attn.v_proj" in message


@pytest.mark.parametrize(
    "targets",
    [
        ["self_attn.q_proj", "v_proj", "c_attn"],  # c_attn: another arch's name, ignored
        "model.layers.[0-9]+.self_attn.(q|v)_proj",  # regex: not evaluated
    ],
)
def test_config_target_forms_are_accepted(
    targets: Any, r8: Path, llama_target: TargetShapes
) -> None:
    edit_config(r8, target_modules=targets)
    assert load_adapter(r8, llama_target, MAX_RANK).target_modules == ("q_proj", "v_proj")


def test_all_linear_config_needs_weights_for_every_module(
    r8: Path, llama_target: TargetShapes
) -> None:
    edit_config(r8, target_modules="all-linear")
    message = refused(r8, llama_target)
    assert "targets modules with no weights" in message and "k_proj" in message


@pytest.mark.parametrize("entry", ["lm_head", "model.embed_tokens"])
def test_config_targeting_unservable_module_is_refused(
    entry: str, r8: Path, llama_target: TargetShapes
) -> None:
    edit_config(r8, target_modules=["q_proj", "v_proj", entry])
    assert f"targets unsupported modules: {entry}" in refused(r8, llama_target)


def test_malformed_target_modules_is_refused(r8: Path, llama_target: TargetShapes) -> None:
    edit_config(r8, target_modules=["q_proj", 3])
    assert "target_modules is malformed" in refused(r8, llama_target)


def test_excluded_config_targets_need_no_weights(r8: Path, llama_target: TargetShapes) -> None:
    edit_tensors(
        r8, lambda t: {k: v for k, v in t.items() if ".layers.1.self_attn.v_proj." not in k}
    )
    edit_config(r8, exclude_modules=["model.layers.1.self_attn.v_proj"])
    adapter = load_adapter(r8, llama_target, MAX_RANK)
    assert (1, "v_proj") not in adapter.weights and (0, "v_proj") in adapter.weights
