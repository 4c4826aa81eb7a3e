"""The async face of the engine, used by the gateway: the in-process ``EngineBackend``.

One background thread owns the :class:`LLMEngine` and runs its step loop; nothing else
ever touches the engine. Coroutines (on any event loop) talk to that thread through a
thread-safe command queue, which the loop drains before every step, and get their
outputs back through one ``asyncio.Queue`` per request, fed with
``loop.call_soon_threadsafe``. When there is no work the thread blocks on the command
queue, so an idle server burns no CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from loraplex.config import EngineConfig
from loraplex.engine.backend import ModelDescription
from loraplex.engine.engine import LLMEngine
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import NO_SHARE, Share
from loraplex.engine.stats import EngineStats
from loraplex.errors import AdapterError, EngineDeadError, InvalidRequestError

if TYPE_CHECKING:
    from loraplex.engine.grammar import Constraint

T = TypeVar("T")

# While requests are queued but nothing could be scheduled (an adapter still loading from
# disk in the background), the loop waits this long for a command before trying again,
# instead of spinning on empty steps.
_STALL_WAIT_S = 0.002


@dataclass
class _Batch:
    """What one step (or one command) produced for one request, in a single hop."""

    deltas: list[SequenceDelta] = field(default_factory=list)
    done: bool = False  # the engine holds nothing of the request any more
    exc: BaseException | None = None


@dataclass(eq=False)
class _Stream:
    """The engine thread's handle on one request's consumer."""

    request_id: str
    n: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Batch]
    finished_indices: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Add:
    stream: _Stream
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None
    cache_salt: str | None
    arrival_time: float
    constraint: Constraint | None = None  # the grammar's, compiled before the hop
    share: Share = NO_SHARE


@dataclass(eq=False)
class _Abort:
    request_id: str
    # Set when a consumer that went away aborts its own request: only that very stream is
    # aborted, never a later request that reused the id after this one finished.
    stream: _Stream | None = None
    done: concurrent.futures.Future[None] | None = None


@dataclass(eq=False)
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future[Any]


class _Stop:
    pass


_Command: TypeAlias = _Add | _Abort | _Call | _Stop


class EngineClient:
    """Runs an :class:`LLMEngine` on one background thread and serves it to coroutines.

    Use ``start()`` then ``generate``/``abort``/``stats``, and ``shutdown()`` (or ``close()``
    from synchronous code) at the end; ``async with EngineClient(...)`` does both.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # Read once, here: the engine's attributes belong to its thread once it runs.
        self._description = engine.describe()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Owned by the engine thread: the consumer of every request the engine holds.
        self._streams: dict[str, _Stream] = {}
        # Guarded by _lock: ids in flight (submitted, not yet retired), and the lifecycle.
        self._lock = threading.Lock()
        self._live_ids: set[str] = set()
        self._closed = False
        self._dead: BaseException | None = None  # what killed the step loop
        self._thread: threading.Thread | None = None
        self._engine_closed = False
        # Engine thread only: commands taken off the queue and not handled yet (a failure
        # midway must still answer those behind it).
        self._drained: deque[_Command] = deque()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False) -> EngineClient:
        """Builds the engine (loads the model) and wraps it; call ``start()`` next."""
        return cls(LLMEngine(config, progress=progress))

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Launches the step-loop thread."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("EngineClient already started")
            if self._closed:
                raise RuntimeError("EngineClient is shut down")
            self._thread = threading.Thread(target=self._run, name="loraplex-engine",
                                            daemon=True)
            self._thread.start()

    @property
    def description(self) -> ModelDescription:
        """The served model."""
        return self._description

    @property
    def is_ready(self) -> bool:
        """Whether the step loop is up and accepting requests."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._closed

    @property
    def is_alive(self) -> bool:
        """False once the step loop has died (it never comes back: restart the server)."""
        return self._dead is None

    # The engine boundary's replica view: one engine in process (see EngineBackend).
    num_replicas: None = None
    missing_replicas: tuple[int, ...] = ()

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished (approximate; any thread)."""
        return len(self._live_ids)

    async def shutdown(self) -> None:
        """Stops the loop: in-flight requests end with finish_reason "abort"; the thread is
        joined and the engine closed. Idempotent."""
        self._request_stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            await asyncio.to_thread(thread.join)
        self._close_engine_if_unstarted()

    def close(self) -> None:
        """Synchronous :meth:`shutdown`, for code that has no event loop."""
        self._request_stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._close_engine_if_unstarted()

    async def __aenter__(self) -> EngineClient:
        self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.shutdown()

    def _request_stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Under the lock: no submission can be queued behind the stop command.
            self._commands.put(_Stop())

    def _close_engine_if_unstarted(self) -> None:
        # A started loop closes the engine itself, on its own thread, as it exits.
        if self._thread is None and not self._engine_closed:
            self._engine_closed = True
            self.engine.close()

    # --- the public calls --------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        lora: AdapterRef | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        share: Share = NO_SHARE,
    ) -> AsyncGenerator[SequenceDelta, None]:
        """Streams the request's outputs: one :class:`SequenceDelta` per new token of each
        of its ``n`` sequences; ends when all of them have finished.

        Raises (from the first iteration) what admission refuses: InvalidRequestError
        (also for an id already in flight), PromptTooLongError, EngineOverloadedError; and
        AdapterError when the adapter fails to load, EngineDeadError when the loop died.
        Closing the generator early (``break``, task cancelled) aborts the request.
        """
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = _Stream(rid, params.n, asyncio.get_running_loop(), asyncio.Queue())
        # Stamped here, so queue time includes the hop to the engine thread.
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        constraint = None
        if params.grammar is not None:
            self._check_open()
            # Compiled in a worker thread (the compile itself in the sandbox's process),
            # never on the step thread: a grammar that costs seconds stalls no one else.
            compiler = self.engine.grammar_compiler()
            constraint = await asyncio.get_running_loop().run_in_executor(
                compiler.executor, compiler.constraint, params.grammar, cache_salt or "")
        self._submit(_Add(stream, list(prompt_token_ids), params, lora, cache_salt, arrival,
                          constraint, share))
        retired = False
        try:
            while not retired:
                batch = await stream.queue.get()
                # Read before yielding: a consumer that stops at the final delta must not
                # send an abort for a request that is already over.
                retired = batch.done
                for delta in batch.deltas:
                    if delta.error is not None:
                        if delta.error_param is not None:
                            raise InvalidRequestError(delta.error, param=delta.error_param)
                        raise AdapterError(delta.error)
                    yield delta
                if batch.exc is not None:
                    raise batch.exc
        finally:
            if not retired:
                self._abort_nowait(_Abort(rid, stream))

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its consumer gets a final delta with finish_reason "abort".
        Unknown or finished ids are a no-op. Returns once the engine has freed it."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._enqueue(_Abort(request_id, None, done))
        await asyncio.wrap_future(done)

    async def stats(self) -> EngineStats:
        """The engine's figures, read on the engine thread between steps."""
        # The client's own count of unfinished requests includes those still queued for
        # the engine thread.
        return await self.run_in_engine(
            lambda engine: replace(engine.stats(), num_unfinished=self.num_unfinished))

    async def replica_stats(self) -> tuple[EngineStats, ...]:
        """The one engine of this process, as replica 0."""
        return (await self.stats(),)

    async def forget_adapter(self, adapter_id: str, digest: str) -> None:
        """Drops a deleted adapter version from the engine (see ``LLMEngine.forget_adapter``)."""
        await self.run_in_engine(lambda engine: engine.forget_adapter(adapter_id, digest))

    async def set_pinned_adapters(self, refs: Sequence[AdapterRef]) -> None:
        """See ``LLMEngine.set_pinned_adapters``."""
        await self.run_in_engine(lambda engine: engine.set_pinned_adapters(refs))

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between two steps and returns its
        result: the one safe way to reach the engine (e.g. to forget a deleted adapter)."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._enqueue(_Call(fn, result))
        return await asyncio.wrap_future(result)

    # --- caller side -------------------------------------------------------------------

    def _dead_error(self) -> EngineDeadError:
        # A fresh instance per raise: one shared exception object raised in many tasks
        # would pile up all their tracebacks.
        error = EngineDeadError(f"the engine step loop failed: {self._dead!r}")
        error.__cause__ = self._dead
        return error

    def _check_open(self) -> None:
        if self._dead is not None:
            raise self._dead_error()
        if self._closed:
            raise EngineDeadError("the engine client is shut down")
        if self._thread is None:
            raise RuntimeError("EngineClient.start() was not called")

    def _enqueue(self, command: _Command) -> None:
        with self._lock:
            self._check_open()
            self._commands.put(command)

    def _submit(self, command: _Add) -> None:
        rid = command.stream.request_id
        with self._lock:
            self._check_open()
            # Checked here rather than only by the engine so the answer does not depend on
            # whether the first request with this id is still queued behind other commands.
            if rid in self._live_ids:
                raise InvalidRequestError(f"request id {rid!r} is already in use",
                                          param="request_id")
            self._live_ids.add(rid)
            self._commands.put(command)

    def _abort_nowait(self, command: _Abort) -> None:
        # From a generator's finally: must not block or raise. A stop or a dead loop takes
        # care of the request anyway.
        with self._lock:
            if not self._closed and self._dead is None:
                self._commands.put(command)

    # --- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        clean = False
        try:
            self._loop()
            clean = True
        except BaseException as exc:  # any escape kills the engine for good
            self._die(exc)
        finally:
            self._engine_closed = True
            # Only a clean stop keeps the prefix cache (after a failure a block may be
            # registered but never computed).
            self.engine.close(save_cache=clean)

    def _loop(self) -> None:
        engine = self.engine
        stalled = False
        while True:
            commands = self._drained
            try:
                if not engine.has_unfinished():
                    commands.append(self._commands.get())
                elif stalled:
                    commands.append(self._commands.get(timeout=_STALL_WAIT_S))
            except queue.Empty:
                pass
            with contextlib.suppress(queue.Empty):
                while True:
                    commands.append(self._commands.get_nowait())
            while commands:
                command = commands.popleft()
                if isinstance(command, _Stop):
                    self._abort_all()
                    return
                try:
                    self._handle(command)
                except BaseException:
                    commands.appendleft(command)  # so that _die answers it too
                    raise
            if not engine.has_unfinished():
                continue
            num_steps = engine.num_steps
            deltas = engine.step()
            stalled = engine.num_steps == num_steps and not deltas
            self._dispatch(deltas)

    def _handle(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            stream = self._streams.get(command.request_id)
            if stream is not None and (command.stream is None or command.stream is stream):
                self._abort_stream(stream)
            if command.done is not None:
                command.done.set_result(None)
        else:
            try:
                command.result.set_result(command.fn(self.engine))
            except Exception as exc:  # the caller gets it; the loop goes on
                command.result.set_exception(exc)

    def _add(self, command: _Add) -> None:
        stream = command.stream
        try:
            if stream.request_id in self._streams:  # unreachable while _live_ids agrees
                raise InvalidRequestError(f"request id {stream.request_id!r} is already in "
                                          "use", param="request_id")
            self.engine.add_request(stream.request_id, command.prompt_token_ids,
                                    command.params, command.adapter, command.cache_salt,
                                    command.arrival_time, constraint=command.constraint,
                                    share=command.share)
        except Exception as exc:
            # Admission leaves the engine untouched when it refuses: the loop goes on.
            self._retire(stream, _Batch(done=True, exc=exc))
            return
        self._streams[stream.request_id] = stream

    def _dispatch(self, deltas: list[SequenceDelta]) -> None:
        batches: dict[str, _Batch] = {}
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            batch = batches.setdefault(delta.request_id, _Batch())
            batch.deltas.append(delta)
            if delta.finished:
                stream.finished_indices.add(delta.index)
            # An error delta ends the whole request, whatever n is.
            if delta.error is not None or len(stream.finished_indices) >= stream.n:
                batch.done = True
        for rid, batch in batches.items():
            stream = self._streams[rid]
            if batch.done:
                del self._streams[rid]
                self._retire(stream, batch)
            else:
                self._post(stream, batch)

    def _abort_stream(self, stream: _Stream) -> None:
        deltas = self.engine.abort(stream.request_id)
        del self._streams[stream.request_id]
        # Every sequence of the request is gone now, even those that were never forked
        # (n > 1 aborted before its first token), so the consumer stops here.
        self._retire(stream, _Batch(deltas, done=True))

    def _abort_all(self) -> None:
        for stream in list(self._streams.values()):
            self._abort_stream(stream)
        self._fail_queued(lambda: EngineDeadError("the engine client is shut down"))

    def _retire(self, stream: _Stream, batch: _Batch) -> None:
        with self._lock:
            self._live_ids.discard(stream.request_id)
        self._post(stream, batch)

    @staticmethod
    def _post(stream: _Stream, batch: _Batch) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, batch)
        except RuntimeError:
            pass  # the consumer's event loop is closed: nobody is left to read this

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            self._closed = True
        # The engine's state is unknown after a failed step: nothing more is asked of it.
        for stream in list(self._streams.values()):
            self._retire(stream, _Batch(done=True, exc=self._dead_error()))
        self._streams.clear()
        self._fail_queued(self._dead_error)

    def _fail_queued(self, make_error: Callable[[], EngineDeadError]) -> None:
        """Answers commands still queued once the loop has ended (none can follow)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._drained.append(self._commands.get_nowait())
        while self._drained:
            command = self._drained.popleft()
            if isinstance(command, _Add):
                self._retire(command.stream, _Batch(done=True, exc=make_error()))
            elif isinstance(command, _Abort) and command.done is not None:
                # After a stop every request is aborted anyway; after a crash, say so.
                if self._dead is not None:
                    command.done.set_exception(make_error())
                else:
                    command.done.set_result(None)
            elif isinstance(command, _Call):
                command.result.set_exception(make_error())
