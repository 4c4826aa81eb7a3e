"""One generation request from admission to its last token.

``Job`` takes a rate-limit lease, submits the request to the engine, and waits for its
first output before any HTTP status is sent, so admission errors (queue full, prompt too
long) still get their own status even when streaming. ``Job.finish`` is the single exit:
it aborts the engine request if it is still running, settles the lease with the real token
count, meters usage and records metrics, exactly once, whatever ended the request.

Usage is what the tenant got: the prompt tokens of an admitted request, plus the
completion tokens that were sent (``Job.sent``): for a stream, those of every chunk written
to the connection before it ended, however it ended (hang-up, engine abort, shutdown); for
a whole response, all of them once the response is handed over, none if the client left
before it was ready. The rate limiter is charged with every token the engine produced: that
is the load the tenant caused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

from redis.exceptions import RedisError

from loraplex.engine.outputs import RequestMetrics, SequenceDelta
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import PRIORITIES, Share
from loraplex.errors import InvalidRequestError
from loraplex.gateway.auth import cache_salt, tenant_limits
from loraplex.gateway.errors import DependencyUnavailableError
from loraplex.gateway.metrics import Observation, Slo
from loraplex.gateway.model_resolution import ResolvedModel
from loraplex.gateway.ratelimit import Lease, TenantLimits
from loraplex.gateway.state import Gateway
from loraplex.gateway.usage import OpenUsage
from loraplex.registry.api_keys import Principal

logger = logging.getLogger("loraplex.gateway")


def request_share(principal: Principal, priority_class: str | None) -> Share:
    """Whose request it is, for the engine's fair scheduling: the tenant's id, weight, KV
    cap and class, or the ``batch`` class the request asked for itself (never a class above
    its tenant's)."""
    priority = priority_class or principal.priority_class
    if PRIORITIES.index(priority) < PRIORITIES.index(principal.priority_class):
        raise InvalidRequestError(
            f"priority_class: {priority!r} is above your tenant's class "
            f"({principal.priority_class!r})", param="priority_class")
    return Share(str(principal.tenant_id), principal.weight, priority,  # type: ignore[arg-type]
                 principal.max_kv_fraction)


class Job:
    """One admitted generation: lease, engine stream, and their cleanup."""

    def __init__(self, gw: Gateway, principal: Principal, resolved: ResolvedModel,
                 prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 observation: Observation, share: Share) -> None:
        self.gw = gw
        self.share = share
        self.principal = principal
        self.resolved = resolved
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.request_id = request_id
        self.obs = observation
        observation.delegated = True
        self.created = int(time.time())
        self.num_completion_tokens = 0
        self.num_sent_tokens = 0
        self.metrics: RequestMetrics | None = None
        self._lease: Lease | None = None
        self._stream: AsyncGenerator[SequenceDelta, None] | None = None
        self._first: SequenceDelta | None = None
        self._finished = False
        self._admitted = False
        self._metering = False
        self.usage = OpenUsage(principal.tenant_id, resolved.adapter_id)
        # The metrics status of a stream that ended with an error event (its HTTP status,
        # 200, was already sent).
        self.stream_status = "ok"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    async def start(self) -> None:
        """Takes the lease and waits for the first output; raises what refuses the request
        (RateLimitExceeded, EngineOverloadedError, PromptTooLongError...), leaving nothing
        held behind."""
        gw, principal = self.gw, self.principal
        # From here the meter's final flush (at shutdown) waits for this request's record.
        gw.meter.open_request(self.usage)
        self._metering = True
        reserved = self.num_prompt_tokens + self.params.n * self.params.max_tokens
        limits = tenant_limits(principal)
        try:
            self._lease = await gw.rate_limiter.acquire(str(principal.tenant_id), limits,
                                                        reserved)
        except InvalidRequestError as exc:
            raise InvalidRequestError(
                f"the prompt ({self.num_prompt_tokens} tokens) plus n * max_tokens "
                f"({self.params.n} * {self.params.max_tokens}) is {reserved} tokens, over "
                f"your limit of {principal.max_tokens_per_minute} tokens per window",
                param="max_tokens") from exc
        except (RedisError, OSError) as exc:
            # The details (they name internal hosts) go to the log, never to the tenant.
            logger.warning("rate limiter unavailable for tenant %s: %s", principal.tenant_id,
                           exc)
            if limits != TenantLimits():
                raise DependencyUnavailableError(
                    "the rate limiter is unavailable; retry later") from None
            # A tenant without limits has nothing to check: it is served, with no lease.
            self._lease = None
        salt = (None if gw.config.allow_cross_tenant_cache_sharing
                else cache_salt(gw.salt_secret, principal.tenant_id))
        self._stream = gw.backend.generate(self.prompt_token_ids, self.params,
                                          self.resolved.ref, salt, self.request_id,
                                          share=self.share)
        try:
            self._first = await self._stream.__anext__()
        except StopAsyncIteration:
            self._first = None
        self._admitted = True
        self.usage.num_prompt_tokens = self.num_prompt_tokens
        self.usage.admitted = True

    async def deltas(self) -> AsyncIterator[SequenceDelta]:
        """Every output of the request, the first (already received) included."""
        if self._first is not None:
            first, self._first = self._first, None
            self._count(first)
            yield first
        if self._stream is None:
            return
        async for delta in self._stream:
            self._count(delta)
            yield delta

    def sent(self) -> None:
        """Every token received so far has reached the client (a chunk carrying it was
        written, or the whole response was handed over)."""
        self.num_sent_tokens = self.num_completion_tokens
        self.usage.num_sent_tokens = self.num_sent_tokens

    def _count(self, delta: SequenceDelta) -> None:
        self.num_completion_tokens += len(delta.new_token_ids)
        if delta.finished and delta.index == 0 and delta.metrics is not None:
            self.metrics = delta.metrics

    async def finish(self, status: str) -> None:
        """Ends the request (aborting it in the engine if it still runs), releases the
        lease with the real count, meters usage, records metrics. Idempotent; call it
        shielded from cancellation."""
        if self._finished:
            return
        self._finished = True
        if self._metering:
            # Metered first, before anything that awaits: nothing more reaches the client,
            # and the shutdown's final flush must not miss it.
            self.gw.meter.close_request(self.usage)
        if self._stream is not None:
            await self._stream.aclose()  # aborts the engine request if it is unfinished
        used = self.num_prompt_tokens + self.num_completion_tokens if self._admitted else 0
        if self._lease is not None:
            try:
                await self.gw.rate_limiter.release(self._lease, used)
            except (RedisError, OSError):
                # The lease expires on its own (its TTL); the request itself went fine.
                logger.warning("could not release rate-limit lease %s", self._lease.lease_id,
                               exc_info=True)
        config, principal = self.gw.config, self.principal
        self.obs.record(status, self.metrics,
                        Slo(principal.slo_ttft_ms or config.slo_ttft_ms,
                            principal.slo_tpot_ms or config.slo_tpot_ms))
