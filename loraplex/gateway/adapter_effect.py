"""An accepted adapter's measured effect: what it changes of the served model's output.

On a fixed set of short prompts, the engine runs the base model and the adapter, each
greedily for a few tokens; the first token's whole next-token distribution comes back
(``SamplingParams.first_token_distribution``). The effect is the mean over the prompts of
KL(adapter || base) of those distributions, in nats, and the fraction of prompts whose
greedy continuation the adapter changed.

The probe's requests go through the engine's own batch like any other, as a tenant of
their own in the ``batch`` class: the fair scheduler admits them after interactive work
and preempts them for it when the batch is full (engine/scheduler.py), so they never
hold another tenant's request back by more than a step. Their prefix-cache
salt is one no tenant's can be (tenant salts are hex digests), so they share no KV block
with a tenant.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from loraplex.engine.backend import EngineBackend
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import Share
from loraplex.errors import EngineOverloadedError, LoraplexError
from loraplex.registry import service
from loraplex.registry.db import transaction
from loraplex.registry.models import Adapter
from loraplex.registry.store import AdapterStore

logger = logging.getLogger("loraplex.gateway")

PROMPTS: Final = (
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a",
    "Q: What is 12 plus 7?\nA:",
)
NUM_CONTINUATION_TOKENS: Final = 8
PROBE_TENANT: Final = "loraplex:effect-probe"
OVERLOAD_WAIT_S: Final = 120.0  # how long a probe request waits for room in a full engine
PROBE_SHARE: Final = Share(tenant=PROBE_TENANT, priority="batch")
PROBE_SALT: Final = "loraplex:effect-probe"
# Below this mean KL (nats) the adapter's effect on the next-token distribution is
# indistinguishable from zero: float32 rounding of the logits alone moves a KL by ~1e-7.
MIN_EFFECT_KL: Final = 1e-6
NO_EFFECT_WARNING: Final = (
    "the adapter's measured effect is indistinguishable from zero: the mean KL divergence "
    "of its next-token distribution from the base model's is {kl:.1e} nats (under "
    f"{MIN_EFFECT_KL:g}) on the probe prompts, and it changed {{changed}} of "
    f"{len(PROMPTS)} greedy continuations; it serves (almost) the base model")


@dataclass(frozen=True)
class Effect:
    """What an adapter changes: ``kl`` the mean KL(adapter || base) of the first
    next-token distribution over the probe prompts (nats), ``changed`` the fraction of
    their greedy continuations that differ."""

    kl: float
    changed: float

    @property
    def is_zero(self) -> bool:
        return self.kl < MIN_EFFECT_KL

    def warning(self) -> str | None:
        """The upload answer's warning when the effect is indistinguishable from zero."""
        if not self.is_zero:
            return None
        return NO_EFFECT_WARNING.format(kl=self.kl,
                                        changed=round(self.changed * len(PROMPTS)))


def effect_json(row: Adapter) -> dict[str, Any] | None:
    """A version's measured effect as the API shows it; None while not measured (a probe
    in progress, one that failed, or a version uploaded before probes existed)."""
    if row.effect_kl is None or row.effect_measured_at is None:
        return None
    return {"kl": row.effect_kl, "changed": row.effect_changed, "prompts": len(PROMPTS),
            "measured_at": row.effect_measured_at.isoformat()}


class ProbeError(LoraplexError):
    """The probe did not get what it needs from the engine (a request ended early)."""


async def _run(backend: EngineBackend, prompt_ids: Sequence[int],
               ref: AdapterRef | None) -> tuple[np.ndarray, list[int]]:
    """One probe request: (the first token's log-probabilities ``[vocab]``, the greedy
    continuation's token ids). Refused as overloaded (a full engine, or a gateway queue
    for busy replicas), it waits and asks again for up to ``OVERLOAD_WAIT_S``: the probe
    is background work and takes the room left over."""
    deadline = time.monotonic() + OVERLOAD_WAIT_S
    delay = 0.2
    while True:
        try:
            return await _run_once(backend, prompt_ids, ref)
        except EngineOverloadedError:
            if time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)


async def _run_once(backend: EngineBackend, prompt_ids: Sequence[int],
                    ref: AdapterRef | None) -> tuple[np.ndarray, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_CONTINUATION_TOKENS,
                            first_token_distribution=True)
    distribution: tuple[float, ...] | None = None
    token_ids: list[int] = []
    stream = backend.generate(prompt_ids, params, ref, PROBE_SALT,
                              f"probe-{uuid.uuid4().hex}", share=PROBE_SHARE)
    try:
        async for delta in stream:
            if delta.distribution is not None:
                distribution = delta.distribution
            token_ids.extend(delta.new_token_ids)
            if delta.finish_reason in ("abort", "error"):
                raise ProbeError(f"a probe request ended with {delta.finish_reason}"
                                 + (f": {delta.error}" if delta.error else ""))
    finally:
        await stream.aclose()
    if distribution is None:
        raise ProbeError("a probe request ended without its first token's distribution")
    return np.asarray(distribution, dtype=np.float64), token_ids  # [vocab]


def kl_divergence(logp: np.ndarray, logq: np.ndarray) -> float:
    """KL(p || q) in nats from log-probabilities ``[vocab]``; 0 where rounding makes the
    sum negative (it never is in exact arithmetic). ProbeError when it is not finite."""
    p = np.exp(logp)
    # Tokens p gives no mass contribute nothing, whatever q says (also -inf against -inf).
    mask = p > 0
    value = float(np.sum(p[mask] * (logp[mask] - logq[mask])))
    if not math.isfinite(value):
        raise ProbeError(f"the KL divergence is not finite ({value})")
    return max(value, 0.0)


async def measure_effect(backend: EngineBackend, prompts: Sequence[Sequence[int]],
                         ref: AdapterRef) -> Effect:
    """The adapter's effect on ``prompts`` (token ids): every request of the probe is
    submitted at once, base and adapter side by side, to share the engine's steps. One
    that fails ends the others, and its error is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_run(backend, ids, side))
                     for ids in prompts for side in (None, ref)]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    runs = [task.result() for task in tasks]
    kls, changed = [], 0
    for i in range(len(prompts)):
        (base_dist, base_ids), (lora_dist, lora_ids) = runs[2 * i], runs[2 * i + 1]
        kls.append(kl_divergence(lora_dist, base_dist))
        changed += base_ids != lora_ids
    return Effect(kl=sum(kls) / len(kls), changed=changed / len(prompts))


@dataclass(frozen=True)
class ProbeOutcome:
    """What an upload's answer says of its probe: the effect (None while pending or when
    the probe failed) and whether it is still running."""

    effect: Effect | None
    pending: bool
    measured_at: datetime | None = None

    def json(self) -> dict[str, Any] | None:
        if self.effect is None or self.measured_at is None:
            return None
        return {"kl": self.effect.kl, "changed": self.effect.changed, "prompts": len(PROMPTS),
                "measured_at": self.measured_at.isoformat()}

    def warnings(self) -> list[str]:
        warning = None if self.effect is None else self.effect.warning()
        return [] if warning is None else [warning]


class EffectProbes:
    """Measures committed adapter versions and stores their effect; built once with the
    adapter service. A probe outlives the upload that started it: the answer waits at most
    ``wait_s``, and the effect is stored whenever the probe ends. A probe that fails is
    logged and leaves the effect null; it never fails the upload."""

    def __init__(self, backend: EngineBackend, sessions: sessionmaker[Session],
                 store: AdapterStore, encode: Callable[[str], Awaitable[list[int]]],
                 wait_s: float = 5.0) -> None:
        self.backend = backend
        self.sessions = sessions
        self.store = store
        self.encode = encode
        self.wait_s = wait_s
        self._prompts: list[list[int]] | None = None
        self._tasks: set[asyncio.Task[tuple[Effect, datetime] | None]] = set()

    async def probe(self, row: Adapter) -> ProbeOutcome:
        """Starts measuring ``row`` (committed) and waits up to ``wait_s`` for it."""
        ref = AdapterRef(adapter_id=str(row.id), digest=row.digest,
                         path=str(self.store.resolve(row.storage_path)))
        task = asyncio.create_task(self._measure_and_store(row.id, ref))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        done, _ = await asyncio.wait({task}, timeout=self.wait_s)
        if task not in done:
            return ProbeOutcome(None, pending=True)
        result = task.result()
        if result is None:
            return ProbeOutcome(None, pending=False)
        return ProbeOutcome(result[0], pending=False, measured_at=result[1])

    async def _measure_and_store(self, adapter_id: int,
                                 ref: AdapterRef) -> tuple[Effect, datetime] | None:
        try:
            if self._prompts is None:
                self._prompts = [await self.encode(text) for text in PROMPTS]
            effect = await measure_effect(self.backend, self._prompts, ref)
            return effect, await asyncio.to_thread(self._store, adapter_id, effect)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # anything: the upload is kept, the effect stays null
            logger.warning("the effect probe of adapter version %s failed: %s", adapter_id,
                           exc)
            return None

    def _store(self, adapter_id: int, effect: Effect) -> datetime:
        with transaction(self.sessions) as session:
            service.record_effect(session, adapter_id, effect.kl, effect.changed)
            measured_at = service.get_adapter(session, adapter_id).effect_measured_at
            assert measured_at is not None
            return measured_at

    async def stop(self) -> None:
        """Cancels the probes still running (the server is stopping): their versions stay
        unmeasured."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
