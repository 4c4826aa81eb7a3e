"""The engine boundary: everything the gateway may use of an engine, and nothing more.

``EngineClient`` (the engine in this process, on its own thread) is the embedded default;
an implementation across a process boundary satisfies the same protocol. Only plain data
crosses it: prompt token ids, frozen sampling params, the tenant's cache salt as an opaque
string, the adapter's identity, a request id; back come ``SequenceDelta`` and
``EngineStats``. Refusals are domain errors from ``loraplex.errors``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import NO_SHARE, Share
from loraplex.engine.stats import EngineStats

if TYPE_CHECKING:
    from loraplex.model.adapter_loader import TargetShapes


@dataclass(frozen=True)
class ModelDescription:
    """The served base model as every engine of a deployment must agree on it."""

    model: str  # the model folder (or id) the engine loaded
    tokenizer: str  # where the tokenizer loads from (a folder)
    max_model_len: int  # context length: prompt plus completion
    vocab_size: int
    max_lora_rank: int
    target_shapes: TargetShapes  # the LoRA-able modules an adapter must match
    architecture: str = ""  # the model's family as users know it ("Gemma 2")
    max_pinned: int = 0  # adapter versions an operator may pin (LoRAConfig.max_pinned)


class EngineBackend(Protocol):
    """What the gateway needs from an engine."""

    @property
    def description(self) -> ModelDescription:
        """The served model; fixed for the backend's lifetime."""
        ...

    @property
    def is_ready(self) -> bool:
        """Whether generation requests are accepted now."""
        ...

    @property
    def is_alive(self) -> bool:
        """False once the engine has failed for good (its step loop died): the process
        must be restarted, so ``/health`` fails for the orchestrator to do it."""
        ...

    @property
    def num_replicas(self) -> int | None:
        """The replicas the deployment runs (ordinals 0..N-1); None for the one engine in
        process, which has no replica to miss."""
        ...

    @property
    def missing_replicas(self) -> tuple[int, ...]:
        """The ordinals of replicas that do not answer now (``/ready`` is 503 meanwhile)."""
        ...

    def start(self) -> None:
        """Starts serving (called once, from the gateway's lifespan)."""
        ...

    async def shutdown(self) -> None:
        """Stops serving: in-flight requests end with finish_reason "abort". Idempotent."""
        ...

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                 lora: AdapterRef | None, cache_salt: str | None,
                 request_id: str, *, share: Share = NO_SHARE,
                 ) -> AsyncGenerator[SequenceDelta, None]:
        """Streams the request's outputs, one delta per new token of each sequence;
        ``share`` says whose request it is (the scheduler is fair between tenants).

        The first iteration raises what admission refuses (InvalidRequestError,
        PromptTooLongError, EngineOverloadedError...); closing the stream before its end
        aborts the request and frees what it holds.
        """
        ...

    async def stats(self) -> EngineStats:
        """The engine's figures now: the whole deployment's (see ``combine_stats``)."""
        ...

    async def replica_stats(self) -> tuple[EngineStats, ...]:
        """Each replica's figures now, ordered by ordinal (``replica`` 0..N-1); what the
        admin API and the metrics show per replica."""
        ...

    async def forget_adapter(self, adapter_id: str, digest: str) -> None:
        """Drops a deleted adapter version: cached prefix blocks, host copy, idle slot.
        Requests already running on it finish unchanged."""
        ...

    async def set_pinned_adapters(self, refs: Sequence[AdapterRef]) -> None:
        """Makes ``refs`` the pinned adapter versions on every replica (replacing the
        previous set): each keeps a device slot and its host copy (see
        ``LLMEngine.set_pinned_adapters``)."""
        ...


def description_mismatch(expected: ModelDescription, actual: ModelDescription) -> str | None:
    """What differs between two descriptions of the served model, in one line; None when
    they agree."""
    diffs = [f"{name} {getattr(actual, name)!r} (expected {getattr(expected, name)!r})"
             for name in ("model", "tokenizer", "max_model_len", "vocab_size", "max_lora_rank",
                          "max_pinned")
             if getattr(actual, name) != getattr(expected, name)]
    if actual.target_shapes != expected.target_shapes:
        diffs.append("LoRA target shapes differ")
    return "; ".join(diffs) or None
