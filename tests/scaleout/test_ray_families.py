"""The Ray backend serves every family: on one real local Ray cluster, each non-Llama
family's tiny random model (its special features on, ``loraplex.testing.FAMILY_FEATURES``)
is deployed in turn through ``RayEngineBackend.deploy`` (the path ``loraplex serve
--backend ray`` takes), given a mixed batch of base and two PEFT adapters on every module
the family has (Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` included), greedy, on
prompts longer than the family's window; the replica's token ids must equal those of the
same batch in this process (which tests/model/test_families.py holds to HF + PEFT). Each
deployment is deleted before the next, so one replica's memory at a time."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("the ray extra is not installed", allow_module_level=True)

from test_ray_replicas import RAY_ENV, Cluster, cluster  # noqa: E402, F401 (fixture)

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
from loraplex.engine.outputs import SequenceDelta  # noqa: E402
from loraplex.engine.request import AdapterRef  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402
from loraplex.model.families import lora_modules  # noqa: E402
from loraplex.testing import (  # noqa: E402
    FAMILY_FEATURES,
    build_adapter,
    build_tiny_model,
    redis_key_prefix,
    redis_url_for_tests,
)

# Not `server`: its cluster's start is test_ray_replicas.py's, which .ci/run repeats beside
# busy loops; nine deployments in turn there would take most of CI's time.
pytestmark = [pytest.mark.slow,
              # Ray Serve's own pydantic models, on import in this process.
              pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")]

# Mistral with its window; Llama's replicas are test_ray_replicas.py's.
FAMILIES = [arch for arch in FAMILY_FEATURES if arch not in ("llama", "mistral")]
PROMPT_LENGTHS = (29, 37)  # past every family's window (6 to 11 tokens), over 2-3 blocks
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_driver(cluster: Cluster) -> Iterator[tuple[Cluster, str]]:  # noqa: F811
    """This process as a driver of the test cluster, in the environment its gateways get
    (the auth token; loopback), and a fresh Redis key prefix for the replicas' state."""
    with pytest.MonkeyPatch.context() as env, redis_key_prefix("rayfamilies") as prefix:
        for name, value in RAY_ENV.items():
            env.setenv(name, value)
        import ray
        from ray._private import ray_constants

        # Read by Ray when it is first imported (in this process maybe before): without it
        # ray.init turns the head's 127.0.0.1 into this host's outside address, where the
        # head does not listen.
        env.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        try:
            yield cluster, prefix
        finally:
            if ray.is_initialized():
                ray.shutdown()


def _family(arch: str, root: Path) -> tuple[Path, dict[str, Path]]:
    """The family's tiny model and two adapters: rank 4 on every module (Phi-3: the fused
    ``qkv_proj`` and ``gate_up_proj`` among them), rank 16 (rsLoRA) on the MLP's last two
    (Phi-3: the fused ``gate_up_proj`` and ``down_proj``)."""
    model_dir = build_tiny_model(root / "model", arch, num_layers=3, seed=7)
    modules = list(lora_modules(arch.split("-")[0]))
    specs: dict[str, dict[str, Any]] = {
        "all-r4": {"rank": 4, "alpha": 8.0, "seed": 31, "target_modules": modules},
        "mlp-r16": {"rank": 16, "alpha": 16.0, "seed": 32, "use_rslora": True,
                    "target_modules": modules[-2:]}}
    return model_dir, {name: build_adapter(root / name, model_dir, **spec)
                       for name, spec in specs.items()}


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=64),
                        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2),
                        SchedulerConfig(max_num_seqs=4))


async def _batch(generate: Any, jobs: list[tuple[AdapterRef | None, list[int]]]
                 ) -> list[list[int]]:
    """The jobs' greedy token ids, all submitted at once (one mixed batch)."""
    async def one(i: int, lora: AdapterRef | None, prompt: list[int]) -> list[int]:
        ids: list[int] = []
        stream: AsyncIterator[SequenceDelta] = generate(prompt, GREEDY, lora, None,
                                                        f"fam-{i}-{uuid.uuid4().hex}")
        async for delta in stream:
            assert delta.error is None, delta.error
            ids += delta.new_token_ids
        return ids

    return list(await asyncio.gather(*(one(i, lora, prompt)
                                       for i, (lora, prompt) in enumerate(jobs))))


def _through_ray(ray_cluster: Cluster, prefix: str, arch: str, engine_config: EngineConfig,
                 store: Path, jobs: list[tuple[AdapterRef | None, list[int]]]
                 ) -> list[list[int]]:
    """The jobs on one replica deployed as ``loraplex serve --backend ray`` deploys it;
    the application is deleted (and this driver disconnected) before returning."""
    import ray
    from ray import serve

    from loraplex.engine.engine import model_description
    from loraplex.engine.ray_backend import RayEngineBackend
    from loraplex.model.args import ModelArgs
    from loraplex.model.loader import load_hf_config

    ray_config = RayConfig(address=ray_cluster.address, replicas=1, replica_cpus=1.0,
                           app_name=f"family_{arch.replace('-', '_')}",
                           sync_key_prefix=f"{prefix}replicas:")
    expected = model_description(engine_config, ModelArgs.from_hf_config(
        load_hf_config(engine_config.model.model)))
    try:
        backend = RayEngineBackend.deploy(engine_config, ray_config, str(store),
                                          redis_url_for_tests(), expected)

        async def run() -> list[list[int]]:
            backend.start()
            try:
                return await _batch(backend.generate, jobs)
            finally:
                await backend.shutdown()

        try:
            return asyncio.run(run())
        finally:
            backend.close()
    finally:
        if ray.is_initialized():  # a failed deployment goes too
            serve.delete(ray_config.app_name)
            # The next family's deploy connects afresh (one connection per process).
            ray.shutdown()


def _in_process(engine_config: EngineConfig,
                jobs: list[tuple[AdapterRef | None, list[int]]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with EngineClient.from_config(engine_config) as client:
            return await _batch(client.generate, jobs)

    return asyncio.run(run())


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_mixed_batch_through_ray_matches_in_process(
        ray_driver: tuple[Cluster, str], arch: str,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    ray_cluster, prefix = ray_driver
    root = tmp_path_factory.mktemp(arch)
    model_dir, adapters = _family(arch, root)
    store = root / "store"  # the content-addressed layout the registry writes
    refs: dict[str, AdapterRef] = {}
    for name, folder in adapters.items():
        digest = folder_digest(folder)
        shutil.copytree(folder, store / stored_folder(digest))
        refs[name] = AdapterRef(name, digest, str(folder))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(5)
    first, second = ([rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS)
    # The same prompt on base and both adapters (so each adapter's effect shows), and a
    # second prompt on one adapter.
    jobs: list[tuple[AdapterRef | None, list[int]]] = [
        (None, first), (refs["all-r4"], first), (refs["mlp-r16"], first),
        (refs["all-r4"], second)]
    engine_config = _engine_config(model_dir)
    remote = _through_ray(ray_cluster, prefix, arch, engine_config, store, jobs)
    local = _in_process(engine_config, jobs)
    assert remote == local
    assert all(len(ids) == MAX_TOKENS for ids in remote)
    assert remote[0] != remote[1] and remote[0] != remote[2], remote  # adapters applied
