"""Makes a draft model out of a target: its first layers, final norm and LM head saved as
a standalone HuggingFace folder (config, tokenizer, safetensors), which the
``draft_model`` method of speculative decoding loads as a separate model with its own KV
cache. For a model that has no smaller sibling with its tokenizer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from loraplex.errors import ConfigError
from loraplex.model.loader import weight_files

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                    "chat_template.jinja", "generation_config.json")


def save_first_layers(model_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Writes the first ``num_layers`` decoder layers of ``model_dir`` (with its embeddings,
    final norm, LM head and tokenizer) to ``out_dir``; returns ``out_dir``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out_dir)
    try:
        config = json.loads((src / "config.json").read_text())
        total = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{src}: no readable config.json with num_hidden_layers "
                          f"({type(exc).__name__})") from None
    if not 1 <= num_layers <= total:
        raise ConfigError(f"num_layers must be in [1, {total}], got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists follow the count
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    tensors = {}
    for path in weight_files(src):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                layer = _LAYER.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = handle.get_tensor(name).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
