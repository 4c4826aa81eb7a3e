"""Each tenant's recent latency over HTTP (``/admin/api/latency``) and the engine view's
tenant names, on the tiny model with its own SQLite registry. The oracle for the figures is
``/metrics``: the same requests counted by the Prometheus histograms and SLO counters."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import (
    SchedulerConfig,
    ServerConfig,
)
from loraplex.gateway.routes import admin
from loraplex.registry.models import MAX_SLO_MS

pytestmark = pytest.mark.server
SERVER_SLO = (1500, 150)  # the server's default SLO (ms), for a tenant without its own
# slo_tpot_ms=1 is met only by a request whose output tokens came within 1 ms each: the
# tiny model on CPU may or may not, so the test reads what happened from /metrics.
TENANT_SLOS = {"roomy": (MAX_SLO_MS, MAX_SLO_MS), "strict": (MAX_SLO_MS, 1),
               "plain": (None, None)}
NUM_REQUESTS = {"roomy": 6, "strict": 5, "plain": 1}
MAX_TOKENS = 8


@pytest.fixture
def server(tiny_llama_dir: Path, tmp_path: Path,
           own_server: Callable[..., contextlib.AbstractContextManager[Any]]) -> Iterator[Any]:
    tenants = {name: {"slo_ttft_ms": ttft_ms, "slo_tpot_ms": tpot_ms}
               for name, (ttft_ms, tpot_ms) in TENANT_SLOS.items()}
    with own_server(tmp_path, tiny_llama_dir, tenants,
                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
                    ServerConfig(served_model_name="tiny", slo_ttft_ms=SERVER_SLO[0],
                                 slo_tpot_ms=SERVER_SLO[1])) as own:
        yield own


def _prometheus(server: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _buckets(prom: dict[str, list[Any]], name: str, tenant: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of ``tenant``'s histogram ``name``."""
    return sorted((float(s.labels["le"]), s.value) for s in prom[f"{name}_bucket"]
                  if s.labels["tenant"] == tenant)


def _check_nearest_rank(value: float, percent: int, buckets: list[tuple[float, float]]) -> None:
    """The nearest-rank percentile is the ``rank``-th smallest value: at or below every
    bound whose bucket holds ``rank`` values, above every bound whose bucket holds fewer."""
    count = buckets[-1][1]
    rank = -(-percent * int(count) // 100)
    for bound, cumulative in buckets:
        assert (value <= bound) == (cumulative >= rank), (value, percent, bound, buckets)


def _slo_counts(prom: dict[str, list[Any]], tenant: str) -> dict[str, float]:
    return {s.labels["result"]: s.value for s in prom["loraplex_slo_requests_total"]
            if s.labels["tenant"] == tenant}


def test_each_tenants_latency_and_attainment(server: Any) -> None:
    for tenant, num in NUM_REQUESTS.items():
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.keys[tenant],
                               max_retries=0, timeout=60)
        for i in range(num):
            done = client.completions.create(model="tiny", prompt=f"hello {i}",
                                             max_tokens=MAX_TOKENS, temperature=0.0,
                                             extra_body={"ignore_eos": True})
            assert done.usage is not None and done.usage.completion_tokens == MAX_TOKENS
        client.close()

    response = server.get("/admin/api/latency")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "tenant_latency" and body["window"] == 1000
    rows = {row["tenant"]: row for row in body["data"]}
    assert [row["tenant"] for row in body["data"]] == sorted(rows)
    assert set(rows) == set(NUM_REQUESTS)  # the admin's own calls are not generations
    prom = _prometheus(server)
    for tenant, num in NUM_REQUESTS.items():
        row = rows[tenant]
        assert row["requests"] == num
        for what in ("ttft", "tpot", "e2e", "queue"):
            p50, p99 = row[f"{what}_p50_s"], row[f"{what}_p99_s"]
            assert 0 <= p50 <= p99, (tenant, what, row)
        assert row["ttft_p99_s"] <= row["e2e_p99_s"]
        assert 1 <= row["ttft_steps_p50"] <= row["ttft_steps_p99"]
        assert isinstance(row["ttft_steps_p99"], int)
        # The same requests, as the Prometheus histograms bucket them.
        for field, histogram in (("ttft", "loraplex_time_to_first_token_seconds"),
                                 ("tpot", "loraplex_time_per_output_token_seconds"),
                                 ("e2e", "loraplex_e2e_request_latency_seconds"),
                                 ("queue", "loraplex_queue_time_seconds"),
                                 ("ttft_steps", "loraplex_time_to_first_token_steps")):
            buckets = _buckets(prom, histogram, tenant)
            assert buckets[-1][1] == num, (tenant, histogram)
            suffix = "" if field == "ttft_steps" else "_s"
            for percent in (50, 99):
                _check_nearest_rank(row[f"{field}_p{percent}{suffix}"], percent, buckets)
        # Attainment is what the SLO counters say, against the SLO the tenant has.
        counts = _slo_counts(prom, tenant)
        met, missed = counts.get("met", 0.0), counts.get("missed", 0.0)
        assert met + missed == num
        assert row["slo_attainment"] == pytest.approx(met / num)
        ttft_ms, tpot_ms = TENANT_SLOS[tenant]
        assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == \
            (ttft_ms or SERVER_SLO[0], tpot_ms or SERVER_SLO[1])
    # An SLO of an hour is always met.
    assert rows["roomy"]["slo_attainment"] == 1.0
    # Within 1 ms per output token (the TTFT part is an hour): exactly the requests whose
    # TPOT the histogram puts in its 1 ms bucket.
    tpot = dict(_buckets(prom, "loraplex_time_per_output_token_seconds", "strict"))
    assert rows["strict"]["slo_attainment"] == pytest.approx(tpot[0.001] / NUM_REQUESTS["strict"])
    assert (rows["strict"]["tpot_p50_s"] <= 0.001) == (rows["strict"]["slo_attainment"] >= 0.5)


def test_latency_needs_an_admin_key(server: Any) -> None:
    assert server.get("/admin/api/latency", key=server.keys["roomy"]).status_code == 403
    anonymous = httpx.get(f"{server.url}/admin/api/latency", timeout=30)
    assert anonymous.status_code == 401
    twice = httpx.get(f"{server.url}/admin/api/latency", timeout=30, headers=[
        ("Authorization", f"Bearer {server.admin_key}"),
        ("Authorization", f"Bearer {server.keys['roomy']}")])
    assert twice.status_code == 400
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    declared = doc["paths"]["/admin/api/latency"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    body = server.get("/admin/api/latency").json()
    assert set(declared["required"]) == set(body)
    assert body["data"] == []  # no request finished yet


def test_the_engine_view_names_its_tenants(server: Any) -> None:
    for tenant in ("roomy", "strict"):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.keys[tenant],
                               max_retries=0, timeout=60)
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        client.close()
    stats = server.get("/admin/api/engine").json()
    named = {t["name"]: t for t in stats["tenants"]}
    assert set(named) == {"roomy", "strict"}
    for name, t in named.items():
        assert t["tenant"] == str(server.tenant_ids[name])
        assert t["decode_tokens"] >= 1 and t["num_running"] == 0
    (replica,) = stats["replicas"]
    assert {t["name"]: t["tenant"] for t in replica["tenants"]} == \
        {name: t["tenant"] for name, t in named.items()}
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    declared = doc["paths"]["/admin/api/engine"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]["properties"]["tenants"]["items"]
    assert set(declared["required"]) == set(stats["tenants"][0])


def test_odd_scheduler_tenant_ids_have_no_name(server: Any) -> None:
    """The engine's tenant is whatever the gateway set: none, or an id the registry does
    not know, is named None instead of failing the view."""
    odd = {"", "x", "-1", "1.5", "٣", "²", "2147483648", "9" * 5000,
           str(max(server.tenant_ids.values()) + 1000)}
    names = admin._tenant_names(server.app.state.gateway,
                                odd | {str(server.tenant_ids["plain"])})
    assert names == dict.fromkeys(odd) | {str(server.tenant_ids["plain"]): "plain"}
