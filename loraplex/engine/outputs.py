"""What the engine reports: incremental deltas per sequence, and whole results."""

from __future__ import annotations

from dataclasses import dataclass, field

TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]  # (logprob, top alternatives)


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    queue_time: float | None
    ttft: float | None
    tpot: float | None
    e2e: float | None
    num_preemptions: int
    # In engine steps from arrival (1: the first step after it), what fair scheduling
    # bounds: when it was first scheduled, and when its first token came.
    queue_steps: int | None = None
    ttft_steps: int | None = None


@dataclass(frozen=True)
class SequenceDelta:
    """New output of one sequence (``index`` of the request's ``n``) since the last delta."""

    request_id: str
    index: int
    new_token_ids: list[int]
    text_delta: str
    new_logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics | None = None  # on the final delta
    error: str | None = None
    # With ``error``: the request field at fault (a grammar that cannot be followed), or
    # None for an adapter that failed.
    error_param: str | None = None
    # On the first token's delta when prompt logprobs were asked for: one per prompt
    # token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # On the first token's delta when ``first_token_distribution`` was asked for: the
    # log-probability of every token of the vocabulary there (raw logits), by token id.
    distribution: tuple[float, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: list[RequestMetrics | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def apply(self, delta: SequenceDelta) -> None:
        out = self.outputs[delta.index]
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        out.text += delta.text_delta
        out.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            out.logprobs = (out.logprobs or []) + delta.new_logprobs
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
            out.stop_reason = delta.stop_reason
            while len(self.metrics) <= delta.index:
                self.metrics.append(None)
            self.metrics[delta.index] = delta.metrics
