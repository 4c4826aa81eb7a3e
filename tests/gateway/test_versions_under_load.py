"""Adapter versions changing under load: streaming greedy requests of three tenants (n of
1, 2 and 3) run on one small engine, where they are preempted by swapping and by
recompute, while the owner promotes versions, starts, changes and cancels a canary split,
uploads a new version, and deletes a version that requests are running on; once on SQLite
and once on PostgreSQL.

A request's version is fixed when it is admitted: the ``X-Loraplex-Adapter-Version``
header names it, and every finished output (each of its n sequences) equals the greedy
output of HF transformers + PEFT on that version's weights. A request in flight on the
version that is deleted finishes on it (the engine keeps its weights for it); one that
comes after the delete is refused, with 404 ``model_not_found`` (it no longer resolves)
or, when it resolved just before the delete, 422 saying the version was deleted — never
an error in the middle of a stream.

Every step waits on progress (tokens streamed, a request in flight), never on time; that
preemption and swapping happened is read from the engine's counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import transformers

from loraplex.cli_registry import run_registry_cli
from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RegistryConfig,
    SchedulerConfig,
    ServerConfig,
)
from loraplex.engine.client import EngineClient
from loraplex.gateway.app import create_app
from loraplex.gateway.model_resolution import VERSION_HEADER
from loraplex.registry import db, service
from loraplex.testing import bootstrap_admin, load_reference, postgres_schema, reference_greedy

SERVED = "tiny-llama"
MAX_TOKENS = 24
# The weights of versions 1, 2, 3 (there at the start) and 4 (uploaded during the run):
# ranks 4, 8, 16 and 8, over every module, q/v, every module (rsLoRA) and gate/down.
SPECS = {1: "r4", 2: "r8qv", 3: "r16rs", 4: "r8mlp"}
DELETED = 1  # the version deleted while requests run on it
TENANTS = ("acme", "bob", "carol")  # acme owns the public adapter "bot"
IN_FLIGHT = 9  # requests the feeder keeps open until the operations are done
PROGRESS_WAIT_S = 120.0  # a bound on each wait for progress, only so a hang fails
_rng = random.Random(56)
PROMPTS = [[_rng.randrange(3, 380) for _ in range(length)] for length in (7, 9, 10, 12)]


@dataclass
class Server:
    url: str
    admin_key: str
    client: EngineClient
    keys: dict[str, str] = field(default_factory=dict)


def _engine_config(model_dir: Path) -> EngineConfig:
    """Small enough that the run preempts: 44 blocks of 4 tokens for up to 8 sequences of
    up to 36 tokens (9 blocks) each, and a host pool of 10 blocks, so a request swaps out
    while there is room there and is recomputed when there is not; 2 adapter slots for the
    4 versions."""
    return EngineConfig(
        ModelConfig(str(model_dir)),
        CacheConfig(block_size=4, num_kv_blocks=44, swap_space_blocks=10),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, preemption_mode="swap"))


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest, tiny_llama_dir: Path,
           llama_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
           serve_app: Callable[..., contextlib.AbstractContextManager[str]],
           ) -> Iterator[Server]:
    """acme's public adapter ``bot`` with versions 1, 2, 3 (3 current), tenants bob and
    carol calling it as ``acme/bot``."""
    root = tmp_path_factory.mktemp(f"versions_load_{request.param}")
    store = root / "store"
    with contextlib.ExitStack() as stack:
        db_url = (f"sqlite:///{root / 'registry.db'}" if request.param == "sqlite"
                  else stack.enter_context(postgres_schema("versions_load")))
        admin_key = bootstrap_admin(db_url)
        keys = {}
        engine = db.make_engine(db_url)
        try:
            with db.transaction(db.make_session_factory(engine)) as session:
                for name in TENANTS:
                    tenant = service.create_tenant(session, name)
                    _, keys[name] = service.create_key(session, tenant.id)
        finally:
            engine.dispose()
        for version in (1, 2, 3):
            assert run_registry_cli([
                "adapters", "add", "--tenant", "acme", "--name", "bot", "--public",
                str(llama_adapters[SPECS[version]]), "--database-url", db_url,
                "--adapter-dir", str(store), "--model", str(tiny_llama_dir)]) == 0
        client = EngineClient.from_config(_engine_config(tiny_llama_dir))
        stack.callback(client.close)
        app = create_app(ServerConfig(served_model_name=SERVED, max_n=4,
                                      usage_flush_interval_s=0.2),
                         RegistryConfig(db_url, str(store)), client)
        url = stack.enter_context(serve_app(app))
        yield Server(url, admin_key, client, keys)


@dataclass
class Call:
    """One streaming request and what came back."""

    tenant: str
    model: str
    n: int
    prompt: int  # index into PROMPTS
    user: str
    version: int | None = None  # from the response header
    texts: list[str] = field(default_factory=list)
    num_chunks: int = 0
    completion_tokens: int | None = None
    refused: tuple[int, str | None, str] | None = None  # status, code, message
    stream_error: str | None = None
    done: bool = False
    started_at: float = 0.0
    ended_at: float = 0.0

    @property
    def streaming(self) -> bool:
        return self.num_chunks > 0 and not self.done


class Run:
    """The calls, the feeder that keeps ``IN_FLIGHT`` of them open, and progress."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.clients = {t: openai.AsyncOpenAI(base_url=f"{server.url}/v1",
                                              api_key=server.keys[t], max_retries=0,
                                              timeout=PROGRESS_WAIT_S)
                        for t in TENANTS}
        self.calls: list[Call] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.feeding = True
        self._specs = self._spec_cycle()

    def _spec_cycle(self) -> Iterator[tuple[str, str, int]]:
        """(tenant, model, n): a third of the calls name the version to be deleted."""
        for i in itertools.count():
            tenant = TENANTS[i % 3]
            name = "bot" if tenant == "acme" else "acme/bot"
            model = f"{name}@{DELETED}" if i % 3 == 1 else name
            yield tenant, model, (1, 2, 1, 3)[i % 4]

    @property
    def num_chunks(self) -> int:
        return sum(c.num_chunks for c in self.calls)

    async def wait_for(self, what: str, cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + PROGRESS_WAIT_S
        while not cond():
            assert time.monotonic() < deadline, f"no progress: {what}"
            assert not any(t.done() and t.exception() for t in self.tasks), \
                [t.exception() for t in self.tasks if t.done() and t.exception()]
            await asyncio.sleep(0.01)

    async def progress(self, num_chunks: int) -> None:
        target = self.num_chunks + num_chunks
        await self.wait_for(f"{num_chunks} more chunks", lambda: self.num_chunks >= target)

    async def feed(self) -> None:
        while self.feeding:
            if sum(not c.done for c in self.calls) < IN_FLIGHT:
                tenant, model, n = next(self._specs)
                call = Call(tenant, model, n, len(self.calls) % len(PROMPTS),
                            f"user-{len(self.calls)}", texts=[""] * n)
                self.calls.append(call)
                self.tasks.append(asyncio.create_task(self._stream(call)))
            else:
                await asyncio.sleep(0.005)

    async def _stream(self, call: Call) -> None:
        call.started_at = time.monotonic()
        try:
            raw = await self.clients[call.tenant].completions.with_raw_response.create(
                model=call.model, prompt=PROMPTS[call.prompt], max_tokens=MAX_TOKENS,
                temperature=0, n=call.n, user=call.user, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            call.refused = (exc.status_code, exc.code, exc.message)
        else:
            call.version = int(raw.headers[VERSION_HEADER])
            try:
                async for chunk in raw.parse():
                    call.num_chunks += 1
                    for choice in chunk.choices:
                        call.texts[choice.index] += choice.text
                    if chunk.usage is not None:
                        call.completion_tokens = chunk.usage.completion_tokens
            except openai.APIError as exc:  # an error event ended the stream
                call.stream_error = exc.message
        call.ended_at = time.monotonic()
        call.done = True

    async def admin(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=self.server.url, timeout=60) as http:
            response = await http.request(
                method, path, headers={"Authorization": f"Bearer {self.server.keys['acme']}"},
                **kwargs)
        assert response.status_code in (200, 201), response.text
        data: dict[str, Any] = response.json()
        return data

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


def _engine_stats(server: Server) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/admin/api/engine", timeout=60,
                         headers={"Authorization": f"Bearer {server.admin_key}"})
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


async def _scenario(run: Run, upload: Path) -> dict[str, float]:
    """The operations, each once the requests have made progress since the last; returns
    when (monotonic) the delete of ``DELETED`` was answered, and who was in flight then."""
    feeder = asyncio.create_task(run.feed())
    marks: dict[str, float] = {}
    try:
        await run.progress(60)
        await run.admin("POST", "/v1/adapters/bot/promote", json={"version": 2})
        await run.progress(60)
        await run.admin("POST", "/v1/adapters/bot/split", json={"version": 3, "percent": 50})
        await run.progress(60)
        await run.admin("POST", "/v1/adapters/bot/split", json={"version": 3, "percent": 90})
        await run.progress(60)
        with open(upload / "adapter_config.json", "rb") as config, \
                open(upload / "adapter_model.safetensors", "rb") as weights:
            state = await run.admin("POST", "/v1/adapters",
                                    data={"name": "bot", "visibility": "public"},
                                    files={"adapter_config.json": config,
                                           "adapter_model.safetensors": weights})
        assert state["version"] == 4, state
        await run.progress(60)
        await run.admin("POST", "/v1/adapters/bot/split", json={"version": 4, "percent": 40})
        await run.progress(60)
        await run.admin("DELETE", "/v1/adapters/bot/split")
        # Delete the version while requests stream on it (n > 1 among them, if any).
        deleted = f"@{DELETED}"

        def on_deleted_streaming() -> list[Call]:
            return [c for c in run.calls if c.model.endswith(deleted) and c.streaming]

        await run.wait_for("requests streaming on the version to delete",
                           lambda: len(on_deleted_streaming()) >= 2
                           and any(c.n > 1 for c in on_deleted_streaming()))
        marks["delete_sent"] = time.monotonic()
        await run.admin("DELETE", "/v1/adapters/bot", params={"version": str(DELETED)})
        marks["deleted"] = time.monotonic()
        await run.progress(60)
        await run.admin("POST", "/v1/adapters/bot/promote", json={"version": 4})
        marks["promoted_4"] = time.monotonic()
        await run.wait_for("requests of the bare name after the last promote",
                           lambda: sum("@" not in c.model and c.done
                                       and c.started_at > marks["promoted_4"]
                                       for c in run.calls) >= 3)
    finally:
        run.feeding = False
        await feeder
        await asyncio.gather(*run.tasks, return_exceptions=True)
    return marks


def _oracle(model_dir: Path, adapters: dict[str, Path],
            wanted: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """HF + PEFT greedy text of each (version, prompt), and every prompt for every version
    (the versions' outputs must differ, or a mix-up would go unseen)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    out = {}
    for version, spec in SPECS.items():
        model = load_reference(model_dir, adapters[spec])
        for prompt in range(len(PROMPTS)):
            ids, _ = reference_greedy(model, PROMPTS[prompt], MAX_TOKENS)
            out[version, prompt] = tokenizer.decode(ids, skip_special_tokens=True)
    assert wanted <= set(out)
    return out


def test_versions_stay_fixed_under_promote_split_upload_and_delete(
        server: Server, tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    async def main() -> tuple[Run, dict[str, float], int]:
        run = Run(server)
        try:
            marks = await _scenario(run, llama_adapters[SPECS[4]])
            retained = await server.client.run_in_engine(lambda e: e.adapters.num_retained)
            return run, marks, retained
        finally:
            await run.close()

    before = _engine_stats(server)
    run, marks, retained = asyncio.run(main())
    after = _engine_stats(server)
    calls = run.calls
    num_preemptions = after["num_preemptions"] - before["num_preemptions"]
    num_swaps = after["num_swap_outs"] - before["num_swap_outs"]
    num_at_delete = sum(c.started_at < marks["delete_sent"] < c.ended_at
                        for c in calls if c.version == DELETED)
    summary = (f"{len(calls)} calls ({sum(c.n for c in calls)} sequences, "
               f"{sum(c.refused is not None for c in calls)} refused), {num_preemptions} "
               f"preemptions ({num_swaps} by swap), calls per version "
               f"{sorted(Counter(c.version for c in calls if c.version).items())}, "
               f"in flight on v{DELETED} at its delete: {num_at_delete}")
    print(summary)

    # The engine was small enough: requests were swapped out, and recomputed.
    assert num_swaps > 0, summary
    assert num_preemptions > num_swaps, summary

    # No request ended with an error in its stream, and every refusal is one of the two a
    # request for the deleted version gets once it is deleted.
    assert not [c for c in calls if c.stream_error], [c.stream_error for c in calls]
    for call in calls:
        if call.refused is None:
            continue
        status, code, message = call.refused
        assert call.model.endswith(f"@{DELETED}"), call
        assert call.ended_at >= marks["delete_sent"], call
        assert (status, code) == (404, "model_not_found") or (
            status == 422 and code == "adapter_unusable" and "was deleted" in message), call

    # Every finished request: whole, and each of its n outputs is its version's oracle.
    finished = [c for c in calls if c.refused is None]
    oracle = _oracle(tiny_llama_dir, llama_adapters,
                     {(c.version, c.prompt) for c in finished if c.version is not None})
    for prompt in range(len(PROMPTS)):
        assert len({oracle[v, prompt] for v in SPECS}) == len(SPECS), prompt
    for call in finished:
        assert call.version is not None and call.completion_tokens == call.n * MAX_TOKENS, call
        if "@" in call.model:
            assert call.version == int(call.model.rsplit("@", 1)[1]), call
        assert call.texts == [oracle[call.version, call.prompt]] * call.n, call

    # Each version served requests; and the deleted one's in-flight requests finished.
    assert {c.version for c in finished} == set(SPECS), summary
    in_flight_at_delete = [c for c in finished if c.version == DELETED
                           and c.started_at < marks["delete_sent"] < c.ended_at]
    assert len(in_flight_at_delete) >= 2 and any(c.n > 1 for c in in_flight_at_delete)
    assert not [c for c in finished if c.version == DELETED
                and c.started_at > marks["deleted"]]
    # After the last promote, a bare name (no split) is version 4.
    late = [c for c in finished if "@" not in c.model and c.started_at > marks["promoted_4"]]
    assert late and {c.version for c in late} == {4}, summary

    # Nothing left behind: no block held, no deleted version's weights kept.
    idle = after
    deadline = time.monotonic() + PROGRESS_WAIT_S
    while idle["kv_blocks_used"] or idle["num_unfinished"]:
        assert time.monotonic() < deadline, idle
        time.sleep(0.05)
        idle = _engine_stats(server)
    assert retained == 0
