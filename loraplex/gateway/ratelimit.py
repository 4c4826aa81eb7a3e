"""Per-tenant rate limits: requests per minute, tokens per minute, concurrent requests.

Two implementations behave the same way:

* ``RedisRateLimiter`` keeps the state in Redis so every gateway process shares it. Each
  acquire and each release is one Lua script, so the three checks and the reservation are
  atomic, and time comes from the Redis server (``TIME``) so processes agree on it.
* ``InProcessRateLimiter`` keeps the same state in dicts behind a lock, for the embedded
  default without ``--redis-url``.

The windows are sliding logs, exact to the microsecond: a request counts against the
window while ``now - window < t_request``; a refused request is told when the oldest entry
that must leave for it to fit actually leaves. Tokens are reserved up front (``max_tokens``)
and settled on release with the real count: unused tokens are refunded to the original
entry if it is still in the window, extra tokens are charged as a new entry at release
time. Concurrency slots are leases that expire after ``lease_ttl_s``, so a dead gateway
process cannot hold its slots for ever.

Talking to Redis is bounded: a request waits at most ``request_budget_s`` (0.5 s) for any
one call (acquire, release, ping), so a hung Redis (paused, not down) costs a request that
much before the answer a down Redis gets; every socket operation times out after
``timeout_s``, a
connection idle for ``HEALTH_CHECK_INTERVAL_S`` is pinged before use, and a command that
fails on a broken connection (a pooled one left stale by a Redis restart) is retried on a
fresh one, twice at most, with a short backoff. Both scripts are idempotent per lease, so
a retried call never counts a request twice.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

from loraplex.errors import ConfigError, InvalidRequestError, LoraplexError

LimitName = Literal["requests", "tokens", "concurrency"]
T = TypeVar("T")

DEFAULT_KEY_PREFIX = "loraplex:rl:"
DEFAULT_REDIS_TIMEOUT_S = 1.0
# The longest a request waits on one Redis call: a local Redis answers in well under a
# millisecond, one across a network in a few.
DEFAULT_REQUEST_BUDGET_S = 0.5
HEALTH_CHECK_INTERVAL_S = 10
REDIS_RETRIES = 2


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; ``None`` means unlimited. Per-minute limits apply per window."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")


class RateLimitExceeded(LoraplexError):
    """A tenant is over one of its limits; the gateway answers 429 with Retry-After."""

    def __init__(self, tenant_id: str, limit: LimitName, retry_after: float) -> None:
        super().__init__(
            f"rate limit exceeded for tenant {tenant_id!r}: {limit}; retry after {retry_after:.3f}s"
        )
        self.tenant_id = tenant_id
        self.limit: LimitName = limit
        # Seconds, > 0, not rounded: the HTTP layer ceils it to whole seconds.
        self.retry_after = retry_after


@dataclass(frozen=True)
class Lease:
    """An admitted request: holds a concurrency slot and a token reservation until released."""

    tenant_id: str
    lease_id: str
    reserved_tokens: int


class RateLimiter(Protocol):
    """What the gateway needs from a rate limiter."""

    async def acquire(self, tenant_id: str, limits: TenantLimits, reserved_tokens: int) -> Lease:
        """Admits one request reserving ``reserved_tokens``, or raises ``RateLimitExceeded``.

        All three checks and the reservation happen in one atomic step; nothing is reserved
        when the request is refused. Raises ``InvalidRequestError`` when the reservation
        alone exceeds the tenant's tokens per minute (waiting would never help).
        """
        ...

    async def release(self, lease: Lease, actual_tokens: int) -> None:
        """Settles the lease's tokens with the real count and frees its concurrency slot.

        Idempotent. A lease released after its TTL expired is a no-op: its slot was already
        freed and its reservation stands (the real count is unknown to whoever expired it).
        """
        ...

    async def ping(self) -> bool:
        """Whether the limiter's store answers now (for readiness)."""
        ...

    async def close(self) -> None:
        """Releases connections; the limiter cannot be used afterwards."""
        ...


def _check_acquire_args(limits: TenantLimits, reserved_tokens: int) -> None:
    if reserved_tokens < 0:
        raise ValueError(f"reserved_tokens must be >= 0, got {reserved_tokens}")
    if limits.tokens_per_minute is not None and reserved_tokens > limits.tokens_per_minute:
        raise InvalidRequestError(
            f"max_tokens ({reserved_tokens}) exceeds the tenant's token limit per window "
            f"({limits.tokens_per_minute})",
            param="max_tokens",
        )


def _check_window(window_s: float, lease_ttl_s: float, concurrency_retry_s: float) -> None:
    if not window_s > 0:
        raise ConfigError(f"window_s must be positive, got {window_s}")
    if not lease_ttl_s > 0:
        raise ConfigError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
    if not concurrency_retry_s > 0:
        raise ConfigError(f"concurrency_retry_s must be positive, got {concurrency_retry_s}")


# ---------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------

# Times are integer microseconds from the server's TIME. Lua turns numbers into strings
# with "%.14g", which would round a 16-digit microsecond timestamp, hence fmt().
# KEYS: requests log (zset id->t), tokens log (zset id->t), token amounts (hash id->n),
#       tokens in window (string), leases (zset id->expiry)
# ARGV: lease_id, window_us, lease_ttl_us, max_requests, max_tokens, max_concurrent
#       (0 = unlimited), reserved, concurrency_retry_us, log_key_ttl_ms, lease_key_ttl_ms
# Returns {1, '', 0} when admitted, {0, limit_name, retry_after_us} when refused.
_ACQUIRE_LUA = """
local req_key, tok_key, amt_key, sum_key, lease_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease_id = ARGV[1]
local window = tonumber(ARGV[2])
local lease_ttl = tonumber(ARGV[3])
local max_requests = tonumber(ARGV[4])
local max_tokens = tonumber(ARGV[5])
local max_concurrent = tonumber(ARGV[6])
local reserved = tonumber(ARGV[7])
local concurrency_retry = tonumber(ARGV[8])
local log_ttl_ms = ARGV[9]
local lease_ttl_ms = ARGV[10]

-- Run again for a lease it already admitted (a client retry after a lost reply): no-op.
if redis.call('ZSCORE', lease_key, lease_id) then return {1, '', 0} end

local function fmt(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cutoff = fmt(now - window)

-- Forget what left the window; keep the running token sum in step with the log.
redis.call('ZREMRANGEBYSCORE', req_key, '-inf', cutoff)
while true do
  local old = redis.call('ZRANGEBYSCORE', tok_key, '-inf', cutoff, 'LIMIT', 0, 500)
  if #old == 0 then break end
  local amounts = redis.call('HMGET', amt_key, unpack(old))
  local freed = 0
  for i = 1, #amounts do freed = freed + (tonumber(amounts[i]) or 0) end
  redis.call('HDEL', amt_key, unpack(old))
  redis.call('ZREM', tok_key, unpack(old))
  if freed > 0 then redis.call('DECRBY', sum_key, freed) end
end
if redis.call('ZCARD', tok_key) == 0 then
  -- Nothing in the window: drop the sum too, so any drift cannot outlive a window.
  redis.call('DEL', sum_key, amt_key)
end
redis.call('ZREMRANGEBYSCORE', lease_key, '-inf', fmt(now))

-- Check every limit and report the one that clears last: the caller must wait for all.
local limit, retry = '', 0
local function refuse(name, r)
  if r < 1 then r = 1 end
  if r > retry then limit, retry = name, r end
end

if max_requests > 0 then
  local n = redis.call('ZCARD', req_key)
  if n >= max_requests then
    -- n - max_requests + 1 entries must leave; the last of them is at this index.
    local e = redis.call('ZRANGE', req_key, n - max_requests, n - max_requests, 'WITHSCORES')
    refuse('requests', tonumber(e[2]) + window - now)
  end
end

if max_tokens > 0 then
  local used = tonumber(redis.call('GET', sum_key) or '0')
  local need = used + reserved - max_tokens
  if need > 0 then
    local r = window
    local start = 0
    local found = false
    while not found do
      local batch = redis.call('ZRANGE', tok_key, start, start + 499, 'WITHSCORES')
      if #batch == 0 then break end
      local ids = {}
      for i = 1, #batch, 2 do ids[#ids + 1] = batch[i] end
      local amounts = redis.call('HMGET', amt_key, unpack(ids))
      for i = 1, #ids do
        need = need - (tonumber(amounts[i]) or 0)
        if need <= 0 then
          r = tonumber(batch[2 * i]) + window - now
          found = true
          break
        end
      end
      start = start + 500
    end
    refuse('tokens', r)
  end
end

if max_concurrent > 0 then
  local c = redis.call('ZCARD', lease_key)
  if c >= max_concurrent then
    -- A slot frees when a request ends (unknown) or a lease expires (known).
    local e = redis.call('ZRANGE', lease_key, 0, 0, 'WITHSCORES')
    refuse('concurrency', math.min(concurrency_retry, tonumber(e[2]) - now))
  end
end

if retry > 0 then return {0, limit, retry} end

local ts = fmt(now)
redis.call('ZADD', req_key, ts, lease_id)
redis.call('PEXPIRE', req_key, log_ttl_ms)
if reserved > 0 then
  redis.call('ZADD', tok_key, ts, lease_id)
  redis.call('HSET', amt_key, lease_id, reserved)
  redis.call('INCRBY', sum_key, reserved)
  redis.call('PEXPIRE', tok_key, log_ttl_ms)
  redis.call('PEXPIRE', amt_key, log_ttl_ms)
  redis.call('PEXPIRE', sum_key, log_ttl_ms)
end
redis.call('ZADD', lease_key, fmt(now + lease_ttl), lease_id)
redis.call('PEXPIRE', lease_key, lease_ttl_ms)
return {1, '', 0}
"""

# KEYS: tokens log, token amounts, tokens in window, leases
# ARGV: lease_id, reserved, actual, log_key_ttl_ms
# Returns 1 when settled, 0 when the lease was already released or had expired.
_RELEASE_LUA = """
local tok_key, amt_key, sum_key, lease_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease_id = ARGV[1]
local delta = tonumber(ARGV[3]) - tonumber(ARGV[2])
local log_ttl_ms = ARGV[4]

local function fmt(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local expiry = redis.call('ZSCORE', lease_key, lease_id)
if not expiry then return 0 end
redis.call('ZREM', lease_key, lease_id)
if tonumber(expiry) <= now then return 0 end

if delta < 0 then
  -- Refund only what is still in the window; an entry that left is already forgotten.
  local cur = tonumber(redis.call('HGET', amt_key, lease_id) or '0')
  local refund = math.min(-delta, cur)
  if refund > 0 then
    redis.call('HSET', amt_key, lease_id, cur - refund)
    redis.call('DECRBY', sum_key, refund)
  end
elseif delta > 0 then
  -- Tokens beyond the reservation were produced up to now: charge them now.
  local member = lease_id .. ':extra'
  redis.call('ZADD', tok_key, fmt(now), member)
  redis.call('HSET', amt_key, member, delta)
  redis.call('INCRBY', sum_key, delta)
  redis.call('PEXPIRE', tok_key, log_ttl_ms)
  redis.call('PEXPIRE', amt_key, log_ttl_ms)
  redis.call('PEXPIRE', sum_key, log_ttl_ms)
end
return 1
"""


# When an acquire's reply is lost, its lease is released after these waits, in turn.
_ABANDONED_RELEASE_DELAYS_S = (0.0, 1.0, 5.0)
logger = logging.getLogger("loraplex.gateway.ratelimit")


class RedisRateLimiter(RateLimiter):
    """Rate limits shared by every gateway process through one Redis."""

    def __init__(
        self,
        url: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        window_s: float = 60.0,
        lease_ttl_s: float = 600.0,
        *,
        concurrency_retry_s: float = 1.0,
        timeout_s: float = DEFAULT_REDIS_TIMEOUT_S,
        request_budget_s: float = DEFAULT_REQUEST_BUDGET_S,
    ) -> None:
        _check_window(window_s, lease_ttl_s, concurrency_retry_s)
        if not (timeout_s > 0 and request_budget_s > 0):
            raise ConfigError(f"timeout_s and request_budget_s must be positive, got "
                              f"{timeout_s} and {request_budget_s}")
        self._budget_s = request_budget_s
        # Imported here so the embedded default never needs redis importable.
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        self._redis = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            health_check_interval=HEALTH_CHECK_INTERVAL_S,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), REDIS_RETRIES),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._prefix = key_prefix
        self._window_us = round(window_s * 1_000_000)
        self._lease_ttl_us = round(lease_ttl_s * 1_000_000)
        self._concurrency_retry_us = round(concurrency_retry_s * 1_000_000)
        # Log keys outlive their newest entry by a window (plus slack), so an idle tenant
        # costs nothing; every write pushes the expiry out again.
        self._log_ttl_ms = math.ceil(window_s * 1000) + 1000
        self._lease_key_ttl_ms = math.ceil(lease_ttl_s * 1000) + 1000
        self._acquire_script = self._redis.register_script(_ACQUIRE_LUA)
        self._release_script = self._redis.register_script(_RELEASE_LUA)
        self._background: set[asyncio.Task[None]] = set()

    def _keys(self, tenant_id: str) -> tuple[str, str, str, str, str]:
        # The hash tag keeps one tenant's keys in one Redis Cluster slot, as scripts need.
        base = f"{self._prefix}{{{tenant_id}}}"
        return (
            f"{base}:req",
            f"{base}:tok",
            f"{base}:tok_amount",
            f"{base}:tok_sum",
            f"{base}:leases",
        )

    async def acquire(self, tenant_id: str, limits: TenantLimits, reserved_tokens: int) -> Lease:
        """See ``RateLimiter.acquire``."""
        _check_acquire_args(limits, reserved_tokens)
        lease_id = uuid.uuid4().hex
        try:
            result = await self._bounded(self._acquire_script(
                keys=list(self._keys(tenant_id)),
                args=[
                    lease_id,
                    self._window_us,
                    self._lease_ttl_us,
                    limits.requests_per_minute or 0,
                    limits.tokens_per_minute or 0,
                    limits.max_concurrent or 0,
                    reserved_tokens,
                    self._concurrency_retry_us,
                    self._log_ttl_ms,
                    self._lease_key_ttl_ms,
                ],
            ))
        except BaseException:
            # The reply was lost (a slow Redis, a cancelled request), not necessarily the
            # script's run: a lease it made would hold the tenant's concurrency and tokens
            # until lease_ttl_s. Released in the background; one never made is not found.
            self._release_later(Lease(tenant_id, lease_id, reserved_tokens))
            raise
        admitted, limit, retry_us = result
        if int(admitted) != 1:
            name = limit.decode() if isinstance(limit, bytes) else str(limit)
            raise RateLimitExceeded(tenant_id, _limit_name(name), int(retry_us) / 1_000_000)
        return Lease(tenant_id=tenant_id, lease_id=lease_id, reserved_tokens=reserved_tokens)

    async def release(self, lease: Lease, actual_tokens: int) -> None:
        """See ``RateLimiter.release``."""
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0, got {actual_tokens}")
        from redis.exceptions import TimeoutError as RedisTimeoutError

        try:
            await self._release_once(lease, actual_tokens)
        except RedisTimeoutError:
            # The request is over and answered: its release (its concurrency slot and its
            # token count) is retried in the background rather than left to the TTL.
            self._release_later(lease, actual_tokens)
            raise

    async def _release_once(self, lease: Lease, actual_tokens: int) -> None:
        req, tok, amount, total, leases = self._keys(lease.tenant_id)
        await self._bounded(self._release_script(
            keys=[tok, amount, total, leases],
            args=[lease.lease_id, lease.reserved_tokens, actual_tokens, self._log_ttl_ms],
        ))

    async def ping(self) -> bool:
        """See ``RateLimiter.ping``."""
        from redis.exceptions import RedisError

        try:
            return bool(await self._bounded(self._redis.ping()))
        except (RedisError, OSError):
            return False

    async def _bounded(self, call: Awaitable[T]) -> T:
        """``call``'s result, or redis' TimeoutError past the request budget."""
        from redis.exceptions import TimeoutError as RedisTimeoutError

        try:
            async with asyncio.timeout(self._budget_s):
                return await call
        except TimeoutError:
            raise RedisTimeoutError(f"Redis timeout: no answer within {self._budget_s:g} s") \
                from None

    def _release_later(self, lease: Lease, actual_tokens: int = 0) -> None:
        async def attempts() -> None:
            for delay in _ABANDONED_RELEASE_DELAYS_S:
                await asyncio.sleep(delay)
                try:
                    await self._release_once(lease, actual_tokens)
                    return
                except Exception:  # Redis still away: the next attempt, then the TTL
                    continue
            logger.warning("lease %s of tenant %s not released: it expires in its TTL",
                           lease.lease_id, lease.tenant_id)

        task = asyncio.get_running_loop().create_task(attempts())
        self._background.add(task)  # held: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Closes the connection pool."""
        await self._redis.aclose()


_LIMIT_NAMES: dict[str, LimitName] = {
    "requests": "requests",
    "tokens": "tokens",
    "concurrency": "concurrency",
}


def _limit_name(name: str) -> LimitName:
    if name not in _LIMIT_NAMES:
        raise RuntimeError(f"rate limit script returned an unknown limit {name!r}")
    return _LIMIT_NAMES[name]


# ---------------------------------------------------------------------------------------
# In process
# ---------------------------------------------------------------------------------------


@dataclass
class _TokenEntry:
    at: float
    amount: int


@dataclass
class _TenantState:
    requests: deque[float] = field(default_factory=deque)  # admission times, oldest first
    tokens: deque[tuple[str, _TokenEntry]] = field(default_factory=deque)  # oldest first
    token_entries: dict[str, _TokenEntry] = field(default_factory=dict)  # by lease id
    num_tokens: int = 0  # sum of amounts in `tokens`
    leases: dict[str, float] = field(default_factory=dict)  # lease id -> expiry

    def is_empty(self) -> bool:
        return not (self.requests or self.tokens or self.leases)


class InProcessRateLimiter(RateLimiter):
    """The same limits as ``RedisRateLimiter``, in this process only (embedded default)."""

    def __init__(
        self,
        window_s: float = 60.0,
        lease_ttl_s: float = 600.0,
        *,
        concurrency_retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_window(window_s, lease_ttl_s, concurrency_retry_s)
        self._window_s = window_s
        self._lease_ttl_s = lease_ttl_s
        self._concurrency_retry_s = concurrency_retry_s
        self._clock = clock
        # A threading lock, not an asyncio one: nothing awaits inside, and callers may sit
        # on different event loops or threads.
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantState] = {}

    def _prune(self, state: _TenantState, now: float) -> None:
        cutoff = now - self._window_s
        while state.requests and state.requests[0] <= cutoff:
            state.requests.popleft()
        while state.tokens and state.tokens[0][1].at <= cutoff:
            key, entry = state.tokens.popleft()
            state.num_tokens -= entry.amount
            del state.token_entries[key]
        expired = [lease_id for lease_id, expiry in state.leases.items() if expiry <= now]
        for lease_id in expired:
            del state.leases[lease_id]

    def _refusal(
        self, state: _TenantState, limits: TenantLimits, reserved_tokens: int, now: float
    ) -> tuple[LimitName, float] | None:
        refusals: list[tuple[LimitName, float]] = []
        rpm = limits.requests_per_minute
        if rpm is not None and len(state.requests) >= rpm:
            at = state.requests[len(state.requests) - rpm]
            refusals.append(("requests", at + self._window_s - now))
        tpm = limits.tokens_per_minute
        if tpm is not None and state.num_tokens + reserved_tokens > tpm:
            need = state.num_tokens + reserved_tokens - tpm
            retry = self._window_s
            for _, entry in state.tokens:
                need -= entry.amount
                if need <= 0:
                    retry = entry.at + self._window_s - now
                    break
            refusals.append(("tokens", retry))
        max_concurrent = limits.max_concurrent
        if max_concurrent is not None and len(state.leases) >= max_concurrent:
            first_expiry = min(state.leases.values())
            refusals.append(("concurrency", min(self._concurrency_retry_s, first_expiry - now)))
        if not refusals:
            return None
        # The caller must wait for every limit to clear: report the one that clears last.
        limit, retry = max(refusals, key=lambda r: r[1])
        return limit, max(retry, 1e-6)

    async def acquire(self, tenant_id: str, limits: TenantLimits, reserved_tokens: int) -> Lease:
        """See ``RateLimiter.acquire``."""
        _check_acquire_args(limits, reserved_tokens)
        lease_id = uuid.uuid4().hex
        with self._lock:
            now = self._clock()
            state = self._tenants.setdefault(tenant_id, _TenantState())
            self._prune(state, now)
            refusal = self._refusal(state, limits, reserved_tokens, now)
            if refusal is not None:
                if state.is_empty():
                    del self._tenants[tenant_id]
                raise RateLimitExceeded(tenant_id, refusal[0], refusal[1])
            state.requests.append(now)
            if reserved_tokens > 0:
                entry = _TokenEntry(now, reserved_tokens)
                state.tokens.append((lease_id, entry))
                state.token_entries[lease_id] = entry
                state.num_tokens += reserved_tokens
            state.leases[lease_id] = now + self._lease_ttl_s
        return Lease(tenant_id=tenant_id, lease_id=lease_id, reserved_tokens=reserved_tokens)

    async def release(self, lease: Lease, actual_tokens: int) -> None:
        """See ``RateLimiter.release``."""
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0, got {actual_tokens}")
        with self._lock:
            now = self._clock()
            state = self._tenants.get(lease.tenant_id)
            if state is None:
                return
            expiry = state.leases.pop(lease.lease_id, None)
            if expiry is not None and expiry > now:
                self._settle(state, lease, actual_tokens, now)
            self._prune(state, now)
            if state.is_empty():
                del self._tenants[lease.tenant_id]

    def _settle(self, state: _TenantState, lease: Lease, actual_tokens: int, now: float) -> None:
        delta = actual_tokens - lease.reserved_tokens
        if delta < 0:
            entry = state.token_entries.get(lease.lease_id)
            if entry is not None:
                refund = min(-delta, entry.amount)
                entry.amount -= refund
                state.num_tokens -= refund
        elif delta > 0:
            extra = _TokenEntry(now, delta)
            key = f"{lease.lease_id}:extra"
            state.tokens.append((key, extra))
            state.token_entries[key] = extra
            state.num_tokens += delta

    async def ping(self) -> bool:
        """See ``RateLimiter.ping``: always, the state is in this process."""
        return True

    async def close(self) -> None:
        """Forgets all state."""
        with self._lock:
            self._tenants.clear()


def make_rate_limiter(
    redis_url: str | None,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    window_s: float = 60.0,
    lease_ttl_s: float = 600.0,
    concurrency_retry_s: float = 1.0,
) -> RateLimiter:
    """A Redis limiter when ``redis_url`` is given, else an in-process one."""
    if redis_url:
        return RedisRateLimiter(
            redis_url, key_prefix, window_s, lease_ttl_s, concurrency_retry_s=concurrency_retry_s
        )
    return InProcessRateLimiter(window_s, lease_ttl_s, concurrency_retry_s=concurrency_retry_s)
