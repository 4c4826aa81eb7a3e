"""Per-tenant rate limits through the HTTP API, against the real Redis."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import openai
import pytest

LiveServer = Any  # tests/gateway/conftest.py's LiveServer
PROMPT_IDS = list(range(3, 13))  # 10 tokens: reservations are exact numbers


def test_requests_per_minute_then_recovery(live: LiveServer) -> None:
    """rl-rpm may send 3 requests per window: the 4th is 429, and it passes once the
    window has moved on."""
    with live.openai("rl-rpm") as client:
        start = time.monotonic()
        for _ in range(3):
            client.completions.create(model=live.served_name, prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=live.served_name, prompt="hi", max_tokens=1)
        assert time.monotonic() - start < live.window_s, "too slow to test the window"
        retry_after = int(refused.value.response.headers["retry-after"])
        assert 1 <= retry_after <= math.ceil(live.window_s)
        body: Any = refused.value.body
        assert body["code"] == "rate_limit_exceeded" and body["type"] == "requests"
        time.sleep(retry_after)
        client.completions.create(model=live.served_name, prompt="hi", max_tokens=1)


async def _burst(live: LiveServer, tenant: str, count: int, **kwargs: Any) -> list[Any]:
    async with live.async_openai(tenant) as client:

        async def one() -> Any:
            try:
                return await client.completions.create(model=live.served_name,
                                                       prompt=PROMPT_IDS, **kwargs)
            except openai.RateLimitError as exc:
                return exc

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_tokens_per_minute_with_20_concurrent_clients(live: LiveServer) -> None:
    """rl-tpm has 300 tokens per window; each request reserves 10 prompt + 20 completion
    tokens and uses exactly that (ignore_eos), so exactly 10 of 20 concurrent requests fit."""
    results = asyncio.run(_burst(live, "rl-tpm", 20, max_tokens=20,
                                 extra_body={"ignore_eos": True}))
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) == 10 and len(refused) == 10
    assert all(r.usage.total_tokens == 30 for r in ok)
    for exc in refused:
        assert exc.body["type"] == "tokens"  # type: ignore[index]
        assert int(exc.response.headers["retry-after"]) >= 1
    # A reservation larger than the whole limit can never pass: 400, not 429.
    with live.openai("rl-tpm") as client, pytest.raises(openai.BadRequestError) as too_big:
        client.completions.create(model=live.served_name, prompt=PROMPT_IDS, max_tokens=300)
    assert too_big.value.body["param"] == "max_tokens"  # type: ignore[index]


async def _hold_streams(live: LiveServer, tenant: str, count: int) -> list[Any]:
    """Opens ``count`` streams at once; admitted ones stay open until every attempt has
    been answered, then close (the server aborts them)."""
    answered = 0
    everyone = asyncio.Event()

    def mark() -> None:
        nonlocal answered
        answered += 1
        if answered == count:
            everyone.set()

    async with live.async_openai(tenant) as client:

        async def one() -> Any:
            try:
                stream = await client.completions.create(
                    model=live.served_name, prompt=PROMPT_IDS, max_tokens=400, stream=True,
                    extra_body={"ignore_eos": True})
            except openai.RateLimitError as exc:
                mark()
                return exc
            try:
                async for _ in stream:
                    break
                mark()
                await asyncio.wait_for(everyone.wait(), 60)
            finally:
                await stream.close()
            return "streamed"

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_concurrency_limit_with_20_concurrent_clients(live: LiveServer) -> None:
    """rl-conc may run 3 requests at once: of 20 simultaneous streams, 3 run."""
    results = asyncio.run(_hold_streams(live, "rl-conc", 20))
    assert results.count("streamed") == 3
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 17
    assert all(r.body["type"] == "concurrency" for r in refused)  # type: ignore[index]
    # Closing the streams aborted them and gave the slots back.
    stats = live.wait_idle()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    with live.openai("rl-conc") as client:
        client.completions.create(model=live.served_name, prompt="hi", max_tokens=1)
