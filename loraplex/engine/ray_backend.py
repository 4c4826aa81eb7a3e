"""Engine replicas on Ray Serve: the ``EngineBackend`` across a process boundary.

Each replica (``ray_replica.EngineReplica``) is a Ray Serve deployment replica holding one
in-process ``EngineClient``. The gateway side (:class:`RayEngineBackend`, this module)
calls them through a deployment handle:

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
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import ray
import redis
import redis.asyncio as aioredis
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException

from loraplex.config import EngineConfig, RayConfig
from loraplex.engine.backend import ModelDescription, description_mismatch
from loraplex.engine.kv_transfer import needs_prefill
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.prefix_routing import PrefixIndex, register_index, unregister_index
from loraplex.engine.ray_address import check_reachable, ray_address
from loraplex.engine.ray_replica import (
    FORGET_BOUND_S,
    FORGET_MAXLEN,
    HEALTH_INTERVAL_S,
    REMOTE_ERRORS,
    STATS_STALE_S,
    forget_key,
    forgot_key,
    kv_events_key,
    make_deployment,
    model_id,
    pins_key,
    prefill_app,
    stats_from_json,
    stats_key,
    stream_id,
)
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import NO_SHARE, Share
from loraplex.engine.stats import EngineStats, combine_stats
from loraplex.errors import (
    ConfigError,
    EngineDeadError,
    EngineOverloadedError,
    LoraplexError,
    first_line,
)

logger = logging.getLogger(__name__)


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
            client.delete(stats_key(ray_config), forget_key(ray_config),
                          pins_key(ray_config), forgot_key(ray_config),
                          kv_events_key(ray_config))
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
        raw = await self._redis_client().hgetall(stats_key(self._config))
        now = time.time()
        records = {int(ordinal): json.loads(value) for ordinal, value in raw.items()}
        return {ordinal: record for ordinal, record in records.items()
                if now - float(record["at"]) <= STATS_STALE_S}

    async def set_pinned_adapters(self, refs: Sequence[AdapterRef]) -> None:
        """Every replica, a replacement included, holds these pins within STATS_INTERVAL_S:
        each reads them from Redis with its stats round."""
        await self._redis_client().set(pins_key(self._config),
                                       json.dumps([model_id(ref) for ref in refs]))

    async def forget_adapter(self, adapter_id: str, digest: str) -> None:
        """Every replica drops the version (see the module doc); returns once every live
        replica has applied it, so that its requests in flight keep the weights they need
        before the files go (``LLMEngine.forget_adapter``), or after 2 × FORGET_BOUND_S
        (a replica that does not answer by then holds no request worth waiting for)."""
        client = self._redis_client()
        entry = stream_id(await client.xadd(forget_key(self._config),
                                             {"adapter_id": adapter_id, "digest": digest},
                                             maxlen=FORGET_MAXLEN, approximate=True))
        deadline = time.monotonic() + 2 * FORGET_BOUND_S
        while True:
            live = await self._published()
            acks = await client.hgetall(forgot_key(self._config))
            behind = [o for o in live if stream_id(acks.get(str(o).encode())) < entry]
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
        key = kv_events_key(self._config)
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
    for cls in REMOTE_ERRORS:
        match = re.search(rf"loraplex\.errors\.{cls}: (.+)", text)
        if match:
            return match.group(1).strip()
    raised = re.findall(r"^\s*((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception)): (.+)$", text,
                        re.MULTILINE)
    if raised:
        kind, message = raised[-1]
        return f"{first_line(exc)} ({kind.rpartition('.')[2]}: {message.strip()})"
    return first_line(exc)
