"""Grammar compilation with a budget: in a worker process, under CPU-time and memory limits.

``GrammarSandbox.compile`` sends a spec to ``grammar_worker`` (started on first use, niced,
its address space capped) and waits for the grammar text while watching the worker's CPU
time: past ``GrammarLimits.cpu_s`` of CPU for one spec (or ``wall_s`` of wall time, for a
worker that stalls) it kills the worker and refuses the spec with an
``InvalidRequestError`` naming the field and the limit; a worker that dies (an allocation
past its memory cap aborts it) refuses the spec the same way. The next compile starts a
fresh worker. Nothing the grammar engine does to the worker reaches the caller's process:
the step loop, the event loop and every other tenant's requests carry on.

One compile at a time per sandbox (callers queue on its lock, in their own threads).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import IO, Any, Final

from loraplex.engine.grammar_worker import read_message, write_message
from loraplex.engine.sampling_params import GrammarSpec
from loraplex.errors import EngineDeadError, InvalidRequestError

_POLL_S: Final = 0.02
_TICKS: Final = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class GrammarLimits:
    """What compiling one spec may cost. ``cpu_s``: CPU seconds of the worker (a legitimate
    schema takes milliseconds: the demo model's nested-object schema compiles in 11 ms);
    ``memory_bytes``: the worker's whole address space (1 GiB); ``wall_s``: wall time, only against
    a worker that stops making progress (on a loaded machine CPU time is what counts)."""

    cpu_s: float = 1.0
    memory_bytes: int = 1 << 30
    wall_s: float = 30.0

    def __post_init__(self) -> None:
        if not (self.cpu_s > 0 and self.wall_s > 0 and self.memory_bytes >= 256 << 20):
            raise ValueError("grammar limits: cpu_s and wall_s must be positive and "
                             "memory_bytes at least 256 MiB")


class GrammarUnavailableError(InvalidRequestError):
    """A spec refused for the moment, not for what it is (the worker stalled or died with
    it): never cached as the spec's answer."""


class GrammarSandbox:
    """Compiles specs in a worker process under ``limits`` (thread-safe)."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int,
                 eos_token_ids: list[int], limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()
        self._setup = {"tokenizer": tokenizer_json, "vocab_size": vocab_size,
                       "eos_token_ids": list(eos_token_ids)}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        self._seq = 0
        self.num_workers_started = 0

    def compile(self, spec: GrammarSpec) -> str:
        """The grammar text of ``spec``; InvalidRequestError naming ``spec.param`` when it
        cannot compile, or not within the limits (GrammarUnavailableError when the worker
        failed for another reason). EngineDeadError once the sandbox is closed."""
        with self._lock:
            if self._closed:
                raise EngineDeadError("the grammar compiler is shut down")
            proc = self._worker()
            assert proc.stdin is not None and proc.stdout is not None
            self._seq += 1
            try:
                write_message(proc.stdin, {"seq": self._seq, "kind": spec.kind,
                                           "source": spec.source})
                answer = self._await(proc, spec)
            except InvalidRequestError:
                raise
            except BaseException:
                # Whatever broke the exchange (a pipe, a frame, an interrupt), the worker's
                # next reply could answer this spec: never reused.
                self._kill()
                raise
            if answer.get("seq") != self._seq:  # a reply to another spec: never served
                self._kill()
                raise self._stopped(spec)
        if "error" in answer:
            raise InvalidRequestError(f"cannot be compiled: {answer['error']}",
                                      param=spec.param)
        return str(answer["grammar"])

    def start(self) -> None:
        """Starts a worker in the background (about a second: the tokenizer), so that the
        next compile does not wait for it."""

        def spawn() -> None:
            with self._lock:
                if not self._closed:
                    try:
                        self._worker()
                    except (OSError, RuntimeError):
                        pass  # the next compile tries again, and says why

        threading.Thread(target=spawn, name="grammar-worker-start", daemon=True).start()

    def close(self) -> None:
        """Stops the worker; compiling afterwards is an error."""
        with self._lock:
            self._closed = True
            self._kill()

    # --- the worker -------------------------------------------------------------------

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is not None:
            if self._proc.poll() is None:
                return self._proc
            self._kill()  # died while idle: its pipes closed before a new one starts
        proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex.engine.grammar_worker",
             str(self.limits.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            close_fds=True)
        self._proc = proc
        # A sandbox dropped without close() (an engine nobody closed) still ends its
        # worker, when it is collected or at exit at the latest.
        self._finalizer = weakref.finalize(self, _end, proc)
        self.num_workers_started += 1
        assert proc.stdin is not None and proc.stdout is not None
        try:
            write_message(proc.stdin, self._setup)
            # Reading the tokenizer takes about a second; a worker that fails even that is
            # a broken installation, not a request's fault.
            ready = _read_within(proc, proc.stdout, None, self.limits.wall_s + 60)
        except BaseException:
            self._kill()
            raise
        if ready != {"ok": True}:
            self._kill()
            raise RuntimeError(f"the grammar worker did not start (exit {proc.poll()})")
        return proc

    def _await(self, proc: subprocess.Popen[bytes], spec: GrammarSpec) -> dict[str, Any]:
        assert proc.stdout is not None
        answer = _read_within(proc, proc.stdout, self.limits.cpu_s, self.limits.wall_s)
        if isinstance(answer, dict):
            return answer
        self._kill()
        self.start()  # the next spec, likely another tenant's, finds a worker ready
        if answer == "cpu":
            raise InvalidRequestError(
                f"took more than {self.limits.cpu_s:g} s of CPU time to compile (the "
                "server's limit): simplify it", param=spec.param)
        if answer == "wall":
            raise GrammarUnavailableError(
                f"did not compile within {self.limits.wall_s:g} s (the server's limit); "
                "retry later", param=spec.param)
        raise self._stopped(spec)

    def _stopped(self, spec: GrammarSpec) -> InvalidRequestError:
        return GrammarUnavailableError(
            f"cannot be compiled within the server's limits ({self.limits.memory_bytes >> 20}"
            f" MiB of memory, {self.limits.cpu_s:g} s of CPU time): the grammar engine "
            "stopped on it", param=spec.param)

    def _kill(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # ends the worker, once, and drops its reference
            self._finalizer = None
        self._proc = None


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


def _read_within(proc: subprocess.Popen[bytes], stream: IO[bytes], cpu_s: float | None,
                 wall_s: float) -> dict[str, Any] | str:
    """The worker's next message, or why none came: "cpu" (past ``cpu_s`` of its CPU
    time), "wall" (past ``wall_s``), "died" (it exited, or sent no message). ``poll``, not
    ``select``: a busy server's descriptors pass 1,024."""
    cpu_start = _cpu_seconds(proc.pid)
    deadline = time.monotonic() + wall_s
    poller = select.poll()
    poller.register(stream.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        if poller.poll(int(_POLL_S * 1000)):
            try:
                message = read_message(stream)
            except ValueError:  # not JSON: the worker broke mid-message
                return "died"
            return message if isinstance(message, dict) else "died"
        if proc.poll() is not None:
            return "died"
        if cpu_s is not None and _cpu_seconds(proc.pid) - cpu_start > cpu_s:
            return "cpu"
        if time.monotonic() > deadline:
            return "wall"
