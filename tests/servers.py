"""Starting ``loraplex serve`` in tests, and waiting on a server by its progress, not by a
fixed time.

On a busy machine a start takes several times what it takes on a quiet one (a first build
of the native kernels: 39 s quiet, 222 s beside other work), so a fixed bound either fails
there or waits for ever on a hung server. A start that is working spends CPU (its own or
its children's: the compiler, Ray's raylet and workers); a hung one does not. ``wait_ready``
fails when the server exits or when its process tree spent no CPU for ``STALL_S``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

# A process tree that spent less than MIN_PROGRESS_S of CPU in STALL_S is stuck, however
# busy the machine: even at a fifth of a core a working start spends ~10 s in that time.
STALL_S = 60.0
MIN_PROGRESS_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on


def tree_cpu_seconds(root_pids: Sequence[int]) -> float:
    """CPU seconds (user + system, reaped children's included) spent by ``root_pids`` and
    every live descendant of theirs."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            stats[int(entry)] = fields
            parents[int(entry)] = int(fields[1])
    members = set(root_pids)
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in members and pid not in members:
                members.add(pid)
                grew = True
    # utime, stime, cutime, cstime: fields 14-17, at 11-14 here
    return sum(sum(int(x) for x in stats[pid][11:15]) for pid in members if pid in stats) \
        / _TICKS


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen[str] | subprocess.Popen[bytes],
               what: str, *, also: Sequence[int] = (), describe: Callable[[], str] = str,
               stall_s: float = STALL_S) -> None:
    """Polls ``ready`` until it is true. Fails if ``proc`` exits, or if ``proc`` and
    ``also`` (with their descendants) spent under MIN_PROGRESS_S of CPU over ``stall_s``
    seconds. ``describe()`` adds to the failure (a log's tail)."""
    pids = [proc.pid, *also]
    spent = tree_cpu_seconds(pids)
    since = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} {describe()}")
        now_spent = tree_cpu_seconds(pids)
        if now_spent - spent >= MIN_PROGRESS_S:
            spent, since = now_spent, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AssertionError(f"{what} made no progress (under {MIN_PROGRESS_S} CPU s) for "
                                 f"{stall_s:.0f} s and is not ready {describe()}")
        time.sleep(0.2)


def ready_check(url: str) -> Callable[[], bool]:
    """Whether ``url``/ready answers 200 (a refused connection is not yet)."""

    def check() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    return check


def wait_ready(url: str, proc: subprocess.Popen[str] | subprocess.Popen[bytes],
               what: str = "loraplex serve", *, also: Sequence[int] = (),
               log: Path | None = None) -> None:
    """``wait_until`` the server at ``url`` is ready (``log``: its output file, whose tail
    a failure shows)."""
    describe = (lambda: f"\n--- {log} ---\n{log.read_text(errors='replace')[-4000:]}") \
        if log is not None else str
    wait_until(ready_check(url), proc, what, also=also, describe=describe)


def stop_gracefully(proc: subprocess.Popen[str] | subprocess.Popen[bytes],
                    timeout_s: float = 30) -> None:
    """SIGINT (a server's clean stop), then SIGKILL past ``timeout_s``; waits for it."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def serve_command(*args: str) -> list[str]:
    exe = shutil.which("loraplex")
    return ([exe] if exe else [sys.executable, "-m", "loraplex.cli"]) + ["serve", *args]


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env["LORAPLEX_HOME"] = str(home)
    return env


def ttft_steps_within(metrics_text: str, tenant: str, steps: int) -> tuple[float, float]:
    """From a /metrics page: ``tenant``'s requests, and how many of them had their first
    token within ``steps`` engine steps (``loraplex_time_to_first_token_steps``)."""
    from prometheus_client.parser import text_string_to_metric_families

    within = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "loraplex_time_to_first_token_steps_bucket" \
                    and s.labels.get("tenant") == tenant:
                if s.labels["le"] == f"{float(steps)}":
                    within = s.value
                if s.labels["le"] == "+Inf":
                    count = s.value
    return count, within
