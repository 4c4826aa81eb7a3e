"""Speculative decoding's engine side: who may speculate, how many tokens, and proposals.
Pure Python (no torch).

Proposals guess a sequence's next tokens: prompt lookup here, before scheduling; or the
layer-skip draft (``ModelRunner.draft``) or the draft model (``ModelRunner.propose``), once
the scheduler has given the slots their KV goes to. The target model scores them all in the step's one forward, next to the batch's
other decodes and prefill chunks, and keeps the longest prefix it agrees with plus one
token of its own (see ``model.sampler.verify``).

Per-token logic: a request with penalties, ``logit_bias``, per-token logprobs or a grammar
(structured output), or one still under ``min_tokens``, does not speculate (its logits
would need that logic at every verified position). Stop tokens, EOS, ``max_tokens`` and
stop strings need nothing: the engine appends the kept tokens one by one and drops the rest
once the sequence has finished.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraplex.config import SpeculativeConfig
from loraplex.engine.request import Request

# Steps a sequence with a poor acceptance rate waits before it proposes again (a probe);
# doubled after each probe that fails too, up to MAX_PAUSE_STEPS.
PAUSE_STEPS = 16
MAX_PAUSE_STEPS = 256
# Weight of the newest step in a sequence's running acceptance rate.
ACCEPTANCE_DECAY = 0.5


class NgramProposer:
    """Prompt lookup: the latest earlier occurrence of the sequence's last n tokens (the
    longest n first) proposes the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        tokens = list(token_ids)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tokens[size - n:]
            last = suffix[-1]
            # Candidate match ends j (exclusive) before the suffix itself, newest first.
            for j in range(size - 1, n - 1, -1):
                if tokens[j - 1] == last and tokens[j - n:j] == suffix:
                    return tokens[j:j + max_tokens]
        return []


def can_speculate(request: Request) -> bool:
    """Whether the request's next tokens depend on nothing but the model's logits (see the
    module docstring for what rules a request out)."""
    p = request.params
    return (not p.has_penalties and not p.logit_bias and p.logprobs is None
            and p.grammar is None and request.num_output_tokens >= p.min_tokens)


@dataclass
class SpecCounters:
    """Running totals of one adapter's (or the base model's) verified proposals."""

    num_drafts: int = 0  # verify steps with at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class SpecController:
    """Decides each step which running sequences propose and how many tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def plan(self, running: Sequence[Request]) -> dict[str, int]:
        """How many tokens each sequence that should speculate this step may propose."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return {}
        wanted = {r.request_id: self._num_tokens(r) for r in running}
        return {rid: num for rid, num in wanted.items() if num > 0}

    def fit_draft_budget(self, running: Sequence[Request], num_spec: Mapping[str, int],
                         budget: int) -> tuple[dict[str, int], dict[str, int]]:
        """The draft model's share of ``plan``: which sequences propose this step, and how
        far the others' draft KV catches up instead, all within ``budget`` draft tokens
        (the step's token budget), so that no forward of the draft is longer than one of
        the target's.

        A sequence's backlog is every token whose draft KV is missing, its newest one
        included: what the draft's first forward runs before it proposes. Sequences whose
        backlog fits what is left propose (running order); then each other one, oldest
        first, runs as much of its backlog as is left, short of the newest token, and
        decodes without proposals, over as many steps as it takes. Returns the proposal
        counts kept and the catch-up tokens by request id.
        """
        by_id = {r.request_id: r for r in running}
        kept: dict[str, int] = {}
        behind: list[Request] = []
        for request_id, num in num_spec.items():
            request = by_id[request_id]
            backlog = request.num_computed_tokens + 1 - request.num_draft_computed_tokens
            if backlog <= budget:
                kept[request_id] = num
                budget -= backlog
            else:
                behind.append(request)
        catch_up: dict[str, int] = {}
        for request in behind:
            if budget <= 0:
                break
            # Only positions whose target KV exists: their blocks are the sequence's already.
            num = min(budget, request.num_computed_tokens - request.num_draft_computed_tokens)
            catch_up[request.request_id] = num
            budget -= num
        return kept, catch_up

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Prompt lookup's proposals by request id, for the sequences of ``plan``."""
        by_id = {r.request_id: r for r in running}
        proposals = {}
        for request_id, num in self.plan(running).items():
            ids = self.proposer.propose(by_id[request_id].all_token_ids, num)
            if ids:
                proposals[request_id] = ids
        return proposals

    def _num_tokens(self, request: Request) -> int:
        if request.num_uncomputed_tokens != 1 or not can_speculate(request):
            return 0
        if request.spec_pause_steps > 0:
            request.spec_pause_steps -= 1
            return 0
        # The verified proposals plus the target's own token must fit max_tokens and the
        # context.
        room = min(request.params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Updates the sequence's acceptance rate after a verify step; a poor one pauses
        its proposals for a while."""
        rate = num_accepted / num_proposed
        request.spec_acceptance = (ACCEPTANCE_DECAY * rate
                                   + (1 - ACCEPTANCE_DECAY) * request.spec_acceptance)
        if request.spec_acceptance < self.config.min_acceptance_rate:
            request.spec_pause_steps = min(PAUSE_STEPS << request.spec_num_pauses,
                                           MAX_PAUSE_STEPS)
            request.spec_num_pauses += 1
            # The probe after the pause starts from the threshold: one good step resumes.
            request.spec_acceptance = self.config.min_acceptance_rate
        else:
            request.spec_num_pauses = 0
