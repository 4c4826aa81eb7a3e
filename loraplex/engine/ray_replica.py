"""What runs in a Ray Serve engine replica, and what crosses between it and the gateways
(``ray_backend.py``, the gateway side, says how the two work together).

- What crosses: prompt token ids, frozen ``SamplingParams``, the salt as an opaque string,
  the adapter identity (``model_id``), the request's ``Share``; back come ``Chunk``s of
  deltas (``in_windows``), our own refusals as ``RemoteError`` data, and, from a prefill
  replica, ``Prefilled`` blocks in the portable form.
- ``EngineReplica``: one ``EngineClient``; it resolves adapters by digest in its own mount
  of the store, publishes its stats (and applies the pins) every ``STATS_INTERVAL_S``,
  follows the deletion stream, and publishes its KV events.
- The Redis keys both sides share (``stats_key``...) live here too.

Imported only in Ray mode: the embedded default never imports ``ray``.
"""


from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import redis.asyncio as aioredis
from ray import serve
from ray.serve.config import RequestRouterConfig

from loraplex.adapter_format import stored_folder
from loraplex.config import EngineConfig, RayConfig
from loraplex.engine import kv_events
from loraplex.engine.backend import ModelDescription, description_mismatch
from loraplex.engine.client import EngineClient
from loraplex.engine.fairness import TenantStats
from loraplex.engine.kv_transfer import prefill_params
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import NO_SHARE, Share
from loraplex.engine.stats import EngineStats
from loraplex.errors import (
    AdapterError,
    ConfigError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    LoraplexError,
    ModelLoadError,
    PromptTooLongError,
    first_line,
)

logger = logging.getLogger(__name__)

STATS_INTERVAL_S: Final = 1.0
STATS_STALE_S: Final = 5.0  # a replica silent this long is no longer listed
FORGET_BOUND_S: Final = 2.0  # a deletion reaches every live replica within this
HEALTH_INTERVAL_S: Final = 2.0
FORGET_MAXLEN: Final = 10_000
PREFIX_ROUTER: Final = "loraplex.engine.ray_router:PrefixAwareRouter"
KV_EVENTS_INTERVAL_S: Final = 0.25  # a replica publishes at most one batch this often
KV_EVENTS_MAXLEN: Final = 2_000  # batches the stream keeps (a late gateway reads them)
_MODEL_ID = re.compile(r"([A-Za-z0-9_.-]{1,128})@([0-9a-f]{64})")


# --- what crosses the boundary -------------------------------------------------------------

REMOTE_ERRORS: Final[dict[str, type[LoraplexError]]] = {
    cls.__name__: cls for cls in (InvalidRequestError, PromptTooLongError,
                                  EngineOverloadedError, EngineDeadError, AdapterError,
                                  ConfigError, ModelLoadError)}


@dataclass(frozen=True)
class RemoteError:
    """A refusal raised in a replica, as plain data (exception pickling loses fields)."""

    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, exc: LoraplexError) -> RemoteError:
        kind = type(exc).__name__ if type(exc).__name__ in REMOTE_ERRORS else "EngineDeadError"
        return cls(kind, str(exc), getattr(exc, "param", None))

    def exception(self) -> LoraplexError:
        cls = REMOTE_ERRORS.get(self.kind, EngineDeadError)
        if issubclass(cls, InvalidRequestError):
            return cls(self.message, param=self.param)
        return cls(self.message)


# One message of a stream: new deltas, then maybe the error that ended it.
Chunk = tuple[list[SequenceDelta], RemoteError | None]


@dataclass(frozen=True)
class Prefilled:
    """What a prefill replica hands a decode replica (through Ray's object store): the
    prompt's blocks in the portable form; none when it refused the prompt (the decode
    replica then computes it itself, and refuses the request if it must)."""

    blocks: tuple[bytes, ...] = ()


def prefill_app(config: RayConfig) -> str:
    """The Serve application of the prefill replicas (beside ``config.app_name``'s)."""
    return f"{config.app_name}_prefill"


def model_id(ref: AdapterRef | None) -> str:
    """Serve's multiplexed model id of a request: the adapter's identity, or "" (base)."""
    return "" if ref is None else f"{ref.adapter_id}@{ref.digest}"


def stats_to_json(stats: EngineStats) -> str:
    return json.dumps(dataclasses.asdict(stats))


def stats_from_json(text: str | bytes) -> EngineStats:
    raw = json.loads(text)
    values: dict[str, Any] = {f.name: _tuples(raw[f.name])
                              for f in dataclasses.fields(EngineStats) if f.name != "tenants"}
    tenants = tuple(TenantStats(**t) for t in raw["tenants"])
    return EngineStats(**values, tenants=tenants)


def _tuples(value: Any) -> Any:
    """JSON's lists as the tuples EngineStats holds, nested ones included."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def stats_key(config: RayConfig) -> str:
    return f"{config.sync_key_prefix}{config.app_name}:stats"


def forget_key(config: RayConfig) -> str:
    return f"{config.sync_key_prefix}{config.app_name}:forget"


def pins_key(config: RayConfig) -> str:
    return f"{config.sync_key_prefix}{config.app_name}:pins"


def kv_events_key(config: RayConfig) -> str:
    """Every replica's KV events (``kv_events.py``), one stream, the newest
    KV_EVENTS_MAXLEN batches."""
    return f"{config.sync_key_prefix}{config.app_name}:kv_events"


def forgot_key(config: RayConfig) -> str:
    """Each replica's newest deletion applied (a stream id), by ordinal."""
    return f"{config.sync_key_prefix}{config.app_name}:forgot"


def stream_id(value: bytes | str | None) -> tuple[int, int]:
    """A Redis stream id ("ms-seq") as a comparable pair."""
    text = value.decode() if isinstance(value, bytes) else (value or "0-0")
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True)
class _End:
    error: RemoteError | None = None
    crash: BaseException | None = None


async def in_windows(stream: AsyncIterator[SequenceDelta],
                     window_s: float) -> AsyncGenerator[Chunk, None]:
    """The stream's deltas in messages: the first alone and at once (time to first token),
    then whatever arrived within ``window_s`` of each message's first delta. A refusal ends
    the messages as data. Closing this closes ``stream`` (which aborts its request)."""
    queue: asyncio.Queue[SequenceDelta | _End] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for delta in stream:
                queue.put_nowait(delta)
        except LoraplexError as exc:
            queue.put_nowait(_End(error=RemoteError.of(exc)))
        except Exception as exc:
            queue.put_nowait(_End(crash=exc))
        else:
            queue.put_nowait(_End())

    task = asyncio.get_running_loop().create_task(pump())
    first = True
    try:
        while True:
            items = [await queue.get()]
            if not first and window_s > 0 and not isinstance(items[0], _End):
                await asyncio.sleep(window_s)
            first = False
            while not queue.empty():
                items.append(queue.get_nowait())
            deltas = [item for item in items if isinstance(item, SequenceDelta)]
            end = items[-1]
            if not isinstance(end, _End):
                yield deltas, None
                continue
            if end.crash is not None:
                raise end.crash
            if deltas or end.error is not None:
                yield deltas, end.error
            return
    finally:
        task.cancel()  # a consumer gone mid-stream: the engine request is aborted
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- the replica ---------------------------------------------------------------------------


class EngineReplica:
    """One engine replica (the body of the Serve deployment ``make_deployment`` builds)."""

    # Serve awaits an async constructor, in the replica's event loop (which the
    # background tasks need).
    async def __init__(self, engine_config: EngineConfig,  # type: ignore[misc]
                       expected: ModelDescription, adapter_dir: str, redis_url: str,
                       ray_config: RayConfig, role: str = "") -> None:
        # Prefill replicas come after the decode replicas' ordinals 0..replicas-1.
        self._ordinal = int(serve.get_replica_context().rank.rank) + (
            ray_config.replicas if role == "prefill" else 0)
        self._role = role
        self._config = ray_config
        client = EngineClient.from_config(engine_config)
        mismatch = description_mismatch(expected, client.description)
        if mismatch is not None:
            client.close()
            raise ConfigError(f"replica {self._ordinal} serves another model than the "
                              f"gateway: {mismatch}")
        client.start()
        self._client = client
        self._store = Path(adapter_dir)

        async def resolve(adapter_key: str) -> AdapterRef:
            return self._resolve(adapter_key)

        # Serve's own LRU of what this replica reports holding (routing); the engine keeps
        # its own slots and host cache, as large.
        self._adapter = serve.multiplexed(
            max_num_models_per_replica=engine_config.lora.max_cpu_loras)(resolve)
        self._redis = aioredis.from_url(redis_url, socket_timeout=10,
                                        health_check_interval=30)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publish_stats()),
                       loop.create_task(self._follow_deletions())]
        if engine_config.cache.kv_events:
            self._tasks.append(loop.create_task(self._publish_kv_events(
                serve.get_replica_context().replica_id.unique_id)))

    def _resolve(self, adapter_key: str) -> AdapterRef:
        match = _MODEL_ID.fullmatch(adapter_key)
        if match is None:
            raise InvalidRequestError("malformed adapter identity", param="model")
        adapter_id, digest = match.groups()
        folder = self._store / stored_folder(digest)
        if not folder.is_dir():
            raise AdapterError(f"adapter {adapter_id}@{digest[:12]} is not in this replica's "
                               "adapter store (is the store mounted here?)")
        return AdapterRef(adapter_id, digest, str(folder))

    async def describe(self) -> ModelDescription:
        return self._client.description

    async def deployed_replicas(self) -> tuple[int, int]:
        """How many decode (or co-located) and prefill replicas the deployment runs (a
        gateway that attaches was not told)."""
        return self._config.replicas, self._config.prefill_replicas

    async def _lora(self, adapter_key: str) -> AdapterRef | None:
        # The key comes as Serve's multiplexed model id (affinity routing), or as an
        # argument when the gateway routes without affinity.
        key = serve.get_multiplexed_model_id() or adapter_key
        return await self._adapter(key) if key else None

    async def prefill(self, prompt_token_ids: list[int], params: SamplingParams,
                      cache_salt: str | None, request_id: str,
                      adapter_key: str = "", share: Share = NO_SHARE) -> Prefilled:
        """Computes the prompt (one greedy token, nobody reads it) and returns its blocks
        (``kv_transfer.py``). The arguments are ``generate``'s, so the routers read both
        alike; the gateway calls this only where ``needs_prefill``."""
        try:
            lora = await self._lora(adapter_key)
            async for _ in self._client.generate(prompt_token_ids, prefill_params(), lora,
                                                 cache_salt, f"{request_id}:prefill",
                                                 share=share):
                pass
            blocks = await self._client.run_in_engine(
                lambda e: e.export_prompt_blocks(prompt_token_ids, lora, cache_salt))
        except LoraplexError as exc:
            logger.info("replica %d: prefill of %s refused: %s", self._ordinal, request_id,
                        first_line(exc))
            return Prefilled()
        return Prefilled(tuple(blocks))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None, request_id: str,
                       adapter_key: str = "", share: Share = NO_SHARE,
                       prefilled: Prefilled | None = None,
                       ) -> AsyncGenerator[Chunk, None]:
        """Streams the request; with ``prefilled`` (a prefill replica's result), its
        blocks go into this engine's prefix cache first, so it computes only the tail."""
        try:
            lora = await self._lora(adapter_key)
            if prefilled is not None and prefilled.blocks:
                blocks = prefilled.blocks
                await self._client.run_in_engine(lambda e: e.import_prompt_blocks(
                    blocks, prompt_token_ids, lora, cache_salt))
        except LoraplexError as exc:
            yield [], RemoteError.of(exc)
            return
        stream = self._client.generate(prompt_token_ids, params, lora, cache_salt, request_id,
                                       share=share)
        async for chunk in in_windows(stream, self._config.delta_window_s):
            yield chunk

    async def stats(self) -> EngineStats:
        return await self._client.stats()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is replaced."""
        if not self._client.is_ready:
            raise EngineDeadError("the engine step loop is not running")

    async def _publish_stats(self) -> None:
        """Each STATS_INTERVAL_S: this replica's stats out, the gateways' pins in."""
        key = stats_key(self._config)
        pinned: Any = None  # the pins last applied, as the gateways wrote them
        while True:
            try:
                # The engine reports itself as replica 0; the deployment knows its ordinal.
                stats = dataclasses.replace(await self._client.stats(), replica=self._ordinal,
                                            role=self._role)
                await self._redis.hset(key, str(self._ordinal), json.dumps(
                    {"at": time.time(), "pid": os.getpid(), "stats": stats_to_json(stats)}))
                now = await self._redis.get(pins_key(self._config)) or b"[]"
                if now != pinned:
                    await self._client.set_pinned_adapters(
                        [self._resolve(identity) for identity in json.loads(now)])
                    pinned = now
            except EngineDeadError:
                return
            except Exception as exc:  # Redis away: the next round tries again
                logger.warning("replica %d: cannot publish stats or apply pins: %s",
                               self._ordinal, exc)
            await asyncio.sleep(STATS_INTERVAL_S)

    async def _publish_kv_events(self, replica_id: str) -> None:
        """Each KV_EVENTS_INTERVAL_S, what the prefix cache stored and evicted since, as
        one batch (none when nothing changed). A batch Redis did not take is replaced by a
        snapshot in the next one (the engine's log starts over)."""
        key = kv_events_key(self._config)
        while True:
            try:
                events = await self._client.run_in_engine(lambda e: e.take_kv_events())
                if events:
                    try:
                        await self._redis.xadd(
                            key, {"batch": json.dumps(kv_events.batch(replica_id, events))},
                            maxlen=KV_EVENTS_MAXLEN, approximate=True)
                    except Exception:
                        await self._client.run_in_engine(lambda e: e.resync_kv_events())
                        raise
            except EngineDeadError:
                return
            except Exception as exc:
                logger.warning("replica %d: cannot publish KV events: %s", self._ordinal, exc)
            await asyncio.sleep(KV_EVENTS_INTERVAL_S)

    async def _follow_deletions(self) -> None:
        key = forget_key(self._config)
        last: str | None = None  # the newest deletion already applied
        while True:
            try:
                if last is None:
                    # Deletions before this replica started concern nothing it holds: start
                    # after the newest one (a concrete id, so none is missed later).
                    exists = await self._redis.exists(key)
                    info: Any = await self._redis.xinfo_stream(key) if exists else None
                    last = info["last-generated-id"] if info else "0-0"
                    if isinstance(last, bytes):
                        last = last.decode()
                    await self._acknowledge(last)
                answer: Any = await self._redis.xread({key: last},
                                                      block=int(FORGET_BOUND_S * 500))
                for _, entries in answer or ():
                    for entry_id, fields in entries:
                        last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                        await self._client.forget_adapter(fields[b"adapter_id"].decode(),
                                                          fields[b"digest"].decode())
                        await self._acknowledge(last)
            except EngineDeadError:
                return
            except Exception as exc:
                logger.warning("replica %d: cannot read deletions: %s", self._ordinal, exc)
                await asyncio.sleep(FORGET_BOUND_S / 4)

    async def _acknowledge(self, entry_id: str) -> None:
        """Tells the gateways this replica applied every deletion up to ``entry_id``: it
        holds its own copy of what its requests need, so the files may go."""
        await self._redis.hset(forgot_key(self._config), str(self._ordinal), entry_id)

    async def __del__(self) -> None:
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        client = getattr(self, "_client", None)
        if client is not None:
            await client.shutdown()


def make_deployment(engine_config: EngineConfig, ray_config: RayConfig, role: str = "") -> Any:
    """The Serve deployment of ``ray_config.replicas`` engine replicas, or of its
    ``prefill_replicas`` for ``role`` "prefill"."""
    gpus = ray_config.replica_gpus
    # Off: Serve's own router (adapter affinity through multiplexed ids, then load).
    router = RequestRouterConfig(
        request_router_class=PREFIX_ROUTER,  # type: ignore[arg-type]  # str | Callable
        request_router_kwargs={"block_size": engine_config.cache.block_size,
                               "room": engine_config.scheduler.max_num_seqs},
    ) if ray_config.prefix_routing else RequestRouterConfig()
    return serve.deployment(
        EngineReplica, name="prefill" if role == "prefill" else "engine",
        num_replicas=(ray_config.prefill_replicas if role == "prefill"
                      else ray_config.replicas),
        ray_actor_options={"num_cpus": ray_config.replica_cpus,
                           **({"num_gpus": gpus} if gpus else {})},
        # Above max_num_seqs so the engine's own queue keeps a batch ready behind the
        # running one; beyond it, requests wait in each gateway (bounded, then 503).
        max_ongoing_requests=2 * engine_config.scheduler.max_num_seqs,
        max_queued_requests=ray_config.max_queued_requests,
        health_check_period_s=HEALTH_INTERVAL_S, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5, request_router_config=router)
