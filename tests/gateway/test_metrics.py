"""Prometheus metrics: values as rendered, bounded label cardinality, no shared state."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loraplex.engine.outputs import RequestMetrics
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
