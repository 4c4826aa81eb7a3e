"""Decides what runs each step. Pure Python (no torch).

Policy, per step, under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. Running requests first, oldest first: a decode takes one token, a prefill takes the next
   chunk of its prompt that fits the remaining budget (chunked prefill), so running decodes
   never wait behind a long prompt. When blocks run out, the newest running request is
   preempted — by recompute (blocks freed, requeued at the front of the waiting queue; its
   prefix may hit the cache on return) or, in ``swap`` mode, by copying its blocks to the
   host pool (recompute when the pool is full).
2. Swapped requests come back (oldest first) when nothing was preempted this step.
3. Waiting requests are admitted oldest first while budget, sequences and blocks allow.
   Adapters: at most ``max_loras`` distinct adapters are in flight (every running request
   pins its adapter's slot). A request whose adapter cannot get a slot, or is still being
   read from disk (that read runs in the background), is skipped so the requests behind it
   are not blocked. Skipping has a limit: once a request has waited ``max_adapter_wait_s``
   for a slot, the running adapters drain to free a slot for it (it cannot starve): until
   it has one, a request behind it that would pin a slot is admitted only if it joins an
   adapter that running requests pin already, with a ``max_tokens`` within the most that
   one of them may still generate, and its whole prompt fits the step. It then ends no
   later than they may, so no slot is held longer than it could be without it, and the
   starving request's wait keeps its bound; without that exception the drain left every
   other request of a running adapter waiting behind it (on a slow machine, where each
   step takes seconds, all of them, as soon as the slots filled).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.config import SchedulerConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import AdapterKey, AdapterRef, Request, RequestStatus
from loraplex.errors import AdapterError


class AdapterSlots(Protocol):
    max_cpu_loras: int  # adapters the host cache holds

    def can_acquire(self, key: AdapterKey) -> bool: ...
    def is_ready(self, ref: AdapterRef) -> bool: ...
    def failure(self, ref: AdapterRef) -> AdapterError | None: ...
    def prefetch(self, ref: AdapterRef) -> None: ...
    def acquire(self, ref: AdapterRef) -> int: ...
    def release(self, key: AdapterKey) -> None: ...


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # speculative tokens included
    lora_slot: int
    # Slots for proposed tokens after the sequence's last token, to be verified.
    num_spec_tokens: int = 0
    # Captured when scheduled: the request's own counter moves on after the step.
    num_computed_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_computed_tokens", self.request.num_computed_tokens)

    @property
    def token_ids(self) -> list[int]:
        """The known tokens computed this step (the proposals follow them)."""
        start = self.num_computed_tokens
        return self.request.all_token_ids[start:start + self.num_new_tokens
                                          - self.num_spec_tokens]

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so a token is sampled)."""
        return (self.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens
                == self.request.num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, AdapterError]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, adapters: AdapterSlots,
                 max_adapter_wait_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.adapters = adapters
        self.max_adapter_wait_s = max_adapter_wait_s
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self._slot_of_request: dict[str, int] = {}
        self.num_swap_outs = 0

    # --- queue management --------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request, slot: int) -> None:
        """Adds an already-admitted sequence (a fork of a running one)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._slot_of_request[request.request_id] = slot

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_unfinished(self) -> bool:
        return self.num_unfinished > 0

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is and releases all it holds."""
        assert status.is_finished
        if request.status.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
            self._unpin(request)
        elif request in self.swapped:
            self.swapped.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        request.status = status
        request.finish_time = self.clock()

    def slot_of(self, request: Request) -> int:
        return self._slot_of_request.get(request.request_id, -1)

    def _pin(self, request: Request) -> int:
        slot = -1 if request.adapter is None else self.adapters.acquire(request.adapter)
        self._slot_of_request[request.request_id] = slot
        return slot

    def _unpin(self, request: Request) -> None:
        if self._slot_of_request.pop(request.request_id, -1) >= 0:
            assert request.adapter is not None
            self.adapters.release(request.adapter.key)

    # --- the step ----------------------------------------------------------------------

    def schedule(self, num_spec: Mapping[str, int] | None = None) -> SchedulerOutput:
        """This step's work. ``num_spec``: speculative tokens wanted, by request id, for
        running decodes; each gets slots for as many as the budget (once every running
        request behind it has a token) and free blocks allow, never preempting anyone for
        them."""
        out = SchedulerOutput(scheduled=[])
        budget = self.config.max_num_batched_tokens
        now = self.clock()
        num_spec = num_spec or {}

        # 1. running requests, oldest first; preempt from the newest end when out of blocks
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            # Proposals take only budget that leaves a token for every running one after it.
            num_after = len(self.running) - index - 1
            spec = min(num_spec.get(request.request_id, 0), budget - 1 - num_after)
            if spec > 0 and request.num_uncomputed_tokens == 1 \
                    and self._allocate(request, 1 + spec) is not None:
                out.scheduled.append(ScheduledSeq(request, 1 + spec, self.slot_of(request),
                                                  spec))
                budget -= 1 + spec
                index += 1
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            while self._allocate(request, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledSeq(request, num_new, self.slot_of(request)))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted: it was the newest

        # 2. swapped requests come back when nothing was preempted
        while self.swapped and not out.preempted and budget > 0 \
                and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            ref = request.adapter
            if ref is not None:
                # Its adapter may have been deleted (or its host copy evicted and its files
                # gone) while it was out: that fails this request, as at admission, and
                # not the step.
                error = self.adapters.failure(ref)
                if error is not None:
                    self.swapped.popleft()
                    self.kv.free(request.request_id)
                    out.failed.append((request, error))
                    continue
                if not self.adapters.can_acquire(ref.key):
                    break
                if not self.adapters.is_ready(ref):
                    self.adapters.prefetch(ref)
                    break
            if not self.kv.can_swap_in(request.request_id):
                break
            pairs = self.kv.swap_in(request.request_id)
            assert pairs is not None
            self.swapped.popleft()
            num_new = min(request.num_uncomputed_tokens, budget)
            if self._allocate(request, num_new) is None:
                # Room for its blocks but not its next token: swap straight back out later.
                self.kv.free(request.request_id)
                request.drop_computed()
                request.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(request)
                continue
            try:
                slot = self._pin(request)
            except AdapterError as exc:  # the host copy went and the reload failed
                self.kv.free(request.request_id)
                out.failed.append((request, exc))
                continue
            out.swap_in.extend(pairs)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledSeq(request, num_new, slot))
            budget -= num_new

        # 3. waiting requests
        if not out.preempted and not self.swapped:
            self._admit(out, budget, now)
        out.block_copies.extend(self.kv.take_pending_copies())
        return out

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> None:
        starving = False  # an older request has waited too long for an adapter slot
        # While starving: by adapter pinned by running requests, the most output tokens one
        # of them may still generate (the steps its slot may stay pinned).
        horizons: dict[AdapterKey, int] | None = None
        # Adapters of the waiting requests passed over so far: loads are started only while
        # they fit the host cache together, or a load would evict an adapter that a request
        # ahead is still waiting for (and it would be read from disk again).
        ahead: set[AdapterKey] = set()
        for request in list(self.waiting):
            if budget <= 0:
                break
            if len(self.running) + request.params.n > self.config.max_num_seqs \
                    and self.running:
                break
            ref = request.adapter
            if ref is not None:
                error = self.adapters.failure(ref)
                if error is not None:
                    self.waiting.remove(request)
                    out.failed.append((request, error))
                    continue
                if starving:
                    if horizons is None:
                        horizons = self._pinned_horizons()
                    if request.params.max_tokens > horizons.get(ref.key, 0):
                        continue
                if not self.adapters.can_acquire(ref.key):
                    starving = now - request.arrival_time > self.max_adapter_wait_s
                    ahead.add(ref.key)
                    continue
                if not self.adapters.is_ready(ref):
                    ahead.add(ref.key)
                    if len(ahead) <= self.adapters.max_cpu_loras:
                        self.adapters.prefetch(ref)
                    continue
            cached = None
            if request.num_computed_tokens == 0 and not request.needs_prompt_logits:
                cached = self.kv.get_computed_blocks(request.all_token_ids, request.extra_keys)
            num_computed = cached.num_tokens if cached else request.num_computed_tokens
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if starving and ref is not None:
                    continue  # a chunked prompt could end after the slot's horizon
                # Without chunked prefill a prompt waits for a step it fits whole, unless no
                # step ever can: a request preempted by recompute comes back with its
                # outputs, past max_num_batched_tokens, and is prefilled in chunks (it had
                # stood at the head of the queue and stalled it for good).
                if (not self.config.enable_chunked_prefill
                        and num_new <= self.config.max_num_batched_tokens):
                    break
                num_new = budget
            if self.kv.allocate_slots(request.request_id, request.all_token_ids, num_computed,
                                      num_new, request.extra_keys, cached) is None:
                break  # out of blocks: admit nothing more this step (keeps FCFS order)
            try:
                slot = self._pin(request)
            except AdapterError as exc:  # the host copy went and the reload failed
                self.kv.free(request.request_id)
                self.waiting.remove(request)
                out.failed.append((request, exc))
                continue
            request.num_computed_tokens = num_computed
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            out.scheduled.append(ScheduledSeq(request, num_new, slot))
            budget -= num_new

    def _pinned_horizons(self) -> dict[AdapterKey, int]:
        horizons: dict[AdapterKey, int] = {}
        for request in self.running:
            if request.adapter is not None:
                left = request.params.max_tokens - request.num_output_tokens
                horizons[request.adapter.key] = max(horizons.get(request.adapter.key, 0), left)
        return horizons

    def _allocate(self, request: Request, num_new: int) -> list[int] | None:
        return self.kv.allocate_slots(request.request_id, request.all_token_ids,
                                      request.num_computed_tokens, num_new, request.extra_keys)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._unpin(request)
        self.kv.record_preemption()
        request.num_preemptions += 1
        out.preempted.append(request)
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(request.request_id):
            pairs = self.kv.swap_out(request.request_id)
            assert pairs is not None
            out.swap_out.extend(pairs)
            self.num_swap_outs += 1
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.kv.free(request.request_id)
        request.drop_computed()
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
