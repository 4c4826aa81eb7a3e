"""What the scheduler tests share: a clock they move by hand, and the engine's part of a
step played without a model."""

from __future__ import annotations

from loraplex.engine.request import RequestStatus
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.slot_cache import AdapterSlotCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def complete_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a forward: advance, append a token, finish at max."""
    for s in out.scheduled:
        r = s.request
        r.num_computed_tokens += s.num_new_tokens
        if s.samples:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)


def drain_loads(adapters: AdapterSlotCache) -> None:
    for fut in list(adapters._loading.values()):
        fut.result()
