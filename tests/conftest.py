"""Fixtures shared by every test directory: tiny models and adapters, built once."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.testing import build_adapter, build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads, intermediate 128) with tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2 (same sizes as tiny_llama_dir, plus q/k/v biases) with tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=1)


ADAPTER_SPECS: dict[str, dict[str, object]] = {
    # rank 4, every module
    "r4": {"rank": 4, "alpha": 8.0, "seed": 11},
    # rank 8, only q and v
    "r8qv": {"rank": 8, "alpha": 16.0, "seed": 12, "target_modules": ("q_proj", "v_proj")},
    # rank 16 with rsLoRA scaling
    "r16rs": {"rank": 16, "alpha": 8.0, "seed": 13, "use_rslora": True},
    # rank 8, MLP only, gate and down (not up)
    "r8mlp": {"rank": 8, "alpha": 4.0, "seed": 14, "target_modules": ("gate_proj", "down_proj")},
}


def _adapters(base: Path, root: Path) -> dict[str, Path]:
    return {name: build_adapter(root / name, base, **spec)  # type: ignore[arg-type]
            for name, spec in ADAPTER_SPECS.items()}


@pytest.fixture(scope="session")
def llama_adapters(tiny_llama_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapters for tiny_llama_dir: r4, r8qv, r16rs, r8mlp (see ADAPTER_SPECS)."""
    return _adapters(tiny_llama_dir, tmp_path_factory.mktemp("llama_adapters"))


@pytest.fixture(scope="session")
def qwen2_adapters(tiny_qwen2_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _adapters(tiny_qwen2_dir, tmp_path_factory.mktemp("qwen2_adapters"))


@pytest.fixture(scope="session")
def tiny_llama_draft_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft model for tiny_llama_dir: its first layer, norm, LM head and tokenizer, cut
    by `loraplex draft`."""
    import contextlib
    import io

    from loraplex.cli import main

    out = tmp_path_factory.mktemp("llama_draft")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["draft", "--model", str(tiny_llama_dir), "--layers", "1",
                     "--out", str(out)]) == 0
    assert printed.getvalue() == f"{out}\n"
    return out


@pytest.fixture(scope="session")
def tiny_qwen2_draft_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft model for tiny_qwen2_dir: its first layer, norm, LM head and tokenizer."""
    from loraplex.model.truncate import save_first_layers

    return save_first_layers(tiny_qwen2_dir, tmp_path_factory.mktemp("qwen2_draft"), 1)


@pytest.fixture
def amx_restored() -> Iterator[None]:
    """Whatever a test turns, the skinny GEMM's AMX is back as it was after it (it is
    process-wide)."""
    from loraplex_kernels import cpu_native

    was = cpu_native.skinny_amx()
    yield
    cpu_native.skinny_amx(was)


@pytest.fixture(scope="session")
def avx2_library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The native library built with AVX-512 turned off: the AVX2 kernels, on any CPU that
    has AVX2 and FMA (the build an AVX2-only CPU gets, tested on AVX-512 machines too)."""
    from loraplex_kernels import cpu_native

    flags = set(cpu_native._cpu_signature().split())
    if not {"avx2", "fma"} <= flags or cpu_native._compiler() is None:
        pytest.skip("no AVX2 with FMA here, or no C compiler")
    return cpu_native.load(cpu_native.build(directory=tmp_path_factory.mktemp("avx2"),
                                            flags=["-mno-avx512f"]))
