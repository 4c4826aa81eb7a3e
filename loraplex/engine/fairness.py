"""Whose request is admitted next: tenant-fair queues. Pure Python (no torch).

The Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024), made to fit our scheduler:

- Every tenant has a counter of the service it has received: each token the scheduler
  gives one of its sequences adds ``prefill_cost`` (a prompt or recomputed token) or
  ``decode_cost`` (a decoded or speculative token; more with a grammar or a logit_bias,
  ``option_cost``), divided by the tenant's weight.
- Waiting requests sit in one FIFO queue per (tenant, class). Admission tries interactive
  queues before batch ones and, within a class, the queue whose tenant has the least
  counter; the counters move as requests are admitted in the step, so one step's
  admissions interleave tenants. A batch request that has waited ``max_batch_wait_s`` is
  ranked as interactive: batch work waits at most that long behind interactive work.
- A tenant that becomes active (nothing of it waiting, running or swapped) has its counter
  lifted to the least counter among the active tenants (to the largest counter of all
  when none is active): it is served at once, but not credited for the time it was away.

With one tenant, or the ``fifo`` policy, there is one queue and admission is the arrival
order, exactly as before tenants existed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from loraplex.engine.request import Request

# What a decoded token of a request with these options costs beyond a plain one, in
# plain decode tokens: what the option adds to a step on the demo model, over the rows
# that carry it (benchmarks/option_cost.py; docs/benchmarks.md, "Per-token options": a
# grammar 1.15x and a full logit_bias 1.09x the step with 16 of 24 rows carrying it).
# The other options cost a step under 2 %: not charged.
GRAMMAR_COST = 0.25
LOGIT_BIAS_COST = 0.15


def option_cost(request: Request) -> float:
    """The decode-token cost factor of the request's options (1: a plain request)."""
    params = request.params
    return (1.0 + (GRAMMAR_COST if params.grammar is not None else 0.0)
            + (LOGIT_BIAS_COST if params.logit_bias else 0.0))


@dataclass(frozen=True)
class TenantStats:
    """One tenant as the scheduler sees it now (``EngineStats.tenants``)."""

    tenant: str
    weight: float
    num_waiting: int
    num_running: int
    num_swapped: int
    prefill_tokens: int  # service received since the engine started
    decode_tokens: int
    service: float  # the counter: weighted tokens / weight, lifted when it came back
    kv_blocks: int  # held by its running requests


_Key = tuple[str | None, str]  # (tenant, class)


def _seats(running: Iterable[Request]) -> dict[str | None, float]:
    """Each tenant's running sequences over its weight (ties between equal counters)."""
    seats: dict[str | None, float] = {}
    for request in running:
        tenant = request.share.tenant
        seats[tenant] = seats.get(tenant, 0.0) + 1 / request.share.weight
    return seats


class TenantQueues:
    """The waiting requests, by (tenant, class), and each tenant's service counter.

    Iterating gives every waiting request (queue by queue); ``order`` gives them in the
    order admission tries them.
    """

    def __init__(self, fair: bool = True, prefill_cost: float = 1.0,
                 decode_cost: float = 1.0, max_batch_wait_s: float = 30.0) -> None:
        self.fair = fair
        self.prefill_cost = prefill_cost
        self.decode_cost = decode_cost
        self.max_batch_wait_s = max_batch_wait_s
        self._queues: dict[_Key, deque[Request]] = {}
        self._counters: dict[str | None, float] = {}
        self._weights: dict[str | None, float] = {}
        self._tokens: dict[str | None, list[int]] = {}  # [prefill, decode]

    # --- the queues --------------------------------------------------------------------

    def _key(self, request: Request) -> _Key:
        if not self.fair:
            return (None, "interactive")
        return (request.share.tenant, request.share.priority)

    def append(self, request: Request) -> None:
        self._queues.setdefault(self._key(request), deque()).append(request)

    def appendleft(self, request: Request) -> None:
        """Back at the head of its tenant's queue (preempted: it keeps its place)."""
        self._queues.setdefault(self._key(request), deque()).appendleft(request)

    def remove(self, request: Request) -> None:
        key = self._key(request)
        queue = self._queues[key]
        queue.remove(request)
        if not queue:  # an empty queue goes: ``tenants`` and ``bool`` read the keys
            del self._queues[key]

    def __contains__(self, request: object) -> bool:
        return any(request in queue for queue in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        for queue in list(self._queues.values()):
            yield from queue

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def tenants(self) -> set[str | None]:
        return {tenant for tenant, _ in self._queues}

    # --- the counters ------------------------------------------------------------------

    def service(self, tenant: str | None) -> float:
        return self._counters.get(tenant, 0.0)

    def activate(self, request: Request, active: Iterable[str | None]) -> None:
        """A request of a tenant that has nothing waiting, running or swapped arrives:
        its counter is lifted (see the module's docstring). ``active``: the tenants that
        have something."""
        tenant = request.share.tenant
        self._weights[tenant] = request.share.weight
        live = [self._counters.get(t, 0.0) for t in set(active) if t != tenant]
        floor = min(live) if live else max(self._counters.values(), default=0.0)
        self._counters[tenant] = max(self._counters.get(tenant, 0.0), floor)

    def charge(self, request: Request, num_prefill: int, num_decode: int) -> None:
        tenant = request.share.tenant
        # A request's costly options are charged to its own tenant, which then slows.
        cost = self.prefill_cost * num_prefill \
            + self.decode_cost * num_decode * (option_cost(request) if num_decode else 1.0)
        self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / request.share.weight
        tokens = self._tokens.setdefault(tenant, [0, 0])
        tokens[0] += num_prefill
        tokens[1] += num_decode

    # --- the order ---------------------------------------------------------------------

    def is_batch(self, request: Request, now: float) -> bool:
        """Ranked behind interactive work: a batch request that has not yet waited its
        bound."""
        return (self.fair and request.share.priority == "batch"
                and now - request.arrival_time < self.max_batch_wait_s)

    def order(self, now: float, running: Iterable[Request] = ()) -> Iterator[Request]:
        """The waiting requests in the order admission tries them. Each queue's rank is
        read when its next request's turn comes, so a tenant charged for an admission
        in between moves back. Between equal counters (a tenant just lifted), the tenant
        with fewer ``running`` sequences per weight goes first. The caller may remove the
        request it was given."""
        snapshots = {key: list(queue) for key, queue in self._queues.items()}
        cursors = dict.fromkeys(snapshots, 0)
        seats = _seats(running) if len(cursors) > 1 else {}
        while cursors:
            key = (next(iter(cursors)) if len(cursors) == 1 else
                   min(cursors, key=lambda k: self._rank(snapshots[k][cursors[k]], now,
                                                         seats)))
            index = cursors[key]
            if index + 1 < len(snapshots[key]):
                cursors[key] = index + 1
            else:
                del cursors[key]
            yield snapshots[key][index]

    def fair_sorted(self, requests: Iterable[Request], now: float,
                    running: Iterable[Request]) -> list[Request]:
        """``requests`` (swapped out, say) in the order their tenants' turns come: class,
        then counter, then running sequences per weight; ties keep the given order (so
        with one tenant nothing moves)."""
        requests = list(requests)
        if len({r.share.tenant for r in requests}) <= 1 and not any(
                self.is_batch(r, now) for r in requests):
            return requests
        seats = _seats(running)
        return sorted(requests, key=lambda r: self._rank(r, now, seats)[:3])

    def _rank(self, request: Request, now: float,
              seats: dict[str | None, float]) -> tuple[bool, float, float, float]:
        tenant = request.share.tenant
        return (self.is_batch(request, now), self._counters.get(tenant, 0.0),
                seats.get(tenant, 0.0), request.arrival_time)

    # --- the view ----------------------------------------------------------------------

    def stats(self, running: Iterable[Request], swapped: Iterable[Request],
              kv_blocks: dict[str | None, int]) -> tuple[TenantStats, ...]:
        waiting: dict[str | None, int] = {}
        for (tenant, _), queue in self._queues.items():
            waiting[tenant] = waiting.get(tenant, 0) + len(queue)
        num_running: dict[str | None, int] = {}
        for request in running:
            t = request.share.tenant
            num_running[t] = num_running.get(t, 0) + 1
        num_swapped: dict[str | None, int] = {}
        for request in swapped:
            t = request.share.tenant
            num_swapped[t] = num_swapped.get(t, 0) + 1
        tenants = set(self._tokens) | set(waiting) | set(num_running) | set(num_swapped)
        return tuple(
            TenantStats(tenant="" if t is None else t, weight=self._weights.get(t, 1.0),
                        num_waiting=waiting.get(t, 0), num_running=num_running.get(t, 0),
                        num_swapped=num_swapped.get(t, 0),
                        prefill_tokens=self._tokens.get(t, [0, 0])[0],
                        decode_tokens=self._tokens.get(t, [0, 0])[1],
                        service=self._counters.get(t, 0.0), kv_blocks=kv_blocks.get(t, 0))
            for t in sorted(tenants, key=lambda t: "" if t is None else t))
