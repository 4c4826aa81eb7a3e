"""One-call GPU check of the kernels: the ``gpu`` tests, then timings against peers.

Usage (on a CUDA machine, from the repository root)::

    python benchmarks/gpu_check.py [--out DIR] [--budget-s 420] [--skip-tests] [--quick]

1. Runs ``pytest -m gpu tests/kernels`` in a child process.
2. Times every kernel with ``triton.testing.do_bench`` (median) beside its peers, at
   serving shapes (Llama-8B-like: hidden 4096, 32 query / 8 KV heads of 128):
   - SGMV shrink/expand vs a per-adapter loop of dense matmuls (the PyTorch reference)
     and vs a gathered-weights ``bmm`` (weights gathered per token at the padded rank);
   - paged decode vs ``F.scaled_dot_product_attention`` on contiguous KV;
   - paged prefill vs SDPA (causal, contiguous); KV store vs ``index_copy_``.
3. Prints achieved GB/s and TFLOP/s against the H200 roofline (about 4.3 TB/s and
   790 dense bf16 TFLOP/s), writes ``gpu_check.json`` (and a PNG if matplotlib is there)
   and prints the table last.

Byte counts are the minimum traffic each op must move (every input read once, every output
written once); FLOP counts are the useful multiply-adds at each adapter's own rank. The
roofline fraction is ``max(bytes / 4.3 TB/s, flops / 790 TFLOP/s) / measured time``.
Do not compare absolute times between runs; ratios within one run are the claim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_BYTES_S = 4.3e12
PEAK_FLOP_S = 790e12


def _ensure_kernels_importable() -> None:
    """Makes ``loraplex_kernels`` importable on a bare machine without an install."""
    try:
        import loraplex_kernels  # noqa: F401
        return
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="loraplex_kernels_"))
    (shim / "loraplex_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    sys.path.insert(0, str(shim))
    # The child pytest needs it too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)


_ensure_kernels_importable()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from loraplex_kernels import ops  # noqa: E402
from loraplex_kernels.attention_triton import choose_num_splits  # noqa: E402
from loraplex_kernels.meta import AttentionMeta, SGMVMeta  # noqa: E402

DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so a CPU dry run can swap it
HIDDEN = 4096
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@dataclass
class Row:
    kernel: str
    shape: str
    impl: str
    ms: float
    bytes: float
    flops: float
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / (self.ms * 1e-3) / 1e12

    @property
    def roofline(self) -> float:
        ideal = max(self.bytes / PEAK_BYTES_S, self.flops / PEAK_FLOP_S)
        return ideal / (self.ms * 1e-3)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _bench(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


# --------------------------------------------------------------------------- SGMV


def _sgmv_workload(num_tokens: int, num_adapters: int, ranks: list[int],
                   seed: int) -> tuple[list[int], list[int]]:
    """Token slots spread over the adapters (every adapter used, tokens interleaved)."""
    rng = random.Random(seed)
    slots = [i % num_adapters for i in range(num_tokens)]
    rng.shuffle(slots)
    slot_ranks = [ranks[i % len(ranks)] for i in range(num_adapters)]
    return slots, slot_ranks


def bench_sgmv(rows: list[Row], budget: Budget, quick: bool) -> None:
    configs = [  # (tokens, adapters, ranks cycled over adapters)
        (1, 1, [16]), (16, 16, [16]), (64, 8, [8]), (64, 64, [16]), (64, 64, [8, 16, 32, 64]),
        (256, 1, [64]), (256, 8, [16]), (256, 64, [8, 16, 32, 64]), (256, 64, [64]),
    ]
    if quick:
        configs = configs[:3]
    for num_tokens, num_adapters, ranks in configs:
        if budget.left() < 30:
            print("budget: skipping remaining SGMV shapes", flush=True)
            return
        _bench_sgmv_shape(rows, num_tokens, num_adapters, ranks)


def _bench_sgmv_shape(rows: list[Row], num_tokens: int, num_adapters: int,
                      ranks: list[int]) -> None:
    dev = torch.device(DEVICE)
    max_rank = 64
    slots, slot_ranks = _sgmv_workload(num_tokens, num_adapters, ranks, seed=num_tokens)
    meta = SGMVMeta.build(slots, slot_ranks, device=dev)
    num_slots = num_adapters
    x = torch.randn(num_tokens, HIDDEN, dtype=DTYPE, device=dev)
    a = torch.randn(num_slots, max_rank, HIDDEN, dtype=DTYPE, device=dev) * 0.02
    b = torch.randn(num_slots, HIDDEN, max_rank, dtype=DTYPE, device=dev) * 0.02
    scales = torch.ones(num_slots, dtype=torch.float32, device=dev)
    y = torch.zeros(1, num_tokens, max_rank, dtype=DTYPE, device=dev)
    out = torch.zeros(num_tokens, HIDDEN, dtype=DTYPE, device=dev)
    slots_t = torch.tensor(slots, dtype=torch.long, device=dev)
    rank_label = "/".join(str(r) for r in ranks)
    shape = f"T={num_tokens} adapters={num_adapters} r={rank_label}"
    tok_rank = sum(slot_ranks[s] for s in slots)  # sum over tokens of their rank
    w_elems = sum(slot_ranks[s] for s in set(slots)) * HIDDEN
    shrink_bytes = 2 * (num_tokens * HIDDEN + w_elems + num_tokens * max_rank)
    expand_bytes = 2 * (num_tokens * max_rank + w_elems + 2 * num_tokens * HIDDEN)
    flops = 2 * tok_rank * HIDDEN

    def gathered_shrink() -> None:
        ag = a.index_select(0, slots_t)  # [T, max_rank, hidden]
        ys = torch.bmm(ag, x.unsqueeze(2)).squeeze(2)  # [T, max_rank]
        y[0].copy_(ys * scales.index_select(0, slots_t)[:, None])

    def gathered_expand() -> None:
        bg = b.index_select(0, slots_t)  # [T, hidden, max_rank]
        out.add_(torch.bmm(bg, y[0].unsqueeze(2)).squeeze(2))

    impls_shrink: dict[str, Callable[[], object]] = {
        "triton": lambda: ops.sgmv_shrink(x, [a], scales, meta, y, "triton"),
        "loop-matmul": lambda: ops.sgmv_shrink(x, [a], scales, meta, y, "torch"),
        "gathered-bmm": gathered_shrink,
    }
    impls_expand: dict[str, Callable[[], object]] = {
        "triton": lambda: ops.sgmv_expand(y, [b], meta, out, [0, HIDDEN], "triton"),
        "loop-matmul": lambda: ops.sgmv_expand(y, [b], meta, out, [0, HIDDEN], "torch"),
        "gathered-bmm": gathered_expand,
    }
    _time_impls(rows, "sgmv_shrink", shape, impls_shrink, shrink_bytes, flops)
    _time_impls(rows, "sgmv_expand", shape, impls_expand, expand_bytes, flops)


# ---------------------------------------------------------------------- attention


def _paged_setup(seq_lens: list[int], query_lens: list[int], dev: torch.device,
                 seed: int) -> tuple[AttentionMeta, torch.Tensor, torch.Tensor]:
    """A paged cache holding exactly these sequences, blocks in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    perm = torch.randperm(sum(needed), generator=g).tolist()
    starts = [0]
    for n in needed:
        starts.append(starts[-1] + n)
    tables = [perm[lo:hi] for lo, hi in zip(starts, starts[1:], strict=False)]
    meta = AttentionMeta.build(tables, seq_lens, query_lens, BLOCK_SIZE, device=dev)
    shape = (sum(needed), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=dev)
    v_cache = torch.randn(shape, dtype=DTYPE, device=dev)
    return meta, k_cache, v_cache


def _time_impls(rows: list[Row], kernel: str, shape: str,
                impls: dict[str, Callable[[], object]], nbytes: float, flops: float,
                note: str = "") -> None:
    for impl, fn in impls.items():
        ms = _bench(fn)
        ours = impl.startswith("triton")
        rows.append(Row(kernel, shape, impl, ms, nbytes, flops, note=note if ours else ""))
        print(f"{kernel:13s} {shape:38s} {impl:13s} {ms * 1e3:9.1f} us", flush=True)


def bench_decode(rows: list[Row], budget: Budget, quick: bool) -> None:
    configs = [(b, c) for b in (1, 16, 64, 256) for c in (512, 2048, 8192)]
    if quick:
        configs = [(1, 512), (16, 2048)]
    for batch, ctx in configs:
        if budget.left() < 30:
            print("budget: skipping remaining decode shapes", flush=True)
            return
        _bench_decode_shape(rows, batch, ctx)


def _bench_decode_shape(rows: list[Row], batch: int, ctx: int) -> None:
    dev = torch.device(DEVICE)
    scale = HEAD_DIM ** -0.5
    meta, k_cache, v_cache = _paged_setup([ctx] * batch, [1] * batch, dev, seed=batch)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    out = torch.empty_like(q)
    # Peer: the same amount of KV laid out contiguously, [batch, kv_heads, ctx, head_dim].
    k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_DIM, dtype=DTYPE, device=dev)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)  # [batch, heads, 1, head_dim]
    nbytes = 2 * (2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM + 2 * batch * NUM_HEADS * HEAD_DIM)
    flops = 4 * batch * NUM_HEADS * ctx * HEAD_DIM
    splits = choose_num_splits(batch, NUM_KV_HEADS, ctx, dev)
    _time_impls(rows, "paged_decode", f"B={batch} ctx={ctx}", {
        "triton-paged": lambda: ops.paged_attention(q, k_cache, v_cache, meta, scale, out,
                                                    "triton"),
        "sdpa-contig": lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale,
                                                              enable_gqa=True),
    }, nbytes, flops, note=f"splits={splits}")


def bench_prefill(rows: list[Row], budget: Budget, quick: bool) -> None:
    for batch, length in [(1, 2048), (4, 1024)] if not quick else [(1, 512)]:
        if budget.left() < 30:
            print("budget: skipping remaining prefill shapes", flush=True)
            return
        _bench_prefill_shape(rows, batch, length)


def _bench_prefill_shape(rows: list[Row], batch: int, length: int) -> None:
    dev = torch.device(DEVICE)
    scale = HEAD_DIM ** -0.5
    meta, k_cache, v_cache = _paged_setup([length] * batch, [length] * batch, dev, seed=7)
    q = torch.randn(batch * length, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    out = torch.empty_like(q)
    q4 = q.view(batch, length, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    k = torch.randn(batch, NUM_KV_HEADS, length, HEAD_DIM, dtype=DTYPE, device=dev)
    v = torch.randn_like(k)
    nbytes = 2 * (2 * batch * length * (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM)
    flops = 2 * batch * NUM_HEADS * length * length * HEAD_DIM  # causal half of 4*L*L*D
    _time_impls(rows, "paged_prefill", f"B={batch} prompt={length}", {
        "triton-paged": lambda: ops.paged_attention(q, k_cache, v_cache, meta, scale, out,
                                                    "triton"),
        "sdpa-causal": lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale,
                                                              is_causal=True, enable_gqa=True),
    }, nbytes, flops)


def bench_store_kv(rows: list[Row], budget: Budget) -> None:
    for num_tokens in (1, 256):
        if budget.left() < 15:
            return
        _bench_store_kv_shape(rows, num_tokens)


def _bench_store_kv_shape(rows: list[Row], num_tokens: int) -> None:
    dev = torch.device(DEVICE)
    num_blocks = 4096
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE,
                          device=dev)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev)[:num_tokens]
    nbytes = 2 * 2 * 2 * num_tokens * NUM_KV_HEADS * HEAD_DIM
    _time_impls(rows, "store_kv", f"T={num_tokens}", {
        "triton": lambda: ops.store_kv(key, value, k_cache, v_cache, slots, "triton"),
        "index_copy": lambda: ops.store_kv(key, value, k_cache, v_cache, slots, "torch"),
    }, nbytes, 0.0)


# ------------------------------------------------------------------------- report


def run_gpu_tests(timeout_s: float) -> dict[str, object]:
    start = time.monotonic()
    # confcutdir: conftests above tests/kernels may import server deps this machine lacks.
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-m", "gpu", "-q",
           "-p", "no:cacheprovider", "--confcutdir", "tests/kernels"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
        tail = (proc.stdout + proc.stderr)[-6000:]
        result = {"returncode": proc.returncode, "summary": tail.strip().splitlines()[-1]
                  if tail.strip() else ""}
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        tail = out[-6000:]
        result = {"returncode": -1, "summary": f"timed out after {timeout_s:.0f}s"}
    print(tail, flush=True)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _table(rows: list[Row]) -> str:
    head = (f"{'kernel':14s} {'shape':38s} {'impl':13s} {'median us':>10s} {'GB/s':>8s} "
            f"{'TFLOP/s':>8s} {'roof%':>6s} {'vs triton':>9s}  note")
    lines = [head, "-" * len(head)]
    ours: dict[tuple[str, str], float] = {
        (r.kernel, r.shape): r.ms for r in rows if r.impl.startswith("triton")}
    for r in rows:
        base = ours.get((r.kernel, r.shape))
        ratio = f"{r.ms / base:8.2f}x" if base else "      -"
        lines.append(f"{r.kernel:14s} {r.shape:38s} {r.impl:13s} {r.ms * 1e3:10.1f} "
                     f"{r.gbps:8.0f} {r.tflops:8.2f} {100 * r.roofline:6.1f} {ratio:>9s}  "
                     f"{r.note}")
    lines.append("vs triton: peer time / Triton time (>1 means Triton is faster). "
                 f"Roofline: {PEAK_BYTES_S / 1e12:.1f} TB/s, {PEAK_FLOP_S / 1e12:.0f} TFLOP/s.")
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kernels = sorted({r.kernel for r in rows})
    fig, axes = plt.subplots(len(kernels), 1, figsize=(12, 3.2 * len(kernels)), squeeze=False)
    for ax, kernel in zip(axes[:, 0], kernels, strict=True):
        sub = [r for r in rows if r.kernel == kernel]
        shapes = list(dict.fromkeys(r.shape for r in sub))
        impls = list(dict.fromkeys(r.impl for r in sub))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [next((r.roofline * 100 for r in sub if r.shape == s and r.impl == impl),
                         math.nan) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=20,
                      fontsize=7, ha="right")
        ax.set_ylabel("% of roofline")
        ax.set_title(kernel)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")))
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="stop starting new shapes after this many seconds in all")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    budget = Budget(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tests = {"skipped": True} if args.skip_tests else run_gpu_tests(
        timeout_s=max(60.0, budget.left() * 0.45))
    rows: list[Row] = []
    bench_sgmv(rows, budget, args.quick)
    bench_decode(rows, budget, args.quick)
    bench_prefill(rows, budget, args.quick)
    bench_store_kv(rows, budget)
    props = torch.cuda.get_device_properties(0)
    report = {
        "device": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(DTYPE),
        "roofline": {"bytes_per_s": PEAK_BYTES_S, "flop_per_s": PEAK_FLOP_S},
        "gpu_tests": tests,
        "rows": [asdict(r) | {"gbps": r.gbps, "tflops": r.tflops, "roofline": r.roofline}
                 for r in rows],
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    plotted = _plot(rows, args.out / "gpu_check.png")
    print(f"\nwrote {args.out / 'gpu_check.json'}" + (" and gpu_check.png" if plotted else ""))
    print(f"gpu tests: {tests}\n")
    print(_table(rows), flush=True)
    return 0 if tests.get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
