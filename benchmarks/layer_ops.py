"""The decoder's small per-layer ops on CPU: the PyTorch reference vs the fused native kernels.

In the demo model's (SmolLM2-135M) shapes, per dtype and batch (a decode step's tokens, a
prefill chunk), it times, in the same run and interleaved, each op through
``ops.*(backend="torch")`` (what every layer ran before) and ``backend="cpu"`` (the native
kernels of ``csrc/cpu_layer_ops.c``): RMSNorm, residual add + RMSNorm, RoPE of q and k with
the KV store, SiLU-and-mul. A layer runs two add + norms, one RoPE + store and one
SiLU-and-mul; the per-step totals multiply that by the layer count. Writes JSON and a PNG.

    python benchmarks/layer_ops.py [--repeats 200] [--threads 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# As offline_throughput.py: idle OpenMP threads must not spin on the cores they share.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from loraplex_kernels import cpu_layer_ops, ops  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query and 3 key/value heads of 64, MLP 1536, 30 layers
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30
BLOCK_SIZE, NUM_BLOCKS = 16, 512
BATCHES = {"decode": 32, "prefill": 512}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# how many times one layer runs each op
PER_LAYER = {"rms_norm": 0, "fused_add_rms_norm": 2, "rope_store_kv": 1, "silu_and_mul": 1}


def _calls(dtype: torch.dtype, tokens: int,
           backend: ops.Backend) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)  # [tokens, hidden]
    residual = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width, generator=g).to(dtype)  # [tokens, qkv width]
    angles = torch.rand(tokens, 1, HEAD_DIM, generator=g) * 6.28
    rope = (angles.cos(), angles.sin())  # [tokens, 1, head_dim] float32 each
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape,
                                                                           dtype=dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:tokens]
    gate_up = torch.randn(tokens, 2 * INTER, generator=g).to(dtype)  # [tokens, 2 * inter]
    # The native ops write into their inputs; repeated calls keep the values bounded (the
    # norm rescales x, RoPE preserves norms), so no input is copied inside the timing.
    return {
        "rms_norm": lambda: ops.rms_norm(x, weight, 1e-5, backend),
        "fused_add_rms_norm": lambda: ops.fused_add_rms_norm(x, residual, weight, 1e-5,
                                                             backend),
        "rope_store_kv": lambda: ops.rope_store_kv(qkv, HEADS, KV_HEADS, HEAD_DIM, rope,
                                                   k_cache, v_cache, slots, backend),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up, backend),
    }


def measure(dtype_name: str, batch: str, repeats: int) -> list[dict[str, Any]]:
    tokens = BATCHES[batch]
    paths = {"reference": _calls(DTYPES[dtype_name], tokens, "torch"),
             "native": _calls(DTYPES[dtype_name], tokens, "cpu")}
    rows = []
    for op in PER_LAYER:
        times: dict[str, list[float]] = {k: [] for k in paths}
        for calls in paths.values():
            calls[op]()
        for _ in range(repeats):  # interleaved, so load from elsewhere hits both alike
            for key, calls in paths.items():
                t0 = time.perf_counter()
                calls[op]()
                times[key].append(time.perf_counter() - t0)
        row: dict[str, Any] = {"op": op, "dtype": dtype_name, "batch": batch,
                               "tokens": tokens}
        for key, ts in times.items():
            row[f"{key}_min_us"] = min(ts) * 1e6
            row[f"{key}_median_us"] = statistics.median(ts) * 1e6
        row["speedup_median"] = row["reference_median_us"] / row["native_median_us"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/layer_ops")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    if not cpu_layer_ops.available():
        parser.error("the native CPU kernels are not available (no compiler, or "
                     "LORAPLEX_CPU_KERNELS=0)")
    torch.set_num_threads(args.threads)
    rows = [r for dt in DTYPES for batch in BATCHES for r in measure(dt, batch, args.repeats)]
    print(f"{args.threads} threads, {args.repeats} interleaved repeats, times in us")
    print(f"{'dtype':9} {'batch':8} {'op':19} {'ref median':>11} {'native median':>14} "
          f"{'speedup':>8}")
    for r in rows:
        print(f"{r['dtype']:9} {r['batch']:8} {r['op']:19} {r['reference_median_us']:11.1f} "
              f"{r['native_median_us']:14.1f} {r['speedup_median']:8.2f}")
    totals = {}
    for dt in DTYPES:
        for batch in BATCHES:
            sel = [r for r in rows if r["dtype"] == dt and r["batch"] == batch]
            old = sum(r["reference_median_us"] * PER_LAYER[r["op"]] for r in sel) * LAYERS
            new = sum(r["native_median_us"] * PER_LAYER[r["op"]] for r in sel) * LAYERS
            totals[f"{dt}_{batch}"] = {"reference_ms": old / 1e3, "native_ms": new / 1e3,
                                       "speedup": old / new}
            print(f"{dt} {batch} ({BATCHES[batch]} tokens), {LAYERS} layers: "
                  f"{old / 1e3:.2f} ms -> {new / 1e3:.2f} ms per step ({old / new:.2f}x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": args.threads, "repeats": args.repeats,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rows": rows,
              "per_step_totals": totals}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['op']}\n{r['dtype']} {r['batch']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["reference_median_us"] for r in rows], 0.4,
           color="#9e9e9e", label="PyTorch reference")
    ax.bar([x + 0.2 for x in xs], [r["native_median_us"] for r in rows], 0.4,
           color="#e0702a", label="native fused kernel")
    ax.set_xticks(list(xs), labels, fontsize=5)
    ax.set_yscale("log")
    ax.set_ylabel("us per call (median)")
    ax.set_title("Per-layer ops on CPU, demo model shapes", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
