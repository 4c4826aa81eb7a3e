"""Two LoRA kernel paths timed against each other in one run (``lora_prefill.py``,
``lora_decode.py``): the demo model's projection shapes, the interleaved timing, the bar
plot of the two paths side by side, and a tree's LoRA slots as another revision's build
reads them."""

from __future__ import annotations

import copy
import ctypes
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _output import pyplot, save_figure

from loraplex_kernels import cpu_native
from loraplex_kernels.lora_slots import LoRASlots, round_up, tiled_layout, vnni_pair_layout

# SmolLM2-135M: hidden 576, 9 query and 3 key/value heads of 64, MLP 1536, 30 layers
PROJECTIONS = {"qkv_proj": (576, [576, 192, 192]), "o_proj": (576, [576]),
               "gate_up_proj": (576, [1536, 1536]), "down_proj": (1536, [576])}
LAYERS = 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def time_interleaved(paths: dict[str, Callable[[], None]],
                     repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each path: one warm-up call each, then ``repeats`` rounds
    that run every path in turn, so load from elsewhere hits them alike."""
    times: dict[str, list[float]] = {k: [] for k in paths}
    for fn in paths.values():
        fn()
    for _ in range(repeats):
        for key, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return times


def add_speedups(row: dict[str, Any], times: dict[str, list[float]]) -> dict[str, Any]:
    """``row`` with each path's min and median ms, and per_slice's speedup over
    block_diagonal on both."""
    for key, ts in times.items():
        row[f"{key}_min_ms"] = min(ts) * 1e3
        row[f"{key}_median_ms"] = statistics.median(ts) * 1e3
    row["speedup_min"] = row["block_diagonal_min_ms"] / row["per_slice_min_ms"]
    row["speedup_median"] = row["block_diagonal_median_ms"] / row["per_slice_median_ms"]
    return row


def plot_paths(rows: list[dict[str, Any]], path: Path, case: str, labels: tuple[str, str],
               ylabel: str, title: str) -> None:
    """The two paths' min ms per row (``row[case]`` and its dtype under each pair)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    ticks = [f"{r[case]}\n{r['dtype']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["block_diagonal_min_ms"] for r in rows], 0.4,
           color="#9e9e9e", label=labels[0])
    ax.bar([x + 0.2 for x in xs], [r["per_slice_min_ms"] for r in rows], 0.4,
           color="#e0702a", label=labels[1])
    ax.set_xticks(list(xs), ticks, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


Slices = Sequence[tuple[int, int, int, int]]


def read_as(slots: LoRASlots, make: Callable[[torch.Tensor, torch.Tensor, Slices],
                                              tuple[torch.Tensor, torch.Tensor]],
             multiple: int) -> LoRASlots:
    """A shallow copy of ``slots`` whose kernel reads ``make(at, bt, slices)`` per slot,
    ``at`` and ``bt`` cut to the slot's ranks rounded up to ``multiple`` (the reading
    build's), which the copy's kernel is told."""
    other = copy.copy(slots)
    other.native = list(slots.native)
    other.at_ptrs, other.bt_ptrs = slots.at_ptrs.clone(), slots.bt_ptrs.clone()
    other.ranks = slots.ranks.clone()
    for s, pair in enumerate(slots.weights):
        if pair is not None:
            rank = round_up(max(r1 for _, r1, _, _ in slots.slices[s]), multiple)
            other.native[s] = copies = make(pair[0][:, :rank], pair[1][:rank], slots.slices[s])
            other.at_ptrs[s], other.bt_ptrs[s] = copies[0].data_ptr(), copies[1].data_ptr()
            other.ranks[s] = rank
    return other


def as_build_reads(slots: LoRASlots, lib: ctypes.CDLL) -> LoRASlots:
    """``slots`` as another build's kernel reads them: at that build's rank multiple
    (16 before it could be asked); builds from before the tiled layout (no
    ``loraplex_lora_tile``) read A^T and B^T in place, pair-interleaved in bfloat16."""
    multiple = cpu_native.lora_rank_multiple_of(lib, slots.dtype)
    if hasattr(lib, "loraplex_lora_tile"):
        tile = cpu_native.lora_tile_of(lib)
        pairs = slots.dtype == torch.bfloat16
        return read_as(slots, lambda at, bt, slices: tiled_layout(at, bt, slices, tile,
                                                                   pairs=pairs), multiple)
    if slots.dtype == torch.bfloat16:
        return read_as(slots, lambda at, bt, _: (vnni_pair_layout(at), vnni_pair_layout(bt)),
                        multiple)
    return read_as(slots, lambda at, bt, _: (at, bt), multiple)
