"""Loads and validates PEFT LoRA adapters for a base model of a supported family.

This is the one place adapter validation lives: the engine calls `load_adapter` before
putting an adapter in a slot, and the upload pipeline calls `validate_adapter_dir` before
storing one. An adapter is either served exactly as PEFT would apply it, or refused with
an `AdapterError` whose one-line message names the problem. Only safetensors are read;
pickle files are refused without being opened.

Validation reads the weights with numpy and the base model's shapes from its
``config.json`` as JSON: neither torch nor transformers is imported until `load_adapter`
turns validated arrays into tensors, so ``loraplex adapters add`` starts in a fraction of a
second (importing both took most of its 8.9 s).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError, safe_open

from loraplex.adapter_format import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    combine_digests,
    file_sha256,
    parse_adapter_config,
)
from loraplex.errors import AdapterError, ModelLoadError
from loraplex.model.families import (
    FAMILIES,
    FUSED_MODULES,
    FUSED_PARTS,
    SPLIT_MODULES,
    family_named_by,
    fused_checkpoint,
    unsupported_model_type,
)

if TYPE_CHECKING:
    import torch

CONFIG_NAME = CONFIG_FILE
WEIGHTS_NAME = WEIGHTS_FILE

# Module short name -> its parent inside a decoder layer: every family's, split (most) and
# fused (Phi-3) alike; a family's own set is its `TargetShapes.shapes`.
LORA_MODULE_PARENTS: dict[str, str] = {**SPLIT_MODULES, **FUSED_MODULES}
SUPPORTED_MODULES: tuple[str, ...] = tuple(SPLIT_MODULES)

# Suffixes of files that may hold pickles; their mere presence refuses the folder.
PICKLE_SUFFIXES: frozenset[str] = frozenset({".bin", ".pt", ".pth", ".pkl", ".ckpt"})

_MAX_NAMES_IN_MESSAGE = 8
# safetensors dtype -> the little-endian numpy dtype its bytes are read as. bfloat16 has no
# numpy dtype: its 16 bits are the high half of a float32, widened below.
_FLOAT_DTYPES: dict[str, str] = {"F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8"}
_UNSERVABLE_TARGETS = frozenset({"lm_head", "embed_tokens"})
# What `TargetShapes.from_hf_config` needs from a config.json with no transformers default
# to fall back on (num_key_value_heads and head_dim default from these).
_REQUIRED_CONFIG_KEYS = ("model_type", "hidden_size", "num_attention_heads",
                         "intermediate_size", "num_hidden_layers")

# PEFT saves `base_model.model.<HF module path>.lora_A.weight`; the HF path of a
# *ForCausalLM starts with `model.`. Trainers that wrapped the bare decoder (or
# stripped the PEFT prefix) drop one or both of those, so all four prefixes are accepted.
# The layer index must be canonical so `layers.01` cannot alias `layers.1`.
# (layer, module) -> float32 (lora_A, lora_B), finite, as read from the weights file.
_Arrays = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
_FLOAT32_MAX = float(np.finfo(np.float32).max)

_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>0|[1-9][0-9]*)\."
    r"(?P<parent>self_attn|mlp)\.(?P<module>[a-z_]+)\.lora_(?P<ab>[AB])"
    r"(?:\.default)?\.weight"
)

# Config keys that describe the adapter (checked separately) or only affect training
# or initialisation, never how trained weights are applied.
_IGNORED_OPTIONS = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "exclude_modules",
        "init_lora_weights",
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",
        # Only meaningful together with layers_to_transform, which is refused.
        "layers_pattern",
        # Settings of init methods; the ones that change the base weights are refused through
        # init_lora_weights, the others (EVA) only pick starting values.
        "eva_config",
        "corda_config",
        "loftq_config",
        "lora_ga_config",
        # Only used with use_qalora, which is refused.
        "qalora_group_size",
        # Only ties modules_to_save / trainable tokens / lm_head LoRA, all refused.
        "ensure_weight_tying",
        # Module path for megatron_config, which is refused when set.
        "megatron_core",
        # Runtime-only knobs (e.g. ephemeral GPU offload) that do not change the math.
        "runtime_config",
    }
)

# Known options that change the forward pass when set; any other unknown key that is set
# is refused too, so a future PEFT feature is never silently served as plain LoRA.
_REFUSED_WHEN_SET = (
    "use_dora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "fan_in_fan_out",
    "lora_bias",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "layer_replication",
    "megatron_config",
    "arrow_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
)

# Initialisations that leave the base weights untouched. PiSSA, OLoRA, CorDA, LoftQ and
# LoRA-GA adapters (unless converted to plain LoRA on save) expect a modified base model;
# MiCA is a LoRA variant with its own forward.
_SAFE_INITS: tuple[Any, ...] = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class TargetShapes:
    """The base model's LoRA-able linear layers: layer count and per-module shapes.

    `shapes` maps a module short name (q_proj … down_proj, or Phi-3's fused qkv_proj and
    gate_up_proj) to (in_features, out_features); `parts` a fused module to the widths of
    the modules it packs (q, k, v; gate, up), which the engine serves it as.
    """

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    parts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    model_type: str = ""  # the served family ("": not checked against adapters' names)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.shapes) - set(LORA_MODULE_PARENTS))
        if unknown:
            raise ValueError(f"unsupported LoRA modules in TargetShapes: {unknown}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")

    @classmethod
    def from_hf_config(cls, config: Any) -> TargetShapes:
        """Builds the shapes from a transformers `PretrainedConfig` of a supported family."""
        model_type = getattr(config, "model_type", None)
        if model_type not in FAMILIES:
            raise ModelLoadError(unsupported_model_type(model_type))
        hidden = int(config.hidden_size)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // num_heads)
        intermediate = int(config.intermediate_size)
        q_out = num_heads * head_dim
        kv_out = num_kv_heads * head_dim
        if min(hidden, num_heads, num_kv_heads, head_dim, intermediate) <= 0:
            raise ValueError("hidden_size, the head counts, head_dim and intermediate_size "
                             "must be positive")
        common = {"o_proj": (q_out, hidden), "down_proj": (intermediate, hidden)}
        if fused_checkpoint(model_type):
            return cls(
                model_type=model_type,
                num_layers=int(config.num_hidden_layers),
                shapes={"qkv_proj": (hidden, q_out + 2 * kv_out), **common,
                        "gate_up_proj": (hidden, 2 * intermediate)},
                parts={"qkv_proj": (q_out, kv_out, kv_out),
                       "gate_up_proj": (intermediate, intermediate)},
            )
        return cls(
            model_type=model_type,
            num_layers=int(config.num_hidden_layers),
            shapes={
                "q_proj": (hidden, q_out),
                "k_proj": (hidden, kv_out),
                "v_proj": (hidden, kv_out),
                "o_proj": common["o_proj"],
                "gate_proj": (hidden, intermediate),
                "up_proj": (hidden, intermediate),
                "down_proj": common["down_proj"],
            },
        )

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> TargetShapes:
        """Reads `config.json` in a local model folder (as JSON: no transformers import)."""
        model_dir = Path(path)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"no config.json in model folder {model_dir}")
        try:
            config = json.loads(config_path.read_bytes())
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
            missing = [k for k in _REQUIRED_CONFIG_KEYS if k not in config]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            return cls.from_hf_config(SimpleNamespace(**config))
        except (OSError, ValueError, TypeError, ArithmeticError, RecursionError) as e:
            # ArithmeticError: num_attention_heads 0 (a division), hidden_size Infinity (int)
            raise ModelLoadError(f"cannot read config.json in {model_dir}: {_one_line(e)}") from e


@dataclass(frozen=True, eq=False)
class LoRAModuleWeights:
    """One module's LoRA pair, float32 on CPU: the delta is `x @ lora_a.T @ lora_b.T`."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]


@dataclass(frozen=True, eq=False)
class CheckedAdapter:
    """A PEFT LoRA adapter that passed every check, without its tensors.

    `digest` is the content digest of the weights and config files together
    (`loraplex.adapter_format`): with the adapter's id it is the adapter's identity, so a
    re-upload that changes either file never reuses anything cached.
    """

    name: str
    path: str
    digest: str
    rank: int
    alpha: float
    use_rslora: bool
    scaling: float
    target_modules: tuple[str, ...]
    base_model_name_or_path: str | None


@dataclass(frozen=True, eq=False)
class LoRAAdapter(CheckedAdapter):
    """A validated LoRA adapter with its weights, ready to be copied into an engine slot."""

    weights: dict[tuple[int, str], LoRAModuleWeights]

    @property
    def num_bytes(self) -> int:
        """Bytes held by the LoRA weights in memory."""
        return sum(
            t.numel() * t.element_size()
            for w in self.weights.values()
            for t in (w.lora_a, w.lora_b)
        )


def validate_adapter_dir(
    path: str | os.PathLike[str], target: TargetShapes, max_lora_rank: int
) -> CheckedAdapter:
    """Runs every check `load_adapter` runs (it is the same code) without importing torch;
    raises AdapterError."""
    checked, _ = _check_adapter(Path(path), target, max_lora_rank, None)
    return checked


def load_adapter(
    path: str | os.PathLike[str],
    target: TargetShapes,
    max_lora_rank: int,
    name: str | None = None,
) -> LoRAAdapter:
    """Loads a PEFT LoRA adapter folder, refusing anything that cannot be served faithfully.

    Raises AdapterError for: pickle files in the folder, a missing or invalid config or
    weights file, a peft_type other than LORA, unsupported PEFT options, rank above
    `max_lora_rank`, tensors that map to no supported module of `target`, shape or rank
    mismatches, incomplete A/B pairs, and non-finite weights.
    """
    import torch

    checked, arrays = _check_adapter(Path(path), target, max_lora_rank, name)
    # The arrays own their memory (read from the file, not mapped), so the tensors may share it.
    weights = {slot: LoRAModuleWeights(lora_a=torch.from_numpy(a), lora_b=torch.from_numpy(b))
               for slot, (a, b) in _split_fused(arrays, target).items()}
    fields = {f.name: getattr(checked, f.name) for f in dataclasses.fields(checked)}
    return LoRAAdapter(**fields, weights=weights)


def _check_adapter(
    adapter_dir: Path, target: TargetShapes, max_lora_rank: int, name: str | None
) -> tuple[CheckedAdapter, _Arrays]:
    if not adapter_dir.is_dir():
        raise AdapterError(f"adapter path {adapter_dir} is not a directory")
    _refuse_pickles(adapter_dir)
    weights_path = adapter_dir / WEIGHTS_NAME
    if not weights_path.is_file():
        raise AdapterError(f"missing {WEIGHTS_NAME} in {adapter_dir}")

    config, config_raw = _read_config(adapter_dir / CONFIG_NAME)
    _check_options(config)
    rank = _config_rank(config, max_lora_rank)
    alpha = _config_alpha(config)
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"adapter_config use_rslora must be true or false, got {use_rslora!r}")
    base_name = config.get("base_model_name_or_path")

    before = _file_identity(weights_path)
    # The config's bytes are the ones parsed above, so the digest names what is served.
    digest = combine_digests(file_sha256(weights_path), hashlib.sha256(config_raw).digest())
    weights = _read_weights(weights_path, config, target, rank)
    # The digest names these exact bytes; a file swapped while we read would give an
    # adapter whose identity does not match its weights.
    if _file_identity(weights_path) != before:
        raise AdapterError(f"{WEIGHTS_NAME} changed while it was being loaded")

    _check_family(base_name, target)
    # Same float operations as peft's LoraLayer.update_layer, so scaling matches exactly.
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    _check_scaling(alpha, scaling, weights)
    _check_effect(weights, scaling)
    return CheckedAdapter(
        name=name if name is not None else adapter_dir.name,
        path=str(adapter_dir),
        digest=digest,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        scaling=scaling,
        target_modules=tuple(sorted({module for _, module in weights})),
        base_model_name_or_path=base_name if isinstance(base_name, str) else None,
    ), weights


# An update this small (bounded above, per module) is below float32's resolution for every
# base weight of magnitude 2^-10 or more: added to the weights, it changes none of them.
_NO_EFFECT = 2.0 ** -34


def _check_effect(weights: _Arrays, scaling: float) -> None:
    """Refuses an adapter that changes nothing: every lora_B (or every lora_A) all zeros
    (PEFT's initialisation, saved untrained), or every module's update ``scaling * B @ A``
    below float32's resolution (bounded by scaling * max row sum |B| * max |A|, which costs
    one pass over the weights, not the product)."""
    if all(not np.any(b) for _, b in weights.values()):
        raise AdapterError("every lora_B is zero: the adapter changes nothing (saved "
                           "untrained, straight after PEFT's initialisation?)")
    if all(not np.any(a) for a, _ in weights.values()):
        raise AdapterError("every lora_A is zero: the adapter changes nothing")
    largest = max(abs(scaling) * float(np.abs(b).sum(axis=1).max(initial=0.0))
                  * float(np.abs(a).max(initial=0.0)) for a, b in weights.values())
    if largest < _NO_EFFECT:
        raise AdapterError(f"the adapter's largest update is below {largest:.1e}: too small "
                           "to change any float32 weight, so it changes nothing")


def _check_family(base_name: object, target: TargetShapes) -> None:
    """Refuses an adapter whose ``base_model_name_or_path`` clearly names another family
    than the served one (shapes alike or not: its deltas were learnt on other weights).
    Names that name no family, or several, are not judged: paths and hub ids of one model
    rarely agree, and the shapes decide the rest."""
    if not isinstance(base_name, str) or not target.model_type:
        return
    named = family_named_by(base_name)
    if named is not None and named != target.model_type:
        raise AdapterError(
            f"adapter_config base_model_name_or_path {_short(base_name)} names a "
            f"{FAMILIES[named]} model; the served model is {FAMILIES[target.model_type]}")


def _split_fused(arrays: _Arrays, target: TargetShapes) -> _Arrays:
    """A fused module's pair as the pairs of the modules it packs: lora_B's rows split by
    their widths, lora_A shared (x A^T B^T restricted to a part's rows is that part's
    delta, exactly)."""
    out: _Arrays = {}
    for (layer, module), (a, b) in arrays.items():
        widths = target.parts.get(module)
        if widths is None:
            out[(layer, module)] = (a, b)
            continue
        start = 0
        for part, width in zip(FUSED_PARTS[module], widths, strict=True):
            out[(layer, part)] = (a, b[start:start + width])
            start += width
    return out


def _refuse_pickles(adapter_dir: Path) -> None:
    # Only names are looked at: a pickle is refused before anything could unpickle it.
    found = sorted(
        str(p.relative_to(adapter_dir))
        for p in adapter_dir.rglob("*")
        if p.suffix.lower() in PICKLE_SUFFIXES
    )
    if found:
        raise AdapterError(
            f"pickle weight files are refused (only safetensors are read): {_names(found)}"
        )


def _read_config(config_path: Path) -> tuple[dict[str, Any], bytes]:
    if not config_path.is_file():
        raise AdapterError(f"missing {CONFIG_NAME} in {config_path.parent}")
    with open(config_path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    config = parse_adapter_config(raw)
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        shown = "None" if peft_type is None else _short(peft_type)  # _short bounds a repr
        raise AdapterError(f"peft_type {shown} is not supported; only LORA adapters are")
    return config, raw


def _check_options(config: dict[str, Any]) -> None:
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"unsupported PEFT option bias={bias!r} (only 'none' is served)")
    init = config.get("init_lora_weights", True)
    if not any(init is s if isinstance(s, bool) else init == s for s in _SAFE_INITS):
        raise AdapterError(
            f"unsupported PEFT option init_lora_weights={init!r} (it changes the base "
            "weights; convert the adapter to plain LoRA)"
        )
    for key in _REFUSED_WHEN_SET:
        if config.get(key):
            raise AdapterError(f"unsupported PEFT option {key}={_short(config[key])}")
    for key in sorted(config):
        if key not in _IGNORED_OPTIONS and key != "bias" and config[key]:
            raise AdapterError(f"unsupported PEFT option {key}={_short(config[key])}")


def _config_rank(config: dict[str, Any], max_lora_rank: int) -> int:
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter_config r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise AdapterError(f"adapter rank {rank} is above max_lora_rank {max_lora_rank}")
    return rank


def _config_alpha(config: dict[str, Any]) -> float:
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"adapter_config lora_alpha must be a finite number, got {alpha!r}")
    return float(alpha)


def _check_scaling(alpha: float, scaling: float, weights: _Arrays) -> None:
    """The engine keeps each slot's scaling in a float32 tensor and folds it into lora_B in
    float32 (lora_slots.py): both must stay finite there. A larger alpha would be
    accepted here and then stop the engine at the adapter's first request, for every
    tenant."""
    peak = max((float(np.abs(b).max(initial=0.0)) for _, b in weights.values()), default=0.0)
    if abs(scaling) > _FLOAT32_MAX or abs(scaling) * peak > _FLOAT32_MAX:
        raise AdapterError(f"adapter_config lora_alpha {alpha:g} scales lora_B past "
                           f"float32's range (scaling {scaling:g})")


def _read_weights(
    weights_path: Path, config: dict[str, Any], target: TargetShapes, rank: int
) -> _Arrays:
    try:
        with safe_open(str(weights_path), framework="numpy") as f:
            keys = list(f.keys())
            # Everything is checked from the header before any tensor is read, so a
            # malformed upload costs no more than its header.
            pairs = _pair_keys(keys, target)
            for (layer, module), (key_a, key_b) in sorted(pairs.items()):
                _check_pair(f, layer, module, key_a, key_b, target, rank)
            _check_config_targets(config, pairs, target)
        # safe_open checked the header; it is read again here only for the data offsets.
        data_start, header = _safetensors_header(weights_path)
        weights: _Arrays = {}
        with open(weights_path, "rb") as fh:
            for (layer, module), (key_a, key_b) in sorted(pairs.items()):
                weights[(layer, module)] = (_load_array(fh, data_start, header, key_a),
                                            _load_array(fh, data_start, header, key_b))
    except SafetensorError as e:
        raise AdapterError(f"{WEIGHTS_NAME} is not a valid safetensors file: {_one_line(e)}") from e
    return weights


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header: dict[str, Any] = json.loads(fh.read(size))
    return 8 + size, header


def _pair_keys(keys: list[str], target: TargetShapes) -> dict[tuple[int, str], tuple[str, str]]:
    halves: dict[tuple[int, str, str], str] = {}
    unsupported: list[str] = []
    for key in keys:
        m = _KEY_RE.fullmatch(key)
        if m is None:
            unsupported.append(key)
            continue
        layer, module = int(m["layer"]), m["module"]
        if (
            LORA_MODULE_PARENTS.get(module) != m["parent"]
            or module not in target.shapes
            or layer >= target.num_layers
        ):
            unsupported.append(key)
            continue
        slot = (layer, module, m["ab"])
        if slot in halves:
            raise AdapterError(f"duplicate LoRA tensors {halves[slot]} and {key}")
        halves[slot] = key
    if unsupported:
        raise AdapterError(
            f"{len(unsupported)} tensor(s) map to no supported module of the base model "
            f"(layers 0..{target.num_layers - 1}, modules {', '.join(sorted(target.shapes))}): "
            f"{_names(sorted(unsupported))}"
        )
    if not halves:
        raise AdapterError("adapter has no LoRA weights")
    pairs: dict[tuple[int, str], tuple[str, str]] = {}
    incomplete: list[str] = []
    for layer, module in sorted({(layer, module) for layer, module, _ in halves}):
        key_a, key_b = halves.get((layer, module, "A")), halves.get((layer, module, "B"))
        if key_a is None or key_b is None:
            missing = "lora_A" if key_a is None else "lora_B"
            incomplete.append(f"{_module_path(layer, module)} (no {missing})")
        else:
            pairs[(layer, module)] = (key_a, key_b)
    if incomplete:
        raise AdapterError(f"incomplete LoRA A/B pairs: {_names(incomplete)}")
    return pairs


def _check_pair(
    f: Any, layer: int, module: str, key_a: str, key_b: str, target: TargetShapes, rank: int
) -> None:
    in_features, out_features = target.shapes[module]
    for key in (key_a, key_b):
        dtype = f.get_slice(key).get_dtype()
        if dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"tensor {key} has dtype {dtype}; LoRA weights must be float")
    shape_a = tuple(f.get_slice(key_a).get_shape())
    shape_b = tuple(f.get_slice(key_b).get_shape())
    where = _module_path(layer, module)
    if len(shape_a) != 2 or len(shape_b) != 2:
        raise AdapterError(
            f"{where}: LoRA tensors must be 2-D, got lora_A {list(shape_a)}, lora_B {list(shape_b)}"
        )
    if shape_a[0] != rank:
        raise AdapterError(
            f"{where}: lora_A rank dim is {shape_a[0]} but adapter_config r is {rank}"
        )
    if shape_b[1] != rank:
        raise AdapterError(
            f"{where}: lora_B rank dim is {shape_b[1]} but adapter_config r is {rank}"
        )
    expected_a, expected_b = (rank, in_features), (out_features, rank)
    if shape_a != expected_a or shape_b != expected_b:
        raise AdapterError(
            f"shape mismatch for {where} ({module}): expected lora_A {list(expected_a)} "
            f"lora_B {list(expected_b)}, got lora_A {list(shape_a)} lora_B {list(shape_b)}"
        )


def _check_config_targets(
    config: dict[str, Any],
    pairs: dict[tuple[int, str], tuple[str, str]],
    target: TargetShapes,
) -> None:
    """Refuses modules the config targets but the file has no weights for.

    PEFT would wrap those modules and give them freshly initialised (with
    init_lora_weights=false, random) weights, so serving them as base would differ.
    Tensors the config does not name are fine: each was already checked to be supported.
    """
    targets = config.get("target_modules")
    excludes = config.get("exclude_modules")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise AdapterError(f"adapter_config target_modules is malformed: {_short(targets)}")
        # Entries naming modules of other architectures are ignored by PEFT too; these two
        # exist in every Llama-family model, so PEFT would give them LoRA layers.
        named = sorted({t for t in targets if t.rsplit(".", 1)[-1] in _UNSERVABLE_TARGETS})
        if named:
            raise AdapterError(f"adapter_config targets unsupported modules: {', '.join(named)}")
    # Regex patterns are not evaluated: a tenant-supplied regex could backtrack for
    # minutes, and the tensors themselves already say what is served.
    if targets is None or isinstance(excludes, str):
        return
    if isinstance(targets, str):
        if targets.lower() != "all-linear":
            return
        targets = list(target.shapes)
    if not isinstance(targets, list):
        raise AdapterError(f"adapter_config target_modules is malformed: {_short(targets)}")
    exclude_list = excludes if isinstance(excludes, list) else []
    if not all(isinstance(e, str) for e in exclude_list):
        raise AdapterError(f"adapter_config exclude_modules is malformed: {_short(excludes)}")
    # PEFT loads only the tensors of modules its config wraps: others in the file would be
    # dropped without a word, and the adapter served as something it is not
    untargeted = [_module_path(layer, module) for layer, module in sorted(pairs)
                  if _matches(_module_path(layer, module), exclude_list)
                  or not _matches(_module_path(layer, module), targets)]
    if untargeted:
        raise AdapterError(
            f"{WEIGHTS_NAME} has weights for modules adapter_config target_modules does not "
            f"name: {_names(untargeted)}")
    missing: list[str] = []
    for layer in range(target.num_layers):
        for module in target.shapes:
            key = _module_path(layer, module)
            if _matches(key, exclude_list) or not _matches(key, targets):
                continue
            if (layer, module) not in pairs:
                missing.append(key)
    if missing:
        raise AdapterError(
            f"adapter_config targets modules with no weights in {WEIGHTS_NAME}: {_names(missing)}"
        )


def _matches(key: str, names: list[str]) -> bool:
    # PEFT's list rule: an exact module path, or a suffix after a dot.
    return any(key == n or key.endswith("." + n) for n in names)


def _load_array(fh: Any, data_start: int, header: dict[str, Any], key: str) -> np.ndarray:
    entry = header[key]
    begin, end = entry["data_offsets"]
    dtype = np.dtype(_FLOAT_DTYPES[entry["dtype"]])
    fh.seek(data_start + begin)
    raw = np.fromfile(fh, dtype=dtype, count=(end - begin) // dtype.itemsize)
    if entry["dtype"] == "BF16":
        array = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        # A float64 beyond float32's range becomes inf here and is refused below, as the
        # engine computes in float32.
        with np.errstate(over="ignore"):
            array = raw.astype(np.float32)
    array = np.ascontiguousarray(array.reshape(entry["shape"]))  # [rows, cols]
    if not np.isfinite(array).all():
        kind = "NaN" if np.isnan(array).any() else "Inf"
        raise AdapterError(f"tensor {key} contains {kind} values")
    return array


def _module_path(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{LORA_MODULE_PARENTS[module]}.{module}"


def _file_identity(p: Path) -> tuple[int, int, int, int]:
    st = p.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_IN_MESSAGE])
    more = len(names) - _MAX_NAMES_IN_MESSAGE
    return f"{shown} (and {more} more)" if more > 0 else shown


def _short(value: Any) -> str:
    text = _one_line(json.dumps(value) if not isinstance(value, str) else repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(e: object) -> str:
    return " ".join(str(e).split())
