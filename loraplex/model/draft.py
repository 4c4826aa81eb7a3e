"""The draft model of speculative decoding's ``draft_model`` method: a separate, smaller
model that shares the target's tokenizer, runs base-only (no LoRA) and keeps its own paged
KV cache.

Its KV pool has as many blocks, of the same size, as the target's, and is indexed by the
very same block tables: block allocation, trimming of rejected slots, copy-on-write and
swap then hold for both pools at once, with no second block manager. How far the draft's
KV reaches in a sequence's blocks is ``Request.num_draft_computed_tokens``.
Whoever moves the target's blocks (``ModelRunner.copy_blocks``, swaps) moves the draft's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loraplex.errors import ConfigError, LoraplexError
from loraplex.model.args import ModelArgs
from loraplex.model.decoder import KVCache
from loraplex.model.loader import load_hf_config, load_model, load_tokenizer

# Files any of which makes a folder's tokenizer loadable by transformers.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "vocab.json")


class DraftModel:
    """The draft's weights and KV tensors. Loading refuses, in one line each, a draft that
    cannot propose the target's tokens: a missing or unreadable folder, another
    vocabulary or tokenizer, or a context shorter than the target's."""

    def __init__(self, path: str, target: ModelArgs, target_tokenizer: Any,
                 max_model_len: int, dtype: str, device: torch.device,
                 progress: bool = True) -> None:
        self.path = path
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(f"draft model {path}: no such folder")
        try:
            args = ModelArgs.from_hf_config(load_hf_config(folder))
        except LoraplexError as exc:
            raise ConfigError(f"draft model: {exc}") from None
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(f"draft model {path}: unreadable config.json "
                              f"({_one_line(exc)})") from None
        if args.vocab_size != target.vocab_size:
            raise ConfigError(f"draft model {path}: vocabulary of {args.vocab_size} tokens, "
                              f"the target's has {target.vocab_size} (the draft must share "
                              f"the target's tokenizer)")
        _check_tokenizer(folder, target_tokenizer)
        if args.max_served_positions < max_model_len:
            raise ConfigError(f"draft model {path}: context of {args.max_served_positions} "
                              f"tokens is shorter than the target's max_model_len "
                              f"({max_model_len}); pass a max_model_len of at most "
                              f"{args.max_served_positions}")
        try:
            # Base-only: one LoRA slot of rank 1, never filled (every token uses slot -1).
            self.model, self.args = load_model(folder, dtype, device, 1, 1, max_model_len,
                                               progress)
        except LoraplexError as exc:
            raise ConfigError(f"draft model: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"draft model {path}: unreadable weights "
                              f"({_one_line(exc)})") from None
        self.model.pack_weights()
        self.dtype = next(iter(self.model.parameters())).dtype
        self.kv_caches: list[KVCache] = []
        self.host_caches: list[KVCache] = []
        # Running totals of the draft's forwards, for the engine's stats: how many, their
        # tokens, and the longest (what a step's catch-up budget bounds).
        self.num_forwards = 0
        self.num_forward_tokens = 0
        self.max_forward_tokens = 0

    def record_forward(self, num_tokens: int) -> None:
        self.num_forwards += 1
        self.num_forward_tokens += num_tokens
        self.max_forward_tokens = max(self.max_forward_tokens, num_tokens)

    def block_bytes(self, block_size: int) -> int:
        """What one KV block costs in the draft's pool."""
        a = self.args
        return (2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim
                * torch.finfo(self.dtype).bits // 8)

    def allocate(self, num_blocks: int, block_size: int, num_host_blocks: int,
                 device: torch.device) -> None:
        """The draft's KV pool (and host swap pool), shaped like the target's in blocks."""
        a = self.args
        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
        # Per draft layer: K and V, each [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=device),
                           torch.zeros(shape, dtype=self.dtype, device=device))
                          for _ in range(a.num_layers)]
        host_shape = (num_host_blocks,) + shape[1:]
        self.host_caches = [(torch.zeros(host_shape, dtype=self.dtype),
                             torch.zeros(host_shape, dtype=self.dtype))
                            for _ in range(a.num_layers)] if num_host_blocks else []


def _check_tokenizer(folder: Path, target_tokenizer: Any) -> None:
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"draft model {folder}: no tokenizer files to compare with the "
                          f"target's (save the target's tokenizer into the folder)")
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"draft model {folder}: unreadable tokenizer "
                          f"({_one_line(exc)})") from None
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ConfigError(f"draft model {folder}: its tokenizer differs from the target's "
                          f"(the draft must share the target's tokenizer)")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__
