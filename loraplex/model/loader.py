"""Loads a HuggingFace model folder (config, tokenizer, safetensors shards) into a
``DecoderModel``."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open

from loraplex.errors import ConfigError, ModelLoadError, first_line
from loraplex.model.args import ModelArgs
from loraplex.model.decoder import DecoderLayer, DecoderModel
from loraplex.model.rope import partial_rotary_order

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
    "self_attn.qkv_proj": ("self_attn.qkv_proj", None),  # Phi-3: fused in the checkpoint
    "self_attn.o_proj": ("self_attn.o_proj", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
    "mlp.down_proj": ("mlp.down_proj", None),
}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def _target(model: DecoderModel, name: str) -> tuple[torch.Tensor, bool] | None:
    """The slice of our parameter that HF tensor ``name`` fills and whether it is a norm's
    weight, or None to skip it."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens, False
    if name == "model.norm.weight":
        return model.norm.weight, True
    if name == "lm_head.weight":
        return None if model.args.tie_word_embeddings else (model.lm_head, False)
    if name.startswith("model.layers."):
        rest = name[len("model.layers."):]
        idx_s, _, rest = rest.partition(".")
        module, _, kind = rest.rpartition(".")
        layer = model.layers[int(idx_s)] if idx_s.isdigit() and int(idx_s) < len(
            model.layers) else None
        if module in _NORMS and kind == "weight" and layer is not None:
            obj: Any = layer
            for part in module.split("."):
                obj = getattr(obj, part, None)
            if obj is not None:
                return obj.weight, True
        if module not in _LAYER_MAP or kind not in ("weight", "bias") or layer is None:
            if "rotary_emb" in rest:
                return None
            raise ModelLoadError(f"unexpected weight {name} for {model.args.family}")
        ours, slice_idx = _LAYER_MAP[module]
        obj = layer
        for part in ours.split("."):
            obj = getattr(obj, part)
        param = getattr(obj, kind)
        if param is None:
            raise ModelLoadError(f"unexpected bias {name} for {model.args.family}")
        if slice_idx is None:
            return param, False
        lo, hi = obj.slice_offsets[slice_idx], obj.slice_offsets[slice_idx + 1]
        return param[lo:hi], False
    raise ModelLoadError(f"unexpected weight {name} for {model.args.family}")


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
               progress: bool = True) -> tuple[DecoderModel, ModelArgs]:
    """Builds the model and fills it from the folder's safetensors shards."""
    from tqdm import tqdm

    config = load_hf_config(model_dir)
    args = ModelArgs.from_hf_config(config)
    limit = args.max_served_positions
    if max_positions is not None and max_positions > limit:
        # as vLLM: past what the model was trained on its outputs are not the model's
        raise ConfigError(f"max_model_len {max_positions} is above the model's "
                          + (f"max_position_embeddings ({limit})"
                             if limit == args.max_position_embeddings else
                             f"original_max_position_embeddings ({limit}): longrope's long "
                             "factors are not served"))
    torch_dtype = DTYPES[dtype]
    model = DecoderModel(args, num_slots, max_rank, torch_dtype, device,
                         max_positions or limit)
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
                found = _target(model, name)
                bar.update(1)
                if found is None:
                    continue
                dst, is_norm = found
                try:
                    src = handle.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ModelLoadError(f"{f}: cannot read {name}: "
                                         f"{first_line(exc)}") from None
                if tuple(src.shape) != tuple(dst.shape):
                    raise ModelLoadError(f"{name}: shape {tuple(src.shape)} does not match "
                                         f"the config's {tuple(dst.shape)}")
                if is_norm and args.norm_offset:  # Gemma's (1 + w), in float32 as HF
                    src = src.float() + args.norm_offset
                with torch.no_grad():
                    dst.copy_(src.to(torch_dtype))
                filled.add(id(dst) if dst._base is None else id(dst._base))
    bar.close()
    _check_complete(model, filled, expected)
    _reorder_partial_rotary(model)
    return model, args


def _reorder_partial_rotary(model: DecoderModel) -> None:
    """Permutes the q and k heads' dimensions so a partial rotation runs as a whole-head
    one (``rope.partial_rotary_order``); adapters get the same order (``qk_head_order``)."""
    a = model.args
    head = qk_head_order(a)
    if head is None:
        return
    qk = (torch.arange(a.num_heads + a.num_kv_heads).unsqueeze(1) * a.head_dim
          + head).flatten()  # [q_size + kv_size]: the rows of q and k, v's stay
    order = torch.cat([qk, torch.arange(qk.numel(), qk.numel() + a.kv_size)])
    for layer in cast("list[DecoderLayer]", list(model.layers)):
        qkv = layer.self_attn.qkv_proj
        with torch.no_grad():
            for param in (qkv.weight, qkv.bias):
                if param is not None:
                    param.copy_(param.index_select(0, order.to(param.device)))


def qk_head_order(args: ModelArgs) -> torch.Tensor | None:
    """Where each dimension of our q and k heads comes from in the checkpoint's (int64
    ``[head_dim]``), or None where the order is the checkpoint's (a whole-head rotation)."""
    dims = {spec.rotary_dim for spec in args.layer_ropes if spec is not None}
    if len(dims) > 1:
        raise ModelLoadError("layers with different partial_rotary_factor are not supported")
    return partial_rotary_order(args.head_dim, dims.pop()) if dims else None


def _check_complete(model: DecoderModel, filled: set[int], expected: set[int]) -> None:
    missing = [n for n, p in model.named_parameters() if id(p) not in filled
               and not n.endswith(".bias")]
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")
