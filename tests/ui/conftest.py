"""A live server and a headless Chromium for the admin UI tests.

The server is the embedded default (SQLite registry, in-process rate limiter) on the tiny
Llama, with one admin key; everything else is made through the UI. The browser is Debian's
Chromium driven by Playwright (no browser download); without it the tests are skipped.
"""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def ui_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
              ) -> Iterator[UIServer]:
    root = tmp_path_factory.mktemp("ui_server")
    db_url = f"sqlite:///{root / 'registry.db'}"
    admin_key = bootstrap_admin(db_url)
    client = EngineClient.from_config(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=128),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        SpeculativeConfig(prompt_lookup_min=1)))
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
        yield UIServer(f"http://127.0.0.1:{sock.getsockname()[1]}", admin_key)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        client.close()


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

