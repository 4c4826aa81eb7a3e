"""Loads a HuggingFace model folder (config, tokenizer, safetensors shards) into LlamaModel."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loraplex.errors import ConfigError, ModelLoadError, first_line
from loraplex.model.args import ModelArgs
from loraplex.model.llama import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def load_hf_config(model_dir: str | Path) -> Any:
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json (expected a HuggingFace model folder)")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:  # not JSON, no or an unknown model_type
        raise ModelLoadError(f"{path}: unreadable config.json ({first_line(exc)})") from None


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors shards of a model folder (via the index when there is one)."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES]
        if pickles:
            raise ModelLoadError(f"{path}: only pickle weights ({', '.join(pickles)}); "
                                 "loraplex reads safetensors only")
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{path}: missing weight shards: {', '.join(missing)}")
    return files


# HF parameter name (after "model.layers.N.") -> (our module path, slice index or None)
_LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", None),
    "input_layernorm": ("input_layernorm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
}


def _target(model: LlamaModel, name: str) -> torch.Tensor | None:
    """The slice of our parameter that HF tensor ``name`` fills, or None to skip it."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens
    if name == "model.norm.weight":
        return model.norm.weight
    if name == "lm_head.weight":
        return None if model.args.tie_word_embeddings else model.lm_head
    if name.startswith("model.layers."):
        rest = name[len("model.layers."):]
        idx_s, _, rest = rest.partition(".")
        module, _, kind = rest.rpartition(".")
        if module not in _LAYER_MAP or kind not in ("weight", "bias"):
            if "rotary_emb" in rest:
                return None
            raise ModelLoadError(f"unexpected weight {name}")
        ours, slice_idx = _LAYER_MAP[module]
        layer = model.layers[int(idx_s)]
        obj: Any = layer
        for part in ours.split("."):
            obj = getattr(obj, part)
        param = getattr(obj, kind)
        if param is None:
            raise ModelLoadError(f"unexpected bias {name} for this architecture")
        if slice_idx is None:
            return param
        lo, hi = obj.slice_offsets[slice_idx], obj.slice_offsets[slice_idx + 1]
        return param[lo:hi]
    raise ModelLoadError(f"unexpected weight {name}")


@contextlib.contextmanager
def _shard(path: Path) -> Iterator[Any]:
    """A safetensors shard, open; ModelLoadError in one line when it is not one (truncated,
    not safetensors at all, unreadable)."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable safetensors file: "
                             f"{first_line(exc)}") from None
    with handle:
        yield handle


def load_model(model_dir: str | Path, dtype: str, device: torch.device, num_slots: int,
               max_rank: int, max_positions: int | None = None,
               progress: bool = True) -> tuple[LlamaModel, ModelArgs]:
    """Builds the model and fills it from the folder's safetensors shards."""
    from tqdm import tqdm

    config = load_hf_config(model_dir)
    args = ModelArgs.from_hf_config(config)
    if max_positions is not None and max_positions > args.max_position_embeddings:
        # as vLLM: past what the model was trained on its outputs are not the model's
        raise ConfigError(f"max_model_len {max_positions} is above the model's "
                          f"max_position_embeddings ({args.max_position_embeddings})")
    torch_dtype = DTYPES[dtype]
    model = LlamaModel(args, num_slots, max_rank, torch_dtype, device,
                       max_positions or args.max_position_embeddings)
    files = weight_files(model_dir)
    filled: set[int] = set()
    expected = {id(p) for p in model.parameters()}
    names: list[tuple[Path, str]] = []
    for f in files:
        with _shard(f) as handle:
            names.extend((f, k) for k in handle.keys())  # noqa: SIM118
    bar = tqdm(total=len(names), desc=f"loading {Path(model_dir).name}", unit="tensor",
               disable=not progress, file=sys.stderr)
    for f in files:
        with _shard(f) as handle:
            for name in handle.keys():  # noqa: SIM118
                dst = _target(model, name)
                bar.update(1)
                if dst is None:
                    continue
                try:
                    src = handle.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ModelLoadError(f"{f}: cannot read {name}: "
                                         f"{first_line(exc)}") from None
                if tuple(src.shape) != tuple(dst.shape):
                    raise ModelLoadError(f"{name}: shape {tuple(src.shape)} does not match "
                                         f"the config's {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(src.to(torch_dtype))
                filled.add(id(dst) if dst._base is None else id(dst._base))
    bar.close()
    _check_complete(model, filled, expected)
    return model, args


def _check_complete(model: LlamaModel, filled: set[int], expected: set[int]) -> None:
    missing = [n for n, p in model.named_parameters() if id(p) not in filled
               and not n.endswith(".bias")]
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")
