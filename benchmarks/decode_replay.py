"""Decode steps replayed in the engine: this tree's native kernels against another
revision's, with and without the step's LoRA, on real steps of the offline workload.

The offline workload's requests (``offline_throughput.py``'s defaults: 64 requests, 20
adapters, loraplex's embedded engine) run twice; in the second run every ``--every``-th
decode step that carries LoRA is captured as it reaches the native decode layers
(``loraplex_kernels.cpu_decode.run``) and replayed ``--repeats`` times before it runs for
real: with this tree's library and with ``--baseline``'s (compiled beside it,
``_baseline.py``), each with its LoRA segments and with none (base model only),
interleaved, each replay from the step's own inputs (its residual stream restored; the
K/V it writes are the same values in the same slots). A step's LoRA cost is its time with
LoRA less its time without, per library, fastest of the repeats; the LoRA weights it reads
are its distinct adapters' bytes. Whole-run timings move by several per cent between
processes on these machines; replayed steps compare two builds within one process.

    python benchmarks/decode_replay.py [--dtype float32] [--baseline HEAD] [--every 20]
        [--repeats 7] [--out PATH]      # ~1.5 minutes on 2 cores

``--read-ahead-ab`` compares this tree's library with itself instead: the GEMM's LoRA
read-ahead (``cpu_native.lora_read_ahead``) off as the baseline, on as the new, whatever
this CPU's default, which is restored after each replay (to try it on a kind of machine
where it is off by default).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loraplex.openmp import apply_defaults  # noqa: E402

apply_defaults()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _baseline import build_baseline  # noqa: E402
from _offline_loraplex import LoraplexSystem  # noqa: E402
from _output import add_out_argument, cpu_name, pyplot, save_figure, write_json  # noqa: E402
from _workload import (  # noqa: E402
    WorkloadSpec,
    ensure_adapters,
    make_workload,
    resolve_model,
    with_adapters,
)

from loraplex_kernels import cpu_decode, cpu_native  # noqa: E402

# LoRA weights per unit of rank, per layer, of an adapter on all seven modules of the
# demo model (A: 576 x (3 + 1 + 2) + 1536 inputs; B: 960 + 576 + 3072 + 576 outputs)
_WEIGHTS_PER_RANK = 4992 + 5184


class _ReadAhead:
    """This tree's library with the LoRA read-ahead forced on or off for each call."""

    def __init__(self, lib: Any, on: bool) -> None:
        self.lib, self.on = lib, on

    def decode_layer_fields(self) -> int:
        return int(self.lib.decode_layer_fields())

    def decode_layers(self, *args: Any) -> int:
        cpu_native.lora_read_ahead(self.on, self.lib)
        try:
            return int(self.lib.decode_layers(*args))
        finally:
            cpu_native.lora_read_ahead("auto", self.lib)


def _declare(lib: Any) -> Any:
    fn = lib.decode_layers
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_float, ctypes.c_float]
    return lib


class Replayer:
    """Wraps ``cpu_decode.run``: captured steps are replayed with both libraries first."""

    def __init__(self, libs: dict[str, Any], every: int, repeats: int,
                 slot_ranks: list[int]) -> None:
        self.libs, self.every, self.repeats = libs, every, repeats
        self.slot_ranks = slot_ranks
        self.capture = False
        self.count = 0
        self.steps: list[dict[str, Any]] = []
        self.run = cpu_decode.run

    def __call__(self, layers: torch.Tensor, num_layers: int, kv_caches: torch.Tensor,
                 step: dict[str, int], eps: float, scale: float) -> None:
        self.count += 1
        if self.capture and step["num_segs"] > 0 and self.count % self.every == 0:
            self.steps.append(self._replay(layers, num_layers, kv_caches, step, eps, scale))
        self.run(layers, num_layers, kv_caches, step, eps, scale)

    def _replay(self, layers: torch.Tensor, num_layers: int, kv_caches: torch.Tensor,
                step: dict[str, int], eps: float, scale: float) -> dict[str, Any]:
        size = 2 if step["bf16"] else 4
        nbytes = step["rows"] * step["hidden"] * size
        saved = {k: ctypes.create_string_buffer(nbytes) for k in ("x", "residual")}
        for k, buf in saved.items():
            ctypes.memmove(buf, step[k], nbytes)
        tables = {}
        for lora in (True, False):
            fields = dict(step, num_segs=step["num_segs"] if lora else 0)
            tables[lora] = torch.tensor([fields[f] for f in cpu_decode.STEP_FIELDS],
                                        dtype=torch.int64)
        best: dict[tuple[str, bool], float] = {}
        # a baseline revision's layer rows may lack the fields added since at their end
        # (the attention's window and soft-cap, 0 in the demo model)
        rows = {name: layers[:, :lib.decode_layer_fields()].contiguous()
                for name, lib in self.libs.items()}
        for _ in range(self.repeats):
            for name, lib in self.libs.items():
                for lora, table in tables.items():
                    for k, buf in saved.items():
                        ctypes.memmove(step[k], buf, nbytes)
                    start = time.perf_counter()
                    status = lib.decode_layers(rows[name].data_ptr(), num_layers,
                                               kv_caches.data_ptr(), table.data_ptr(), eps,
                                               scale)
                    seconds = time.perf_counter() - start
                    if status != 0:
                        raise RuntimeError(f"decode_layers returned {status} ({name})")
                    best[name, lora] = min(best.get((name, lora), seconds), seconds)
        for k, buf in saved.items():
            ctypes.memmove(step[k], buf, nbytes)
        slots = set((ctypes.c_int64 * step["num_segs"]).from_address(step["seg_slot"]))
        lora_mb = (sum(self.slot_ranks[s] for s in slots) * _WEIGHTS_PER_RANK * num_layers
                   * size / 1e6)
        row: dict[str, Any] = {"step": self.count, "rows": step["rows"],
                               "adapters": len(slots), "lora_mb": round(lora_mb, 1)}
        for name in self.libs:
            row[f"{name}_lora_ms"] = best[name, True] * 1e3
            row[f"{name}_base_ms"] = best[name, False] * 1e3
            row[f"{name}_lora_cost_ms"] = (best[name, True] - best[name, False]) * 1e3
        return row


def plot(steps: list[dict[str, Any]], baseline: str, title: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [s["rows"] for s in steps]
    for name, label in (("old", baseline), ("new", "this tree")):
        ax.plot(rows, [s[f"{name}_lora_cost_ms"] for s in steps], "o-", label=label)
    ax.set_xlabel("rows in the decode step")
    ax.set_ylabel("LoRA cost of the step, ms (with - without)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--baseline", metavar="REV", default="HEAD",
                        help="the git revision whose kernels the replays compare against")
    parser.add_argument("--read-ahead-ab", action="store_true",
                        help="this tree with the GEMM's LoRA read-ahead off, then on, "
                             "instead of --baseline against this tree")
    parser.add_argument("--every", type=int, default=20, help="replay every N-th LoRA step")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--num-requests", type=int, default=64)
    add_out_argument(parser, "benchmarks/results/decode_replay")
    args = parser.parse_args(argv)
    if args.every < 1 or args.repeats < 1 or args.adapters < 1 or args.num_requests < 1:
        parser.error("--every, --repeats, --adapters and --num-requests must be at least 1")
    if not cpu_decode.available():
        raise SystemExit("the native decode layers are not available here")
    model = resolve_model(None)
    system = LoraplexSystem(model, ensure_adapters(model, args.adapters),
                            argparse.Namespace(max_loras=16, max_num_seqs=256,
                                               max_num_batched_tokens=2048), 768, args.dtype)
    system.warm_host_cache(args.adapters)
    tokenizer = system.llm.engine.tokenizer
    spec = WorkloadSpec(num_requests=max(200, args.num_requests))
    items = with_adapters(make_workload(spec, len(tokenizer), tokenizer.all_special_ids)
                          [:args.num_requests], args.adapters, spec.zipf_exponent, spec.seed)
    with tempfile.TemporaryDirectory() as tmp:
        if args.read_ahead_ab:
            if not cpu_native.lora_read_ahead(True):
                raise SystemExit("this build has no LoRA read-ahead (no AVX-512)")
            cpu_native.lora_read_ahead("auto")
            args.baseline = "read-ahead off"
            lib = _declare(cpu_decode._lib())
            libs: dict[str, Any] = {"old": _ReadAhead(lib, False), "new": _ReadAhead(lib, True)}
        else:
            libs = {"old": _declare(build_baseline(args.baseline, Path(tmp))),
                    "new": _declare(cpu_decode._lib())}
        replayer = Replayer(libs, args.every, args.repeats,
                            system.llm.engine.runner.slot_ranks)
        cpu_decode.run = replayer
        try:
            system.generate(items)  # warm: every shape seen once
            replayer.capture = True
            system.generate(items)
        finally:
            cpu_decode.run = replayer.run
    steps = replayer.steps
    if not steps:
        raise SystemExit("no decode step with LoRA was captured (fewer steps than --every?)")
    print(f"{'step':>5} {'rows':>4} {'adapters':>8} {'MB':>6} "
          f"{'old LoRA ms':>11} {'new LoRA ms':>11} {'old/new':>7}")
    for s in steps:
        print(f"{s['step']:5} {s['rows']:4} {s['adapters']:8} {s['lora_mb']:6.0f} "
              f"{s['old_lora_cost_ms']:11.2f} {s['new_lora_cost_ms']:11.2f} "
              f"{s['old_lora_cost_ms'] / s['new_lora_cost_ms']:7.2f}")
    total = {k: sum(s[k] for s in steps) for k in
             ("lora_mb", "old_lora_cost_ms", "new_lora_cost_ms", "old_lora_ms", "new_lora_ms")}
    summary = {
        "steps": len(steps),
        "lora_mb_per_step": total["lora_mb"] / len(steps),
        "old_lora_cost_ms_per_step": total["old_lora_cost_ms"] / len(steps),
        "new_lora_cost_ms_per_step": total["new_lora_cost_ms"] / len(steps),
        "lora_cost_old_over_new": total["old_lora_cost_ms"] / total["new_lora_cost_ms"],
        "lora_step_old_over_new": total["old_lora_ms"] / total["new_lora_ms"],
        "old_lora_gbps": total["lora_mb"] / total["old_lora_cost_ms"],
        "new_lora_gbps": total["lora_mb"] / total["new_lora_cost_ms"],
    }
    print(f"{len(steps)} steps, {summary['lora_mb_per_step']:.0f} MB of LoRA weights each: "
          f"LoRA cost {summary['old_lora_cost_ms_per_step']:.2f} ms ({args.baseline}) -> "
          f"{summary['new_lora_cost_ms_per_step']:.2f} ms (this tree), "
          f"{summary['lora_cost_old_over_new']:.3f}x; read at {summary['old_lora_gbps']:.1f} "
          f"-> {summary['new_lora_gbps']:.1f} GB/s; steps with LoRA "
          f"{summary['lora_step_old_over_new']:.3f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"dtype": args.dtype, "baseline": args.baseline, "every": args.every,
              "repeats": args.repeats, "adapters": args.adapters,
              "num_requests": args.num_requests, "machine": cpu_name(),
              "threads": torch.get_num_threads(), "summary": summary, "steps": steps}
    write_json(out, report)
    plot(steps, args.baseline, f"{args.dtype}, {cpu_name()}", out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
