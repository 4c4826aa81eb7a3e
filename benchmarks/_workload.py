"""Shared workload helpers for the benchmarks: deterministic requests and cached adapters.

A workload is a list of `WorkItem`s drawn from one seed: adapter popularity follows a
Zipf (power-law) distribution, prompt and output lengths are log-uniform integers, and the
prompt tokens are random ids from the model's vocabulary (special tokens excluded), so
there is no accidental prefix sharing between requests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ADAPTER_RANKS = (8, 16, 32)


@dataclass(frozen=True)
class WorkItem:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    adapter: int | None  # index into the adapter list; None = base model


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 200
    num_adapters: int = 20
    min_prompt: int = 32
    max_prompt: int = 512
    min_output: int = 16
    max_output: int = 256
    zipf_exponent: float = 1.0
    seed: int = 0


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Popularity of adapter i (0-based) is proportional to 1 / (i + 1) ** exponent."""
    raw = [1.0 / (i + 1) ** exponent for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    if lo >= hi:
        return lo
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_workload(spec: WorkloadSpec, vocab_size: int,
                  excluded_ids: Sequence[int] = ()) -> list[WorkItem]:
    """The same spec and vocabulary always give the same requests, in the same order."""
    rng = random.Random(spec.seed)
    excluded = set(excluded_ids)
    allowed = [t for t in range(vocab_size) if t not in excluded]
    items = []
    for i in range(spec.num_requests):
        prompt_len = log_uniform_int(rng, spec.min_prompt, spec.max_prompt)
        max_tokens = log_uniform_int(rng, spec.min_output, spec.max_output)
        prompt = [rng.choice(allowed) for _ in range(prompt_len)]
        items.append(WorkItem(i, prompt, max_tokens, None))
    return with_adapters(items, spec.num_adapters, spec.zipf_exponent, spec.seed)


def with_adapters(items: Sequence[WorkItem], num_adapters: int, exponent: float,
                  seed: int) -> list[WorkItem]:
    """The same prompts and lengths, assigned to ``num_adapters`` (0: base model only).

    Adapter ``i`` is drawn with Zipf weight ``1 / (i + 1) ** exponent``.
    """
    if num_adapters == 0:
        return [WorkItem(w.index, w.prompt_ids, w.max_tokens, None) for w in items]
    rng = random.Random(seed * 7919 + num_adapters)
    weights = zipf_weights(num_adapters, exponent)
    choices = rng.choices(range(num_adapters), weights, k=len(items))
    return [WorkItem(w.index, w.prompt_ids, w.max_tokens, c)
            for w, c in zip(items, choices, strict=True)]


def num_output_tokens(items: Sequence[WorkItem]) -> int:
    return sum(w.max_tokens for w in items)


def num_prompt_tokens(items: Sequence[WorkItem]) -> int:
    return sum(len(w.prompt_ids) for w in items)


# --- the model and its adapters -----------------------------------------------------------


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``--model``, which ``resolve_model`` reads."""
    parser.add_argument("--model",
                        help="HF model folder (default: the demo model, prepared if needed)")


def resolve_model(model: str | None, absolute: bool = False) -> str:
    """The model folder given (made absolute when ``absolute``: a server subprocess runs
    elsewhere), or the demo model, prepared if needed."""
    if model:
        return str(Path(model).absolute()) if absolute else model
    from loraplex.model.demo import prepare_demo_model

    return str(prepare_demo_model(progress=True))


def model_fingerprint(model_dir: str | Path) -> str:
    """Changes when the base model's weights or config change."""
    model_dir = Path(model_dir).absolute()
    h = hashlib.sha256(str(model_dir).encode())
    for name in sorted(os.listdir(model_dir)):
        path = model_dir / name
        if path.is_file() and (name.endswith(".safetensors") or name == "config.json"):
            st = path.stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    from loraplex.config import default_home

    return Path(default_home()) / "benchmarks"


def adapter_rank(index: int) -> int:
    return ADAPTER_RANKS[index % len(ADAPTER_RANKS)]


def ensure_adapters(model_dir: str | Path, num: int, cache_dir: str | Path | None = None,
                    progress: bool = True) -> list[Path]:
    """PEFT LoRA adapters ``0..num-1`` for the model (ranks 8/16/32 in turn), cached on disk.

    The first adapter of each rank is made with `loraplex.testing.build_adapter`; the rest
    copy that template's config and draw fresh random A/B weights of the same shapes
    (seeded by the index), which takes milliseconds instead of a model load each.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = root / "adapters" / model_fingerprint(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"lora-{i:03d}-r{adapter_rank(i)}" for i in range(num)]
    missing = [i for i, p in enumerate(paths) if not (p / "adapter_model.safetensors").is_file()]
    if missing and progress:
        print(f"building {len(missing)} adapters in {root}", flush=True)
    for i in missing:
        _build_one(model_dir, root, i, paths[i])
    return paths


def _build_one(model_dir: str | Path, root: Path, index: int, dest: Path) -> None:
    rank = adapter_rank(index)
    template = root / f"template-r{rank}"
    if not (template / "adapter_model.safetensors").is_file():
        from loraplex.testing import build_adapter

        with tempfile.TemporaryDirectory(dir=root) as tmp:
            build_adapter(Path(tmp) / "a", model_dir, rank=rank, alpha=2.0 * rank, seed=rank)
            os.rename(Path(tmp) / "a", template)
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(template / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(1000 + index)
    fresh = {name: (torch.randn(t.shape, generator=gen) * 0.5 / t.shape[-1] ** 0.5).to(t.dtype)
             for name, t in tensors.items()}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        out = Path(tmp) / "a"
        out.mkdir()
        save_file(fresh, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = json.loads((template / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(out, dest)
