"""Tenant-fair scheduling over HTTP: a quiet tenant's request beside one that keeps the
batch full or holds a backlog, on the tiny model, asserted on the engine's step counts
(``loraplex_time_to_first_token_steps`` in /metrics), never on wall time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from servers import ttft_steps_within

from loraplex.config import (
    SchedulerConfig,
    ServerConfig,
)

pytestmark = pytest.mark.slow
MAX_NUM_SEQS = 4


@contextlib.contextmanager
def _server(root: Path, model_dir: Path, policy: str,
            own_server: Callable[..., contextlib.AbstractContextManager[Any]],
            ) -> Iterator[tuple[str, dict[str, str], str]]:
    tenants = {"noisy": {}, "quiet": {}, "batchy": {"priority_class": "batch"}}
    with own_server(root / policy, model_dir, tenants,
                    SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256,
                                    policy=policy),  # type: ignore[arg-type]
                    ServerConfig(served_model_name="tiny", max_tokens_limit=400)) as own:
        yield own.url, own.keys, own.admin_key


def _engine(http: httpx.Client, admin_key: str) -> dict[str, Any]:
    response = http.get("/admin/api/engine", headers={"Authorization": f"Bearer {admin_key}"})
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def _ttft_steps(http: httpx.Client, admin_key: str, tenant: str) -> tuple[float, float]:
    """(requests, of which first token within 3 steps) of ``tenant``, from /metrics."""
    text = http.get("/metrics", headers={"Authorization": f"Bearer {admin_key}"}).text
    return ttft_steps_within(text, tenant, 3)


async def _scenario(url: str, keys: dict[str, str], admin_key: str, num_noisy: int) -> None:
    """The noisy tenant sends ``num_noisy`` long requests; once the engine runs a full batch
    (and holds the rest waiting), the quiet tenant sends one short streaming request."""
    noisy = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys["noisy"], max_retries=0,
                               timeout=120)
    quiet = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys["quiet"], max_retries=0,
                               timeout=120)
    tasks = [asyncio.create_task(noisy.completions.create(
        model="tiny", prompt=f"noise {i}", max_tokens=380, temperature=0.0,
        extra_body={"ignore_eos": True})) for i in range(num_noisy)]
    with httpx.Client(base_url=url, timeout=30) as http:
        # A full batch, and (with a backlog) at least another batch's worth waiting.
        backlog = min(num_noisy - MAX_NUM_SEQS, MAX_NUM_SEQS)
        while True:
            stats = await asyncio.to_thread(_engine, http, admin_key)
            if stats["num_running"] == MAX_NUM_SEQS and stats["num_waiting"] >= backlog:
                break
            assert not all(task.done() for task in tasks), "the noisy requests ended first"
            await asyncio.sleep(0.01)
        stream = await quiet.completions.create(model="tiny", prompt="hello", max_tokens=2,
                                                temperature=0.0, stream=True)
        async for _ in stream:
            pass
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await noisy.close()
    await quiet.close()


@pytest.mark.parametrize("num_noisy", [MAX_NUM_SEQS, 3 * MAX_NUM_SEQS],
                         ids=["batch-full", "backlog"])
def test_a_quiet_tenant_gets_its_first_token_within_three_steps(
        num_noisy: int, tiny_llama_dir: Path, tmp_path: Path,
        own_server: Callable[..., contextlib.AbstractContextManager[Any]]) -> None:
    """Admitted within 2 steps of its arrival, first token in the next at the latest
    (fair); oldest-first makes it wait for a noisy request to end (the check can fail)."""
    for policy in ("fair", "fifo"):
        with _server(tmp_path, tiny_llama_dir, policy, own_server) as (url, keys, admin_key):
            asyncio.run(_scenario(url, keys, admin_key, num_noisy))
            with httpx.Client(base_url=url, timeout=30) as http:
                count, within = _ttft_steps(http, admin_key, "quiet")
        assert count == 1
        assert within == (1 if policy == "fair" else 0), policy


def test_a_request_may_ask_for_batch_but_never_above_its_tenants_class(
        tiny_llama_dir: Path, tmp_path: Path,
        own_server: Callable[..., contextlib.AbstractContextManager[Any]]) -> None:
    with _server(tmp_path, tiny_llama_dir, "fair", own_server) as (url, keys, admin_key):
        def ask(tenant: str, priority: object) -> Any:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys[tenant], max_retries=0)
            return client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                             extra_body={"priority_class": priority})

        assert ask("quiet", "batch").choices[0].text is not None
        assert ask("batchy", "batch").choices[0].text is not None
        assert ask("batchy", None).choices[0].text is not None  # the tenant's own class
        for tenant, priority in (("batchy", "interactive"), ("quiet", "urgent"),
                                 ("quiet", "Batch"), ("quiet", 1), ("quiet", ["batch"])):
            with pytest.raises(openai.BadRequestError) as info:
                ask(tenant, priority)
            assert info.value.body["param"] == "priority_class", (tenant, priority)
        with httpx.Client(base_url=url, timeout=30) as http:
            assert _engine(http, admin_key)["num_unfinished"] == 0
