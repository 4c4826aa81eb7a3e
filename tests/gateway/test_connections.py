"""Connection limits against ``loraplex serve``, with raw sockets as a hostile client
writes them: connections that send nothing, part of their headers, part of a JSON body or
part of an upload are answered 408 and closed by the stated timeouts; oversized headers
are a 400; connections waiting for their headers are capped; the server's descriptors and
memory come back afterwards."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import clean_env, free_port, serve_command, wait_ready

from loraplex.registry import service

pytestmark = [pytest.mark.slow, pytest.mark.server]

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
# A server's timer fires late on a busy machine, never by this much.
CLOSE_WITHIN_S = 30.0


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, key: str, home: Path) -> None:
        self.proc, self.port, self.key, self.home = proc, port, key, home
        self.url = f"http://127.0.0.1:{port}"

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=CLOSE_WITHIN_S)
        return sock

    def num_fds(self) -> int:
        return len(list(Path(f"/proc/{self.proc.pid}/fd").iterdir()))

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


def _serve(model_dir: Path, home: Path, *extra: str) -> Iterator[Server]:
    key = service.generate_key()
    port = free_port()
    proc = subprocess.Popen(
        serve_command("--model", str(model_dir), "--served-model-name", "tiny", "--port",
                      str(port), "--num-kv-blocks", "32", "--log-level", "warning",
                      "--header-timeout-s", str(HEADER_TIMEOUT_S),
                      "--body-timeout-s", str(BODY_TIMEOUT_S), *extra),
        env=clean_env(home) | {"LORAPLEX_ADMIN_KEY": key}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    server = Server(proc, port, key, home)
    try:
        wait_ready(server.url, proc)
        yield server
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tiny_llama_dir, tmp_path_factory.mktemp("conn_home"),
                      "--max-pending-connections", "400")


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    began = time.monotonic()
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
            assert time.monotonic() - began < CLOSE_WITHIN_S
    return data


def _stalled(server: Server, kind: int) -> socket.socket:
    sock = server.connect()
    auth = f"Authorization: Bearer {server.key}\r\n".encode()
    if kind == 1:  # part of the headers
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    elif kind == 2:  # the headers, part of a JSON body
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": "tiny", "pro')
    elif kind == 3:  # part of a multipart upload, 1 KB of it
        sock.sendall(b"POST /v1/adapters HTTP/1.1\r\nHost: x\r\n" + auth +
                     b"Content-Type: multipart/form-data; boundary=b\r\n"
                     b"Content-Length: 10000000\r\n\r\n--b\r\nContent-Disposition: form-data; "
                     b'name="name"\r\n\r\nslow\r\n--b\r\nContent-Disposition: form-data; '
                     b'name="adapter_model.safetensors"; filename="adapter_model.safetensors"'
                     b"\r\n\r\n" + b"\0" * 1024)
    return sock  # kind 0: nothing at all


def _round(server: Server, per_kind: int) -> list[tuple[int, bytes]]:
    socks = [(kind, _stalled(server, kind)) for kind in range(4) for _ in range(per_kind)]
    return [(kind, _answer(sock)) for kind, sock in socks]


def test_slow_connections_are_answered_408_and_closed(server: Server) -> None:
    # A first round grows the pools it uses (database connections), which stay open: the
    # second must leave nothing of its own behind.
    _round(server, 50)
    time.sleep(1.0)
    fds, rss = server.num_fds(), server.rss()
    answers = _round(server, 50)
    for kind, answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 "), (kind, answer[:200])
        if kind >= 2:  # ours: the OpenAI-style JSON
            assert b'"code":"request_timeout"' in answer.replace(b" ", b""), answer
    # The stalled uploads' staging is removed with them.
    store = server.home / "adapters" / ".tmp"
    assert not store.is_dir() or not any(store.iterdir())
    # Back to where they started: 200 connections' worth gone, give or take the SQLite
    # pool (it keeps up to 5 connections of 2 descriptors each, grown as concurrency was).
    deadline = time.monotonic() + CLOSE_WITHIN_S
    while server.num_fds() > fds + 10:
        assert time.monotonic() < deadline, (server.num_fds(), fds)
        time.sleep(0.1)
    assert server.rss() <= 1.1 * rss
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_oversized_headers_are_refused_without_growing_the_server(server: Server) -> None:
    rss = server.rss()
    socks = []
    for _ in range(10):  # a megabyte each of one unfinished header
        sock = server.connect()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(16):
                sock.sendall(b"a" * 65536)
        except OSError:
            pass  # closed on us as it should be
        socks.append(sock)
    for sock in socks:
        try:
            answer = _answer(sock)
        except ConnectionResetError:
            continue  # closed before it was read: refused all the same
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert server.rss() <= 1.1 * rss
    one_big = httpx.get(f"{server.url}/health", headers={"X-Big": "a" * 100_000}, timeout=30)
    assert one_big.status_code == 431
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_connections_waiting_for_headers_are_capped(tiny_llama_dir: Path,
                                                    tmp_path: Path) -> None:
    for server in _serve(tiny_llama_dir, tmp_path / "home", "--max-pending-connections", "5",
                         "--header-timeout-s", "5"):
        waiting = [server.connect() for _ in range(5)]
        time.sleep(0.5)  # all five accepted and counted
        with server.connect() as extra:
            assert extra.recv(100) == b""  # closed at once, nothing sent
        for sock in waiting:
            assert _answer(sock).startswith(b"HTTP/1.1 408 ")
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
