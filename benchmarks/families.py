"""Offline throughput per model family, at equal size, against Llama's in the same run.

Each supported family's tiny-but-not-trivial random model of the same dimensions (hidden
512, 4 layers, 8 heads of 64 and 4 KV heads, intermediate 1408: the same parameter count
but for norms, with each family's special features on: windows, soft-capping, q/k norms,
NoPE layers, multipliers) runs one multi-adapter workload through ``LLM.generate``, in
float32 and bfloat16; the families run in turn, twice, the order reversed the second time,
and each family's tokens/s is taken over Llama's of the same round. A family well behind
Llama's (below 0.8x) is on a slower CPU path; the load banner says which
(docs/engine.md, "Model families").

    python benchmarks/families.py --out docs/benchmarks/families   # ~6 min on 2 cores
    python benchmarks/families.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, command_line, cpu_name, pyplot, save_figure, write_json  # noqa: E402

from loraplex import LLM, LoRARequest, SamplingParams  # noqa: E402
from loraplex.testing import FAMILY_FEATURES, build_adapter, build_tiny_model  # noqa: E402

FAMILIES = ["llama", "mistral-window", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
            "smollm3", "olmo2", "granite"]
SIZE = {"hidden_size": 512, "intermediate_size": 1408, "num_heads": 8, "num_kv_heads": 4,
        "num_layers": 4, "max_position_embeddings": 1024}


def _layers(arch: str) -> dict[str, Any]:
    """The family's per-layer lists stretched to four layers."""
    features = FAMILY_FEATURES[arch]
    overrides: dict[str, Any] = {}
    for key in ("layer_types", "no_rope_layers"):
        if key in features:
            pattern = features[key]
            overrides[key] = [pattern[i % len(pattern)] for i in range(SIZE["num_layers"])]
    if arch == "phi3":  # longrope served up to its original context: the whole workload
        rope = dict(features["rope_parameters"])
        half = SIZE["hidden_size"] // SIZE["num_heads"] * rope["partial_rotary_factor"] // 2
        rope["short_factor"] = [1.0 + 0.1 * i for i in range(int(half))]
        rope["long_factor"] = [2.0 + 0.2 * i for i in range(int(half))]
        overrides.update(rope_parameters=rope, original_max_position_embeddings=1024,
                         max_position_embeddings=2048)
    return overrides


def _workload(num: int, seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, adapter index or -1) per request."""
    import random

    rng = random.Random(seed)
    return [([rng.randrange(3, 380) for _ in range(rng.randrange(32, 200))],
             rng.randrange(16, 80), rng.randrange(-1, 4)) for _ in range(num)]


def _run(model: Path, adapters: list[Path], dtype: str,
         work: list[tuple[list[int], int, int]]) -> tuple[float, int, str]:
    llm = LLM(str(model), dtype=dtype, progress=False, max_lora_rank=16, max_loras=4)
    banner = llm.engine.runner.model.describe()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for _, m, _ in work]
    loras = [None if a < 0 else LoRARequest(f"a{a}", str(adapters[a])) for _, _, a in work]
    llm.generate([p for p, _, _ in work[:4]], params[:4], loras[:4])  # warm: kernels, slots
    start = time.perf_counter()
    outs = llm.generate([p for p, _, _ in work], params, loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.close()
    return seconds, tokens, banner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="12 requests, one round")
    add_out_argument(p, "docs/benchmarks/families")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.rounds = 12, 1
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILY_FEATURES))
    if unknown or "llama" not in families:
        p.error(f"--families must include llama and name only {', '.join(FAMILY_FEATURES)}")
    dtypes = [d for d in args.dtype.split(",") if d]
    work = _workload(args.num_requests, 0)
    rows: dict[tuple[str, str], list[float]] = {}
    banners: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        built: dict[str, tuple[Path, list[Path]]] = {}
        for arch in families:
            model = build_tiny_model(Path(tmp) / arch / "model", arch, seed=1,
                                     config_overrides=_layers(arch), **SIZE)  # type: ignore[arg-type]
            built[arch] = (model, [build_adapter(Path(tmp) / arch / f"a{i}", model,
                                                 rank=(4, 8, 16, 8)[i], seed=i)
                                   for i in range(4)])
        for round_no in range(args.rounds):
            order = families if round_no % 2 == 0 else families[::-1]
            for dtype in dtypes:
                for arch in order:
                    seconds, tokens, banner = _run(*built[arch], dtype, work)
                    rows.setdefault((arch, dtype), []).append(tokens / seconds)
                    banners[arch] = banner
                    print(f"round {round_no + 1} {dtype:8s} {arch:14s} {tokens / seconds:8.1f} "
                          f"tok/s  ({banner})", flush=True)
    table = []
    for arch in families:
        for dtype in dtypes:
            # per round over Llama's of the same round (the same state of the machine)
            ratios = [t / ll for t, ll in zip(rows[arch, dtype], rows["llama", dtype],
                                              strict=True)]
            table.append({"family": arch, "dtype": dtype,
                          "tokens_per_s": round(statistics.median(rows[arch, dtype]), 1),
                          "over_llama": round(statistics.median(ratios), 3),
                          "path": banners[arch].split("; ", 1)[-1]})
    print(f"\n{'family':14s} {'dtype':9s} {'tok/s':>8s} {'/ llama':>8s}  path")
    for r in table:
        print(f"{r['family']:14s} {r['dtype']:9s} {r['tokens_per_s']:8.1f} "
              f"{r['over_llama']:8.2f}  {r['path']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"command": command_line("families.py", args), "machine": cpu_name(),
                     "size": SIZE, "num_requests": args.num_requests, "rounds": args.rounds,
                     "results": table})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(dtypes)
    for k, dtype in enumerate(dtypes):
        ax.bar([i + k * width for i in range(len(families))],
               [r["over_llama"] for r in table if r["dtype"] == dtype], width, label=dtype)
    ax.axhline(0.8, color="grey", linestyle="--", linewidth=1, label="0.8x goal")
    ax.set_xticks([i + width * (len(dtypes) - 1) / 2 for i in range(len(families))],
                  families, rotation=30, ha="right")
    ax.set_ylabel("tokens/s over Llama's")
    ax.set_title("Offline throughput per family, equal size (loraplex, CPU)")
    ax.legend()
    save_figure(fig, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
