"""A benchmark's HTTP server in a subprocess of its own session, logging to a file: waits
until a readiness URL answers 200, and shows the log's tail when it does not."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """Subclasses start ``self.proc`` (a ``subprocess.Popen``) logging to ``log_path``."""

    name = "the server"
    proc: subprocess.Popen[bytes]
    ready_path = "/ready"
    poll_interval = 0.5

    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                                   f"{self.tail()}")
            try:
                if httpx.get(f"{self.url}{self.ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_interval)
        raise TimeoutError(f"{self.name} was not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""
