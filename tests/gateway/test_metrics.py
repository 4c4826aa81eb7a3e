"""Prometheus metrics: values as rendered, bounded label cardinality, no shared state."""

from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loraplex.engine.outputs import RequestMetrics
from loraplex.gateway.latency import nearest_rank
from loraplex.gateway.metrics import (
    OTHER_LABEL,
    REQUEST_STATUSES,
    GatewayMetrics,
    Slo,
    status_for_http,
)


def samples(metrics: GatewayMetrics) -> list[Sample]:
    payload, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return [
        s for family in text_string_to_metric_families(payload.decode()) for s in family.samples
    ]


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    found = [s.value for s in samples(metrics) if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _timed(ttft: float | None, tpot: float | None, e2e: float | None, queue: float = 0.01,
           ttft_steps: int = 1) -> RequestMetrics:
    return RequestMetrics(0.0, queue, ttft, tpot, e2e, 0, 1, ttft_steps)


def test_request_counter_by_tenant_adapter_status() -> None:
    metrics = GatewayMetrics()
    metrics.observe_request("acme", "sql@abc", "ok", _timed(0.1, 0.02, 1.0))
    metrics.observe_request("acme", "sql@abc", "ok", _timed(0.3, 0.04, 2.0))
    metrics.observe_request("acme", "sql@abc", "rate_limited")
    metrics.observe_request("beta", "base", "server_error")
    total = "loraplex_requests_total"
    assert value(metrics, total, tenant="acme", adapter="sql@abc", status="ok") == 2
    assert value(metrics, total, tenant="acme", adapter="sql@abc", status="rate_limited") == 1
    assert value(metrics, total, tenant="beta", adapter="base", status="server_error") == 1


def test_latency_histograms_by_tenant() -> None:
    metrics = GatewayMetrics()
    metrics.observe_request("acme", "a", "ok", _timed(0.1, 0.02, 1.0, ttft_steps=2))
    metrics.observe_request("acme", "a", "ok", _timed(0.3, None, 2.0, ttft_steps=5))
    metrics.observe_request("acme", "a", "aborted")  # no latency observed
    metrics.observe_request("beta", "a", "ok", _timed(9.0, 0.5, 20.0))
    ttft = "loraplex_time_to_first_token_seconds"
    assert value(metrics, f"{ttft}_count", tenant="acme") == 2
    assert value(metrics, f"{ttft}_sum", tenant="acme") == pytest.approx(0.4)
    assert value(metrics, f"{ttft}_bucket", tenant="acme", le="0.25") == 1
    assert value(metrics, f"{ttft}_bucket", tenant="acme", le="+Inf") == 2
    assert value(metrics, f"{ttft}_count", tenant="beta") == 1
    tpot = "loraplex_time_per_output_token_seconds"
    assert value(metrics, f"{tpot}_count", tenant="acme") == 1
    assert value(metrics, f"{tpot}_sum", tenant="acme") == pytest.approx(0.02)
    e2e = "loraplex_e2e_request_latency_seconds"
    assert value(metrics, f"{e2e}_count", tenant="acme") == 2
    assert value(metrics, f"{e2e}_sum", tenant="acme") == pytest.approx(3.0)
    assert value(metrics, f"{e2e}_bucket", tenant="acme", le="1.0") == 1
    steps = "loraplex_time_to_first_token_steps"
    assert value(metrics, f"{steps}_bucket", tenant="acme", le="2.0") == 1
    assert value(metrics, f"{steps}_bucket", tenant="acme", le="6.0") == 2
    assert value(metrics, "loraplex_queue_time_seconds_count", tenant="beta") == 1


def test_goodput_counts_requests_within_the_tenants_slo() -> None:
    metrics = GatewayMetrics()
    slo = Slo(ttft_ms=500, tpot_ms=50)
    metrics.observe_request("acme", "a", "ok", _timed(0.1, 0.02, 1.0), slo)  # met
    metrics.observe_request("acme", "a", "ok", _timed(0.6, 0.02, 1.0), slo)  # late first
    metrics.observe_request("acme", "a", "ok", _timed(0.1, 0.06, 1.0), slo)  # slow after
    metrics.observe_request("acme", "a", "ok", _timed(0.1, None, 0.1), slo)  # one token: met
    metrics.observe_request("acme", "a", "aborted", None, slo)  # not counted
    slo_total = "loraplex_slo_requests_total"
    assert value(metrics, slo_total, tenant="acme", result="met") == 2
    assert value(metrics, slo_total, tenant="acme", result="missed") == 2


def test_label_cardinality_is_capped() -> None:
    metrics = GatewayMetrics(max_label_values=5)
    for i in range(50):
        metrics.observe_request(f"tenant{i}", f"adapter{i % 20}", "ok")
    metrics.observe_request("tenant0", "adapter0", "ok")  # a kept value stays kept
    counted = [s for s in samples(metrics) if s.name == "loraplex_requests_total"]
    tenants = {s.labels["tenant"] for s in counted}
    adapters = {s.labels["adapter"] for s in counted}
    assert tenants == {f"tenant{i}" for i in range(5)} | {OTHER_LABEL}
    assert adapters == {f"adapter{i}" for i in range(5)} | {OTHER_LABEL}
    assert sum(s.value for s in counted) == 51  # nothing lost, only folded
    # Tenants 5..49 are other; of those, adapters i % 20 >= 5 are other too.
    assert (
        value(metrics, "loraplex_requests_total", tenant="tenant0", adapter="adapter0", status="ok")
        == 2
    )
    assert (
        value(
            metrics, "loraplex_requests_total", tenant=OTHER_LABEL, adapter=OTHER_LABEL, status="ok"
        )
        == 35
    )


def test_default_cap_is_100() -> None:
    metrics = GatewayMetrics()
    for i in range(150):
        metrics.observe_request(f"t{i}", "a", "ok")
    tenants = {s.labels["tenant"] for s in samples(metrics) if s.name == "loraplex_requests_total"}
    assert len(tenants) == 101 and OTHER_LABEL in tenants


def test_status_is_from_a_fixed_set() -> None:
    metrics = GatewayMetrics()
    with pytest.raises(ValueError):
        metrics.observe_request("t", "a", "teapot")
    for status in REQUEST_STATUSES:
        metrics.observe_request("t", "a", status)
    statuses = {s.labels["status"] for s in samples(metrics) if s.name == "loraplex_requests_total"}
    assert statuses == set(REQUEST_STATUSES)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (200, "ok"),
        (400, "client_error"),
        (401, "client_error"),
        (404, "client_error"),
        (429, "rate_limited"),
        (500, "server_error"),
        (503, "overloaded"),
    ],
)
def test_status_for_http(code: int, status: str) -> None:
    assert status_for_http(code) == status


def test_instances_do_not_share_state() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    first.observe_request("t", "a", "ok")
    assert not [s for s in samples(second) if s.name == "loraplex_requests_total"]


# --- the latency window behind /admin/api/latency --------------------------------------


def test_nearest_rank_is_one_of_the_values() -> None:
    values = list(range(1, 101))  # 1..100: the p-th percentile is p
    assert [nearest_rank(values, p) for p in (1, 50, 99, 100)] == [1, 50, 99, 100]
    assert nearest_rank([7], 50) == nearest_rank([7], 99) == 7
    assert nearest_rank([], 50) is None
    # ceil(0.5 * 2) = 1st and ceil(0.99 * 2) = 2nd; never an interpolated 1.5.
    assert (nearest_rank([1.0, 2.0], 50), nearest_rank([1.0, 2.0], 99)) == (1.0, 2.0)
    # ceil(0.99 * 1000) = 990th, in integers (0.99 * 1000 in floats is not 990 exactly).
    assert nearest_rank(list(range(1000)), 99) == 989
    for bad in (0, 101):
        with pytest.raises(ValueError):
            nearest_rank([1], bad)


def test_tenant_latency_percentiles_and_attainment() -> None:
    metrics = GatewayMetrics()
    slo = Slo(ttft_ms=500, tpot_ms=50)
    # ttft 0.01..1.00 s, tpot 0.001..0.1 s, steps 1..100, shuffled arrival order.
    for i in (*range(100, 0, -2), *range(1, 100, 2)):
        metrics.observe_request("acme", "a", "ok",
                                _timed(i / 100, i / 1000, i / 10, queue=i / 200, ttft_steps=i),
                                slo)
    metrics.observe_request("acme", "a", "rate_limited", None, slo)  # no latency: not counted
    (acme,) = metrics.tenant_latency()
    assert acme.tenant == "acme" and acme.requests == 100
    assert (acme.ttft.p50, acme.ttft.p99) == (0.5, 0.99)
    assert (acme.tpot.p50, acme.tpot.p99) == (0.05, 0.099)
    assert (acme.e2e.p50, acme.e2e.p99) == (5.0, 9.9)
    assert (acme.queue.p50, acme.queue.p99) == (0.25, 0.495)
    assert (acme.ttft_steps.p50, acme.ttft_steps.p99) == (50, 99)
    # Met: ttft <= 0.5 s and tpot <= 0.05 s, i.e. i <= 50.
    assert acme.slo == slo and acme.slo_attainment == 0.5


def test_tenant_latency_judges_only_completed_requests() -> None:
    metrics = GatewayMetrics()
    slo = Slo(ttft_ms=100, tpot_ms=10)
    metrics.observe_request("acme", "a", "ok", _timed(0.05, None, 0.05), slo)  # one token: met
    metrics.observe_request("acme", "a", "ok", _timed(0.05, 0.02, 0.5), slo)  # missed
    metrics.observe_request("acme", "a", "aborted", _timed(9.0, 9.0, 9.0), slo)  # not judged
    metrics.observe_request("acme", "a", "ok", _timed(None, None, None), slo)  # no token
    metrics.observe_request("beta", "a", "ok", _timed(0.01, 0.001, 0.1))  # no SLO
    acme, beta = metrics.tenant_latency()
    assert acme.requests == 4 and acme.slo_attainment == 0.5
    # Only requests that had the value count: the single token has no TPOT.
    assert (acme.tpot.p50, acme.tpot.p99) == (0.02, 9.0)
    assert (beta.tenant, beta.requests, beta.slo, beta.slo_attainment) == ("beta", 1, None, None)
    assert beta.ttft.p50 == beta.ttft.p99 == 0.01


def test_tenant_latency_window_keeps_the_latest_requests() -> None:
    metrics = GatewayMetrics(latency_window=10)
    assert metrics.latency_window == 10
    for i in range(1, 26):
        metrics.observe_request("acme", "a", "ok", _timed(float(i), None, float(i)),
                                Slo(ttft_ms=i * 1000, tpot_ms=i))
    (acme,) = metrics.tenant_latency()
    assert acme.requests == 10
    assert (acme.ttft.p50, acme.ttft.p99) == (20.0, 25.0)  # of 16..25
    assert acme.slo == Slo(ttft_ms=25_000, tpot_ms=25)  # the latest one
    assert acme.slo_attainment == 1.0
    with pytest.raises(ValueError):
        GatewayMetrics(latency_window=0)


def test_tenant_latency_windows_are_bounded_by_the_label_cap() -> None:
    metrics = GatewayMetrics(max_label_values=3, latency_window=5)
    for i in range(40):
        metrics.observe_request(f"t{i}", "a", "ok", _timed(0.1, 0.01, 1.0))
    summary = metrics.tenant_latency()
    assert [t.tenant for t in summary] == sorted(["t0", "t1", "t2", OTHER_LABEL])
    assert {t.tenant: t.requests for t in summary} == {"t0": 1, "t1": 1, "t2": 1,
                                                      OTHER_LABEL: 5}


def test_tenant_latency_under_concurrent_observers() -> None:
    metrics = GatewayMetrics(latency_window=100_000)

    def observe(tenant: str) -> None:
        for i in range(2000):
            metrics.observe_request(tenant, "a", "ok", _timed(i / 1000, 0.001, 1.0),
                                    Slo(ttft_ms=2000, tpot_ms=1000))  # all met

    threads = [threading.Thread(target=observe, args=(f"t{n % 2}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    summaries = []
    while any(thread.is_alive() for thread in threads):
        summaries.append(metrics.tenant_latency())  # reading meanwhile never fails
    for thread in threads:
        thread.join()
    final = metrics.tenant_latency()
    assert [(t.tenant, t.requests, t.slo_attainment) for t in final] == \
        [("t0", 8000, 1.0), ("t1", 8000, 1.0)]
    assert all(t.ttft.p50 is not None and t.ttft.p50 <= t.ttft.p99  # type: ignore[operator]
               for s in summaries for t in s)
