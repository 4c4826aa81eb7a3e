"""Speculative decoding inside the engine's step: who proposes how many tokens (before
scheduling), the proposals once the scheduler has given them slots, and what a verify
step keeps. The policy (prompt lookup, the batch-size and acceptance controller, the draft
model's catch-up budget) is ``engine/speculative.py``; this module runs it against the
runner and the block manager."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex.config import SpeculativeConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import Request
from loraplex.engine.scheduler import ScheduledSeq, SchedulerOutput
from loraplex.engine.speculative import SpecController, SpecCounters
from loraplex.engine.stats import EngineStats
from loraplex.errors import ConfigError
from loraplex.model.runner import ModelRunner, SeqInput


@dataclass
class SpecPlan:
    """What a step's speculation was planned as, before scheduling."""

    num_tokens: dict[str, int] = field(default_factory=dict)  # wanted, by request id
    proposals: dict[str, list[int]] = field(default_factory=dict)  # prompt lookup's
    catch_up: dict[str, int] = field(default_factory=dict)  # draft-model tokens to catch up


class SpecStep:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, kv: KVCacheManager,
                 max_model_len: int, max_num_batched_tokens: int) -> None:
        if config.num_speculative_tokens >= max_model_len:
            raise ConfigError(f"num_speculative_tokens ({config.num_speculative_tokens}) "
                              f"must be below the context length ({max_model_len})")
        num_layers = runner.args.num_layers
        if config.num_draft_layers is not None and config.num_draft_layers >= num_layers:
            raise ConfigError(f"num_draft_layers ({config.num_draft_layers}) must be below "
                              f"the model's {num_layers} layers")
        self.config = config
        self.runner = runner
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.controller = SpecController(config, max_model_len)
        # Verified proposals by adapter identity ("" for the base model).
        self.counters: dict[str, SpecCounters] = {}

    def plan(self, running: Sequence[Request]) -> SpecPlan:
        plan = SpecPlan()
        method = self.config.method
        if method == "ngram":
            plan.proposals = self.controller.propose(running)
            plan.num_tokens = {rid: len(ids) for rid, ids in plan.proposals.items()}
        else:
            plan.num_tokens = self.controller.plan(running)
        if method == "draft_model":
            plan.num_tokens, plan.catch_up = self.controller.fit_draft_budget(
                running, plan.num_tokens, self.max_num_batched_tokens)
        return plan

    def proposals(self, out: SchedulerOutput, plan: SpecPlan) -> dict[str, list[int]]:
        """The proposals of the sequences given slots for them: prompt lookup's (cut to
        the slots), the layer-skip draft's or the draft model's, run now that the slots exist."""
        if self.config.method == "draft_model":
            return self._draft_model_proposals(out, plan.catch_up)
        seqs = [s for s in out.scheduled if s.num_spec_tokens]
        if not seqs:
            return {}
        if self.config.method == "ngram":
            return {s.request.request_id: plan.proposals[s.request.request_id][:s.num_spec_tokens]
                    for s in seqs}
        assert self.config.num_draft_layers is not None
        drafts = self.runner.draft(
            [SeqInput(token_ids=s.token_ids, num_computed=s.request.num_computed_tokens,
                      block_table=self.kv.block_table(s.request.request_id),
                      lora_slot=s.lora_slot) for s in seqs],
            [s.num_spec_tokens for s in seqs], self.config.num_draft_layers)
        return {s.request.request_id: ids for s, ids in zip(seqs, drafts, strict=True)}

    def _draft_model_proposals(self, out: SchedulerOutput,
                               catch_up: dict[str, int]) -> dict[str, list[int]]:
        """The draft model's proposals for the sequences given slots for them. Each one's
        draft KV first catches up with the target's (see ``ModelRunner.propose``), in the
        same forward as the ``catch_up`` tokens of those too far behind to propose this
        step (``SpecController.fit_draft_budget``); the draft does not run for the others,
        so it costs nothing where speculation is off."""
        seqs = [s for s in out.scheduled if s.num_spec_tokens]
        # Catching up only for the scheduled: the blocks of the others may be swapped out.
        behind = [s for s in out.scheduled if not s.num_spec_tokens
                  and catch_up.get(s.request.request_id, 0) > 0]
        if not seqs and not behind:
            return {}
        inputs = []
        for s in behind:
            request = s.request
            done = request.num_draft_computed_tokens
            end = min(done + catch_up[request.request_id], request.num_computed_tokens)
            inputs.append(SeqInput(token_ids=request.all_token_ids[done:end],
                                   num_computed=done,
                                   block_table=self.kv.block_table(request.request_id)))
            request.num_draft_computed_tokens = end
        for s in seqs:
            request = s.request
            # A new sequence computes the draft's KV of its prefix-cache hits again: their
            # blocks may have been filled while the draft did not run.
            done = request.num_draft_computed_tokens
            end = request.num_computed_tokens + s.num_new_tokens - s.num_spec_tokens
            inputs.append(SeqInput(token_ids=request.all_token_ids[done:end],
                                   num_computed=done,
                                   block_table=self.kv.block_table(request.request_id)))
            # The draft feeds every proposal but the last.
            request.num_draft_computed_tokens = end + s.num_spec_tokens - 1
        drafts = self.runner.propose(inputs, [0] * len(behind)
                                     + [s.num_spec_tokens for s in seqs])
        return {s.request.request_id: ids
                for s, ids in zip(seqs, drafts[len(behind):], strict=True)}

    def verified(self, sched: ScheduledSeq, num_accepted: int, adapter: str) -> None:
        """After a verify step: the KV of the accepted proposals is kept, the slots of the
        rejected ones are released; the sequence's acceptance and ``adapter``'s counters
        (its identity, "" for the base model) are updated."""
        request = sched.request
        num_proposed = sched.num_spec_tokens
        self.controller.record(request, num_proposed, num_accepted)
        counters = self.counters.setdefault(adapter, SpecCounters())
        counters.num_drafts += 1
        counters.num_draft_tokens += num_proposed
        counters.num_accepted_tokens += num_accepted
        request.num_computed_tokens += sched.num_new_tokens - num_proposed + num_accepted
        # The draft's KV of rejected proposals is stale: computed again when next needed.
        request.num_draft_computed_tokens = min(request.num_draft_computed_tokens,
                                                request.num_computed_tokens)
        self.kv.trim(request.request_id, request.num_computed_tokens)

    def stats(self) -> dict[str, Any]:
        """The ``spec_*`` fields of ``EngineStats``."""
        counters = self.counters.values()
        drafts = sum(c.num_drafts for c in counters)
        draft_tokens = sum(c.num_draft_tokens for c in counters)
        accepted = sum(c.num_accepted_tokens for c in counters)
        acceptance, mean_length = EngineStats.spec_rates(drafts, draft_tokens, accepted)
        drafter = self.runner.drafter
        return dict(spec_draft_forwards=drafter.num_forwards if drafter else 0,
                    spec_draft_forward_tokens=drafter.num_forward_tokens if drafter else 0,
                    spec_draft_max_forward_tokens=drafter.max_forward_tokens if drafter else 0,
                    spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens,
                    spec_num_accepted_tokens=accepted, spec_acceptance_rate=acceptance,
                    spec_mean_accepted_length=mean_length,
                    spec_by_adapter=tuple((name, c.num_drafts, c.num_draft_tokens,
                                           c.num_accepted_tokens)
                                          for name, c in sorted(self.counters.items())))
