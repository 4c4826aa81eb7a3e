"""Scheduler policy, driven step by step without a model (pure Python)."""

from __future__ import annotations

from types import SimpleNamespace

from scheduling import Clock, complete_step, drain_loads

from loraplex.config import SchedulerConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import AdapterRef, Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.slot_cache import AdapterSlotCache
from loraplex.errors import AdapterError


def _setup(max_loras: int = 2, num_blocks: int = 256, budget: int = 64,
           max_seqs: int = 16) -> tuple[Scheduler, AdapterSlotCache, Clock]:
    installed: dict[int, object] = {}
    adapters = AdapterSlotCache(max_loras, max_loras + 2,
                              load_from_disk=lambda ref: SimpleNamespace(rank=4, ref=ref),
                              install=installed.__setitem__)
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                      KVCacheManager(num_blocks, 4), adapters, max_adapter_wait_s=1.0,
                      clock=clock)
    return sched, adapters, clock


def _ref(name: str) -> AdapterRef:
    return AdapterRef(name, name * 8, f"/adapters/{name}")


def _request(rid: str, n_prompt: int, adapter: str | None, clock: Clock,
             max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   None if adapter is None else _ref(adapter), arrival_time=clock.now)


def test_decodes_never_wait_behind_a_long_prefill() -> None:
    sched, adapters, clock = _setup(budget=8)
    for i in range(3):
        sched.add(_request(f"d{i}", 2, None, clock, max_tokens=50))
    sched.schedule()  # the three short prompts
    for r in sched.running:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(7)
    sched.add(_request("long", 100, None, clock))
    for _ in range(10):
        out = sched.schedule()
        ids = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert all(ids.get(f"d{i}") == 1 for i in range(3)), ids
        assert ids.get("long") == 5  # the rest of the budget, as a prefill chunk
        complete_step(sched, out)
    sched.kv.check_invariants()


def test_never_more_adapters_in_flight_than_slots() -> None:
    sched, adapters, clock = _setup(max_loras=2)
    names = ["a", "b", "c", "d"]
    for i in range(40):
        sched.add(_request(f"r{i}", 3 + i % 5, names[i % 4], clock, max_tokens=3 + i % 4))
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        in_flight = {r.adapter.key for r in sched.running if r.adapter is not None}
        assert len(in_flight) <= 2
        assert len({s.lora_slot for s in out.scheduled}) <= 2
        complete_step(sched, out)
        drain_loads(adapters)
        clock.now += 0.01
    assert not sched.has_unfinished()
    assert sched.kv.all_free_or_cached()
    assert all(p == 0 for p in adapters.stats().pins)


def test_a_rare_adapter_is_not_starved() -> None:
    """One slot, a steady stream of adapter-A requests, and one request for B: once B has
    waited past the limit, no new A request is admitted until B holds the slot."""
    sched, adapters, clock = _setup(max_loras=1)
    sched.add(_request("a0", 4, "a", clock, max_tokens=6))
    sched.add(_request("b", 4, "b", clock, max_tokens=2))
    b_started = None
    for step in range(200):
        sched.add(_request(f"a{step + 1}", 4, "a", clock, max_tokens=6))
        out = sched.schedule()
        if any(s.request.request_id == "b" for s in out.scheduled) and b_started is None:
            b_started = clock.now
        complete_step(sched, out)
        drain_loads(adapters)
        clock.now += 0.1
        if b_started is not None:
            break
    assert b_started is not None, "request b starved"
    assert b_started <= 1.0 + 0.1 * 8  # the wait limit plus the running A requests draining


def test_abort_releases_everything() -> None:
    sched, adapters, clock = _setup()
    reqs = [_request(f"r{i}", 9, "a" if i % 2 else None, clock, max_tokens=20)
            for i in range(6)]
    for r in reqs:
        sched.add(r)
    for _ in range(3):
        complete_step(sched, sched.schedule())
        drain_loads(adapters)
    for r in reqs:
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    assert sched.kv.all_free_or_cached()
    assert all(p == 0 for p in adapters.stats().pins)
    sched.kv.check_invariants()


def test_waiting_adapters_are_loaded_once_when_more_are_queued_than_the_host_holds() -> None:
    # 2 slots, a host cache of 4, 12 queued requests on 12 adapters: loading all 12 ahead
    # would evict the first before their requests run, and load them again.
    sched, adapters, clock = _setup(max_loras=2)
    for i in range(12):
        sched.add(_request(f"r{i}", 3, f"x{i:02d}", clock, max_tokens=3))
    for _ in range(300):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        complete_step(sched, out)
        drain_loads(adapters)
        clock.now += 0.01
    assert not sched.has_unfinished()
    assert adapters.stats().num_disk_loads == 12
    assert sched.kv.all_free_or_cached()


def test_speculative_slots_fit_the_budget_and_never_preempt() -> None:
    sched, _, clock = _setup(num_blocks=3, budget=5)
    a, b = _request("a", 3, None, clock, max_tokens=8), _request("b", 3, None, clock,
                                                                  max_tokens=8)
    for r in (a, b):
        sched.add(r)
    complete_step(sched, sched.schedule())  # both prompts: a block each, one token each
    # a wants 4 proposals: the budget of 5 leaves it 3 (plus its own token) once b has
    # its one token.
    out = sched.schedule({"a": 4})
    assert [(s.request.request_id, s.num_new_tokens, s.num_spec_tokens)
            for s in out.scheduled] == [("a", 4, 3), ("b", 1, 0)]
    assert sched.kv.num_tokens("a") == 7 and not out.preempted
    sched.kv.trim("a", 4)  # what the engine does once a kept one proposal
    a.num_computed_tokens, b.num_computed_tokens = 4, 4
    a.output_token_ids += [7, 7]
    b.output_token_ids.append(7)
    # Now a needs a new block for its next token and b's proposals would need one more:
    # the pool has one free block, so b runs without proposals and nobody is preempted.
    out = sched.schedule({"b": 4})
    assert [(s.request.request_id, s.num_spec_tokens) for s in out.scheduled] == [
        ("a", 0), ("b", 0)]
    assert not out.preempted
    sched.kv.check_invariants()


def _ids(out: SchedulerOutput) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def test_a_drain_still_admits_requests_that_end_within_their_running_adapter() -> None:
    """While a request starves for the only slot, a request of the adapter already in it
    joins the slot if it ends no later than the slot's running requests may: within their
    max_tokens left, its whole prompt this step. The starving request gets the slot at the
    same step as if nothing had joined."""
    sched, adapters, clock = _setup(max_loras=1, budget=64)
    for name in ("a", "b"):
        adapters.load_now(_ref(name))
    sched.add(_request("a0", 4, "a", clock, max_tokens=10))
    out = sched.schedule()
    assert _ids(out) == ["a0"]
    complete_step(sched, out)  # a0 may generate 9 more tokens
    for rid, n_prompt, adapter, max_tokens in (
            ("b", 4, "b", 2),  # no slot for it: it starves once the clock moves on
            ("a1", 4, "a", 9),  # ends with a0
            ("a2", 4, "a", 10),  # would end one step after a0: waits
            ("a3", 70, "a", 3),  # its prompt does not fit what is left of the budget
            ("base", 4, None, 20)):  # pins no slot
        sched.add(_request(rid, n_prompt, adapter, clock, max_tokens=max_tokens))
    clock.now = 5.0
    out = sched.schedule()
    assert _ids(out) == ["a0", "a1", "base"]
    complete_step(sched, out)
    step, b_step = 2, None
    while sched.has_unfinished() and step < 100:
        step += 1
        out = sched.schedule()
        if "b" in _ids(out) and b_step is None:
            b_step = step
            assert "a2" not in {r.request_id for r in sched.running}
        complete_step(sched, out)
    # a0 took its 10th token at step 10 and a1 its 9th with it: b starts at step 11.
    assert b_step == 11
    assert not sched.has_unfinished()
    assert sched.kv.all_free_or_cached()
    assert all(p == 0 for p in adapters.stats().pins)


def _steps(requests: list[tuple[str, int, str, int]], max_loras: int, budget: int,
           seconds_per_step: float) -> tuple[int, dict[str, int]]:
    """Steps to finish ``requests`` (id, prompt, adapter, max_tokens), queued together, and
    each one's first step."""
    sched, adapters, clock = _setup(max_loras=max_loras, budget=budget)
    for _, _, name, _ in requests:
        adapters.load_now(_ref(name))
    for rid, n_prompt, name, max_tokens in requests:
        sched.add(_request(rid, n_prompt, name, clock, max_tokens=max_tokens))
    step, first = 0, {}
    while sched.has_unfinished():
        step += 1
        out = sched.schedule()
        for rid in _ids(out):
            first.setdefault(rid, step)
        complete_step(sched, out)
        clock.now += seconds_per_step
        assert step < 1000
    assert sched.kv.all_free_or_cached()
    return step, first


def test_a_slow_engine_takes_as_many_steps_as_a_fast_one_under_slot_pressure() -> None:
    """Longest first (as LLM.generate queues a batch) over 3 adapters and 2 slots. When each
    step takes longer than the wait limit, every request waiting for a slot starves from
    the second step on; the drain must not hold back the requests of the running adapters
    (it did: 62 steps instead of 38, a1 and b1 starting at steps 29 and 39 instead of 2)."""
    requests = [("a0", 8, "a", 30), ("b0", 8, "b", 28), ("c0", 8, "c", 10),
                ("a1", 8, "a", 25), ("b1", 8, "b", 24), ("c1", 8, "c", 8)]
    fast, fast_first = _steps(requests, max_loras=2, budget=16, seconds_per_step=0.0)
    slow, slow_first = _steps(requests, max_loras=2, budget=16, seconds_per_step=10.0)
    assert fast == slow == 38
    assert slow_first == fast_first
    assert slow_first["c0"] == 29  # when b0's slot frees: its wait is bounded as before


def test_a_swapped_request_whose_adapter_was_deleted_fails_alone() -> None:
    # Its adapter deleted (host copy dropped, files gone) while it was swapped out: the
    # reload failed inside schedule() and had stopped the engine for every request.
    deleted: set[str] = set()

    def load(ref: AdapterRef) -> object:
        if ref.adapter_id in deleted:
            raise AdapterError(f"adapter {ref.adapter_id}: files are gone")
        return SimpleNamespace(rank=4, ref=ref)

    adapters = AdapterSlotCache(2, 4, load_from_disk=load, install=lambda slot, a: None)
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      preemption_mode="swap"),
                      KVCacheManager(12, 4, num_host_blocks=32), adapters,
                      max_adapter_wait_s=1.0, clock=clock)
    for i in range(2):
        sched.add(_request(f"base{i}", 8, None, clock, max_tokens=24))
    sched.add(_request("x", 8, "a", clock, max_tokens=24))  # the newest: the victim
    adapters.prefetch(_ref("a"))
    drain_loads(adapters)
    failed: list[tuple[Request, AdapterError]] = []
    for _ in range(200):
        out = sched.schedule()
        failed.extend(out.failed)
        complete_step(sched, out)
        for load in list(adapters._loading.values()):
            load.exception()  # waits; a failed load is the scheduler's to report
        if sched.swapped and not deleted:
            assert sched.swapped[0].request_id == "x"
            deleted.add("a")
            adapters.forget(_ref("a").key)
        if not sched.has_unfinished():
            break
    assert deleted, "x was never swapped out"
    # Forgotten with no weights kept for it (the engine keeps them for requests in flight,
    # tests/engine/test_adapter_deletion.py): never read again, it fails as deleted.
    assert [(r.request_id, "was deleted" in str(e)) for r, e in failed] == [("x", True)]
    assert not sched.has_unfinished()  # the base requests ran to their end
    assert sched.kv.num_free_blocks() == 12
    sched.kv.check_invariants()


def test_without_chunked_prefill_a_recomputed_request_past_the_budget_still_runs() -> None:
    # Preempted by recompute after some outputs, its prompt and outputs together exceed
    # max_num_batched_tokens; it had waited at the head of the queue, and everything
    # behind it, for good.
    adapters = AdapterSlotCache(2, 4, load_from_disk=lambda ref: None,
                              install=lambda slot, a: None)
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=9,
                                      enable_chunked_prefill=False),
                      KVCacheManager(8, 4, enable_prefix_caching=False), adapters,
                      max_adapter_wait_s=1.0, clock=clock)
    for i in range(2):
        sched.add(_request(f"r{i}", 8, None, clock, max_tokens=20))
    preempted: set[str] = set()
    for _ in range(300):
        out = sched.schedule()
        preempted.update(r.request_id for r in out.preempted)
        complete_step(sched, out)
        if not sched.has_unfinished():
            break
    assert preempted, "nothing was preempted"
    assert not sched.has_unfinished()
    sched.kv.check_invariants()
