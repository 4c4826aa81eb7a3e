"""Fair scheduling between tenants (engine/fairness.py, scheduler.py), driven step by step
without a model (pure Python, a clock moved by hand).

The bound on service: when tenant f is admitted, its counter is the least of the
backlogged tenants'; from then on it grows only by what f's running requests receive, at
most ``max_num_seqs`` requests each costing at most ``prefill_cost * (P + T) * (1 + k) +
decode_cost * T`` (prompt P, output T, recomputed after each of at most k fair
preemptions), over f's weight. So for any two tenants backlogged throughout (a tenant
whose queue runs dry takes less, by its own demand, and may fall behind), at every step:

    |service(f) - service(g)| <= max_num_seqs * (p * (P + T) * (1 + k) + d * T) / min weight
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling import Clock, complete_step, drain_loads

from loraplex.config import SchedulerConfig
from loraplex.engine.fairness import LOGIT_BIAS_COST
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import AdapterRef, Request
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.share import Share
from loraplex.engine.slot_cache import AdapterSlotCache


def _setup(policy: str = "fair", max_seqs: int = 8, budget: int = 64, num_blocks: int = 512,
           max_loras: int = 2, **config: object) -> tuple[Scheduler, AdapterSlotCache, Clock]:
    adapters = AdapterSlotCache(max_loras, max_loras + 2,
                              load_from_disk=lambda ref: SimpleNamespace(rank=4, ref=ref),
                              install=lambda slot, adapter: None)
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      policy=policy, **config),  # type: ignore[arg-type]
                      KVCacheManager(num_blocks, 4), adapters, max_adapter_wait_s=1.0,
                      clock=clock)
    return sched, adapters, clock


def _request(rid: str, tenant: str | None, clock: Clock, prompt: int = 8, max_tokens: int = 8,
             weight: float = 1.0, priority: str = "interactive", adapter: str | None = None,
             kv: float | None = None) -> Request:
    # Distinct prompts: no prefix-cache hit between requests.
    tokens = [zlib.crc32(f"{rid}/{i}".encode()) % 1000 + 1 for i in range(prompt)]
    return Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   None if adapter is None else AdapterRef(adapter, adapter * 8, "/a"),
                   arrival_time=clock.now,
                   share=Share(tenant, weight, priority, kv))  # type: ignore[arg-type]


def _step(sched: Scheduler, adapters: AdapterSlotCache, clock: Clock,
          seconds: float = 0.1) -> SchedulerOutput:
    out = sched.schedule()
    complete_step(sched, out)
    drain_loads(adapters)
    clock.now += seconds
    return out


def _trace(out: SchedulerOutput) -> tuple[object, ...]:
    return (tuple((s.request.request_id, s.num_new_tokens) for s in out.scheduled),
            tuple(r.request_id for r in out.preempted), tuple(out.swap_in),
            tuple(out.swap_out))


workloads = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(1, 24),
                               st.sampled_from([None, "a", "b", "c"])),
                     min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(workloads, st.sampled_from(["recompute", "swap"]), st.integers(24, 200),
       st.floats(0.1, 50))
def test_one_tenant_schedules_exactly_as_fifo(requests: list[tuple[int, int, int, str | None]],
                                              mode: str, num_blocks: int,
                                              weight: float) -> None:
    """Step by step, the same batches, preemptions and swaps as the fifo policy."""
    traces = []
    for policy in ("fair", "fifo"):
        sched, adapters, clock = _setup(policy, max_seqs=6, budget=32, num_blocks=num_blocks,
                                        preemption_mode=mode)
        for name in "abc":  # loaded up front: a load's thread would race the steps
            adapters.load_now(AdapterRef(name, name * 8, "/a"))
        trace = []
        for step in range(400):
            for i, (arrival, prompt, max_tokens, adapter) in enumerate(requests):
                if arrival == step:
                    sched.add(_request(f"r{i}", "t", clock, prompt, max_tokens, weight,
                                       adapter=adapter))
            if step > 30 and not sched.has_unfinished():
                break
            trace.append(_trace(_step(sched, adapters, clock)))
        assert not sched.has_unfinished()
        assert sched.kv.all_free_or_cached()
        traces.append(trace)
    assert traces[0] == traces[1]


def _backlog_run(policy: str, weights: list[float], starts: list[int], shapes: list[tuple[int, int]],
                 steps: int, max_seqs: int = 8, check=None) -> tuple[Scheduler, list[float]]:
    """Tenants t0.. keep 2 * ``max_seqs`` requests waiting from their start step on, so
    each is backlogged at every step (more waits than one step can admit); ``shapes`` (prompt,
    max_tokens) are cycled through. ``check(sched, started)`` runs after every step."""
    sched, adapters, clock = _setup(policy, max_seqs=max_seqs, budget=64)
    counter = 0
    for step in range(steps):
        started = [f"t{i}" for i, s in enumerate(starts) if s <= step]
        for i, tenant in enumerate(started):
            while sum(r.share.tenant == tenant for r in sched.waiting) < 2 * max_seqs:
                prompt, max_tokens = shapes[counter % len(shapes)]
                sched.add(_request(f"{tenant}-{counter}", tenant, clock, prompt, max_tokens,
                                   weights[i]))
                counter += 1
        _step(sched, adapters, clock)
        if check is not None:
            check(sched, started)
    return sched, [sched.waiting.service(f"t{i}") for i in range(len(weights))]


def _bound(sched: Scheduler, weights: list[float], shapes: list[tuple[int, int]]) -> float:
    config = sched.config
    prompt = max(p for p, _ in shapes)
    output = max(t for _, t in shapes)
    per_request = (config.prefill_token_cost * (prompt + output) * (1 + config.max_fair_preemptions)
                   + config.decode_token_cost * output)
    return config.max_num_seqs * per_request / min(weights)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.25, 8), min_size=2, max_size=4),
       st.lists(st.integers(0, 60), min_size=4, max_size=4),
       st.lists(st.tuples(st.integers(1, 48), st.integers(1, 32)), min_size=1, max_size=6))
def test_backlogged_tenants_service_stays_within_the_bound(
        weights: list[float], starts: list[int], shapes: list[tuple[int, int]]) -> None:
    starts = starts[:len(weights)]
    worst = [0.0]

    def check(sched: Scheduler, started: list[str]) -> None:
        waiting = {r.share.tenant for r in sched.waiting}
        assert set(started) <= waiting  # every started tenant is still backlogged
        counters = [sched.waiting.service(t) for t in started]
        if len(counters) > 1:
            worst[0] = max(worst[0], max(counters) - min(counters))
        for request in sched.running:  # the thrash bound
            assert request.num_preemptions <= sched.config.max_fair_preemptions

    sched, _ = _backlog_run("fair", weights, starts, shapes, steps=250, check=check)
    assert worst[0] <= _bound(sched, weights, shapes)


def test_under_fifo_the_same_backlog_breaks_that_bound() -> None:
    """The check above can fail: oldest-first lets the first tenant's backlog run ahead."""
    shapes = [(8, 8)]
    gaps = []

    def check(sched: Scheduler, started: list[str]) -> None:
        if len(started) == 2:
            gaps.append(abs(sched.waiting.service("t0") - sched.waiting.service("t1")))

    # t0 queues 120 requests up front (FIFO serves them all before t1's first).
    sched, adapters, clock = _setup("fifo")
    for i in range(120):
        sched.add(_request(f"t0-{i}", "t0", clock, 8, 8))
    for step in range(150):
        if step == 5:
            sched.add(_request("t1-0", "t1", clock, 8, 8))
        _step(sched, adapters, clock)
        check(sched, ["t0", "t1"] if step >= 5 else ["t0"])
    assert max(gaps) > _bound(sched, [1.0, 1.0], shapes)


def test_a_late_tenant_is_admitted_at_once_and_not_credited_for_idle_time() -> None:
    sched, adapters, clock = _setup(max_seqs=8)
    for i in range(40):  # a backlog: the batch stays full
        sched.add(_request(f"a{i}", "a", clock, 16, 32))
    for _ in range(20):
        _step(sched, adapters, clock)
    assert len(sched.running) == 8
    a_service = sched.waiting.service("a")
    sched.add(_request("b0", "b", clock, 16, 4))
    # lifted to the active tenants' least counter: no credit for the 20 steps away
    assert sched.waiting.service("b") == a_service
    out = _step(sched, adapters, clock)
    assert "b0" in [s.request.request_id for s in out.scheduled]  # the step it arrived
    assert len(out.preempted) == 1 and out.preempted[0].share.tenant == "a"
    assert len(sched.running) == 8
    for _ in range(200):
        _step(sched, adapters, clock)
    assert not sched.has_unfinished() or sched.waiting.service("a") > 0
    assert sched.kv.all_free_or_cached() or sched.has_unfinished()


def test_weights_three_to_one_share_the_service_three_to_one() -> None:
    sched, service = _backlog_run("fair", [3.0, 1.0], [0, 0], [(8, 16), (24, 8)], steps=600)
    stats = {t.tenant: t for t in sched.tenant_stats()}
    cost = {name: sched.config.prefill_token_cost * t.prefill_tokens
            + sched.config.decode_token_cost * t.decode_tokens for name, t in stats.items()}
    assert 3 * 0.9 <= cost["t0"] / cost["t1"] <= 3 * 1.1


def test_interactive_work_goes_first_and_batch_work_waits_at_most_its_bound() -> None:
    sched, adapters, clock = _setup(max_seqs=4, max_batch_wait_s=5.0)
    for i in range(60):
        sched.add(_request(f"i{i}", "i", clock, 8, 8))
    sched.add(_request("b0", "b", clock, 8, 8, priority="batch"))
    started = None
    for step in range(100):
        out = _step(sched, adapters, clock, seconds=1.0)
        if "b0" in [s.request.request_id for s in out.scheduled]:
            started = step
            break
    # behind interactive work until it has waited 5 s (one step = 1 s), then at once
    assert started is not None and 5 <= started <= 6


def test_a_tenant_over_its_kv_cap_never_holds_more_than_the_cap() -> None:
    sched, adapters, clock = _setup(max_seqs=8, num_blocks=64)
    cap = int(0.25 * 64)
    for i in range(12):
        sched.add(_request(f"big{i}", "big", clock, 24, 16, kv=0.25))
        sched.add(_request(f"small{i}", "small", clock, 4, 8))
    for _ in range(400):
        _step(sched, adapters, clock)
        held = sum(sched.kv.num_blocks_held(r.request_id) for r in sched.running
                   if r.share.tenant == "big")
        assert held <= cap
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert sched.kv.all_free_or_cached()
    sched.kv.check_invariants()


def test_a_rare_adapter_is_still_not_starved_between_tenants() -> None:
    sched, adapters, clock = _setup(max_loras=1)
    sched.add(_request("rare", "b", clock, 4, 2, adapter="b"))
    started = None
    for step in range(200):
        sched.add(_request(f"a{step}", "a", clock, 4, 6, adapter="a"))
        out = _step(sched, adapters, clock)
        if "rare" in [s.request.request_id for s in out.scheduled]:
            started = clock.now
            break
    assert started is not None and started <= 1.0 + 0.1 * 10


def test_a_tenants_costly_options_are_charged_to_it() -> None:
    """Two backlogged tenants of equal weight, one biasing every request's logits: its
    decode tokens cost 1 + LOGIT_BIAS_COST in its counter, so it gets that much fewer."""
    sched, adapters, clock = _setup(max_seqs=8)
    counter = 0
    for _ in range(300):
        for tenant in ("plain", "biased"):
            while sum(r.share.tenant == tenant for r in sched.waiting) < 3:
                request = _request(f"{tenant}-{counter}", tenant, clock, 4, 16)
                if tenant == "biased":
                    request.params = SamplingParams(temperature=0.0, max_tokens=16,
                                                    logit_bias={5: 1.0})
                sched.add(request)
                counter += 1
        _step(sched, adapters, clock)
    stats = {t.tenant: t for t in sched.tenant_stats()}
    ratio = stats["plain"].decode_tokens / stats["biased"].decode_tokens
    assert 1 + LOGIT_BIAS_COST - 0.05 <= ratio <= 1 + LOGIT_BIAS_COST + 0.05, ratio


def test_swapped_requests_come_back_in_their_tenants_order() -> None:
    """The tenant with less service first; one tenant's (or equal ones') in the order they
    were swapped out."""
    sched, _, clock = _setup()
    a1, b1, a2 = (_request(rid, tenant, clock) for rid, tenant in
                  (("a1", "a"), ("b1", "b"), ("a2", "a")))
    sched.waiting.charge(a1, 100, 0)
    assert sched.waiting.fair_sorted([a1, b1, a2], clock.now, []) == [b1, a1, a2]
    assert sched.waiting.fair_sorted([a2, a1], clock.now, []) == [a2, a1]
    sched.waiting.charge(b1, 100, 0)
    assert sched.waiting.fair_sorted([a1, b1, a2], clock.now, []) == [a1, b1, a2]


def test_interactive_work_preempts_another_tenants_batch_work_above_its_share() -> None:
    """A tenant already holding its share still gets a seat from another tenant's running
    batch work (the adapter effect probe's) in the step it arrives; never from that
    tenant's interactive work, nor from batch work past its wait bound."""
    sched, adapters, clock = _setup(max_seqs=4, max_batch_wait_s=5.0)
    sched.add(_request("stream", "a", clock, 8, 64))
    _step(sched, adapters, clock)
    for i in range(3):
        sched.add(_request(f"probe{i}", "probe", clock, 8, 32, priority="batch"))
    _step(sched, adapters, clock)  # the batch is full: stream + 3 probe requests
    assert len(sched.running) == 4
    sched.add(_request("a1", "a", clock, 8, 8))
    out = _step(sched, adapters, clock)
    assert "a1" in [s.request.request_id for s in out.scheduled]
    assert [r.request_id for r in out.preempted] == ["probe2"]
    # Interactive work of a third tenant is not preempted for it.
    sched, adapters, clock = _setup(max_seqs=2)
    sched.add(_request("stream", "a", clock, 8, 64))
    sched.add(_request("other", "b", clock, 8, 64))
    _step(sched, adapters, clock)
    sched.add(_request("a1", "a", clock, 8, 8))
    out = _step(sched, adapters, clock)
    assert out.preempted == [] and "a1" not in [s.request.request_id for s in out.scheduled]
    # Batch work that has waited its bound ranks as interactive: not preempted for it.
    sched, adapters, clock = _setup(max_seqs=2, max_batch_wait_s=5.0)
    sched.add(_request("stream", "a", clock, 8, 200))
    sched.add(_request("late", "probe", clock, 8, 200, priority="batch"))
    _step(sched, adapters, clock)
    clock.now += 10.0
    sched.add(_request("a1", "a", clock, 8, 8))
    out = _step(sched, adapters, clock)
    assert out.preempted == []
