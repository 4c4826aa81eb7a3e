"""Engine replicas on a real local Ray cluster, behind two real gateway processes.

First, alone, a gateway that starts a local cluster of its own, and its clean stop. Then one
module-scoped cluster (``ray start --head`` on loopback, two CPUs), two replicas of the
tiny Llama deployed by the first ``loraplex serve --backend ray``, a second gateway process
attached to the same replicas, PostgreSQL for the registry and Redis for limits and replica
state. Every call goes through the official ``openai`` client or plain HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from servers import ready_check, stop_gracefully, wait_ready, wait_until

if importlib.util.find_spec("ray") is None:
    pytest.skip("the ray extra is not installed", allow_module_level=True)

from loraplex.adapter_format import folder_digest  # noqa: E402
from loraplex.cli_registry import run_registry_cli  # noqa: E402
from loraplex.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)
from loraplex.engine.client import EngineClient  # noqa: E402
from loraplex.engine.request import AdapterRef  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402
from loraplex.registry import db, pins, service  # noqa: E402
from loraplex.testing import (
    postgres_schema,
    process_descendants,
    redis_key_prefix,
    redis_url_for_tests,
)  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server]

REDIS_URL = redis_url_for_tests()
SERVED = "tiny"
MAX_LORAS = 2  # per replica, device slots and host cache alike: 4 adapters fit 2 replicas
MAX_NUM_SEQS = 4
ADAPTERS = {"alice/sql": "r4", "alice/qv": "r8qv", "alice/mlp": "r8mlp", "bob/secret": "r16rs"}
RPM = 6  # requests per window of tenant "metered"
# The cluster runs with token authentication, as docs/scale-out.md asks of every cluster.
# How long a replacement replica may show almost no CPU in the cluster's process tree:
# beside busy CPUs, Serve reported one "taken more than 30s to be scheduled" for over 60 s
# (CI, 12-07) before its worker started importing.
REPLACEMENT_STALL_S = 240.0
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@dataclass
class Deployment:
    gateways: list[str]  # base URLs
    keys: dict[str, str]
    admin_key: str
    redis_prefix: str
    model_dir: Path
    adapter_dirs: dict[str, Path]
    logs: list[Path]
    argv: list[str]  # a gateway's command line, less --port
    env: dict[str, str]
    db_url: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    head: subprocess.Popen[bytes] | None = None  # the cluster's `ray start --head`

    def client(self, tenant: str, gateway: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateways[gateway]}/v1", api_key=self.keys[tenant],
                             max_retries=0, timeout=120)

    def replicas(self) -> dict[int, dict[str, Any]]:
        """What each replica last published: ordinal -> {pid, stats}."""
        with redis.Redis.from_url(REDIS_URL) as r:
            raw = r.hgetall(f"{self.redis_prefix}replicas:loraplex:stats")
        out = {}
        for ordinal, value in raw.items():
            record = json.loads(value)
            if time.time() - record["at"] < 5:
                out[int(ordinal)] = {"pid": record["pid"], **json.loads(record["stats"])}
        return out

    def wait_replicas(self, predicate: Any,
                      timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """What the replicas published once ``predicate`` holds for it. With ``timeout_s``
        (where a time bound is what is tested) that long at most; else for as long as the
        cluster works at it (a replacement replica's start takes minutes beside busy CPUs),
        failing only when the cluster stalls or stops."""
        seen: dict[int, dict[str, Any]] = {}

        def reached() -> bool:
            nonlocal seen
            seen = self.replicas()
            return bool(predicate(seen))

        if timeout_s is None:
            assert self.head is not None
            wait_until(reached, self.head, "the replicas", describe=lambda: f"last: {seen}",
                       stall_s=REPLACEMENT_STALL_S)
            return seen
        deadline = time.monotonic() + timeout_s
        while not reached():
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas never reached the state; last: {seen}")
            time.sleep(0.2)
        return seen


def stop_cluster(head: subprocess.Popen[bytes]) -> None:
    """Stops a ``ray start --block`` head and everything it started (SIGINT is its graceful
    stop; a few of its agents outlive it otherwise)."""
    spawned = process_descendants(head.pid)
    stop_gracefully(head)
    for pid in spawned:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Cluster:
    address: str
    head: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A real local Ray cluster on loopback (two CPUs, a small object store)."""
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, **RAY_ENV}
    head = subprocess.Popen(
        [_bin("ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", f"--ray-client-server-port={_free_port()}",
         f"--dashboard-agent-listen-port={_free_port()}", "--num-cpus=2",
         f"--object-store-memory={200 << 20}",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, head, "ray start --head")
        yield Cluster(f"127.0.0.1:{port}", head)
    finally:
        stop_cluster(head)


@pytest.fixture(scope="module")
def deployment(cluster: Cluster, tiny_llama_dir: Path, llama_adapters: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("scaleout")
    store = root / "store"
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(postgres_schema("scaleout"))
        prefix = stack.enter_context(redis_key_prefix("scaleout"))
        db.upgrade(db_url)
        engine = db.make_engine(db_url)
        keys: dict[str, str] = {}
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                for name in ("alice", "bob", "metered"):
                    tenant = service.create_tenant(
                        session, name, max_requests_per_minute=RPM if name == "metered" else None)
                    keys[name] = service.create_key(session, tenant.id)[1]
                ops = service.create_tenant(session, "ops")
                admin_key = service.create_key(session, ops.id, role="admin")[1]
        finally:
            engine.dispose()
        adapter_dirs = {}
        for full, spec in ADAPTERS.items():
            tenant, name = full.split("/")
            assert run_registry_cli(["adapters", "add", "--tenant", tenant, "--name", name,
                                     str(llama_adapters[spec]), "--database-url", db_url,
                                     "--adapter-dir", str(store),
                                     "--model", str(tiny_llama_dir)]) == 0
            adapter_dirs[full] = llama_adapters[spec]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env.update(LORAPLEX_CACHE_SALT_SECRET="scale-out-test-secret",
                   LORAPLEX_HOME=str(root / "home"), **RAY_ENV)
        ports = [_free_port(), _free_port()]
        argv = [_bin("loraplex"), "serve", "--backend", "ray", "--replicas", "2",
                "--replica-cpus", "0.5", "--ray-address", cluster.address,
                "--model", str(tiny_llama_dir), "--served-model-name", SERVED,
                "--database-url", db_url, "--adapter-dir", str(store),
                "--redis-url", REDIS_URL, "--redis-key-prefix", prefix,
                "--num-kv-blocks", "128", "--max-loras", str(MAX_LORAS),
                "--max-cpu-loras", str(MAX_LORAS), "--max-lora-rank", "16",
                "--max-num-seqs", str(MAX_NUM_SEQS), "--log-level", "warning"]
        dep = Deployment([f"http://127.0.0.1:{p}" for p in ports], keys, admin_key, prefix,
                         tiny_llama_dir, adapter_dirs, [root / "gw0.log", root / "gw1.log"],
                         argv, env, db_url=db_url, head=cluster.head)
        try:
            for i, port in enumerate(ports):
                cmd = [*dep.argv, "--port", str(port)]
                if i == 0:  # the deployer: each gateway holds two requests for busy replicas
                    cmd += ["--max-queued-requests", "2"]
                with dep.logs[i].open("wb") as log:
                    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
                dep.procs.append(proc)
                # The first deploys the replicas; the second attaches to them.
                wait_ready(dep.gateways[i], proc, f"gateway {i}", also=[cluster.head.pid],
                           log=dep.logs[i])
            yield dep
        finally:
            for proc in dep.procs:
                proc.send_signal(signal.SIGINT)
            for proc in dep.procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=128),
                        LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=16,
                                   max_cpu_loras=MAX_LORAS),
                        SchedulerConfig(max_num_seqs=MAX_NUM_SEQS))


def _in_process(model_dir: Path, jobs: list[tuple[str | None, str]],
                adapter_dirs: dict[str, Path], max_tokens: int) -> list[str]:
    """The same greedy completions from an engine in this process (the reference)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    async def run() -> list[str]:
        texts = []
        async with EngineClient.from_config(_engine_config(model_dir)) as client:
            for adapter, prompt in jobs:
                ref = None if adapter is None else AdapterRef(
                    adapter, folder_digest(adapter_dirs[adapter]), str(adapter_dirs[adapter]))
                text = ""
                async for delta in client.generate(tokenizer.encode(prompt),
                                                   SamplingParams(max_tokens=max_tokens,
                                                                  temperature=0.0), ref):
                    text += delta.text_delta
                texts.append(text)
        return texts

    return asyncio.run(run())


def _simulated_random_hits(sequence: list[str], replicas: int, capacity: int,
                           seed: int = 0) -> float:
    """Hit rate of the same request sequence under random routing: each replica an LRU of
    ``capacity`` adapters (as the engine's host cache)."""
    rng = random.Random(seed)
    caches: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(replicas)]
    hits = 0
    for adapter in sequence:
        cache = caches[rng.randrange(replicas)]
        if adapter in cache:
            hits += 1
            cache.move_to_end(adapter)
        else:
            cache[adapter] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(sequence)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _stop_with_children(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    spawned = process_descendants(proc.pid)
    stop_gracefully(proc, 60)
    for pid in spawned:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_clean_stop_of_its_own_cluster_leaves_nothing_behind(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """``loraplex serve --backend ray`` without ``--ray-address`` starts a local cluster;
    SIGTERM stops it and removes everything the Ray backend made: the cluster's processes,
    Ray's session folder, the replicas' keys in Redis. The stop prints no error-looking
    line (Serve's shutdown printed two "Task ServeController... failed")."""
    # Where Ray puts its folder (else /tmp/ray): short, as its socket paths must fit 107 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="lpx", dir="/tmp"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, ray_tmp, True)
        db_url = stack.enter_context(postgres_schema("raystop"))
        prefix = stack.enter_context(redis_key_prefix("raystop"))
        db.upgrade(db_url)
        engine = db.make_engine(db_url)
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                key = service.create_key(session, service.create_tenant(session, "alice").id)[1]
        finally:
            engine.dispose()
        store = tmp_path / "store"
        assert run_registry_cli(["adapters", "add", "--tenant", "alice", "--name", "sql",
                                 str(llama_adapters["r4"]), "--database-url", db_url,
                                 "--adapter-dir", str(store),
                                 "--model", str(tiny_llama_dir)]) == 0
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env.update(LORAPLEX_CACHE_SALT_SECRET="clean-stop-secret",
                   LORAPLEX_HOME=str(tmp_path / "home"), RAY_TMPDIR=str(ray_tmp), **RAY_ENV)
        url = f"http://127.0.0.1:{(port := _free_port())}"
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [_bin("loraplex"), "serve", "--backend", "ray", "--replicas", "1",
                 "--replica-cpus", "0.5", "--model", str(tiny_llama_dir),
                 "--database-url", db_url, "--adapter-dir", str(store),
                 "--redis-url", REDIS_URL, "--redis-key-prefix", prefix,
                 "--num-kv-blocks", "64", "--max-lora-rank", "16", "--port", str(port),
                 "--log-level", "warning"], env=env, stdout=out, stderr=out)
        stack.callback(_stop_with_children, proc)  # when the test failed before its stop
        wait_ready(url, proc, "the gateway with its own cluster", log=log)
        ready = httpx.get(f"{url}/ready", timeout=30).json()
        assert ready["replicas"] == {"configured": 1, "missing": []}, ready
        # The replica's stats, a deletion stream (an adapter it served, deleted), the
        # replica's acknowledgement of it, and its KV events (prefix-aware routing).
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        client.completions.create(model="sql", prompt="x", max_tokens=2)
        assert httpx.delete(f"{url}/v1/adapters/sql", headers={
            "Authorization": f"Bearer {key}"}, timeout=30).status_code == 200
        with redis.Redis.from_url(REDIS_URL) as r:
            assert sorted(r.scan_iter(match=f"{prefix}replicas:*")) == [
                f"{prefix}replicas:loraplex:{name}".encode()
                for name in ("forget", "forgot", "kv_events", "stats")]
        assert [p.name[:13] for p in ray_tmp.iterdir()] == ["loraplex-ray-"]
        spawned = process_descendants(proc.pid)  # Ray's, the replica's worker among them
        assert spawned
        mark = log.stat().st_size
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: proc.poll() is not None, proc, "the stop")
        stop_output = log.read_bytes()[mark:].decode(errors="replace")
        # Ray's driver turns the SIGTERM uvicorn re-raises once stopped into exit status 15.
        assert proc.returncode in (0, signal.SIGTERM), (proc.returncode, stop_output)
        assert not re.search(r"error|fail|traceback|exception", stop_output,
                             re.IGNORECASE), stop_output
        assert [pid for pid in spawned if _alive(pid)] == []
        assert list(ray_tmp.iterdir()) == []
        with redis.Redis.from_url(REDIS_URL) as r:
            assert list(r.scan_iter(match=f"{prefix}replicas:*")) == []


def test_mixed_adapters_match_in_process_and_stick_to_replicas(
        deployment: Deployment) -> None:
    rng = random.Random(7)
    mine = [a for a in ADAPTERS if a.startswith("alice/")]
    # Base requests between adapter requests: the working set (3 adapters of alice, and
    # bob's) fits the two replicas' slots together, not one replica's.
    sequence = [rng.choice(mine) for _ in range(36)]
    jobs: list[tuple[str | None, str]] = []
    for i, adapter in enumerate(sequence):
        jobs.append((adapter, f"request {i} says"))
        if i % 4 == 0:
            jobs.append((None, f"base {i} says"))
    before = deployment.wait_replicas(lambda seen: len(seen) == 2)
    loads_before = sum(s["adapter_disk_loads"] for s in before.values())
    client = deployment.client("alice")
    texts = []
    for adapter, prompt in jobs:
        model = SERVED if adapter is None else adapter.split("/")[1]
        texts.append(client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                               temperature=0).choices[0].text)
    expected = _in_process(deployment.model_dir, jobs, deployment.adapter_dirs, 8)
    assert texts == expected

    def settled(seen: dict[int, dict[str, Any]]) -> bool:
        return len(seen) == 2 and all(s["num_unfinished"] == 0 for s in seen.values())

    after = deployment.wait_replicas(settled)
    loads = sum(s["adapter_disk_loads"] for s in after.values()) - loads_before
    hit_rate = 1 - loads / len(sequence)
    random_rate = _simulated_random_hits(sequence, 2, MAX_LORAS)
    print(f"adapter affinity hit rate {hit_rate:.0%} vs {random_rate:.0%} under random "
          f"routing ({len(sequence)} requests, {len(mine)} adapters, 2 replicas x "
          f"{MAX_LORAS} slots)")
    assert hit_rate >= 0.8, (hit_rate, random_rate)
    assert hit_rate > random_rate


def test_a_gateway_for_another_model_configuration_is_refused(
        deployment: Deployment) -> None:
    argv = [*deployment.argv, "--port", str(_free_port())]
    argv[argv.index("--max-lora-rank") + 1] = "8"
    proc = subprocess.run(argv, env=deployment.env, capture_output=True, text=True,
                          timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("loraplex: error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "the running replicas serve another model: max_lora_rank 16 (expected 8)" \
        in errors[0]


def test_cross_tenant_requests_are_404_on_every_gateway(deployment: Deployment) -> None:
    for gateway in (0, 1):
        with pytest.raises(openai.NotFoundError):
            deployment.client("bob", gateway).completions.create(model="sql", prompt="x",
                                                                 max_tokens=2)
        result = deployment.client("bob", gateway).completions.create(
            model="secret", prompt="x", max_tokens=2)
        assert result.usage is not None and result.usage.completion_tokens <= 2


def test_two_gateways_share_exact_rate_limits(deployment: Deployment) -> None:
    outcomes = []
    for i in range(2 * RPM):
        try:
            deployment.client("metered", i % 2).completions.create(model=SERVED, prompt="x",
                                                                   max_tokens=1)
            outcomes.append("ok")
        except openai.RateLimitError:
            outcomes.append("429")
    assert outcomes.count("ok") == RPM, outcomes
    # Usage, metered by each gateway into the shared registry, adds up across them.
    deadline = time.monotonic() + 10
    while True:
        report = httpx.get(f"{deployment.gateways[0]}/admin/api/usage?tenant=metered",
                           headers={"Authorization": f"Bearer {deployment.admin_key}"},
                           timeout=30).json()
        totals = report["totals"][0] if report["totals"] else {"requests": 0}
        if totals["requests"] == RPM or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert totals["requests"] == RPM and totals["completion_tokens"] <= RPM, totals


def test_an_upload_is_measured_through_the_replicas(deployment: Deployment) -> None:
    """The effect probe runs on the replicas like any batch request: the upload answer (or,
    past its wait, the version's entry soon after) carries a non-zero effect."""
    folder = deployment.adapter_dirs["alice/qv"]
    files = {f: (f, (folder / f).read_bytes())
             for f in ("adapter_config.json", "adapter_model.safetensors")}
    headers = {"Authorization": f"Bearer {deployment.keys['bob']}"}
    response = httpx.post(f"{deployment.gateways[0]}/v1/adapters", data={"name": "probed"},
                          files=files, headers=headers, timeout=300)
    assert response.status_code == 201, response.text
    effect = response.json()["effect"]
    try:
        if effect is None:  # measured after the answer: the entry gets it
            def measured() -> bool:
                nonlocal effect
                listed = httpx.get(f"{deployment.gateways[1]}/v1/adapters", headers=headers,
                                   timeout=30).json()["data"]
                effect = next(a["effect"] for a in listed if a["name"] == "probed")
                return effect is not None

            assert deployment.head is not None
            wait_until(measured, deployment.head, "the effect probe")
        assert effect["kl"] > 0 and effect["changed"] > 0, effect
    finally:
        assert httpx.delete(f"{deployment.gateways[0]}/v1/adapters/probed", headers=headers,
                            timeout=60).status_code == 200


def test_deletion_reaches_every_replica(deployment: Deployment) -> None:
    client = deployment.client("alice")
    # More concurrent requests than one replica takes: Serve spills them to the other,
    # so both load the adapter.
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> None:
        with contextlib.suppress(openai.InternalServerError):  # 503: over the bounded queue
            client.completions.create(model="mlp", prompt=f"spill {i}", max_tokens=40,
                                      temperature=0, extra_body={"ignore_eos": True})

    digest12 = folder_digest(deployment.adapter_dirs["alice/mlp"])[:12]

    def holders(seen: dict[int, dict[str, Any]]) -> list[int]:
        return [o for o, s in seen.items()
                if any(slot and slot.endswith(digest12) for slot in s["adapter_slots"])]

    # The spill needs the burst to overlap on the first replica, which a loaded machine
    # (the whole suite running) does not give every time: up to three bursts.
    for _ in range(3):
        with ThreadPoolExecutor(24) as pool:
            list(pool.map(one, range(24)))
        with contextlib.suppress(AssertionError):
            deployment.wait_replicas(lambda seen: len(holders(seen)) == 2, timeout_s=10)
            break
    assert len(holders(deployment.replicas())) == 2, "no burst spilled to the other replica"
    prompt = "in flight at the delete"
    in_flight = iter(client.completions.create(model="mlp", prompt=prompt, max_tokens=40,
                                               temperature=0, stream=True))
    streamed = next(in_flight).choices[0].text  # it runs on a replica now
    deleted_at = time.monotonic()
    response = httpx.delete(f"{deployment.gateways[1]}/v1/adapters/mlp",
                            headers={"Authorization": f"Bearer {deployment.keys['alice']}"})
    assert response.status_code == 200, response.text
    # The delete answered (and removed the files) only once both replicas had applied it.
    with redis.Redis.from_url(REDIS_URL) as r:
        base = f"{deployment.redis_prefix}replicas:loraplex"
        newest = r.xinfo_stream(f"{base}:forget")["last-generated-id"].decode()
        acks = {int(k): v.decode() for k, v in r.hgetall(f"{base}:forgot").items()}

    def as_pair(entry: str) -> tuple[int, ...]:
        return tuple(int(part) for part in entry.split("-"))

    assert set(acks) >= {0, 1} and all(as_pair(acks[o]) >= as_pair(newest) for o in (0, 1))
    streamed += "".join(chunk.choices[0].text for chunk in in_flight)
    assert streamed == _in_process(deployment.model_dir, [("alice/mlp", prompt)],
                                   deployment.adapter_dirs, 40)[0]
    with pytest.raises(openai.NotFoundError):  # at once, on the other gateway too
        client.completions.create(model="mlp", prompt="x", max_tokens=1)
    deployment.wait_replicas(lambda seen: len(seen) == 2 and not holders(seen), timeout_s=5)
    assert time.monotonic() - deleted_at < 5


def test_every_replica_is_listed_and_labelled_by_ordinal(deployment: Deployment) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    digest12 = folder_digest(deployment.adapter_dirs["alice/qv"])[:12]
    deployment.client("alice").completions.create(model="qv", prompt="observe", max_tokens=2)
    deployment.wait_replicas(lambda seen: len(seen) == 2 and any(
        slot and slot.endswith(digest12) for s in seen.values() for slot in s["adapter_slots"]))
    admin = {"Authorization": f"Bearer {deployment.admin_key}"}
    for url in deployment.gateways:  # each gateway lists both replicas
        engine = httpx.get(f"{url}/admin/api/engine", headers=admin, timeout=30).json()
        replicas = engine["replicas"]
        assert [r["replica"] for r in replicas] == [0, 1] and engine["replica"] == -1
        assert [r["max_loras"] for r in replicas] == [MAX_LORAS, MAX_LORAS]
        assert engine["max_loras"] == 2 * MAX_LORAS == len(engine["adapter_slots"])
        assert any(s and s["model"] == "alice/qv" for r in replicas for s in r["slots"])
        # The request's Share crossed to its replica: the scheduler served alice by name.
        assert any(t["name"] == "alice" and t["prefill_tokens"] > 0
                   for r in replicas for t in r["tenants"]), [r["tenants"] for r in replicas]
        text = httpx.get(f"{url}/metrics", headers=admin, timeout=30).text
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        for name in ("loraplex_queue_depth", "loraplex_kv_pool_usage",
                     "loraplex_lora_requests_info", "loraplex_adapter_loads_total"):
            assert sorted(s.labels["replica"] for s in samples if s.name == name) == [
                "0", "1"], name
        assert {s.labels["max_lora"] for s in samples
                if s.name == "loraplex_lora_requests_info"} == {str(MAX_LORAS)}
        device = [s.value for s in samples if s.name == "loraplex_adapter_resident"
                  and s.labels["level"] == "device"]
        assert len(device) == 2 and sum(device) >= 1


def test_replica_killed_mid_stream(deployment: Deployment) -> None:
    client = deployment.client("alice")
    digest12 = folder_digest(deployment.adapter_dirs["alice/sql"])[:12]
    client.completions.create(model="sql", prompt="warm", max_tokens=1)
    seen = deployment.wait_replicas(lambda seen: len(seen) == 2 and any(
        slot and slot.endswith(digest12) for s in seen.values() for slot in s["adapter_slots"]))
    # Serve sends the stream to the replica holding the adapter.
    victim = next(s["pid"] for s in seen.values()
                  if any(slot and slot.endswith(digest12) for slot in s["adapter_slots"]))
    stream = client.completions.create(model="sql", prompt="a long story", max_tokens=400,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    # The gateway stays up; new requests go to the other replica and the replacement.
    for i in range(6):
        result = client.completions.create(model="sql" if i % 2 else SERVED,
                                           prompt=f"after {i}", max_tokens=3)
        assert result.choices[0].finish_reason in ("stop", "length")
    assert all(proc.poll() is None for proc in deployment.procs)
    replaced = deployment.wait_replicas(
        lambda seen: len(seen) == 2 and victim not in {s["pid"] for s in seen.values()})
    assert sorted(replaced) == [0, 1]  # the replacement took the ordinal back
    # Ready again once the gateway's probe (every 2 s) has seen the replacement.
    assert deployment.head is not None
    wait_until(ready_check(deployment.gateways[0]), deployment.head, "/ready",
               also=[p.pid for p in deployment.procs], stall_s=REPLACEMENT_STALL_S)


def test_ready_names_a_missing_replica_until_it_is_replaced(deployment: Deployment) -> None:
    assert deployment.head is not None
    seen = deployment.wait_replicas(lambda seen: sorted(seen) == [0, 1])
    ordinal = 1
    victim = seen[ordinal]["pid"]
    last: dict[str, Any] = {}

    def every_gateway(status: int, missing: list[int]) -> bool:
        for url in deployment.gateways:
            response = httpx.get(f"{url}/ready", timeout=30)
            last[url] = (response.status_code, response.json())
            if response.status_code != status or response.json()["replicas"] != {
                    "configured": 2, "missing": missing}:
                return False
        return True

    # Stopped, not killed: it stays down until killed (or Serve's 30 s health check), so
    # the 503 does not race the replacement's start.
    os.kill(victim, signal.SIGSTOP)
    try:
        wait_until(lambda: every_gateway(503, [ordinal]), deployment.head,
                   "the gateways' /ready", also=[p.pid for p in deployment.procs],
                   describe=lambda: f"last: {last}")
        assert all(body["status"] == "not ready" for _, body in last.values())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    # 503 while the replacement starts, 200 again once it answers under the same ordinal.
    wait_until(lambda: every_gateway(200, []), deployment.head, "the gateways' /ready",
               also=[p.pid for p in deployment.procs], describe=lambda: f"last: {last}",
               stall_s=REPLACEMENT_STALL_S)
    replaced = deployment.replicas()
    assert sorted(replaced) == [0, 1] and replaced[ordinal]["pid"] != victim


def _set_pin(deployment: Deployment, tenant: str, name: str, pinned: bool) -> str:
    """Pins (or unpins) the latest version of tenant/name in the registry, as the CLI
    does with no server; returns the version's identity as stats spell it."""
    engine = db.make_engine(deployment.db_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            owner = service.get_tenant_by_name(session, tenant)
            row = service.resolve_adapter(session, owner.id, name)
            (pins.pin if pinned else pins.unpin)(session, owner.id, name, row.version)
            return f"{row.id}@{row.digest[:12]}"
    finally:
        engine.dispose()


def test_a_pin_holds_on_every_replica(deployment: Deployment) -> None:
    """A pin written to the registry reaches both replicas through the gateways' sync:
    each reports it pinned and in a device slot; unpinned, it is released everywhere."""
    identity = _set_pin(deployment, "alice", "qv", True)
    try:
        deployment.wait_replicas(lambda seen: len(seen) == 2 and all(
            r["pinned_adapters"] == [identity] and identity in r["adapter_slots"]
            for r in seen.values()))
        # Both gateways export it with the pinned label, for each replica.
        for url in deployment.gateways:
            text = httpx.get(f"{url}/metrics", timeout=30, headers={
                "Authorization": f"Bearer {deployment.admin_key}"}).text
            held = {s.labels["replica"] for family in text_string_to_metric_families(text)
                    for s in family.samples if s.name == "loraplex_adapter_residency"
                    and s.labels["adapter"] == identity and s.labels["level"] == "device"
                    and s.labels["pinned"] == "true" and s.value == 1}
            assert held == {"0", "1"}, url
    finally:
        _set_pin(deployment, "alice", "qv", False)
    deployment.wait_replicas(lambda seen: len(seen) == 2 and all(
        not r["pinned_adapters"] for r in seen.values()))


def test_overflow_is_503_with_retry_after(deployment: Deployment) -> None:
    # Each replica takes 2*max_num_seqs (running or queued in its engine), the gateway holds
    # two more: the rest are refused at once.
    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        return await http.post("/v1/completions", json={
            "model": SERVED, "prompt": f"flood {i}", "max_tokens": 300, "ignore_eos": True})

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(
                base_url=deployment.gateways[0], timeout=120,
                headers={"Authorization": f"Bearer {deployment.keys['alice']}"}) as http:
            return await asyncio.gather(*(one(http, i) for i in range(60)))

    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 503]
    assert set(codes) == {200, 503}, codes
    # At least one replica's worth (the replacement of the replica killed above may not be
    # in this gateway's routing table yet).
    assert codes.count(200) >= 2 * MAX_NUM_SEQS
    for response in refused:
        assert response.json()["error"]["code"] == "engine_overloaded"
        assert int(response.headers["Retry-After"]) >= 1
    result = deployment.client("alice", 0).completions.create(model=SERVED, prompt="after",
                                                              max_tokens=2)
    assert result.choices[0].finish_reason in ("stop", "length")


def test_losing_ray_makes_ready_503(deployment: Deployment, cluster: Cluster) -> None:
    # Last: the cluster goes for good.
    stop_cluster(cluster.head)
    deadline = time.monotonic() + 30
    while True:
        response = httpx.get(f"{deployment.gateways[0]}/ready", timeout=10)
        if response.status_code == 503:
            break
        assert time.monotonic() < deadline, "/ready stayed 200 without Ray"
        time.sleep(0.5)
    assert response.json()["engine"] is False
    assert all(proc.poll() is None for proc in deployment.procs)  # the gateways stay up
