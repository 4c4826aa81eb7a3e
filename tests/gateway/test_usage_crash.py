"""Usage that survives ``kill -9``: streams in flight are metered while they run, so a
server killed outright loses at most what it delivered in its last flush interval (1 s)
and the write under way, never a whole stream. The client's own count of what it received
(each chunk's tokens, from ``logprobs``) is the oracle."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
import sqlalchemy as sa
from servers import clean_env, free_port, serve_command, wait_ready

from loraplex.model.demo import prepare_demo_model
from loraplex.registry import service

pytestmark = [pytest.mark.slow, pytest.mark.server]

NUM_STREAMS = 2
MAX_TOKENS = 400
# What the meter may still owe at the kill: its interval, the write under way, and what a
# busy machine adds to when its timer fires.
OWED_S = 3.0


class Reader(threading.Thread):
    """Reads one stream, timing each chunk's tokens as they arrive."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.arrivals: list[tuple[float, int]] = []  # (monotonic time, tokens)

    def run(self) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0,
                               timeout=600)
        try:
            stream = client.completions.create(
                model="demo", prompt="Once upon a time", max_tokens=MAX_TOKENS, stream=True,
                logprobs=1, extra_body={"ignore_eos": True})
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.logprobs is not None and choice.logprobs.tokens:
                        self.arrivals.append((time.monotonic(),
                                              len(choice.logprobs.tokens)))
        except (openai.APIError, OSError):
            pass  # the server was killed under it
        finally:
            client.close()

    @property
    def received(self) -> int:
        return sum(n for _, n in self.arrivals)


def _metered(db: Path) -> tuple[int, int]:
    """(requests, completion tokens) the registry holds, read as a restarted server would."""
    engine = sa.create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as conn:
            row = conn.execute(sa.text(
                "SELECT coalesce(sum(requests), 0), coalesce(sum(completion_tokens), 0) "
                "FROM usage")).one()
    finally:
        engine.dispose()
    return int(row[0]), int(row[1])


def test_kill_9_loses_at_most_the_last_interval_of_delivery(tmp_path: Path) -> None:
    model = prepare_demo_model(progress=False)
    home = tmp_path / "home"
    key = service.generate_key()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = clean_env(home) | {"LORAPLEX_ADMIN_KEY": key}
    proc = subprocess.Popen(
        serve_command("--model", str(model), "--served-model-name", "demo", "--port",
                      str(port), "--log-level", "warning"),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        readers = [Reader(url, key) for _ in range(NUM_STREAMS)]
        for reader in readers:
            reader.start()
        db = home / "loraplex.db"
        # Metered while the streams still run (the meter wrote nothing of a stream before
        # its end): then the server dies mid-stream.
        while _metered(db)[1] == 0:
            assert proc.poll() is None and all(r.is_alive() for r in readers), \
                "the streams ended before any of their usage was metered"
            time.sleep(0.1)
        time.sleep(1.0)
        assert all(r.is_alive() for r in readers), "a stream ended before the kill"
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for reader in readers:
            reader.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    requests, metered = _metered(db)
    received = sum(r.received for r in readers)
    owed = sum(n for r in readers for t, n in r.arrivals if t >= killed_at - OWED_S)
    assert requests == NUM_STREAMS
    assert 0 < received < NUM_STREAMS * MAX_TOKENS  # cut mid-stream
    # Never billed for more than was received (a chunk written as the server died may not
    # have arrived), never short of more than the last interval's delivery.
    assert received - owed <= metered <= received + NUM_STREAMS, (metered, received, owed)
