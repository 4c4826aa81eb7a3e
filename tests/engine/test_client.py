"""EngineClient: the engine on a background thread, driven by many coroutines at once."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.client import EngineClient
from loraplex.engine.engine import LLMEngine
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import (
    AdapterError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)
from loraplex.llm import LLM, LoRARequest
from loraplex.testing import build_adapter, build_tiny_model

T = TypeVar("T")
TIMEOUT_S = 60.0  # per test: a hang in the client must fail the test, not stall the run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("client_model"))


@pytest.fixture(scope="module")
def loras(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("client_adapters")
    return [
        LoRARequest("r4", str(build_adapter(root / "r4", model_dir, rank=4, alpha=8.0, seed=1))),
        LoRARequest("r8", str(build_adapter(root / "r8", model_dir, rank=8, alpha=16.0,
                                            seed=2, target_modules=("q_proj", "v_proj")))),
    ]


def make_config(model_dir: Path, num_kv_blocks: int = 64, **scheduler: Any) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(model_dir)),
        CacheConfig(num_kv_blocks=num_kv_blocks),
        LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=4),
        SchedulerConfig(**{"max_num_seqs": 32, "max_num_batched_tokens": 256, **scheduler}),
    )


def run(main: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), TIMEOUT_S)

    return asyncio.run(bounded())


def prompt(rng: random.Random, length: int, prefix: list[int] | None = None) -> list[int]:
    # Ids from 3 on: 0-2 are the tokenizer's special tokens.
    body = [rng.randrange(3, 384) for _ in range(length)]
    return (prefix or []) + body


async def collect(agen: Any) -> list[SequenceDelta]:
    return [delta async for delta in agen]


async def wait_until_retired(client: EngineClient) -> None:
    # Aborts from abandoned generators are fire-and-forget (some only once the garbage
    # collector has finalized the generator), so give them a moment to land.
    deadline = time.monotonic() + 10
    while client.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert client.num_unfinished == 0


def check_engine_drained(engine: LLMEngine) -> None:
    """Runs on the engine thread (via run_in_engine): nothing of any request is left."""
    assert not engine.has_unfinished()
    assert engine.scheduler.num_unfinished == 0
    assert engine.kv.all_free_or_cached()
    engine.kv.check_invariants()
    assert all(p == 0 for p in engine.adapters.stats().pins)


def test_100_concurrent_streams_some_aborted(model_dir: Path,
                                             loras: list[LoRARequest]) -> None:
    refs: list[AdapterRef | None] = [None, *(lr.to_ref() for lr in loras)]
    rng = random.Random(0)
    shared = prompt(rng, 32)  # two full blocks: prefix-cache hits within each adapter
    client = EngineClient.from_config(make_config(model_dir))
    tokenizer = client.engine.tokenizer
    completed: dict[str, list[SequenceDelta]] = {}
    aborted: dict[str, tuple[str, list[SequenceDelta]]] = {}

    async def stream(i: int, started: asyncio.Event) -> None:
        rid = f"req-{i}"
        ref = refs[i % 3]
        tokens = prompt(rng, rng.randrange(4, 40), shared if i % 2 else None)
        salt = "tenant-b" if i % 7 == 0 else None
        to_abort = i % 5 == 1
        how = ("client.abort", "break", "aclosing", "cancel")[(i // 5) % 4]
        # Aborted streams are long, so they cannot finish before their abort lands.
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=96 if to_abort else rng.randrange(8, 17))
        abort_after = 2 + i % 3
        deltas: list[SequenceDelta] = []
        if not to_abort:
            completed[rid] = await collect(client.generate(tokens, params, lora=ref,
                                                           cache_salt=salt, request_id=rid))
            assert completed[rid][-1].num_output_tokens == params.max_tokens
            return
        aborted[rid] = (how, deltas)
        agen = client.generate(tokens, params, lora=ref, cache_salt=salt, request_id=rid)
        if how == "aclosing":
            async with contextlib.aclosing(agen) as closing:
                async for delta in closing:
                    deltas.append(delta)
                    if len(deltas) == abort_after:
                        break
            return
        if how == "break":
            del agen  # only the loop below holds the generator: break drops it
            async for delta in client.generate(tokens, params, lora=ref, request_id=rid):
                deltas.append(delta)
                if len(deltas) == abort_after:
                    break  # the generator is finalized (and aborts) once collected
            return
        async for delta in agen:
            deltas.append(delta)
            if len(deltas) == abort_after:
                if how == "client.abort":
                    await client.abort(rid)
                else:
                    started.set()  # the test cancels this task, most likely mid-__anext__

    async def main() -> None:
        client.start()
        events = [asyncio.Event() for _ in range(100)]
        tasks = [asyncio.create_task(stream(i, events[i])) for i in range(100)]
        for i, task in enumerate(tasks):
            if i % 5 == 1 and (i // 5) % 4 == 3:
                await events[i].wait()
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)
                  and not isinstance(r, asyncio.CancelledError)]
        assert not errors, errors
        await wait_until_retired(client)
        await client.run_in_engine(check_engine_drained)
        stats = await client.stats()
        assert stats.prefix_cache_hit_tokens > 0
        await client.shutdown()

    run(main)
    assert not client.is_ready
    assert len(completed) == 80 and len(aborted) == 20
    for rid, deltas in completed.items():
        ids = [t for d in deltas for t in d.new_token_ids]
        assert all(d.request_id == rid and d.index == 0 for d in deltas)
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1].finish_reason == "length" and deltas[-1].metrics is not None
        assert len(ids) == deltas[-1].num_output_tokens
        assert "".join(d.text_delta for d in deltas) == tokenizer.decode(
            ids, skip_special_tokens=True)
    for how, deltas in aborted.values():
        if how == "client.abort":
            assert deltas[-1].finish_reason == "abort"
            assert sum(len(d.new_token_ids) for d in deltas) < 96
        else:
            assert all(d.finish_reason is None for d in deltas)


def test_greedy_and_seeded_outputs_match_offline(model_dir: Path,
                                                 loras: list[LoRARequest]) -> None:
    rng = random.Random(1)
    prompts = [prompt(rng, rng.randrange(3, 30)) for _ in range(12)]
    adapters: list[LoRARequest | None] = [[None, *loras][i % 3] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 10 + [
        SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)] * 2
    config = make_config(model_dir)
    llm = LLM(str(model_dir), max_loras=2, max_lora_rank=8, max_cpu_loras=4,
              num_kv_blocks=64, max_num_seqs=32, max_num_batched_tokens=256, progress=False)
    try:
        offline = llm.generate(prompts, params, adapters)
    finally:
        llm.close()

    async def one(client: EngineClient, i: int) -> list[list[int]]:
        lora = adapters[i]
        outs: list[list[int]] = [[] for _ in range(params[i].n)]
        async for delta in client.generate(prompts[i], params[i],
                                           lora=lora.to_ref() if lora else None):
            outs[delta.index].extend(delta.new_token_ids)
        return outs

    async def main() -> list[list[list[int]]]:
        async with EngineClient.from_config(config) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(12))))

    online = run(main)
    for i in range(12):
        assert online[i] == [o.token_ids for o in offline[i].outputs], i


def test_admission_errors_surface_and_the_loop_goes_on(model_dir: Path,
                                                       loras: list[LoRARequest]) -> None:
    client = EngineClient.from_config(make_config(model_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main() -> None:
        client.start()
        with pytest.raises(PromptTooLongError):
            await collect(client.generate([5] * 600, greedy))
        with pytest.raises(InvalidRequestError, match="out of range"):
            await collect(client.generate([5, 100_000], greedy))
        # A wrong digest fails the adapter's load: the request ends with AdapterError.
        bad = AdapterRef("r4", "0" * 64, loras[0].path)
        with pytest.raises(AdapterError, match="does not match"):
            await collect(client.generate([5, 6, 7], greedy, lora=bad))

        long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        first = client.generate([5, 6, 7], long_run, request_id="dup")
        assert (await anext(first)).new_token_ids
        with pytest.raises(InvalidRequestError, match="already in use"):
            await collect(client.generate([8, 9], greedy, request_id="dup"))
        await client.abort("dup")
        rest = await collect(first)
        assert rest[-1].finish_reason == "abort"
        await client.abort("no-such-request")  # a no-op

        # Ids are free again once their request is over.
        deltas = await collect(client.generate([8, 9], greedy, request_id="dup"))
        assert deltas[-1].finish_reason == "length"
        await wait_until_retired(client)
        await client.run_in_engine(check_engine_drained)
        await client.shutdown()

    run(main)


def test_overload_surfaces(model_dir: Path) -> None:
    client = EngineClient.from_config(make_config(model_dir, max_waiting=2, max_num_seqs=2))
    long_run = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main() -> None:
        async with client:
            streams = [client.generate([5, 6, 7], long_run) for _ in range(2)]
            for agen in streams:
                await anext(agen)
            with pytest.raises(EngineOverloadedError):
                await collect(client.generate([5, 6, 7], long_run))
            for agen in streams:
                await agen.aclose()  # aborts them
            await wait_until_retired(client)
            await client.run_in_engine(check_engine_drained)

    run(main)


def test_n_greater_than_one_streams_every_sequence_and_aborts_cleanly(model_dir: Path) -> None:
    client = EngineClient.from_config(make_config(model_dir))
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)

    async def main() -> None:
        async with client:
            deltas = await collect(client.generate([5, 6, 7, 8], params))
            finished = {d.index: d for d in deltas if d.finished}
            assert sorted(finished) == [0, 1, 2]
            assert all(d.finish_reason == "length" and d.num_output_tokens == 6
                       for d in finished.values())
            # Aborted at once, possibly before the group has forked: the stream still ends.
            task = asyncio.create_task(collect(client.generate(
                [5, 6, 7], SamplingParams(n=3, max_tokens=200, ignore_eos=True),
                request_id="group")))
            await asyncio.sleep(0)
            await client.abort("group")
            aborted = await task
            assert aborted and all(d.finish_reason == "abort" for d in aborted if d.finished)
            await wait_until_retired(client)
            await client.run_in_engine(check_engine_drained)

    run(main)


def test_shutdown_with_requests_in_flight(model_dir: Path) -> None:
    client = EngineClient.from_config(make_config(model_dir))
    long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> list[list[SequenceDelta]]:
        client.start()
        assert client.is_ready
        streams = [client.generate([5, 6, 7 + i], long_run) for i in range(8)]
        firsts = [await anext(agen) for agen in streams]
        tasks = [asyncio.create_task(collect(agen)) for agen in streams]
        assert client.num_unfinished == 8
        await client.shutdown()
        rests = await asyncio.gather(*tasks)
        assert not client.is_ready and client._thread is not None
        assert not client._thread.is_alive()
        with pytest.raises(EngineDeadError):
            await collect(client.generate([5], long_run))
        with pytest.raises(EngineDeadError):
            await client.stats()
        await client.shutdown()  # idempotent
        client.close()
        return [[first, *rest] for first, rest in zip(firsts, rests, strict=True)]

    for deltas in run(main):
        assert deltas[-1].finish_reason == "abort"
        assert sum(len(d.new_token_ids) for d in deltas) < 200
    # The thread is gone, so the engine may be inspected from here.
    check_engine_drained(client.engine)


def test_step_crash_is_engine_dead_for_everyone(model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    client = EngineClient.from_config(make_config(model_dir))
    engine = client.engine
    real_step = engine.step
    num_calls = 0

    def flaky_step() -> list[SequenceDelta]:
        nonlocal num_calls
        num_calls += 1
        if num_calls == 5:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)
    long_run = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def main() -> None:
        client.start()
        results = await asyncio.gather(
            *(collect(client.generate([5, 6, i + 7], long_run)) for i in range(4)),
            return_exceptions=True)
        for result in results:
            assert isinstance(result, EngineDeadError)
            assert isinstance(result.__cause__, RuntimeError)
        assert not client.is_ready
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(client.generate([5], long_run))
        with pytest.raises(EngineDeadError):
            await client.abort("x")
        with pytest.raises(EngineDeadError):
            await client.stats()
        await client.shutdown()
        assert client._thread is not None and not client._thread.is_alive()

    run(main)


def test_failure_while_handling_a_command_answers_those_queued_behind_it(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = EngineClient.from_config(make_config(model_dir))

    def broken_abort(request_id: str) -> list[SequenceDelta]:
        raise RuntimeError("abort broke")

    monkeypatch.setattr(client.engine, "abort", broken_abort)
    gate = threading.Event()
    long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        client.start()
        first = client.generate([5, 6, 7], long_run, request_id="x")
        await anext(first)
        # Hold the engine thread inside a call, so the abort and the next request are
        # drained together once it returns: the abort fails, the request behind it waits.
        blocker = asyncio.create_task(client.run_in_engine(lambda _: gate.wait(10)))
        await asyncio.sleep(0.05)
        aborting = asyncio.create_task(client.abort("x"))
        second = asyncio.create_task(collect(client.generate([8, 9], long_run)))
        await asyncio.sleep(0.05)
        gate.set()
        assert await blocker
        with pytest.raises(EngineDeadError, match="abort broke"):
            await aborting
        with pytest.raises(EngineDeadError):
            await second
        with pytest.raises(EngineDeadError):
            await collect(first)
        await client.shutdown()

    run(main)


def test_idle_loop_blocks_instead_of_spinning(model_dir: Path) -> None:
    client = EngineClient.from_config(make_config(model_dir))

    async def main() -> None:
        async with client:
            start = await client.run_in_engine(lambda _: time.thread_time())
            await asyncio.sleep(0.3)
            end = await client.run_in_engine(lambda _: time.thread_time())
            assert end - start < 0.05
            with pytest.raises(ZeroDivisionError):
                await client.run_in_engine(lambda _: 1 / 0)
            assert client.is_ready  # a failing call does not kill the loop

    run(main)
