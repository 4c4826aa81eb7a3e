"""A request's whole state, in one class. Pure Python (no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.kv_hashing import ExtraKey, extra_keys_for
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import NO_SHARE, Share


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV freed (recompute)
    SWAPPED = 3  # its KV in the host pool
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


AdapterKey = tuple[str, str]  # (adapter_id, content digest)


@dataclass(frozen=True)
class AdapterRef:
    """Which adapter version a request runs: identity is ``adapter_id@digest``."""

    adapter_id: str
    digest: str
    path: str

    @property
    def key(self) -> AdapterKey:
        return (self.adapter_id, self.digest)


@dataclass
class Request:
    """One sequence being generated. ``n > 1`` is a group of these sharing a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str | None = None  # the user's request id when this is one of n samples
    sample_index: int = 0
    eos_token_ids: tuple[int, ...] = ()
    share: Share = NO_SHARE  # whose it is, for fair scheduling

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(
        default_factory=list)
    # Prompt tokens 1.. (the first has none); shared by the n samples of one prompt.
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(
        default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Engine steps completed when it arrived; the steps in which it was first scheduled
    # and in which its first token came (the scheduler's latency, free of wall time).
    arrival_step: int = 0
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # Speculative decoding: the running acceptance rate of this sequence's proposals, the
    # steps it still waits before proposing again after a poor one, and how many pauses in
    # a row it has had.
    spec_acceptance: float = 1.0
    spec_pause_steps: int = 0
    spec_num_pauses: int = 0
    # The draft model's KV reaches this far in the sequence's blocks: every position before
    # it holds the draft's KV of the sequence's token there. Never past num_computed_tokens.
    num_draft_computed_tokens: int = 0
    # Text state kept by the engine's detokenizer: the text so far, how much of it was sent,
    # and the window of output tokens it decodes next (detokenizer.py).
    output_text: str = ""
    num_text_sent: int = 0
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    # Structured output: the sequence's position in its grammar (a grammar.Constraint,
    # which keeps torch out of this module); it only ever reads this sequence's output.
    constraint: Any = None
    # What the sampler reads of the params every step, made once (tensors of logit_bias
    # and of min_tokens' banned ids: the engine keeps torch out of this module).
    sampling_cache: dict[str, Any] = field(default_factory=dict)

    def drop_computed(self) -> None:
        """Its KV is gone (a recompute preemption): the target's and the draft's."""
        self.num_computed_tokens = 0
        self.num_draft_computed_tokens = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the prompt must run through
        the model, prefix-cache hits or not."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def extra_keys(self) -> tuple[ExtraKey, ...]:
        return extra_keys_for(self.adapter.key if self.adapter else None, self.cache_salt)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def queue_steps(self) -> int | None:
        """1 when it was scheduled in the first step after it arrived."""
        if self.first_scheduled_step is None:
            return None
        return self.first_scheduled_step - self.arrival_step

    @property
    def ttft_steps(self) -> int | None:
        if self.first_token_step is None:
            return None
        return self.first_token_step - self.arrival_step

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.finish_time is None:
            return None
        if self.num_output_tokens < 2:
            return 0.0
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)
