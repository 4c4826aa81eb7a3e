"""Rotary position embeddings as the model families configure them: which frequencies
each layer's rotation uses (default, linear, llama3, yarn, longrope, dynamic), over how
much of the head (partial rotary), and the cos/sin tables the kernels read.

The kernels rotate a whole head as neox does (dimension ``i`` paired with
``i + head_dim / 2``). A partial rotation (``rotary_dim < head_dim``, Phi-4-mini's 0.75)
pairs ``i`` with ``i + rotary_dim / 2`` and leaves the rest alone; it becomes a whole-head
rotation by permuting the q and k heads' dimensions once, at load (``partial_rotary_order``),
and giving the dimensions that pass through cos 1 and sin 0. q·k is unchanged by a
permutation applied to both, and v is not permuted, so attention is the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass(frozen=True)
class RopeSpec:
    """One set of rotary frequencies: base, scaling (``None``: plain) and rotated width."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] | None  # sorted items of the scaling dict
    rotary_dim: int

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else str(dict(self.scaling)["rope_type"])

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any], head_dim: int,
                        where: str = "rope_parameters") -> RopeSpec:
        """From a config's ``rope_parameters`` (or legacy ``rope_scaling``); refuses a type
        or a partial factor it cannot serve exactly, naming the field."""
        rope = dict(params)
        theta = float(rope.pop("rope_theta", 10000.0))
        partial = float(rope.pop("partial_rotary_factor", 1.0) or 1.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"{where}.rope_type {rope_type!r} is not supported; "
                                 f"supported: {', '.join(ROPE_TYPES)}")
        rotary_dim = int(head_dim * partial)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2 or (head_dim - rotary_dim) % 2:
            raise ModelLoadError(f"{where}.partial_rotary_factor {partial} gives a rotated "
                                 f"width of {rotary_dim} of head_dim {head_dim}; supported: "
                                 "an even width whose complement is even")
        for key in _REQUIRED.get(rope_type, ()):
            if rope.get(key) is None:
                raise ModelLoadError(f"{where}: rope_type {rope_type!r} needs {key!r}")
        rope.pop("type", None)
        scaling = None if rope_type == "default" else tuple(
            sorted({**rope, "rope_type": rope_type}.items(), key=lambda kv: kv[0]))
        return cls(theta, _frozen(scaling), rotary_dim)


_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
    "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
}


def _frozen(items: Any) -> Any:
    """Lists (longrope's factors) as tuples, so a spec is hashable."""
    if isinstance(items, (list, tuple)):
        return tuple(_frozen(v) for v in items)
    return items


def longrope_limit(spec: RopeSpec) -> int | None:
    """The most positions a longrope spec serves exactly: HF switches a sequence to the
    long factors once it grows past ``original_max_position_embeddings`` and keeps the keys
    it cached with the short ones, which a paged cache shared by many requests cannot
    reproduce; so loraplex serves such a model up to that length (None: not longrope)."""
    if spec.rope_type != "longrope":
        return None
    return int(dict(spec.scaling or ())["original_max_position_embeddings"])


def inverse_frequencies(spec: RopeSpec, max_position_embeddings: int,
                        ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` float64 and the factor cos and sin are
    multiplied by (yarn's and longrope's attention factor; 1 otherwise)."""
    dim = spec.rotary_dim
    inv = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
    if spec.scaling is None:
        return inv, 1.0
    s = dict(spec.scaling)
    kind = s["rope_type"]
    if kind == "linear":
        return inv / float(s["factor"]), 1.0
    if kind == "dynamic":
        # NTK scaling changes the base only past max_position_embeddings, beyond which
        # loraplex never serves (max_model_len is capped by it): the plain frequencies.
        return inv, 1.0
    if kind == "llama3":
        return _llama3(inv, s), 1.0
    if kind == "yarn":
        return _yarn(spec, s, max_position_embeddings)
    return _longrope_short(spec, s, max_position_embeddings)


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # long wavelengths are slowed by `factor`, short ones kept, a smooth blend between
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, s: dict[str, Any], max_positions: int,
          ) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than ``beta_slow`` times over
    the original context are interpolated by ``factor``, those turning more than
    ``beta_fast`` times kept, a linear ramp between; cos/sin scaled by the attention
    factor (0.1 ln(factor) + 1 unless the config sets it)."""
    dim, base = spec.rotary_dim, spec.theta
    factor = float(s["factor"])
    original = float(s.get("original_max_position_embeddings") or max_positions)
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all)
                     if mscale and mscale_all else _mscale(factor))
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # share of the original (extrapolated) frequency
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return extrapolated / factor * (1 - kept) + extrapolated * kept, float(attention)


def _longrope_short(spec: RopeSpec, s: dict[str, Any], max_positions: int,
                    ) -> tuple[torch.Tensor, float]:
    """LongRoPE's short factors (the ones HF uses up to the original context, all loraplex
    serves: ``longrope_limit``), per-frequency divisors; the attention factor from the
    context's growth unless the config sets it."""
    dim = spec.rotary_dim
    short = torch.tensor([float(v) for v in s["short_factor"]], dtype=torch.float64)
    if short.numel() != dim // 2:
        raise ModelLoadError(f"rope_parameters.short_factor has {short.numel()} values; "
                             f"the rotated width {dim} needs {dim // 2}")
    original = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_positions / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    inv = 1.0 / (short * spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).double()
                                        / dim))
    return inv, float(attention)


def cos_sin_table(spec: RopeSpec | None, head_dim: int, max_positions: int,
                  max_position_embeddings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_positions, head_dim]`` float32 in the kernels' whole-head neox
    layout; ``spec`` None: no rotation (a NoPE layer), cos 1 and sin 0 everywhere."""
    if spec is None:
        return (torch.ones(max_positions, head_dim), torch.zeros(max_positions, head_dim))
    inv, attention = inverse_frequencies(spec, max_position_embeddings)
    pos = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(pos, inv)  # [max_positions, rotary_dim // 2]
    cos, sin = freqs.cos() * attention, freqs.sin() * attention
    pad = (head_dim - spec.rotary_dim) // 2  # dimensions that pass through, per half
    if pad:
        one = torch.ones(max_positions, pad, dtype=torch.float64)
        zero = torch.zeros(max_positions, pad, dtype=torch.float64)
        cos, sin = torch.cat([cos, one], dim=1), torch.cat([sin, zero], dim=1)
    return torch.cat([cos, cos], dim=1).float(), torch.cat([sin, sin], dim=1).float()


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """Where each of our head's dimensions comes from in the checkpoint's order (int64
    ``[head_dim]``), so that a partial rotation pairs ``i`` with ``i + head_dim / 2`` as the
    kernels rotate; None when the whole head rotates."""
    if rotary_dim == head_dim:
        return None
    half, pad = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(half)) + list(range(rotary_dim, rotary_dim + pad))
    second = list(range(half, rotary_dim)) + list(range(rotary_dim + pad, head_dim))
    return torch.tensor(first + second, dtype=torch.int64)
