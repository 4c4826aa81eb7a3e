"""Prefill/decode disaggregation on a real local Ray cluster, deployed as ``loraplex serve
--backend ray --prefill-replicas 1 --decode-replicas 1`` deploys it, in bfloat16: every
prompt with a full block is computed on the prefill replica, its blocks reach the decode
replica through Ray's object store, and the decode replica computes only the tail. Greedy
outputs of mixed adapters and tenants, seeded samples with n > 1 and a structured output
equal one in-process bf16 engine's; a stream closed early frees its blocks on both sides;
killing the prefill replica, then the decode replica, while requests are in their hands
ends each request with the right tokens (the gateway retries once, on a decode replica
alone) or a clean EngineDeadError, and leaves no block held in either pool."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import random
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("the ray extra is not installed", allow_module_level=True)

import redis  # noqa: E402
from servers import wait_until  # noqa: E402
from test_ray_families import ray_driver  # noqa: E402, F401 (fixture)
from test_ray_replicas import (  # noqa: E402
    REPLACEMENT_STALL_S,
    Cluster,
    cluster,  # noqa: F401 (fixture)
)

from loraplex.adapter_format import folder_digest, stored_folder  # noqa: E402
from loraplex.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RayConfig,
    SchedulerConfig,
)
from loraplex.engine.client import EngineClient  # noqa: E402
from loraplex.engine.engine import model_description  # noqa: E402
from loraplex.engine.request import AdapterRef  # noqa: E402
from loraplex.engine.sampling_params import GrammarSpec, SamplingParams  # noqa: E402
from loraplex.errors import EngineDeadError  # noqa: E402
from loraplex.model.args import ModelArgs  # noqa: E402
from loraplex.model.loader import load_hf_config  # noqa: E402
from loraplex.testing import redis_url_for_tests  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")]

BLOCK = 16
APP = "pd"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
Job = tuple[AdapterRef | None, str, list[int], SamplingParams]


@pytest.fixture(scope="module")
def setup(ray_driver: tuple[Cluster, str], tiny_llama_dir: Path,  # noqa: F811
          llama_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[tuple[EngineConfig, RayConfig, Path, dict[str, AdapterRef]]]:
    ray_cluster, prefix = ray_driver
    store = tmp_path_factory.mktemp("pd_store")
    refs = {}
    for name in ("r4", "r8qv"):
        digest = folder_digest(llama_adapters[name])
        shutil.copytree(llama_adapters[name], store / stored_folder(digest))
        refs[name] = AdapterRef(name, digest, str(llama_adapters[name]))
    engine_config = EngineConfig(ModelConfig(str(tiny_llama_dir), dtype="bfloat16"),
                                 CacheConfig(block_size=BLOCK, num_kv_blocks=128),
                                 LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2),
                                 SchedulerConfig(max_num_seqs=4))
    ray_config = RayConfig(address=ray_cluster.address, replicas=1, prefill_replicas=1,
                           replica_cpus=0.5, app_name=APP,
                           sync_key_prefix=f"{prefix}replicas:")
    yield engine_config, ray_config, store, refs


def _published(ray_config: RayConfig) -> dict[int, dict[str, Any]]:
    with redis.Redis.from_url(redis_url_for_tests()) as client:
        raw = client.hgetall(f"{ray_config.sync_key_prefix}{APP}:stats")
    out = {}
    for ordinal, value in raw.items():
        record = json.loads(value)
        if time.time() - record["at"] < 5:  # a killed replica's last record goes stale
            out[int(ordinal)] = {"at": record["at"], "pid": record["pid"],
                                 **json.loads(record["stats"])}
    return out


async def _run(generate: Any, jobs: list[Job]) -> list[list[list[int]] | BaseException]:
    """Each job's token ids per sequence, all submitted at once; a failure as itself."""
    async def one(lora: AdapterRef | None, salt: str, prompt: list[int],
                  params: SamplingParams) -> list[list[int]]:
        seqs: list[list[int]] = [[] for _ in range(params.n)]
        async for delta in generate(prompt, params, lora, salt, f"pd-{uuid.uuid4().hex}"):
            assert delta.error is None, delta.error
            seqs[delta.index] += delta.new_token_ids
        return seqs

    return list(await asyncio.gather(*(one(*job) for job in jobs), return_exceptions=True))


def _in_process(engine_config: EngineConfig, jobs: list[Job]) -> list[Any]:
    async def run() -> list[Any]:
        async with EngineClient.from_config(engine_config) as client:
            return [(await _run(client.generate, [job]))[0] for job in jobs]

    return asyncio.run(run())


def _idle(ray_config: RayConfig, since: float, head: Any) -> dict[int, dict[str, Any]]:
    """Both replicas' stats, published after ``since`` with no block held."""
    def check() -> bool:
        live = _published(ray_config)
        return len(live) == 2 and all(r["at"] > since and r["kv_blocks_used"] == 0
                                      and r["num_unfinished"] == 0 for r in live.values())

    wait_until(check, head, "both pools idle with every block free",
               stall_s=REPLACEMENT_STALL_S)
    return _published(ray_config)


def test_prefill_on_one_pool_decode_on_the_other_matches_one_engine(
        setup: tuple[EngineConfig, RayConfig, Path, dict[str, AdapterRef]],
        cluster: Cluster,  # noqa: F811
) -> None:
    import ray
    from ray import serve

    from loraplex.engine.ray_backend import RayEngineBackend, prefill_app

    engine_config, ray_config, store, refs = setup
    expected = model_description(engine_config, ModelArgs.from_hf_config(
        load_hf_config(engine_config.model.model)))
    rng = random.Random(3)
    system = [rng.randrange(3, 250) for _ in range(3 * BLOCK)]

    def prompt(n: int) -> list[int]:
        return system + [rng.randrange(3, 250) for _ in range(n)]

    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, n=2,
                             ignore_eos=True)
    choice = dataclasses.replace(GREEDY, grammar=GrammarSpec.choice(["yes", "no", "maybe"]),
                                 ignore_eos=False)
    jobs: list[Job] = [
        (None, "salt-1", prompt(5), GREEDY), (refs["r4"], "salt-1", prompt(7), GREEDY),
        (refs["r8qv"], "salt-2", prompt(21), GREEDY), (refs["r4"], "salt-2", prompt(5), GREEDY),
        (None, "salt-2", prompt(3)[-BLOCK:], GREEDY),  # one block: decoded without a prefill
        (refs["r8qv"], "salt-1", prompt(9), sampled), (None, "salt-1", prompt(4), choice)]
    more: list[Job] = [(refs["r4"], f"salt-k{i}", prompt(60 + i), GREEDY) for i in range(4)]
    decode_killed: list[Job] = [(refs["r8qv"], f"salt-d{i}", prompt(50 + i), GREEDY)
                                for i in range(4)]
    backend = RayEngineBackend.deploy(engine_config, ray_config, str(store),
                                      redis_url_for_tests(), expected)

    def idle() -> dict[int, dict[str, Any]]:
        return _idle(ray_config, time.time(), cluster.head)

    async def scenario() -> tuple[list[Any], dict[int, dict[str, Any]], list[Any]]:
        backend.start()
        try:
            got = await _run(backend.generate, jobs)
            stats = await asyncio.to_thread(idle)
            # A stream closed after its first token: its request ends on both sides.
            stream = backend.generate(prompt(40), dataclasses.replace(GREEDY, max_tokens=400),
                                      refs["r4"], "salt-3", "pd-closed")
            async for _ in stream:
                break
            await stream.aclose()
            await asyncio.to_thread(idle)
            # The prefill replica killed while requests wait on it: each ends with the
            # right tokens (the gateway retries) or a clean error.
            prefill_pid = _published(ray_config)[1]["pid"]
            task = asyncio.ensure_future(_run(backend.generate, more))
            await asyncio.sleep(0.005)
            os.kill(prefill_pid, signal.SIGKILL)
            after_kill = await task
            # The decode replica killed while requests wait on it (or stream from it).
            await asyncio.to_thread(lambda: wait_until(
                lambda: _published(ray_config).get(1, {}).get("pid", prefill_pid) != prefill_pid,
                cluster.head, "a new prefill replica", stall_s=REPLACEMENT_STALL_S))
            pid = _published(ray_config)[0]["pid"]
            task = asyncio.ensure_future(_run(backend.generate, decode_killed))
            await asyncio.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            return got, stats, after_kill + await task
        finally:
            await backend.shutdown()

    try:
        assert backend.num_replicas == 2
        got, stats, after_kill = asyncio.run(scenario())
        # both pools (the replacements included) hold nothing once the requests ended
        _idle(ray_config, time.time(), cluster.head)
    finally:
        backend.close()
        if ray.is_initialized():
            for app in (APP, prefill_app(ray_config)):
                serve.delete(app)
            ray.shutdown()
    assert {o: r["role"] for o, r in stats.items()} == {0: "decode", 1: "prefill"}
    # six prompts with full blocks went through the prefill replica: the decode replica
    # took their blocks and refused none
    assert stats[1]["kv_transfer_exported"] >= 6 * 3
    assert stats[0]["kv_transfer_imported"] >= 6 * 3 - 3  # salt-1's base prefix, once
    assert stats[0]["kv_transfer_refused"] == 0
    assert stats[0]["prefix_cache_hit_tokens"] >= 6 * 3 * BLOCK
    want = _in_process(engine_config, jobs)
    assert got == want
    want_more = _in_process(engine_config, more + decode_killed)
    for result, right in zip(after_kill, want_more, strict=True):
        if isinstance(result, BaseException):
            assert isinstance(result, EngineDeadError), repr(result)
        else:
            assert result == right
