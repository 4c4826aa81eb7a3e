"""What the serving benchmark reports of a stream: latency percentiles (TTFT, TPOT, ITL,
end to end), throughput, goodput under each SLO, and the engine's own counters over the run
(prefix-cache hit rate, preemptions) from ``/admin/api/engine``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import httpx
from _serving_client import Record


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _latencies(records: Sequence[Record]
               ) -> tuple[list[Record], list[float], list[float], list[float]]:
    """The completed records, and their TTFTs, TPOTs and end-to-end latencies."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    return ok, ttft, tpot, e2e


def summarise(records: Sequence[Record], span: float,
              slos: Sequence[tuple[float, float]]) -> dict[str, Any]:
    ok, ttft, tpot, e2e = _latencies(records)
    gaps = [g for r in ok for g in r.gaps]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": errors, "span_s": span,
        "output_tokens": sum(r.output_tokens for r in ok),
        "throughput_tok_s": sum(r.output_tokens for r in ok) / span,
        "request_rate_done": len(ok) / span,
        "goodput_req_s": [_good(ok, slo) / span for slo in slos],
        "slo_met_fraction": [_good(ok, slo) / len(records) for slo in slos],
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
        "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
    }


def _good(ok: Sequence[Record], slo: tuple[float, float]) -> int:
    return sum(1 for r in ok if (r.ttft or 0) < slo[0] and (r.tpot or 0) < slo[1])


def slo_label(slo: tuple[float, float]) -> str:
    return f"TTFT<{slo[0]:g}s, TPOT<{slo[1] * 1000:g}ms"


def engine_stats(url: str, admin_key: str) -> dict[str, Any]:
    try:
        r = httpx.get(f"{url}/admin/api/engine", headers={"Authorization": f"Bearer {admin_key}"},
                      timeout=30)
        return dict(r.json()) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def engine_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def d(name: str) -> float:
        return float(after.get(name, 0) or 0) - float(before.get(name, 0) or 0)

    queried = d("prefix_cache_queried_tokens")
    return {"prefix_cache_hit_rate": d("prefix_cache_hit_tokens") / queried if queried else 0.0,
            "preemptions": d("num_preemptions"), "steps": d("num_steps"),
            "adapter_slot_loads": d("adapter_slot_loads"),
            "kv_blocks_total": after.get("kv_blocks_total")}


def probe_summary(records: Sequence[Record]) -> dict[str, Any]:
    ok, ttft, tpot, e2e = _latencies(records)
    return {"requests": len(records), "completed": len(ok), "max_tokens": 16,
            "prompt_tokens": 32, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99), "e2e_p50": pct(e2e, 50),
            "e2e_p99": pct(e2e, 99),
            "errors": sorted({r.error for r in records if r.error})[:3]}
