"""The adapter config parser and the content digest: any bytes give a config or a domain
error (AdapterError, which the gateway answers with 422), never another exception."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from loraplex.adapter_format import (
    CONFIG_FILE,
    MAX_CONFIG_DEPTH,
    WEIGHTS_FILE,
    combine_digests,
    folder_digest,
    parse_adapter_config,
)
from loraplex.errors import AdapterError
from loraplex.model.adapter_loader import TargetShapes, validate_adapter_dir

TARGET = TargetShapes(num_layers=1, shapes={"q_proj": (16, 16), "v_proj": (16, 8)})
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_scalars = (st.none() | st.booleans() | st.integers() | st.text(max_size=20)
                | st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=20)


@st.composite
def hostile_texts(draw: st.DrawFn) -> bytes:
    """Config-shaped bytes that broke parsers: nesting, long numbers, constants, bad
    encodings, wrong types where PEFT keys are."""
    depth = draw(st.integers(1, 50_000))
    opener = draw(st.sampled_from(["[", '{"a":']))
    closer = "]" if opener == "[" else "}"
    number = draw(st.sampled_from(["1" * 400, "-" + "9" * 5000, "1e400", "-1e999", "1.5",
                                   "NaN", "Infinity", "-Infinity", "0x10", "1" * 19]))
    key = draw(st.sampled_from(["r", "lora_alpha", "target_modules", "peft_type",
                                "use_rslora", "bias", "init_lora_weights", "x"]))
    choices = [
        opener * depth + "0" + closer * depth,
        '{"peft_type": "LORA", "' + key + '": ' + number + "}",
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "' + key + '": '
        + "[" * depth + "]" * depth + "}",
        json.dumps({"peft_type": "LORA", key: draw(json_values)}),
    ]
    text = draw(st.sampled_from(choices)).encode()
    encoding = draw(st.sampled_from(["utf-8", "utf-16", "latin-1-junk", "bom"]))
    if encoding == "utf-16":
        return text.decode().encode("utf-16")
    if encoding == "latin-1-junk":
        return text[:10] + b"\xff\xfe\xc3" + text[10:]
    if encoding == "bom":
        return b"\xef\xbb\xbf" + text
    return text


@given(st.binary(max_size=2048) | hostile_texts())
@FUZZ
def test_parser_gives_a_config_or_an_adapter_error(raw: bytes) -> None:
    try:
        config = parse_adapter_config(raw)
    except AdapterError as exc:
        assert str(exc)  # a message the tenant can act on
        return
    assert isinstance(config, dict)
    json.dumps(config)  # and what it accepted can be walked without recursing too far


@st.composite
def peft_configs(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly-valid PEFT configs with any field replaced by any JSON value."""
    config: dict[str, Any] = {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                              "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    for key in draw(st.lists(st.sampled_from(
            ["r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "bias",
             "init_lora_weights", "peft_type", "base_model_name_or_path", "rank_pattern",
             "layers_to_transform", "unknown_option"]), max_size=3)):
        config[key] = draw(json_values | st.just(10**30) | st.just(-1))
    return config


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("fuzzed_adapter")
    rng = np.random.default_rng(0)
    tensors = {}
    for module, (fan_in, fan_out) in TARGET.shapes.items():
        stem = f"base_model.model.model.layers.0.self_attn.{module}"
        tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((4, fan_in), np.float32)
        tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((fan_out, 4), np.float32)
    save_file(tensors, str(path / WEIGHTS_FILE))
    yield path


@given(peft_configs() | hostile_texts())
@FUZZ
def test_loader_gives_an_adapter_or_an_adapter_error(adapter_dir: Path,
                                                     config: dict[str, Any] | bytes) -> None:
    raw = config if isinstance(config, bytes) else json.dumps(config).encode()
    (adapter_dir / CONFIG_FILE).write_bytes(raw)
    try:
        adapter = validate_adapter_dir(adapter_dir, TARGET, max_lora_rank=8)
    except AdapterError as exc:
        assert str(exc)
        return
    assert math.isfinite(adapter.scaling) and adapter.digest == folder_digest(adapter_dir)


@pytest.mark.parametrize(("raw", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a":' + b"[" * MAX_CONFIG_DEPTH + b"]" * MAX_CONFIG_DEPTH + b"}", "nested too deeply"),
    (b'{"lora_alpha": 1' + b"0" * 400 + b"}", "too large"),
    (b'{"lora_alpha": NaN}', "NaN"),
    (b'{"lora_alpha": 1e400}', "out of range"),
    (b"\xff{}", "not UTF-8"),
    (b"[]", "JSON object"),
])
def test_each_malformed_kind_is_named(raw: bytes, message: str) -> None:
    with pytest.raises(AdapterError, match=message):
        parse_adapter_config(raw)


def test_limits_admit_real_configs() -> None:
    nested = {"loftq_config": {"a": {"b": [[1, 2]]}}, "r": 2**62, "lora_alpha": 1e300}
    assert parse_adapter_config(json.dumps(nested).encode()) == nested


def test_digest_covers_both_files_and_is_framed(tmp_path: Path) -> None:
    (tmp_path / WEIGHTS_FILE).write_bytes(b"weights")
    (tmp_path / CONFIG_FILE).write_bytes(b"{}")
    w, c = hashlib.sha256(b"weights").digest(), hashlib.sha256(b"{}").digest()
    assert folder_digest(tmp_path) == combine_digests(w, c) == hashlib.sha256(
        b"loraplex-adapter-v1\0" + w + c).hexdigest()
    assert combine_digests(c, w) != combine_digests(w, c)  # the order is part of it
    assert folder_digest(tmp_path) != hashlib.sha256(b"weights").hexdigest()
    with pytest.raises(ValueError):
        combine_digests(w.hex().encode(), c)
