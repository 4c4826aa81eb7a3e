"""A live server and a headless Chromium for the admin UI tests.

The server is the embedded default (SQLite registry, in-process rate limiter) on the tiny
Llama, with one admin key; everything else is made through the UI. One more server of the
kind (``ui_disk_server``) has the prefix cache's disk tier on. The browser is Debian's
Chromium driven by Playwright (no browser download); without it the tests are skipped.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RegistryConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from loraplex.engine.client import EngineClient
from loraplex.gateway.app import create_app
from loraplex.testing import bootstrap_admin, build_adapter

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SERVED = "tiny-llama"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"


@dataclass
class UIServer:
    url: str
    admin_key: str
    kv_disk_dir: Path | None = None  # the KV disk tier's folder, where it has one


@contextlib.contextmanager
def _serve(tiny_llama_dir: Path, root: Path, cache: CacheConfig,
           speculative: SpeculativeConfig | None) -> Iterator[UIServer]:
    """The embedded server on the tiny Llama, its registry under ``root``, until exit."""
    db_url = f"sqlite:///{root / 'registry.db'}"
    admin_key = bootstrap_admin(db_url)
    client = EngineClient.from_config(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), cache,
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), speculative))
    app = create_app(ServerConfig(served_model_name=SERVED, usage_flush_interval_s=0.2),
                     RegistryConfig(db_url, str(root / "store")), client)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the UI test server did not start")
        time.sleep(0.02)
    try:
        yield UIServer(f"http://127.0.0.1:{sock.getsockname()[1]}", admin_key,
                       None if cache.kv_disk_dir is None else Path(cache.kv_disk_dir))
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        client.close()


@pytest.fixture(scope="session")
def ui_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
              ) -> Iterator[UIServer]:
    """The server most UI tests share: no KV disk tier."""
    with _serve(tiny_llama_dir, tmp_path_factory.mktemp("ui_server"),
                CacheConfig(block_size=16, num_kv_blocks=128),
                SpeculativeConfig(prompt_lookup_min=1)) as server:
        yield server


# The disk tier's server: blocks of 4 tokens in a pool of 16 (a 24-token prompt takes 7),
# so a handful of prompts evicts each other's prefixes to disk, and a disk budget of about
# 16 blocks of the tiny Llama's (2 KiB of KV each, plus the header), so the tier evicts too.
DISK_BLOCK_SIZE = 4
DISK_BUDGET_BYTES = 16 * 2600


@pytest.fixture(scope="session")
def ui_disk_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                   ) -> Iterator[UIServer]:
    """A server of its own with the prefix cache's disk tier on (``kv_disk_dir``): the
    shared one's figures must not move under other tests, nor theirs under this one's."""
    root = tmp_path_factory.mktemp("ui_disk_server")
    with _serve(tiny_llama_dir, root,
                CacheConfig(block_size=DISK_BLOCK_SIZE, num_kv_blocks=16,
                            kv_disk_dir=str(root / "kv"),
                            kv_disk_gib=DISK_BUDGET_BYTES / 2**30), None) as server:
        yield server


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not CHROMIUM.is_file():
        pytest.skip(f"needs Debian's Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="loraplex-chromium-") as profile, \
            sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture(scope="session")
def ui_adapters(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good adapter (rank 4) and a bad one (rank 32, over the server's max of 16)."""
    bad = build_adapter(tmp_path_factory.mktemp("ui_rank32"), tiny_llama_dir, rank=32, seed=7)
    return {"good": llama_adapters["r4"], "bad": bad}

