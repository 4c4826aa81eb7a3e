"""The HF transformers + PEFT peers of ``offline_throughput.py``: (a) one request at a time,
(b) static left-padded batches with PEFT's mixed-batch ``adapter_names``."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from _workload import WorkItem

# --- (a) and (b): HF transformers + PEFT ------------------------------------------------


class HFPeer:
    """One PeftModel with every adapter loaded, shared by (a) and (b)."""

    def __init__(self, model_dir: str, adapter_paths: Sequence[Path], pad_id: int,
                 dtype: str = "float32") -> None:
        import peft
        import transformers

        base = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype))
        self.names = [f"lora-{i}" for i in range(len(adapter_paths))]
        model = peft.PeftModel.from_pretrained(base, str(adapter_paths[0]),
                                               adapter_name=self.names[0])
        for name, path in zip(self.names[1:], adapter_paths[1:], strict=True):
            model.load_adapter(str(path), adapter_name=name)
        self.model = model.eval()
        self.pad_id = pad_id

    def _config(self, num_new: int) -> Any:
        import transformers

        # No EOS: generation runs to max_new_tokens, exactly like loraplex's ignore_eos.
        return transformers.GenerationConfig(
            do_sample=False, max_new_tokens=num_new, min_new_tokens=num_new,
            eos_token_id=None, pad_token_id=self.pad_id, bos_token_id=None)

    @torch.inference_mode()
    def one(self, item: WorkItem) -> list[int]:
        ids = torch.tensor([item.prompt_ids])
        kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=self._config(item.max_tokens))
        if item.adapter is None:
            with self.model.disable_adapter():
                out = self.model.generate(**kwargs)
        else:
            self.model.set_adapter(self.names[item.adapter])
            out = self.model.generate(**kwargs)
        return out[0, ids.shape[1]:].tolist()

    @torch.inference_mode()
    def batch(self, items: Sequence[WorkItem]) -> list[list[int]]:
        width = max(len(w.prompt_ids) for w in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, w in enumerate(items):  # left padding
            ids[row, width - len(w.prompt_ids):] = torch.tensor(w.prompt_ids)
            mask[row, width - len(w.prompt_ids):] = 1
        names = [self.names[w.adapter] if w.adapter is not None else "__base__" for w in items]
        num_new = max(w.max_tokens for w in items)
        out = self.model.generate(input_ids=ids, attention_mask=mask, adapter_names=names,
                                  generation_config=self._config(num_new))
        return [out[row, width:width + w.max_tokens].tolist() for row, w in enumerate(items)]


@contextlib.contextmanager
def peer_gemm(kind: str) -> Iterator[None]:
    """``"onednn"``: every float32 or bfloat16 ``F.linear`` (transformers' and PEFT's
    ``nn.Linear``) goes through the same oneDNN-packed weights as loraplex's base
    projections, packed once per weight; a sensitivity check of how much of the gap is the
    GEMM library.
    ``"torch"``: PyTorch's default, untouched."""
    if kind == "torch":
        yield
        return
    from loraplex_kernels import ops

    plain = torch.nn.functional.linear
    packed: dict[int, tuple[torch.Tensor, Any]] = {}

    def linear(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - torch's name
               bias: torch.Tensor | None = None) -> torch.Tensor:
        entry = packed.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = packed[id(weight)] = (weight, ops.pack_linear_weight(weight))
        if entry[1] is None or input.dim() < 2 or input.dtype != weight.dtype:
            return plain(input, weight, bias)
        out = ops.linear(input.reshape(-1, input.shape[-1]), weight, bias, entry[1])
        return out.reshape(*input.shape[:-1], out.shape[-1])

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = plain


def run_hf_single(peer: HFPeer, items: Sequence[WorkItem], label: str) -> tuple[float, Any]:
    from tqdm import tqdm

    peer.one(WorkItem(-1, items[0].prompt_ids[:16], 4, items[0].adapter))  # warm-up
    outputs = []
    start = time.perf_counter()
    for item in tqdm(items, desc=label, unit="req", file=sys.stderr, leave=False):
        outputs.append(peer.one(item))
    return time.perf_counter() - start, outputs


def run_hf_batched(peer: HFPeer, items: Sequence[WorkItem], batch_size: int,
                   label: str) -> tuple[float, Any]:
    from tqdm import tqdm

    peer.batch([WorkItem(-1, w.prompt_ids[:16], 4, w.adapter) for w in items[:2]])  # warm-up
    batches = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for b in tqdm(batches, desc=label, unit="batch", file=sys.stderr, leave=False):
        outputs.extend(peer.batch(b))
    return time.perf_counter() - start, outputs
