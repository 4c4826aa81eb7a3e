"""This machine's floors, measured in the same run as a benchmark: so a result from a slower
or faster machine explains itself.

- GEMM rate at the model's own shapes, at the run's thread count and dtype: GFLOP/s of the
  fastest of ``torch.nn.functional.linear``, oneDNN's packed weight and the native skinny
  GEMM (``_gemm_rate``), the best of a few repeats. Two rates: a decoder layer's linear
  layers (at a prefill-sized and a decode-sized number of rows), and the LM head apart
  (prefill-sized), each weighted in the floor by its own FLOPs in the workload. (Until
  2026-12-05 one rate covered one of each layer shape and the head: the head, 28 M of the
  32 M weights in that sum for the demo model, set 89 % of it, and it alone moved: on a
  Xeon the layers' shapes measured 280-310 GFLOP/s at the start and end of a run, the
  head 205-240 at the start and about 300 after the engine had run, which the old rate
  read as the machine speeding up 1.2x.) For bfloat16 on a CPU without bf16 GEMM
  instructions (AVX2 only: torch's bf16 GEMM ran at a sixth of its float32 one there),
  the float32 rate where that is higher: a bf16 GEMM with float32 sums computes exactly
  that way (loraplex does, ``ops.pack_linear_weight``), so the floor never credits a run
  for beating a slow bf16 GEMM.
- Streaming bandwidth: GB/s of copying a buffer far larger than the caches (read + write).
- The workload's compute floor: its base-model FLOPs (2 x the parameters without the LM
  head per processed token, prompt and output alike, at the layers' rate, plus 2 x the LM
  head's per sampled token at the head's rate). ``fraction`` of a run = floor seconds /
  the run's seconds.
- Measured twice, before the first run and after the last (``higher``): these machines'
  GEMM rate moved 1.2-1.34x within an hour (on the Xeon, the head's measurement, above),
  so a single measurement at the start made the fraction follow the measurement's minute
  as much as the code's speed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loraplex_kernels.ops import PackedWeight, linear, onednn_bf16_gemm, pack_linear_weight

_GEMM_VARIABLE = "LORAPLEX_CPU_GEMM"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShapes:
    """The linear layers that carry a decoder's FLOPs, from its HF config."""

    hidden: int
    intermediate: int
    q_out: int
    kv_out: int
    num_layers: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShapes:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, config.intermediate_size, heads * head_dim,
                   kv_heads * head_dim, config.num_hidden_layers, config.vocab_size)

    def layer_linears(self) -> list[tuple[int, int]]:
        """(in, out) of q, k, v, o, gate, up, down."""
        h, i = self.hidden, self.intermediate
        return [(h, self.q_out), (h, self.kv_out), (h, self.kv_out), (self.q_out, h),
                (h, i), (h, i), (i, h)]

    @property
    def body_params(self) -> int:
        return self.num_layers * sum(a * b for a, b in self.layer_linears())

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab


@dataclass(frozen=True)
class Floors:
    dtype: str
    threads: int
    gemm_gflops_prefill: float  # a decoder layer's linear layers, rows = 256
    gemm_gflops_decode: float  # the same, rows = 16
    stream_gbps: float
    gemm_gflops_head: float  # the LM head, rows = 256

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"GEMM {self.gemm_gflops_prefill:.0f} GFLOP/s (layers, 256 rows), "
                f"{self.gemm_gflops_decode:.0f} (16 rows), head {self.gemm_gflops_head:.0f}; "
                f"streaming {self.stream_gbps:.1f} GB/s")


def pack_as(weight: torch.Tensor, choice: str) -> PackedWeight | None:
    """``pack_linear_weight`` under ``LORAPLEX_CPU_GEMM=choice``, the variable restored."""
    saved = os.environ.get(_GEMM_VARIABLE)
    os.environ[_GEMM_VARIABLE] = choice
    try:
        return pack_linear_weight(weight)
    finally:
        if saved is None:
            del os.environ[_GEMM_VARIABLE]
        else:
            os.environ[_GEMM_VARIABLE] = saved


def _gemm_rate(layers: list[tuple[int, int]], rows: int, dtype: torch.dtype,
               repeats: int) -> float:
    """GFLOP/s of linear layers of shapes ``layers`` ((in, out) each), each through the
    fastest of ``F.linear``, a oneDNN-packed weight and the native skinny GEMM
    (``ops.linear``; from 65 rows oneDNN on the plain weight): the machine's rate, not one
    library's (MKL's float32 sgemm takes its AVX2 path on AMD CPUs, at half oneDNN's AVX-512
    rate there)."""
    weights = [torch.randn(out, inp, dtype=dtype) * 0.02 for inp, out in layers]
    inputs = [torch.randn(rows, inp, dtype=dtype) for inp, _ in layers]
    flops = sum(2 * rows * inp * out for inp, out in layers)
    seconds = 0.0
    for x, w in zip(inputs, weights, strict=True):
        ways: list[Callable[[], torch.Tensor]] = [partial(F.linear, x, w)]
        for choice in ("onednn", "skinny"):
            packed = pack_as(w, choice)
            # not a float32 GEMM on a widened copy (the float32 floor counts that)
            if packed is not None and choice == packed.kind \
                    and not (packed.widen and packed.kind == "onednn"):
                ways.append(partial(linear, x, w, None, packed))
        best = float("inf")
        for way in ways:
            way()  # warm-up: oneDNN's primitive for this shape
            for _ in range(repeats):
                start = time.perf_counter()
                way()
                best = min(best, time.perf_counter() - start)
        seconds += best
    return flops / seconds / 1e9


def _stream_rate(repeats: int, megabytes: int = 512) -> float:
    src = torch.ones(megabytes << 18, dtype=torch.float32)  # megabytes MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def measure(shapes: ModelShapes, dtype: str, threads: int, repeats: int = 5) -> Floors:
    """The floors now, at ``threads`` threads (set for the duration, then restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            kinds = [_DTYPES[dtype]]
            if dtype == "bfloat16" and not onednn_bf16_gemm():
                kinds.append(torch.float32)
            layers, head = shapes.layer_linears(), [(shapes.hidden, shapes.vocab)]
            rates = []
            for t in kinds:
                _gemm_rate(layers + head, 16, t, 1)  # warm-up: oneDNN primitives, page faults
                rates.append((_gemm_rate(layers, 256, t, repeats),
                              _gemm_rate(layers, 16, t, repeats),
                              _gemm_rate(head, 256, t, repeats)))
            return Floors(dtype, threads, max(r[0] for r in rates), max(r[1] for r in rates),
                          _stream_rate(repeats), max(r[2] for r in rates))
    finally:
        torch.set_num_threads(before)


def higher(a: Floors, b: Floors) -> Floors:
    """Each rate the higher of two measurements of the same floors (a run's start and end):
    the machine's best shown in that run."""
    return Floors(a.dtype, a.threads, max(a.gemm_gflops_prefill, b.gemm_gflops_prefill),
                  max(a.gemm_gflops_decode, b.gemm_gflops_decode),
                  max(a.stream_gbps, b.stream_gbps),
                  max(a.gemm_gflops_head, b.gemm_gflops_head))


def compute_floor_seconds(shapes: ModelShapes, floors: Floors, num_prompt_tokens: int,
                          num_output_tokens: int) -> float:
    """The seconds the workload's base-model FLOPs take at the prefill-shaped GEMM rates:
    the layers' at theirs, the LM head's at its own."""
    body = 2 * shapes.body_params * (num_prompt_tokens + num_output_tokens)
    head = 2 * shapes.head_params * num_output_tokens
    return body / (floors.gemm_gflops_prefill * 1e9) + head / (floors.gemm_gflops_head * 1e9)
