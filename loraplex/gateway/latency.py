"""Each tenant's recent latencies, for the admin view: p50/p99 and SLO attainment.

Prometheus histograms answer "how many under a bucket bound" over all time; an operator
glancing at the admin page wants the percentiles of what happened lately. So each tenant
(by its capped metrics label, so the number of windows is bounded like the series) keeps
the last ``size`` finished requests' latencies, and a summary is computed from them when
asked: exact, over the window, by nearest rank.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from loraplex.engine.outputs import RequestMetrics


@dataclass(frozen=True)
class Slo:
    """A tenant's latency objectives: first token within ``ttft_ms``, and the output tokens
    after it at ``tpot_ms`` each or less on average."""

    ttft_ms: int
    tpot_ms: int


DEFAULT_WINDOW: Final = 1000

_N = TypeVar("_N", int, float)


def nearest_rank(sorted_values: Sequence[_N], percent: int) -> _N | None:
    """The ``percent``-th percentile (1..100) of ascending ``sorted_values`` by nearest
    rank: the smallest value with at least ``percent``% of the values at or below it, i.e.
    the ``ceil(percent / 100 * n)``-th (1-based). Always one of the values (never
    interpolated); ``None`` when there are none."""
    if not 1 <= percent <= 100:
        raise ValueError(f"percent must be in 1..100, got {percent}")
    if not sorted_values:
        return None
    rank = -(-percent * len(sorted_values) // 100)  # ceil, in integers: no float rounding
    return sorted_values[rank - 1]


@dataclass(frozen=True, slots=True)
class _Sample:
    ttft: float | None
    tpot: float | None
    e2e: float | None
    queue: float | None
    ttft_steps: int | None
    met: bool | None  # None: no SLO judged this request (not ok, or no first token)


@dataclass(frozen=True)
class Spread:
    """The p50 and p99 of one latency over a window (``None`` where it had no value)."""

    p50: float | None
    p99: float | None


@dataclass(frozen=True)
class StepSpread:
    """The p50 and p99 of a count of engine steps over a window."""

    p50: int | None
    p99: int | None


@dataclass(frozen=True)
class TenantLatency:
    """One tenant's window: how many requests it holds, the spread of each latency in
    seconds (TTFT also in engine steps), and the fraction of the requests judged against
    the SLO (``slo``: the latest one recorded) that met it."""

    tenant: str
    requests: int
    ttft: Spread
    tpot: Spread
    e2e: Spread
    queue: Spread
    ttft_steps: StepSpread
    slo: Slo | None
    slo_attainment: float | None  # met / (met + missed); None when none was judged


def _spread(values: list[float | None]) -> Spread:
    present = sorted(v for v in values if v is not None)
    return Spread(nearest_rank(present, 50), nearest_rank(present, 99))


class LatencyWindows:
    """The last ``size`` finished requests of each tenant. Thread-safe."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"the latency window must hold >= 1 request, got {size}")
        self.size = size
        self._lock = threading.Lock()
        self._windows: dict[str, deque[_Sample]] = {}
        self._slos: dict[str, Slo] = {}

    def add(self, tenant: str, metrics: RequestMetrics, met: bool | None,
            slo: Slo | None) -> None:
        """Records one finished request of ``tenant`` (a capped label), with whether it met
        ``slo`` where it was judged."""
        sample = _Sample(metrics.ttft, metrics.tpot, metrics.e2e, metrics.queue_time,
                         metrics.ttft_steps, met)
        with self._lock:
            window = self._windows.get(tenant)
            if window is None:
                window = self._windows[tenant] = deque(maxlen=self.size)
            window.append(sample)
            if slo is not None:
                self._slos[tenant] = slo

    def summary(self) -> list[TenantLatency]:
        """Every tenant's window summarised, sorted by tenant."""
        with self._lock:  # copied under the lock, summarised outside it
            windows = {tenant: list(window) for tenant, window in self._windows.items()}
            slos = dict(self._slos)
        out = []
        for tenant in sorted(windows):
            samples = windows[tenant]
            steps = sorted(s.ttft_steps for s in samples if s.ttft_steps is not None)
            judged = [s.met for s in samples if s.met is not None]
            out.append(TenantLatency(
                tenant=tenant, requests=len(samples),
                ttft=_spread([s.ttft for s in samples]),
                tpot=_spread([s.tpot for s in samples]),
                e2e=_spread([s.e2e for s in samples]),
                queue=_spread([s.queue for s in samples]),
                ttft_steps=StepSpread(nearest_rank(steps, 50), nearest_rank(steps, 99)),
                slo=slos.get(tenant),
                slo_attainment=sum(judged) / len(judged) if judged else None))
        return out
