"""When prefill/decode disaggregation pays off on a GPU cluster: a model from what
``pd_ray.py`` measured (what moving one block costs in loraplex's portable form) and stated
GPU profiles (prefill compute-bound, decode bandwidth-bound). Prints a table and writes it
as JSON; every assumption is an argument or a constant below, printed with the result.

Per prompt token, for each model, GPU and link:

- prefill: ``2 x params / (peak FLOP/s x MFU)`` (compute-bound);
- KV bytes: ``2 (K, V) x layers x KV heads x head dim x 2 bytes`` (bf16);
- transfer: KV bytes over the link, and at least the portable form's own cost (encode +
  sha256 on the prefill side, verify + place on the decode side) at the throughput
  ``pd_ray.py`` measured for it on this CPU: a GPU deployment pays it too unless it moves
  blocks GPU to GPU;
- decode step: ``(weights + batch x context x KV bytes per token) / (HBM B/s x efficiency)``
  (bandwidth-bound), and the same step carrying one chunk of ``--chunk`` prompt tokens
  co-located (chunked prefill): what every running stream's TPOT becomes in such steps.

PD pays where the transfer is a small part of the prefill it replaces (``transfer /
prefill`` well under 1) and co-located chunks push TPOT past its SLO (``chunk step /
decode step`` above ``--tpot-slack``). It cannot pay on one machine whose cores both pools
share: that is what ``pd_ray.py`` measures here.

    python benchmarks/pd_model.py --measured docs/benchmarks/pd_ray.json \\
        --out docs/benchmarks/pd_model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _output import add_out_argument, command_line, write_json  # noqa: E402

# (name, parameters, layers, KV heads, head dim, GPUs it runs on)
MODELS = [("Llama-3-8B", 8.0e9, 32, 8, 128, 1), ("Llama-3-70B", 70.6e9, 80, 8, 128, 4)]
# H100 SXM, bf16 dense: peak FLOP/s, HBM bytes/s; per GPU
GPU = {"name": "H100 SXM", "flops": 989e12, "hbm": 3.35e12}
# Effective bytes/s of each link for large transfers (stated, not measured here).
LINKS = {"25 GbE TCP": 2.5e9, "400 Gb/s RDMA": 45e9, "NVLink 4 (same node)": 350e9}


def model_rows(args: argparse.Namespace, portable_bps: float) -> list[dict[str, Any]]:
    rows = []
    for name, params, layers, kv_heads, head_dim, gpus in MODELS:
        prefill_s = 2 * params / (GPU["flops"] * gpus * args.mfu)  # per token
        kv_bytes = 2 * layers * kv_heads * head_dim * 2  # per token, bf16
        hbm = GPU["hbm"] * gpus * args.hbm_efficiency
        step_s = (2 * params + args.batch * args.context * kv_bytes) / hbm
        chunk_step_s = step_s + args.chunk * prefill_s
        interferes = chunk_step_s / step_s > args.tpot_slack
        form_bps = portable_bps * args.form_cores * gpus
        for link, bps in LINKS.items():
            link_s = kv_bytes / (bps * gpus)  # the link alone (GPU to GPU)
            form_s = kv_bytes / min(bps * gpus, form_bps)  # through the portable form
            rows.append({
                "model": name, "gpus": gpus, "link": link,
                "prefill_ms_per_1k": prefill_s * 1e6, "kv_mb_per_1k": kv_bytes * 1e3 / 1e6,
                "link_ms_per_1k": link_s * 1e6, "link_over_prefill": link_s / prefill_s,
                "form_ms_per_1k": form_s * 1e6, "form_over_prefill": form_s / prefill_s,
                "decode_step_ms": step_s * 1e3, "chunk_step_ms": chunk_step_s * 1e3,
                "pays_link_only": interferes and link_s / prefill_s < args.max_transfer,
                "pays_portable_form": interferes and form_s / prefill_s < args.max_transfer})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", default="docs/benchmarks/pd_ray.json",
                   help="pd_ray.py's JSON (the portable form's cost per block)")
    p.add_argument("--mfu", type=float, default=0.5, help="prefill's share of peak FLOP/s")
    p.add_argument("--hbm-efficiency", type=float, default=0.7,
                   help="decode's share of peak HBM bandwidth")
    p.add_argument("--batch", type=int, default=32, help="running sequences per decode step")
    p.add_argument("--context", type=int, default=2048, help="tokens of each one's context")
    p.add_argument("--chunk", type=int, default=512,
                   help="prompt tokens a co-located step carries (chunked prefill)")
    p.add_argument("--tpot-slack", type=float, default=1.5,
                   help="chunk step / decode step past which co-located TPOT breaks its SLO")
    p.add_argument("--max-transfer", type=float, default=0.25,
                   help="transfer / prefill below which the transfer is worth it")
    p.add_argument("--form-cores", type=int, default=8,
                   help="CPU cores per GPU encoding and verifying the portable form")
    add_out_argument(p, "pd_model")
    args = p.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    bf16 = measured["block_costs"]["bfloat16"]
    ms = bf16["ms_per_block"]
    # the portable form's CPU cost alone (the object store's copy is the link's part)
    portable_bps = bf16["block_bytes"] / ((ms["export"] + ms["import"]) / 1e3)
    rows = model_rows(args, portable_bps)
    print(f"assumptions: {GPU['name']} ({GPU['flops'] / 1e12:.0f} TFLOP/s bf16, "
          f"{GPU['hbm'] / 1e12:.2f} TB/s), MFU {args.mfu}, HBM efficiency "
          f"{args.hbm_efficiency}, batch {args.batch} x {args.context} tokens, chunk "
          f"{args.chunk}; portable form {portable_bps / 1e9:.2f} GB/s per core x "
          f"{args.form_cores} cores per GPU (measured, "
          f"{measured['machine']['cpu']})")
    print(f"{'model':>12} {'link':>21} {'prefill':>8} {'KV MB':>6} {'link':>6} {'form':>6} "
          f"{'step':>6} {'chunk step':>10}  PD pays (link only / portable form)")
    for r in rows:
        print(f"{r['model']:>12} {r['link']:>21} {r['prefill_ms_per_1k']:7.1f}  "
              f"{r['kv_mb_per_1k']:6.0f} {r['link_over_prefill']:6.2f} "
              f"{r['form_over_prefill']:6.2f} {r['decode_step_ms']:6.1f} "
              f"{r['chunk_step_ms']:10.1f}  {'yes' if r['pays_link_only'] else 'no'} / "
              f"{'yes' if r['pays_portable_form'] else 'no'}")
    print("(prefill: ms per 1k prompt tokens; link, form: transfer / prefill; steps in ms)")
    write_json(Path(args.out), {"command": command_line("pd_model.py", args), "gpu": GPU,
                                "links_bytes_per_s": LINKS, "portable_bytes_per_s":
                                portable_bps, "measured_on": measured["machine"]["cpu"],
                                "rows": rows})


if __name__ == "__main__":
    main()
