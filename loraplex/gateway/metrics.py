"""Prometheus metrics for GET /metrics, held in one object with its own registry.

Nothing is registered globally or at import time: each ``GatewayMetrics`` owns a
``CollectorRegistry``, so tests and several apps in one process never collide.

Label values are bounded so a tenant with many adapters (or a bug passing raw input)
cannot blow up the series count: each of ``tenant``, ``adapter`` and the engine's
``replica`` keeps at most ``max_label_values`` distinct values (first come, first kept) and
maps the rest to ``"other"``; ``status`` must be one of ``REQUEST_STATUSES``. The engine's
series are in ``engine_metrics``. Beside the series, each tenant label keeps a window of its
latest requests' latencies (``latency``) for the admin view's percentiles.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from loraplex.engine.outputs import RequestMetrics
from loraplex.engine.stats import EngineStats
from loraplex.gateway.engine_metrics import EngineMetrics
from loraplex.gateway.latency import DEFAULT_WINDOW, LatencyWindows, Slo, TenantLatency

OTHER_LABEL: Final = "other"

REQUEST_STATUSES: Final = (
    "ok",  # completed (2xx)
    "client_error",  # refused as invalid, unauthorised, forbidden, not found (4xx)
    "rate_limited",  # 429 from the tenant's limits
    "overloaded",  # the engine's queue was full (503)
    "aborted",  # the client went away mid-request
    "server_error",  # anything else (5xx)
)

STEP_BUCKETS: Final = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TTFT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def status_for_http(code: int) -> str:
    """The request status label for an HTTP status code."""
    if code < 400:
        return "ok"
    if code == 429:
        return "rate_limited"
    if code == 503:
        return "overloaded"
    if code < 500:
        return "client_error"
    return "server_error"


class _CappedLabel:
    """Keeps the first ``max_values`` distinct values of one label; the rest become other."""

    def __init__(self, max_values: int) -> None:
        self._max_values = max_values
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self._max_values and value != OTHER_LABEL:
                self._seen.add(value)
                return value
        return OTHER_LABEL


class GatewayMetrics:
    """Every metric the gateway exports, registered in its own ``CollectorRegistry``."""

    def __init__(self, max_label_values: int = 100, namespace: str = "loraplex",
                 latency_window: int = DEFAULT_WINDOW) -> None:
        if max_label_values < 1:
            raise ValueError(f"max_label_values must be >= 1, got {max_label_values}")
        self.registry = CollectorRegistry(auto_describe=True)
        # Keyed by the capped tenant label: at most max_label_values + 1 windows.
        self._latency = LatencyWindows(latency_window)
        self._tenant_label = _CappedLabel(max_label_values)
        self._adapter_label = _CappedLabel(max_label_values)
        reg = self.registry
        ns = namespace

        self.requests = Counter(
            "requests",
            "Requests finished, by tenant, adapter and status.",
            ["tenant", "adapter", "status"],
            namespace=ns,
            registry=reg,
        )

        def by_tenant(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["tenant"], namespace=ns, registry=reg,
                             buckets=buckets)

        self.ttft = by_tenant(
            "time_to_first_token_seconds",
            "Time from arrival to the first output token, by tenant.",
            TTFT_BUCKETS)
        self.tpot = by_tenant(
            "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request, by tenant.",
            TPOT_BUCKETS)
        self.e2e = by_tenant(
            "e2e_request_latency_seconds",
            "Time from arrival to the last output token, by tenant.",
            E2E_BUCKETS)
        self.queue = by_tenant(
            "queue_time_seconds",
            "Time from arrival until first scheduled, by tenant.",
            TTFT_BUCKETS)
        self.ttft_steps = by_tenant(
            "time_to_first_token_steps",
            "Engine steps from arrival to the first output token (1: the first step after "
            "it arrived), by tenant: the scheduler's latency, free of the steps' length.",
            STEP_BUCKETS)
        self.slo = Counter(
            "slo_requests",
            "Finished requests by tenant and whether they met the tenant's TTFT and TPOT "
            "SLOs (result met or missed): goodput is met over all.",
            ["tenant", "result"],
            namespace=ns,
            registry=reg,
        )
        self._engine_series = EngineMetrics(reg, ns, _CappedLabel(max_label_values),
                                            _CappedLabel(max_label_values),
                                            _CappedLabel(max_label_values))

    def observe_request(
        self,
        tenant: str,
        adapter: str,
        status: str,
        metrics: RequestMetrics | None = None,
        slo: Slo | None = None,
    ) -> None:
        """Records one finished request.

        ``tenant`` and ``adapter`` are registry names, not raw input; ``status`` is one of
        ``REQUEST_STATUSES`` (``ValueError`` otherwise). Latencies that do not apply (no
        token produced, a single output token) are ``None`` and are not observed. With
        ``slo``, a completed request counts as met or missed against it. A request with
        ``metrics`` also enters its tenant's latency window (``tenant_latency``).
        """
        if status not in REQUEST_STATUSES:
            raise ValueError(f"unknown request status {status!r}; one of {REQUEST_STATUSES}")
        label = self._tenant_label(tenant)
        self.requests.labels(
            tenant=label,
            adapter=self._adapter_label(adapter),
            status=status,
        ).inc()
        if metrics is None:
            return
        ttft_s, tpot_s, e2e_s = metrics.ttft, metrics.tpot, metrics.e2e
        if metrics.queue_time is not None:
            self.queue.labels(tenant=label).observe(metrics.queue_time)
        if metrics.ttft_steps is not None:
            self.ttft_steps.labels(tenant=label).observe(metrics.ttft_steps)
        if ttft_s is not None:
            self.ttft.labels(tenant=label).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(tenant=label).observe(tpot_s)
        if e2e_s is not None:
            self.e2e.labels(tenant=label).observe(e2e_s)
        met: bool | None = None
        if slo is not None and status == "ok" and ttft_s is not None:
            met = ttft_s * 1000 <= slo.ttft_ms and (tpot_s or 0.0) * 1000 <= slo.tpot_ms
            self.slo.labels(tenant=label, result="met" if met else "missed").inc()
        self._latency.add(label, metrics, met, slo)

    @property
    def latency_window(self) -> int:
        """How many of each tenant's latest requests ``tenant_latency`` summarises."""
        return self._latency.size

    def tenant_latency(self) -> list[TenantLatency]:
        """Per tenant label, sorted: the p50 and p99 of each latency over its window of
        latest requests (nearest rank, see ``latency.nearest_rank``) and the fraction of
        them that met the SLO (``None`` when none was judged)."""
        return self._latency.summary()

    def observe_engine(self, replicas: Sequence[EngineStats]) -> None:
        """Sets the engine's series from one snapshot of each replica (see
        ``EngineMetrics.observe``)."""
        self._engine_series.observe(replicas)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Observation:
    """Labels of one request's metrics sample, recorded once."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self.tenant = "unauthenticated"
        self.adapter = "none"
        # Set once a Job owns the request: it records the sample when the request really
        # ends, which for a stream is long after the handler returned.
        self.delegated = False
        self._done = False

    def record(self, status: str, metrics: RequestMetrics | None = None,
               slo: Slo | None = None) -> None:
        if self._done:
            return
        self._done = True
        self._metrics.observe_request(self.tenant, self.adapter, status, metrics=metrics,
                                      slo=slo)

    def record_http(self, status_code: int) -> None:
        self.record(status_for_http(status_code))
