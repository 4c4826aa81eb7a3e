"""The decoder's small per-layer ops on CPU: the PyTorch reference vs the fused native kernels.

In the demo model's (SmolLM2-135M) shapes, per dtype and batch (a decode step's tokens, a
prefill chunk), it times, in the same run and interleaved, each op through
``ops.*(backend="torch")`` (what every layer ran before) and ``backend="cpu"`` (the native
kernels of ``csrc/cpu_layer_ops.c``): RMSNorm, residual add + RMSNorm, RoPE of q and k with
the KV store, SiLU-and-mul. A layer runs two add + norms, one RoPE + store and one
SiLU-and-mul; the per-step totals multiply that by the layer count.

``--model-steps N`` also times the demo model's whole forward (base model, LM head
included) for a decode step and a prefill chunk, N interleaved times each, with the layers'
ops on the native kernels and on the reference (swapped in this process only, attention
and GEMMs unchanged): the end-to-end share of these ops. Writes JSON and a PNG.

    python benchmarks/layer_ops.py [--repeats 200] [--model-steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# As offline_throughput.py: idle OpenMP threads must not spin on the cores they share.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from _lora_paths import time_interleaved  # noqa: E402
from _output import add_out_argument, cpu_name, pyplot, save_figure, write_json  # noqa: E402

import loraplex.model.decoder as decoder  # noqa: E402
from loraplex.model.demo import default_demo_dir, is_prepared  # noqa: E402
from loraplex.model.loader import load_model  # noqa: E402
from loraplex_kernels import cpu_layer_ops, ops  # noqa: E402
from loraplex_kernels.meta import AttentionMeta  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query and 3 key/value heads of 64, MLP 1536, 30 layers
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30
BLOCK_SIZE, NUM_BLOCKS = 16, 512
BATCHES = {"decode": 32, "prefill": 512}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# how many times one layer runs each op
PER_LAYER = {"rms_norm": 0, "fused_add_rms_norm": 2, "rope_store_kv": 1, "silu_and_mul": 1}


def _calls(dtype: torch.dtype, tokens: int,
           backend: ops.Backend) -> dict[str, Callable[[], None]]:
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
        times = time_interleaved({key: calls[op] for key, calls in paths.items()}, repeats)
        row: dict[str, Any] = {"op": op, "dtype": dtype_name, "batch": batch,
                               "tokens": tokens}
        for key, ts in times.items():
            row[f"{key}_min_us"] = min(ts) * 1e6
            row[f"{key}_median_us"] = statistics.median(ts) * 1e6
        row["speedup_median"] = row["reference_median_us"] / row["native_median_us"]
        rows.append(row)
    return rows


# The model's layer ops as decoder.py imports them, and the same ops on the reference.
NATIVE_OPS = {name: getattr(decoder, name) for name in PER_LAYER}
REFERENCE_OPS: dict[str, Callable[..., Any]] = {
    "rms_norm": lambda x, w, eps, backend=None: ops.rms_norm(x, w, eps, "torch"),
    "fused_add_rms_norm": lambda x, r, w, eps, backend=None: ops.fused_add_rms_norm(
        x, r, w, eps, "torch"),
    "rope_store_kv": lambda *a, backend=None: ops.rope_store_kv(*a[:8], backend="torch"),
    "silu_and_mul": lambda gate_up, backend=None: ops.silu_and_mul(gate_up, "torch"),
}
# (sequences, context length, new tokens per sequence)
STEPS = {"decode": (32, 256, 1), "prefill": (1, 512, 512)}


def measure_model(dtype_name: str, steps: int) -> list[dict[str, Any]]:
    model, args = load_model(default_demo_dir(), dtype_name, torch.device("cpu"), 1, 8,
                             max_positions=1024, progress=False)
    model.pack_weights()
    rows = []
    for step, (num_seqs, context, new) in STEPS.items():
        blocks = -(-context // BLOCK_SIZE)
        shape = (num_seqs * blocks, BLOCK_SIZE, args.num_kv_heads, args.head_dim)
        caches = [(torch.zeros(shape, dtype=model.embed_tokens.dtype),
                   torch.zeros(shape, dtype=model.embed_tokens.dtype))
                  for _ in range(args.num_layers)]  # [blocks, block_size, kv_heads, dim]
        meta = AttentionMeta.build([list(range(b * blocks, (b + 1) * blocks))
                                    for b in range(num_seqs)], [context] * num_seqs,
                                   [new] * num_seqs, BLOCK_SIZE)
        ids = torch.randint(0, args.vocab_size, (num_seqs * new,))  # [tokens]
        positions = torch.arange(context - new, context).repeat(num_seqs)  # [tokens]

        times: dict[str, list[float]] = {"reference": [], "native": []}
        for i in range(steps + 1):  # interleaved; the first round warms up
            for key, table in (("reference", REFERENCE_OPS), ("native", NATIVE_OPS)):
                for name, fn in table.items():
                    setattr(decoder, name, fn)
                t0 = time.perf_counter()
                model.compute_logits(model(ids, positions, caches, meta, None))
                if i:
                    times[key].append(time.perf_counter() - t0)
        for name, fn in NATIVE_OPS.items():
            setattr(decoder, name, fn)
        row: dict[str, Any] = {"step": step, "dtype": dtype_name, "tokens": num_seqs * new,
                               "context": context}
        for key, ts in times.items():
            row[f"{key}_median_ms"] = statistics.median(ts) * 1e3
            row[f"{key}_min_ms"] = min(ts) * 1e3
        row["speedup_median"] = row["reference_median_ms"] / row["native_median_ms"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--model-steps", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    add_out_argument(parser, "benchmarks/results/layer_ops")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1 or args.model_steps < 0:
        parser.error("--repeats and --threads must be at least 1, --model-steps at least 0")
    if args.model_steps and not is_prepared(default_demo_dir()):
        parser.error(f"no demo model in {default_demo_dir()}: run `loraplex demo` first")
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
    model_rows = [r for dt in DTYPES for r in measure_model(dt, args.model_steps)
                  ] if args.model_steps else []
    for r in model_rows:
        print(f"demo model forward, {r['dtype']} {r['step']} ({r['tokens']} tokens, context "
              f"{r['context']}): {r['reference_median_ms']:.1f} ms -> "
              f"{r['native_median_ms']:.1f} ms ({r['speedup_median']:.3f}x, medians of "
              f"{args.model_steps})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"cpu": cpu_name(), "threads": args.threads, "repeats": args.repeats,
              "model_steps": args.model_steps,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rows": rows,
              "per_step_totals": totals, "model_rows": model_rows}
    written = write_json(out, report)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {written} and {out.with_suffix('.png')}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.5))
    labels = [f"{r['op']}\n{r['dtype']} {r['batch']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["reference_median_us"] for r in rows], 0.4,
           color="#9e9e9e", label="PyTorch reference")
    ax.bar([x + 0.2 for x in xs], [r["native_median_us"] for r in rows], 0.4,
           color="#e0702a", label="native fused kernel")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=40, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("us per call (median)")
    ax.set_title("Per-layer ops on CPU, demo model shapes", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
