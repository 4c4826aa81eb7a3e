"""Shared fixtures for tests/model: tiny random base models, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.testing import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads, intermediate 128) with tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2 (same sizes as tiny_llama_dir, plus q/k/v biases) with tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=1)
