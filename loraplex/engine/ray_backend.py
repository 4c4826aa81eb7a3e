"""Engine replicas on Ray Serve: the ``EngineBackend`` across a process boundary.

Each replica (:class:`EngineReplica`) is a Ray Serve deployment replica holding one
in-process ``EngineClient``. The gateway side (:class:`RayEngineBackend`) calls them through
a deployment handle:

- Routing: a request on an adapter carries ``adapter_id@digest`` as Serve's multiplexed
  model id, so Serve prefers a replica that already holds that adapter; base-model
  requests carry none and get Serve's load balancing.
- Streaming: a replica sends a stream's first token at once and then gathers new tokens
  for ``delta_window_s`` per message (each message through the handle costs replica CPU).
  Closing the stream cancels the replica's request, which aborts it in its engine.
- Errors: a replica answers our own refusals (``InvalidRequestError``...) as plain data,
  rebuilt here, so no Ray wrapper or remote traceback reaches the gateway's error mapping;
  a replica that dies before the first token is retried once (Serve routes the retry to a
  live replica), after it the stream ends with ``EngineDeadError``.
- Adapters: only the identity crosses; a replica resolves the folder by digest in its own
  mount of the content-addressed store (never a path from the request) and its engine
  checks the files' digest when it loads them.
- Shared state goes through Redis (required in Ray mode, as Serve has no broadcast):
  deletions are appended to a stream that every replica reads (blocking), so each drops
  the adapter's slot, host copy and prefix blocks within ``FORGET_BOUND_S`` (keeping the
  weights its requests in flight need) and acknowledges it; the gateway removes the files
  once every live replica has; every replica
  writes its stats under its ordinal (Serve's replica rank, stable across replacements)
  each ``STATS_INTERVAL_S``, which is how the gateway lists every replica, and how it knows
  which of the deployment's replicas are missing (``/ready`` is 503 until all answer); in
  the same round it applies the pinned adapters the gateways wrote (one JSON list of
  ``id@digest``), so a replacement replica holds them too.
- A clean stop of a gateway that started its own local cluster takes everything down: the
  cluster's processes, its session folder, and the replicas' keys in Redis. A gateway that
  joined a cluster leaves it, its replicas and their keys to the other gateways.

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
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import ray
import redis
import redis.asyncio as aioredis
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, RayServeException

from loraplex.adapter_format import stored_folder
from loraplex.config import EngineConfig, RayConfig
from loraplex.engine import kv_events
from loraplex.engine.backend import ModelDescription, description_mismatch
from loraplex.engine.client import EngineClient
from loraplex.engine.fairness import TenantStats
from loraplex.engine.kv_transfer import needs_prefill, prefill_params
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.prefix_routing import PrefixIndex, register_index, unregister_index
from loraplex.engine.ray_address import check_reachable, ray_address
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import NO_SHARE, Share
from loraplex.engine.stats import EngineStats, combine_stats
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
_FORGET_MAXLEN: Final = 10_000
PREFIX_ROUTER: Final = "loraplex.engine.ray_router:PrefixAwareRouter"
KV_EVENTS_INTERVAL_S: Final = 0.25  # a replica publishes at most one batch this often
KV_EVENTS_MAXLEN: Final = 2_000  # batches the stream keeps (a late gateway reads them)
_MODEL_ID = re.compile(r"([A-Za-z0-9_.-]{1,128})@([0-9a-f]{64})")


# --- what crosses the boundary -------------------------------------------------------------

_ERRORS: Final[dict[str, type[LoraplexError]]] = {
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
        kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "EngineDeadError"
        return cls(kind, str(exc), getattr(exc, "param", None))

    def exception(self) -> LoraplexError:
        cls = _ERRORS.get(self.kind, EngineDeadError)
        if issubclass(cls, InvalidRequestError):
            return cls(self.message, param=self.param)
        return cls(self.message)


# One message of a stream: new deltas, then maybe the error that ended it.
Chunk = tuple[list[SequenceDelta], RemoteError | None]


@dataclass(frozen=True)
class Prefilled:
    """What a prefill replica hands a decode replica (through Ray's object store): the
    prompt's blocks in the portable form, or why it computed none (the decode replica
    then computes the prompt itself, and refuses the request if it must)."""

    blocks: tuple[bytes, ...] = ()
    error: RemoteError | None = None


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


def _stats_key(config: RayConfig) -> str:
    return f"{config.sync_key_prefix}{config.app_name}:stats"


def _forget_key(config: RayConfig) -> str:
    return f"{config.sync_key_prefix}{config.app_name}:forget"


def _pins_key(config: RayConfig) -> str:
    return f"{config.sync_key_prefix}{config.app_name}:pins"


def _kv_events_key(config: RayConfig) -> str:
    """Every replica's KV events (``kv_events.py``), one stream, the newest
    KV_EVENTS_MAXLEN batches."""
    return f"{config.sync_key_prefix}{config.app_name}:kv_events"


def _forgot_key(config: RayConfig) -> str:
    """Each replica's newest deletion applied (a stream id), by ordinal."""
    return f"{config.sync_key_prefix}{config.app_name}:forgot"


def _stream_id(value: bytes | str | None) -> tuple[int, int]:
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
        self._block_size = engine_config.cache.block_size
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
        alike; ``params`` only says whether there is anything to hand over."""
        try:
            lora = await self._lora(adapter_key)
            if not needs_prefill(len(prompt_token_ids), params, self._block_size):
                return Prefilled()
            async for _ in self._client.generate(prompt_token_ids, prefill_params(), lora,
                                                 cache_salt, f"{request_id}:prefill",
                                                 share=share):
                pass
            blocks = await self._client.run_in_engine(
                lambda e: e.export_prompt_blocks(prompt_token_ids, lora, cache_salt))
        except LoraplexError as exc:
            return Prefilled(error=RemoteError.of(exc))
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
        key = _stats_key(self._config)
        pinned: Any = None  # the pins last applied, as the gateways wrote them
        while True:
            try:
                # The engine reports itself as replica 0; the deployment knows its ordinal.
                stats = dataclasses.replace(await self._client.stats(), replica=self._ordinal,
                                            role=self._role)
                await self._redis.hset(key, str(self._ordinal), json.dumps(
                    {"at": time.time(), "pid": os.getpid(), "stats": stats_to_json(stats)}))
                now = await self._redis.get(_pins_key(self._config)) or b"[]"
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
        key = _kv_events_key(self._config)
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
        key = _forget_key(self._config)
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
        await self._redis.hset(_forgot_key(self._config), str(self._ordinal), entry_id)

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


# --- the gateway side ----------------------------------------------------------------------


def connect_ray(ray_config: RayConfig) -> Path | None:
    """Joins the cluster at ``ray_config.address`` (or ``LORAPLEX_RAY_ADDRESS``), or starts
    a local one on loopback; returns the folder of the local cluster this process started
    (its session files: ``stop_local_cluster`` removes it), None when it joined one.
    ConfigError in one line when the cluster cannot be reached."""
    address = ray_address(ray_config.address)
    # Without it Ray binds a non-loopback address even when told 127.0.0.1.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if address is not None:
        check_reachable(address)
    temp_dir: Path | None = None
    try:
        if address is None:
            # A folder of its own where Ray would put /tmp/ray, so that a clean stop removes
            # exactly this cluster's files; "local": never a cluster found through
            # RAY_ADDRESS or Ray's "current cluster" file.
            temp_dir = Path(tempfile.mkdtemp(prefix="loraplex-ray-",
                                             dir=os.environ.get("RAY_TMPDIR") or None))
            ray.init(address="local", num_cpus=max(1, os.cpu_count() or 1),
                     include_dashboard=False, _node_ip_address="127.0.0.1",
                     _temp_dir=str(temp_dir),
                     object_store_memory=ray_config.object_store_memory,
                     configure_logging=False, log_to_driver=False)
            return temp_dir
        ray.init(address=address, configure_logging=False, log_to_driver=False)
    except BaseException as exc:
        if temp_dir is not None:  # whatever it had started
            stop_local_cluster(temp_dir)
        if isinstance(exc, ConnectionError | RuntimeError | ValueError):
            raise ConfigError(f"cannot reach the Ray cluster at "
                              f"{address or 'a new local one'}: {first_line(exc)}") from None
        raise
    return None


def stop_local_cluster(temp_dir: Path) -> None:
    """Stops the local cluster this process started (every process of it, replicas
    included, waited for) and removes its session files.

    Not ``serve.shutdown()`` first: the cluster goes as a whole, and Serve's shutdown ends
    with its controller killing itself while this driver still has calls on it (the
    shutdown request, which Serve awaits until that kill, and the handle's long poll); the
    driver's error listener prints each as "Task ServeController.... failed", on every
    clean stop. ``ray.shutdown`` stops that listener before it stops the processes."""
    ray.shutdown(wait_for_processes=True)
    shutil.rmtree(temp_dir, ignore_errors=True)


def remove_replica_state(ray_config: RayConfig, redis_url: str) -> None:
    """Deletes what the replicas keep in Redis (their stats, the deletion stream): only once
    they are gone, or a live replica writes its stats again within STATS_INTERVAL_S."""
    try:
        with redis.Redis.from_url(redis_url, socket_timeout=5) as client:
            client.delete(_stats_key(ray_config), _forget_key(ray_config),
                          _pins_key(ray_config), _forgot_key(ray_config),
                          _kv_events_key(ray_config))
    except redis.RedisError as exc:
        logger.warning("cannot remove the engine replicas' keys from Redis: %s",
                       first_line(exc))


def _unwrap(exc: BaseException) -> BaseException:
    """Our own exception inside a Ray wrapper, or the wrapper."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, LoraplexError):
            return cause
    return exc


class RayEngineBackend:
    """The gateway's handle on the replicas: an ``EngineBackend``."""

    def __init__(self, handle: Any, description: ModelDescription, ray_config: RayConfig,
                 redis_url: str, *, cluster_dir: Path | None = None,
                 prefill_handle: Any = None, block_size: int = 16) -> None:
        """``ray_config.replicas`` (and ``prefill_replicas``): the deployment's, which an
        attaching gateway asks for; ``cluster_dir``: the local cluster this process
        started (see ``connect_ray``); ``prefill_handle``: the prefill replicas' (with
        disaggregation), whose blocks go to replicas of ``handle``."""
        self._handle = handle
        self._prefill_handle = prefill_handle
        self._block_size = block_size
        self._description = description
        self._config = ray_config
        self._redis_url = redis_url
        self._cluster_dir = cluster_dir
        self._redis: aioredis.Redis | None = None
        self._healthy = True
        # Ordinals not seen publishing: every one until the first probe has looked.
        self._missing = tuple(range(self.num_replicas))
        self._health_task: asyncio.Task[None] | None = None
        self._kv_index = PrefixIndex()  # what the router reads (prefix_routing.py)
        self._events_task: asyncio.Task[None] | None = None
        self._stopped = False  # by shutdown: this gateway sends no more requests
        self._closed = False  # by close: the cluster this process started is gone too

    @classmethod
    def deploy(cls, engine_config: EngineConfig, ray_config: RayConfig, adapter_dir: str,
               redis_url: str, expected: ModelDescription) -> RayEngineBackend:
        """Connects to Ray, deploys the replicas unless the application already runs (then
        attaches to it), and checks the served model against ``expected``; ConfigError in
        one line on any failure."""
        cluster_dir = connect_ray(ray_config)
        try:
            handle = cls._existing(ray_config.app_name)
            prefill = cls._existing(prefill_app(ray_config))
            if handle is None:
                if ray_config.prefix_routing:  # the replicas publish what they cache
                    engine_config = dataclasses.replace(engine_config, cache=dataclasses.replace(
                        engine_config.cache, kv_events=True))
                serve.start(proxy_location="Disabled")  # handles only, no HTTP proxy
                if ray_config.prefill_replicas:
                    prefill = _run_app(engine_config, ray_config, "prefill", expected,
                                       adapter_dir, redis_url)
                handle = _run_app(engine_config, ray_config,
                                  "decode" if ray_config.prefill_replicas else "", expected,
                                  adapter_dir, redis_url)
            for h in (handle, prefill) if prefill is not None else (handle,):
                served = h.describe.remote().result(timeout_s=120)
                mismatch = description_mismatch(expected, served)
                if mismatch is not None:
                    raise ConfigError(f"the running replicas serve another model: {mismatch}")
            deployed, prefilling = handle.deployed_replicas.remote().result(timeout_s=120)
            if prefilling and prefill is None:
                raise ConfigError(f"the prefill replicas ({prefill_app(ray_config)}) are not "
                                  "running")
        except BaseException:
            if cluster_dir is not None:
                stop_local_cluster(cluster_dir)
                remove_replica_state(ray_config, redis_url)
            raise
        return cls(handle, expected, dataclasses.replace(ray_config, replicas=deployed,
                                                         prefill_replicas=prefilling),
                   redis_url, cluster_dir=cluster_dir,
                   prefill_handle=prefill if prefilling else None,
                   block_size=engine_config.cache.block_size)

    @staticmethod
    def _existing(app_name: str) -> Any:
        with contextlib.suppress(Exception):  # none running (Serve not started, or no app)
            app = serve.status().applications.get(app_name)
            if app is not None and app.status == "RUNNING":
                return serve.get_app_handle(app_name)
        return None

    # --- EngineBackend ---------------------------------------------------------------------

    @property
    def description(self) -> ModelDescription:
        return self._description

    @property
    def is_ready(self) -> bool:
        return self._healthy and not self._stopped

    @property
    def num_replicas(self) -> int:
        """The replicas the deployment runs (ordinals 0..num_replicas-1; prefill replicas
        after the decode replicas)."""
        return self._config.replicas + self._config.prefill_replicas

    @property
    def missing_replicas(self) -> tuple[int, ...]:
        """The ordinals of the deployment's replicas that have not published their stats
        within STATS_STALE_S (dead, or a replacement still starting), as of the last probe
        (every HEALTH_INTERVAL_S)."""
        return self._missing

    @property
    def is_alive(self) -> bool:
        """Always: a replica whose step loop died fails Serve's health check and is
        replaced (``EngineReplica.check_health``); the gateway itself keeps serving."""
        return True

    def start(self) -> None:
        """Opens the Redis client and starts the readiness probe (on the serving loop)."""
        self._redis = aioredis.from_url(self._redis_url, socket_timeout=5)
        loop = asyncio.get_running_loop()
        self._health_task = loop.create_task(self._probe())
        for app in (self._config.app_name, prefill_app(self._config)):
            register_index(app, self._kv_index)
        self._events_task = loop.create_task(self._follow_kv_events())

    async def shutdown(self) -> None:
        """Stops this gateway's use of the replicas (they serve other gateways on); a local
        cluster this process started goes in ``close``, once the server has stopped."""
        if self._stopped:
            return
        self._stopped = True
        for app in (self._config.app_name, prefill_app(self._config)):
            unregister_index(app, self._kv_index)
        for task in (self._health_task, self._events_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._redis is not None:
            await self._redis.aclose()

    def close(self) -> None:
        """The end: a local cluster this process started goes, with its replicas, its
        session files and their keys in Redis (see ``stop_local_cluster``)."""
        if self._closed:
            return
        self._closed = self._stopped = True
        if self._cluster_dir is not None:
            stop_local_cluster(self._cluster_dir)
            remove_replica_state(self._config, self._redis_url)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       lora: AdapterRef | None, cache_salt: str | None,
                       request_id: str, *, share: Share = NO_SHARE,
                       ) -> AsyncGenerator[SequenceDelta, None]:
        if self._stopped:
            raise EngineDeadError("the engine backend is shut down")
        key = model_id(lora)
        if self._config.adapter_affinity:
            options: dict[str, Any] = {"multiplexed_model_id": key}
            argument = ""
        else:
            options, argument = {}, key
        handle = self._handle.options(stream=True, **options)
        prompt = list(prompt_token_ids)
        # With disaggregation, a prefill replica computes the prompt first; its blocks
        # reach the decode replica as an argument, through Ray's object store (Serve
        # routes the decode call once the prefill is done, and never through here).
        prefill = (self._prefill_handle.options(**options)
                   if self._prefill_handle is not None
                   and needs_prefill(len(prompt), params, self._block_size) else None)
        received = False
        for attempt in range(2):
            # A retry goes to a decode replica alone (it computes the prompt itself):
            # the prefill replica may be what failed.
            prefilled = (prefill.prefill.remote(prompt, params, cache_salt, request_id,
                                                argument, share)
                         if prefill is not None and attempt == 0 else None)
            response = handle.generate.remote(prompt, params, cache_salt, request_id, argument,
                                              share, prefilled)
            finished = False
            try:
                async for deltas, error in response:
                    received = received or bool(deltas)
                    for delta in deltas:
                        yield delta
                    if error is not None:
                        raise error.exception()
                finished = True
                return
            except BackPressureError:
                finished = True  # never assigned to a replica
                raise EngineOverloadedError("every engine replica is busy") from None
            except LoraplexError:
                finished = True
                raise
            # RayServeException: also a replica (or, with disaggregation, the prefill
            # replica whose result this call waits for) gone before its answer.
            except (RayError, RayServeException) as exc:
                cause = _unwrap(exc)
                if isinstance(cause, LoraplexError):
                    raise cause from None
                logger.warning("request %s: engine replica failed (attempt %d): %s",
                               request_id, attempt + 1, first_line(exc))
                if received or attempt == 1:
                    raise EngineDeadError("the engine replica serving this request "
                                          "failed") from None
            finally:
                if not finished:
                    # A consumer gone, or a failure: free the replicas. Serve re-raises the
                    # request's own failure here, which was handled above.
                    for call in (response, prefilled):
                        with contextlib.suppress(Exception):
                            if call is not None:
                                call.cancel()

    async def stats(self) -> EngineStats:
        return combine_stats(await self.replica_stats())

    async def replica_stats(self) -> tuple[EngineStats, ...]:
        """Every live replica's figures (as each last published them), by ordinal."""
        live = await self._published()
        return tuple(stats_from_json(live[ordinal]["stats"]) for ordinal in sorted(live))

    async def _published(self) -> dict[int, dict[str, Any]]:
        """What each live replica last published (within STATS_STALE_S), by ordinal."""
        raw = await self._redis_client().hgetall(_stats_key(self._config))
        now = time.time()
        records = {int(ordinal): json.loads(value) for ordinal, value in raw.items()}
        return {ordinal: record for ordinal, record in records.items()
                if now - float(record["at"]) <= STATS_STALE_S}

    async def set_pinned_adapters(self, refs: Sequence[AdapterRef]) -> None:
        """Every replica, a replacement included, holds these pins within STATS_INTERVAL_S:
        each reads them from Redis with its stats round."""
        await self._redis_client().set(_pins_key(self._config),
                                       json.dumps([model_id(ref) for ref in refs]))

    async def forget_adapter(self, adapter_id: str, digest: str) -> None:
        """Every replica drops the version (see the module doc); returns once every live
        replica has applied it, so that its requests in flight keep the weights they need
        before the files go (``LLMEngine.forget_adapter``), or after 2 × FORGET_BOUND_S
        (a replica that does not answer by then holds no request worth waiting for)."""
        client = self._redis_client()
        entry = _stream_id(await client.xadd(_forget_key(self._config),
                                             {"adapter_id": adapter_id, "digest": digest},
                                             maxlen=_FORGET_MAXLEN, approximate=True))
        deadline = time.monotonic() + 2 * FORGET_BOUND_S
        while True:
            live = await self._published()
            acks = await client.hgetall(_forgot_key(self._config))
            behind = [o for o in live if _stream_id(acks.get(str(o).encode())) < entry]
            if not behind:
                return
            if time.monotonic() > deadline:
                logger.warning("replica %s did not confirm the deletion of adapter %s in "
                               "%.0f s", ", ".join(map(str, behind)), adapter_id,
                               2 * FORGET_BOUND_S)
                return
            await asyncio.sleep(0.05)

    def _redis_client(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("RayEngineBackend.start() was not called")
        return self._redis

    async def _follow_kv_events(self) -> None:
        """The replicas' KV events into this gateway's prefix index, from the oldest batch
        the stream keeps; batches that are not KV events are counted and skipped."""
        key = _kv_events_key(self._config)
        last = "0-0"
        while True:
            try:
                answer: Any = await self._redis_client().xread({key: last}, count=100,
                                                               block=1000)
                for _, entries in answer or ():
                    for entry_id, fields in entries:
                        last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                        if not self._kv_index.apply(fields.get(b"batch", b"")):
                            logger.warning("skipped a message in %s that is not KV events "
                                           "(%d so far)", key, self._kv_index.num_refused)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: routing goes on from what it knows
                logger.warning("cannot read the replicas' KV events: %s", first_line(exc))
                await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _probe(self) -> None:
        while True:
            try:
                live = await self._published()
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away: /ready says so itself (its "redis")
                pass
            else:
                missing = tuple(o for o in range(self.num_replicas) if o not in live)
                gone = sorted(set(missing) - set(self._missing))  # none before a first look
                if gone:
                    logger.warning("engine replica %s of %d stopped answering",
                                   ", ".join(map(str, gone)), self.num_replicas)
                self._missing = missing
            try:
                await asyncio.wait_for(self._handle.describe.remote(), HEALTH_INTERVAL_S * 2)
                self._healthy = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._healthy:
                    logger.warning("engine replicas unreachable: %s", first_line(exc))
                self._healthy = False
            await asyncio.sleep(HEALTH_INTERVAL_S)


def _run_app(engine_config: EngineConfig, ray_config: RayConfig, role: str,
             expected: ModelDescription, adapter_dir: str, redis_url: str) -> Any:
    """Deploys one pool of replicas as its own Serve application; its handle."""
    app = prefill_app(ray_config) if role == "prefill" else ray_config.app_name
    deployment = make_deployment(engine_config, ray_config, role)
    try:
        return serve.run(deployment.bind(engine_config, expected, adapter_dir, redis_url,
                                         ray_config, role),
                         name=app, route_prefix=None)
    except RuntimeError as exc:
        raise ConfigError(f"the engine replicas did not start: "
                          f"{_replica_failure(exc, app)}") from None


def _replica_failure(exc: BaseException, app_name: str) -> str:
    """The one line that says why a deployment failed: our own error from a replica's
    constructor when there is one, else Serve's first line with the last exception its
    deployments report (Serve's own message names only the deployment)."""
    text = str(exc)
    with contextlib.suppress(Exception):  # the controller gone too: Serve's message alone
        app = serve.status().applications.get(app_name) if ray.is_initialized() else None
        if app is not None:
            text += "\n" + "\n".join(d.message for d in app.deployments.values())
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    for cls in _ERRORS:
        match = re.search(rf"loraplex\.errors\.{cls}: (.+)", text)
        if match:
            return match.group(1).strip()
    raised = re.findall(r"^\s*((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception)): (.+)$", text,
                        re.MULTILINE)
    if raised:
        kind, message = raised[-1]
        return f"{first_line(exc)} ({kind.rpartition('.')[2]}: {message.strip()})"
    return first_line(exc)
