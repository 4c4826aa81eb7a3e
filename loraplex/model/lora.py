"""LoRA-aware linear layers: a base projection plus every token's own adapter delta.

A packed projection (q/k/v, gate/up) has one slice per PEFT module; the adapters' weights
live in one ``LoRASlots`` per projection, in the layout the device's kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loraplex_kernels.lora_slots import LoRASlots, default_layout
from loraplex_kernels.meta import SGMVMeta
from loraplex_kernels.ops import (
    Backend,
    PackedWeight,
    linear,
    linear_lora,
    pack_linear_weight,
)

# PEFT module name -> (our packed module, slice index within it)
MODULE_SLICES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


@dataclass(frozen=True)
class LoRAStep:
    """What every LoRA layer needs for one forward pass."""

    meta: SGMVMeta
    scales: torch.Tensor  # [num_slots] float32
    backend: Backend | None = None


class LoRALinear(nn.Module):
    """A (possibly packed) linear projection with per-token LoRA deltas."""

    def __init__(self, in_features: int, slice_widths: list[int], bias: bool,
                 num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.slice_widths = list(slice_widths)
        self.slice_offsets = [0]
        for w in slice_widths:
            self.slice_offsets.append(self.slice_offsets[-1] + w)
        out = self.slice_offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self.lora = LoRASlots(in_features, slice_widths, num_slots, max_rank, dtype, device,
                              default_layout(device))
        self.packed_weight: PackedWeight | None = None  # see pack_weight

    def forward(self, x: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
        if lora is None:
            return linear(x, self.weight, self.bias, self.packed_weight)  # [num_tokens, out]
        return linear_lora(x, self.weight, self.bias, self.packed_weight, self.lora,
                           lora.scales, lora.meta, lora.backend)

    def pack_weight(self) -> None:
        """Keeps a GEMM-packed copy of the (loaded, now fixed) base weight where that is
        faster (float32 or bfloat16 on CPU; see ``pack_linear_weight``). A oneDNN-packed
        copy is all the GEMM reads (with, on CPUs without AVX-512, the plain weight it keeps
        for large batches), so ``weight`` is released (half the base weights' memory) and
        is then an empty tensor. Packing twice is a no-op."""
        if self.packed_weight is not None:
            return
        self.packed_weight = pack_linear_weight(self.weight)
        if self.packed_weight is not None and self.packed_weight.kind == "onednn":
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
