"""The rate limiters themselves (gateway/ratelimit.py), against a real Redis and the
in-process limiter alike; the limits as HTTP callers meet them are in
test_rate_limits_http.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest

from loraplex.errors import ConfigError, InvalidRequestError
from loraplex.gateway.ratelimit import (
    InProcessRateLimiter,
    Lease,
    RateLimiter,
    RateLimitExceeded,
    RedisRateLimiter,
    TenantLimits,
    make_rate_limiter,
)
from loraplex.testing import redis_key_prefix, redis_url_for_tests

REDIS_URL = redis_url_for_tests()

T = TypeVar("T")
LimiterFactory = Callable[..., RateLimiter]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    with redis_key_prefix("rl") as prefix:
        yield prefix


@pytest.fixture(params=["redis", "in_process"])
def make_limiter(request: pytest.FixtureRequest, redis_prefix: str) -> LimiterFactory:
    """Builds a limiter of the parametrised kind; call it inside the test's event loop."""

    def factory(
        window_s: float = 1.0, lease_ttl_s: float = 600.0, concurrency_retry_s: float = 1.0
    ) -> RateLimiter:
        if request.param == "redis":
            return RedisRateLimiter(
                REDIS_URL,
                key_prefix=redis_prefix,
                window_s=window_s,
                lease_ttl_s=lease_ttl_s,
                concurrency_retry_s=concurrency_retry_s,
            )
        return InProcessRateLimiter(
            window_s=window_s, lease_ttl_s=lease_ttl_s, concurrency_retry_s=concurrency_retry_s
        )

    return factory


def test_n_plus_first_request_in_window_is_refused(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=1.0)
        limits = TenantLimits(requests_per_minute=5)
        try:
            for _ in range(5):
                await limiter.release(await limiter.acquire("t", limits, 0), 0)
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 0)
            assert info.value.limit == "requests"
            assert info.value.tenant_id == "t"
            assert 0 < info.value.retry_after <= 1.0
        finally:
            await limiter.close()

    run(main())


def test_recovers_after_the_window_exactly_as_told(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=0.6)
        limits = TenantLimits(requests_per_minute=3)
        try:
            await limiter.acquire("t", limits, 0)
            await asyncio.sleep(0.2)
            await limiter.acquire("t", limits, 0)
            await limiter.acquire("t", limits, 0)
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 0)
            # The oldest request leaves first, about 0.4 s from now.
            assert 0 < info.value.retry_after <= 0.4
            await asyncio.sleep(info.value.retry_after + 0.03)
            await limiter.acquire("t", limits, 0)  # one slot came back...
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 0)  # ...only one: the window slides
            await asyncio.sleep(0.65)
            for _ in range(3):
                await limiter.acquire("t", limits, 0)
        finally:
            await limiter.close()

    run(main())


def test_tokens_reserved_up_front_then_settled(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=5.0)
        limits = TenantLimits(tokens_per_minute=100)
        try:
            first = await limiter.acquire("t", limits, 60)
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 50)  # 60 + 50 > 100
            assert info.value.limit == "tokens"
            assert 0 < info.value.retry_after <= 5.0
            await limiter.release(first, 20)  # refund 40: 20 in the window
            second = await limiter.acquire("t", limits, 50)  # 70
            with pytest.raises(RateLimitExceeded):
                await limiter.acquire("t", limits, 40)  # 110
            await limiter.release(second, 80)  # 30 over the reservation: 100
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 1)
            assert info.value.limit == "tokens"
            await limiter.acquire("t", limits, 0)  # a request reserving nothing still fits
        finally:
            await limiter.close()

    run(main())


def test_tokens_recover_after_the_window(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=0.5)
        limits = TenantLimits(tokens_per_minute=100)
        try:
            lease = await limiter.acquire("t", limits, 100)
            await limiter.release(lease, 100)
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 10)
            assert 0 < info.value.retry_after <= 0.5
            await asyncio.sleep(info.value.retry_after + 0.03)
            await limiter.acquire("t", limits, 100)
        finally:
            await limiter.close()

    run(main())


def test_over_use_is_charged_at_release_time(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=0.6)
        limits = TenantLimits(tokens_per_minute=100)
        try:
            lease = await limiter.acquire("t", limits, 10)
            await asyncio.sleep(0.4)
            await limiter.release(lease, 100)  # 90 extra, charged now
            await asyncio.sleep(0.3)  # the reservation has left the window, the extra not
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 20)
            assert 0.1 < info.value.retry_after <= 0.35
        finally:
            await limiter.close()

    run(main())


def test_reservation_above_the_token_limit_is_invalid(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter()
        try:
            with pytest.raises(InvalidRequestError) as info:
                await limiter.acquire("t", TenantLimits(tokens_per_minute=100), 101)
            assert info.value.param == "max_tokens"
        finally:
            await limiter.close()

    run(main())


def test_concurrency_limit_holds_with_20_clients(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=10.0)
        limits = TenantLimits(max_concurrent=4)
        in_flight = 0
        max_in_flight = 0
        refusals: list[RateLimitExceeded] = []
        done = 0

        async def client() -> None:
            nonlocal in_flight, max_in_flight, done
            for _ in range(3):
                while True:
                    try:
                        lease = await limiter.acquire("t", limits, 0)
                        break
                    except RateLimitExceeded as exc:
                        refusals.append(exc)
                        await asyncio.sleep(random.uniform(0.002, 0.01))
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                await asyncio.sleep(random.uniform(0.005, 0.02))
                in_flight -= 1
                await limiter.release(lease, 0)
                done += 1

        try:
            await asyncio.gather(*(client() for _ in range(20)))
        finally:
            await limiter.close()
        assert done == 60
        assert max_in_flight == 4  # the limit was reached, never passed
        assert refusals
        assert all(r.limit == "concurrency" and 0 < r.retry_after <= 1.0 for r in refusals)

    run(main())


def test_token_limit_holds_with_20_clients(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=30.0)
        limits = TenantLimits(tokens_per_minute=1000)
        rng = random.Random(0)
        wanted = [rng.randint(50, 150) for _ in range(20)]  # ~2000 in all

        async def client(tokens: int) -> tuple[int, Lease | None]:
            try:
                return tokens, await limiter.acquire("t", limits, tokens)
            except RateLimitExceeded as exc:
                assert exc.limit == "tokens"
                return tokens, None

        try:
            results = await asyncio.gather(*(client(n) for n in wanted))
            admitted = sum(n for n, lease in results if lease is not None)
            refused = [n for n, lease in results if lease is None]
            assert admitted <= 1000
            assert refused
            # Usage only grew, so each refused reservation did not fit at its turn.
            assert all(admitted + n > 1000 for n in refused)
            for _, lease in results:
                if lease is not None:
                    await limiter.release(lease, 0)
            # Every reservation was refunded in full.
            await limiter.acquire("t", limits, 1000)
        finally:
            await limiter.close()

    run(main())


def test_nothing_is_reserved_when_refused(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=10.0)
        limits = TenantLimits(requests_per_minute=3, tokens_per_minute=100, max_concurrent=1)
        try:
            held = await limiter.acquire("t", limits, 50)  # request 1, 50 tokens
            for _ in range(5):
                with pytest.raises(RateLimitExceeded) as info:
                    await limiter.acquire("t", limits, 50)
                assert info.value.limit == "concurrency"
            await limiter.release(held, 50)
            for _ in range(5):
                with pytest.raises(RateLimitExceeded) as info:
                    await limiter.acquire("t", limits, 51)
                assert info.value.limit == "tokens"
            # Had any refusal reserved something, one of these would not fit.
            second = await limiter.acquire("t", limits, 50)  # request 2, 100 tokens
            await limiter.release(second, 50)
            await limiter.acquire("t", limits, 0)  # request 3, one slot
        finally:
            await limiter.close()

    run(main())


def test_release_is_idempotent(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=10.0)
        limits = TenantLimits(tokens_per_minute=100, max_concurrent=1)
        try:
            first = await limiter.acquire("t", limits, 60)
            await limiter.release(first, 30)
            await limiter.release(first, 30)  # a second refund would leave 0 in use
            await limiter.release(first, 0)
            second = await limiter.acquire("t", limits, 70)  # 100
            await limiter.release(first, 0)  # must not free the second's slot
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 0)
            assert info.value.limit == "concurrency"
            await limiter.release(second, 70)
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 1)
            assert info.value.limit == "tokens"
        finally:
            await limiter.close()

    run(main())


def test_leases_expire_by_ttl(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=10.0, lease_ttl_s=0.3)
        limits = TenantLimits(tokens_per_minute=100, max_concurrent=1)
        try:
            lost = await limiter.acquire("t", limits, 40)  # its process "dies"
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 0)
            assert info.value.limit == "concurrency"
            assert 0 < info.value.retry_after <= 0.3  # the lease expires before the hint
            await asyncio.sleep(info.value.retry_after + 0.03)
            held = await limiter.acquire("t", limits, 60)  # the reservation stood: 100
            await limiter.release(lost, 0)  # late: neither refunds nor frees a slot
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 0)
            assert info.value.limit == "concurrency"
            await limiter.release(held, 60)
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 1)
            assert info.value.limit == "tokens"
        finally:
            await limiter.close()

    run(main())


def test_refusal_reports_the_limit_that_clears_last(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=2.0, concurrency_retry_s=0.5)
        limits = TenantLimits(requests_per_minute=1, max_concurrent=1)
        try:
            await limiter.acquire("t", limits, 0)
            with pytest.raises(RateLimitExceeded) as info:
                await limiter.acquire("t", limits, 0)
            assert info.value.limit == "requests"
            assert 1.0 < info.value.retry_after <= 2.0
        finally:
            await limiter.close()

    run(main())


def test_tenants_are_independent(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter(window_s=10.0)
        limits = TenantLimits(requests_per_minute=1, tokens_per_minute=10, max_concurrent=1)
        try:
            await limiter.acquire("a", limits, 10)
            with pytest.raises(RateLimitExceeded):
                await limiter.acquire("a", limits, 0)
            await limiter.acquire("b", limits, 10)
        finally:
            await limiter.close()

    run(main())


def test_unlimited_tenant(make_limiter: LimiterFactory) -> None:
    async def main() -> None:
        limiter = make_limiter()
        limits = TenantLimits()
        try:
            leases = [await limiter.acquire("t", limits, 10_000) for _ in range(50)]
            for lease in leases:
                await limiter.release(lease, 20_000)
        finally:
            await limiter.close()

    run(main())


def test_gateway_processes_share_redis_limits(redis_prefix: str) -> None:
    async def main() -> None:
        limiters = [
            RedisRateLimiter(REDIS_URL, key_prefix=redis_prefix, window_s=5.0) for _ in range(2)
        ]
        limits = TenantLimits(requests_per_minute=4, max_concurrent=2)
        try:
            a = await limiters[0].acquire("t", limits, 0)
            await limiters[1].acquire("t", limits, 0)
            with pytest.raises(RateLimitExceeded) as info:
                await limiters[0].acquire("t", limits, 0)
            assert info.value.limit == "concurrency"
            await limiters[1].release(a, 0)  # any process can release any lease
            await limiters[0].acquire("t", limits, 0)
        finally:
            for limiter in limiters:
                await limiter.close()

    run(main())


def test_make_rate_limiter_picks_the_backend(redis_prefix: str) -> None:
    async def main() -> None:
        in_process = make_rate_limiter(None, window_s=2.0)
        shared = make_rate_limiter(REDIS_URL, key_prefix=redis_prefix, window_s=2.0)
        try:
            assert isinstance(in_process, InProcessRateLimiter)
            assert isinstance(shared, RedisRateLimiter)
        finally:
            await in_process.close()
            await shared.close()

    run(main())


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute", "max_concurrent"])
@pytest.mark.parametrize("value", [0, -1])
def test_limits_must_be_positive(field: str, value: int) -> None:
    with pytest.raises(ConfigError):
        TenantLimits(**{field: value})


def test_a_lease_whose_reply_was_lost_is_released(redis_prefix: str) -> None:
    # Redis slower than the client's timeout: the acquire script ran and recorded its lease,
    # the reply came too late, the request got a 503, and the lease held the tenant's one
    # concurrency slot for lease_ttl_s (600 s). Here a proxy in front of the real Redis
    # holds its replies back while `slow` is set.
    url = urlsplit(REDIS_URL)
    slow = asyncio.Event()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   delayed: bool) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if delayed and slow.is_set():
                    await asyncio.sleep(0.6)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(url.hostname, url.port or 6379)
        writers.extend([client_w, server_w])
        tasks.extend([asyncio.create_task(pipe(client_r, server_w, False)),
                      asyncio.create_task(pipe(server_r, client_w, True))])

    tasks: list[asyncio.Task[None]] = []
    writers: list[asyncio.StreamWriter] = []

    async def scenario() -> None:
        proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
        port = proxy.sockets[0].getsockname()[1]
        limiter = RedisRateLimiter(f"redis://127.0.0.1:{port}{url.path}",
                                   key_prefix=redis_prefix, timeout_s=0.3)
        one = TenantLimits(max_concurrent=1)
        try:
            await limiter.release(await limiter.acquire("t", one, 0), 0)  # script loaded
            slow.set()
            with pytest.raises(Exception, match="(?i)timeout"):
                await limiter.acquire("t", one, 0)
            slow.clear()
            for _ in range(50):  # the lease goes back in the background
                await asyncio.sleep(0.1)
                try:
                    lease = await limiter.acquire("t", one, 0)
                    break
                except RateLimitExceeded:
                    continue
            else:
                pytest.fail("the lost acquire's lease still holds the slot")
            await limiter.release(lease, 0)
        finally:
            await limiter.close()
            proxy.close()
            await proxy.wait_closed()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in writers:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    run(scenario())
