"""Decides what runs each step. Pure Python (no torch).

Policy, per step, under ``max_num_batched_tokens`` and ``max_num_seqs``:

0. Fair preemption: when the first waiting request in fair order (``fairness.py``)
   cannot be admitted because the batch is full (sequences or blocks) and its tenant
   holds under half of its fair share (the seats or blocks over the active tenants'
   weights, times its own), requests of the tenant furthest above its share (batch class
   first) are preempted for it, newest first, while that tenant stays above its share.
   An interactive request whose tenant holds more still preempts other tenants' batch
   work (within its ``max_batch_wait_s``): batch work never holds interactive work back.
   A request is preempted so at most ``max_fair_preemptions`` times, and tenants near
   their shares (where admission by counters keeps them) never preempt each other, so
   throughput does not collapse into thrash.
1. Running requests first, oldest first: a decode takes one token, a prefill takes the next
   chunk of its prompt that fits the remaining budget (chunked prefill), so running decodes
   never wait behind a long prompt. When blocks run out, a running request not yet
   scheduled this step is preempted: the newest of the tenant furthest above its share of
   blocks (with one tenant, the newest) — by recompute (blocks freed, requeued at the front
   of its tenant's queue; its prefix may hit the cache on return) or, in ``swap`` mode, by
   copying its blocks to the host pool (recompute when the pool is full). A tenant over
   its KV cap (``max_kv_fraction`` of the pool) preempts its own newest request instead.
2. Swapped requests come back when nothing was preempted this step, in fair order
   between tenants and oldest swapped first within one (with one tenant, oldest first).
3. Waiting requests are admitted in fair order (FIFO with one tenant or the ``fifo``
   policy) while budget, sequences, blocks and the tenant's KV cap allow.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.config import SchedulerConfig
from loraplex.engine.fairness import TenantQueues, TenantStats
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
        self.waiting = TenantQueues(config.policy == "fair", config.prefill_token_cost,
                                    config.decode_token_cost, config.max_batch_wait_s)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self._slot_of_request: dict[str, int] = {}
        self.num_swap_outs = 0

    # --- queue management --------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._activate(request)
        self.waiting.append(request)

    def add_running(self, request: Request, slot: int) -> None:
        """Adds an already-admitted sequence (a fork of a running one)."""
        self._activate(request)
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

    def _activate(self, request: Request) -> None:
        """Lifts the counter of a tenant that had nothing waiting, running or swapped."""
        active = (self.waiting.tenants() | {r.share.tenant for r in self.running}
                  | {r.share.tenant for r in self.swapped})
        if request.share.tenant not in active:
            self.waiting.activate(request, active)

    def kv_cap(self, request: Request) -> int | None:
        """The most blocks the request's tenant's running requests may hold together."""
        fraction = request.share.max_kv_fraction or self.config.max_kv_fraction
        if fraction is None or self.config.policy != "fair":
            return None
        return max(1, int(fraction * self.kv.num_blocks))

    def tenant_stats(self) -> tuple[TenantStats, ...]:
        return self.waiting.stats(self.running, self.swapped, self._blocks_by_tenant())

    def _blocks_by_tenant(self) -> dict[str | None, int]:
        held: dict[str | None, int] = {}
        for request in self.running:
            t = request.share.tenant
            held[t] = held.get(t, 0) + self.kv.num_blocks_held(request.request_id)
        return held

    def _emit(self, out: SchedulerOutput, seq: ScheduledSeq) -> None:
        """Schedules the chunk and charges its tenant for it."""
        out.scheduled.append(seq)
        request = seq.request
        known = seq.num_new_tokens - seq.num_spec_tokens
        if known == 1 and request.num_output_tokens > 0 \
                and seq.num_computed_tokens == request.num_tokens - 1:
            self.waiting.charge(request, 0, seq.num_new_tokens)
        else:
            self.waiting.charge(request, seq.num_new_tokens, 0)

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

        # 0. room for a tenant below its share, when the batch is full
        if self.waiting and self.config.policy == "fair":
            self._make_room(out, now)
        num_fair = len(out.preempted)

        # 1. running requests, oldest first; preempt from the newest end when out of blocks
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            # Proposals take only budget that leaves a token for every running one after it.
            num_after = len(self.running) - index - 1
            spec = min(num_spec.get(request.request_id, 0), budget - 1 - num_after)
            if spec > 0 and request.num_uncomputed_tokens == 1 \
                    and self._within_cap(request, 1 + spec) \
                    and self._allocate(request, 1 + spec) is not None:
                self._emit(out, ScheduledSeq(request, 1 + spec, self.slot_of(request), spec))
                budget -= 1 + spec
                index += 1
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            while not self._within_cap(request, num_new) \
                    or self._allocate(request, num_new) is None:
                victim = self._victim(self.running[index:], request, num_new)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                self._emit(out, ScheduledSeq(request, num_new, self.slot_of(request)))
                budget -= num_new
                index += 1
                continue
            # the request itself was preempted: the ones after it were considered first
        pressure = len(out.preempted) > num_fair

        # 2. swapped requests come back when nothing was preempted, in their tenants'
        # order (as admission's), oldest swapped first within a tenant
        for request in self.waiting.fair_sorted(self.swapped, now, self.running):
            if out.preempted or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            ref = request.adapter
            if ref is not None:
                # Its adapter may have been deleted (or its host copy evicted and its files
                # gone) while it was out: that fails this request, as at admission, and
                # not the step.
                error = self.adapters.failure(ref)
                if error is not None:
                    self.swapped.remove(request)
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
            self.swapped.remove(request)
            num_new = min(request.num_uncomputed_tokens, budget)
            if not self._within_cap(request, num_new) \
                    or self._allocate(request, num_new) is None:
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
            self._emit(out, ScheduledSeq(request, num_new, slot))
            budget -= num_new

        # 3. waiting requests; those preempted for fairness just now stay out this step
        fair_out = {id(r) for r in out.preempted[:num_fair]}
        if not pressure and all(id(r) in fair_out for r in self.swapped):
            self._admit(out, budget, now, fair_out)
        out.block_copies.extend(self.kv.take_pending_copies())
        return out

    # --- between tenants ---------------------------------------------------------------

    def _make_room(self, out: SchedulerOutput, now: float) -> None:
        """Preempts for the first waiting request, in fair order, that could run now but
        for a full batch, when a tenant is further above its share than its own."""
        for request in self.waiting.order(now, self.running):
            ref = request.adapter
            if ref is None or (self.adapters.is_ready(ref)
                               and self.adapters.can_acquire(ref.key)):
                break
        else:
            return
        tenant = request.share.tenant
        if all(r.share.tenant == tenant for r in self.running):
            return  # nobody else to make room: one tenant schedules as FIFO did
        cap = self.kv_cap(request)
        seats = len(self.running) + request.params.n - self.config.max_num_seqs
        if seats <= 0 and self.kv.num_free_blocks() >= self.kv.blocks_for(
                min(request.num_tokens, self.config.max_num_batched_tokens)):
            return  # room for its first chunk even without a cache hit: nothing to make
        cached = (self.kv.get_computed_blocks(request.all_token_ids, request.extra_keys)
                  if request.num_computed_tokens == 0 and not request.needs_prompt_logits
                  else None)
        num_cached = cached.num_tokens if cached else 0
        first_chunk = min(request.num_tokens,
                          num_cached + self.config.max_num_batched_tokens)
        # blocks found on a lower tier (disk) need fresh pool blocks too
        need = self.kv.blocks_for(first_chunk) - (len(cached.block_ids) if cached else 0)
        held = self._blocks_by_tenant()
        if cap is not None and held.get(request.share.tenant, 0) + need > cap:
            return  # its own cap keeps it waiting: preempting others would not help
        blocks = need - self.kv.num_free_blocks()
        while seats > 0 or blocks > 0:
            by_blocks = seats <= 0
            victim = self._fair_victim(request, now, held if by_blocks else None)
            if victim is None:
                return
            freed = self.kv.num_blocks_held(victim.request_id)
            held[victim.share.tenant] -= freed
            self._preempt(victim, out)
            seats -= 1
            blocks -= freed

    def _fair_victim(self, beneficiary: Request, now: float,
                     blocks: dict[str | None, int] | None) -> Request | None:
        """The newest request of the tenant furthest above its share (of sequences, or
        of ``blocks`` when given), for a beneficiary whose tenant holds under half of its
        own share (above it, only another tenant's batch work, for interactive work);
        never one of a higher class, nor one preempted too often already."""
        held = blocks
        if held is None:
            held = {}
            for request in self.running:
                held[request.share.tenant] = held.get(request.share.tenant, 0) + 1

        def load(tenant: str | None, weight: float, extra: int = 0) -> float:
            return (held.get(tenant, 0) + extra) / weight

        share = beneficiary.share
        unit = 1 if blocks is None else max(1, self.kv.blocks_for(beneficiary.num_tokens))
        own = load(share.tenant, share.weight, unit)
        # Each active tenant's fair share, per unit of weight, of the seats or blocks:
        # only a tenant below half of it makes room, only from one above all of it (so
        # tenants near their shares, as admission by counters keeps them, never thrash).
        active = {r.share.tenant: r.share.weight for r in (*self.running, *self.waiting)}
        fair = ((self.config.max_num_seqs if blocks is None else self.kv.num_blocks)
                / sum(active.values()))
        beneficiary_batch = self.waiting.is_batch(beneficiary, now)
        # Above half of its share, an interactive request still makes room from another
        # tenant's batch work within its wait bound (the adapter effect probe's, say): batch
        # work never holds interactive work back by more than a step.
        above_half = own > fair / 2
        if above_half and beneficiary_batch:
            return None
        best: Request | None = None
        best_rank: tuple[bool, float] | None = None
        for request in reversed(self.running):  # newest first
            theirs = request.share
            if theirs.tenant == share.tenant \
                    or request.num_preemptions >= self.config.max_fair_preemptions \
                    or (beneficiary_batch and theirs.priority != "batch"):
                continue
            if above_half and not self.waiting.is_batch(request, now):
                continue
            rank = (theirs.priority == "batch" and not beneficiary_batch,
                    load(theirs.tenant, theirs.weight))
            if rank[1] <= max(own, fair) and not rank[0]:
                continue
            if best_rank is None or rank > best_rank:
                best, best_rank = request, rank
        return best

    def _victim(self, candidates: Sequence[Request], request: Request,
                num_new: int) -> Request:
        """Who makes room when ``request`` cannot grow: over its tenant's KV cap, that
        tenant's newest; out of blocks, the newest of the tenant furthest above its share
        of blocks (batch class first); with one tenant, simply the newest."""
        tenant = request.share.tenant
        if not self._within_cap(request, num_new):
            return next(r for r in reversed(candidates) if r.share.tenant == tenant)
        if self.config.policy != "fair":
            return candidates[-1]
        held = self._blocks_by_tenant()
        return max(reversed(candidates), key=lambda r: (
            r.share.priority == "batch", held.get(r.share.tenant, 0) / r.share.weight))

    def _within_cap(self, request: Request, num_new: int) -> bool:
        cap = self.kv_cap(request)
        if cap is None:
            return True
        held = self._tenant_blocks(request.share.tenant) \
            - self.kv.num_blocks_held(request.request_id)
        return held + self.kv.blocks_held_after(request.num_computed_tokens, num_new) <= cap

    def _tenant_blocks(self, tenant: str | None) -> int:
        return sum(self.kv.num_blocks_held(r.request_id) for r in self.running
                   if r.share.tenant == tenant)

    def _admit(self, out: SchedulerOutput, budget: int, now: float,
               skip: set[int]) -> None:
        starving = False  # an older request has waited too long for an adapter slot
        # While starving: by adapter pinned by running requests, the most output tokens one
        # of them may still generate (the steps its slot may stay pinned).
        horizons: dict[AdapterKey, int] | None = None
        # Adapters of the waiting requests passed over so far: loads are started only while
        # they fit the host cache together, or a load would evict an adapter that a request
        # ahead is still waiting for (and it would be read from disk again).
        ahead: set[AdapterKey] = set()
        capped: set[str | None] = set()  # tenants whose KV cap stopped their queue's head
        for request in self.waiting.order(now, self.running):
            if budget <= 0:
                break
            if id(request) in skip or request.share.tenant in capped:
                continue
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
            cap = self.kv_cap(request)
            if cap is not None and self._tenant_blocks(request.share.tenant) \
                    + self.kv.blocks_held_after(num_computed, num_new) > cap:
                capped.add(request.share.tenant)  # FIFO within the tenant
                continue
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
            self._emit(out, ScheduledSeq(request, num_new, slot))
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
