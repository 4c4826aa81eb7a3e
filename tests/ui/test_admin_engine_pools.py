"""Prefill/decode disaggregation as an operator runs it: ``loraplex serve --backend ray
--prefill-replicas 1 --decode-replicas 1`` starting its own local Ray cluster. The
official openai client's completions (plain and streamed) equal an in-process engine's;
/admin/api/engine lists one replica per pool with its role and the blocks that moved; and
the Engine page, in a real browser, shows the two pools with the figures the API gives.
The page goes to ``artifacts/screenshots/engine-pools.png``."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from servers import clean_env, free_port, serve_command, stop_gracefully, wait_ready
from test_admin_figures import SERVED, admin, new_tenant, signed_in_page, watch_errors

from loraplex import LLM, SamplingParams
from loraplex.testing import (
    bootstrap_admin,
    postgres_schema,
    redis_key_prefix,
    redis_url_for_tests,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="needs the ray extra")]



@dataclass
class UIServer:  # what test_admin_figures' helpers read of a server
    url: str
    admin_key: str

PROMPT = ("The ledger lists every refund, invoice and order of the quarter; the auditor "
          "checks each account balance against the warranty and shipping records, then ")
POOL_FIGURES = ("kv_transfer_exported", "kv_transfer_imported", "kv_transfer_refused")


@pytest.fixture(scope="module")
def pd_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
              ) -> Iterator[UIServer]:
    root = tmp_path_factory.mktemp("ui_pd")
    # Ray's socket paths must fit 107 bytes: a short folder for its session files.
    ray_tmp = Path(tempfile.mkdtemp(prefix="lpx", dir="/tmp"))
    port = free_port()
    log = root / "gateway.log"
    with postgres_schema("uipd") as db_url, redis_key_prefix("uipd") as prefix:
        admin_key = bootstrap_admin(db_url)
        env = clean_env(root / "home") | {"LORAPLEX_CACHE_SALT_SECRET": "ui-pd-secret",
                                          "RAY_TMPDIR": str(ray_tmp)}
        with log.open("wb") as out:
            proc = subprocess.Popen(serve_command(
                "--backend", "ray", "--prefill-replicas", "1", "--decode-replicas", "1",
                "--replica-cpus", "0.5", "--model", str(tiny_llama_dir),
                "--served-model-name", SERVED, "--database-url", db_url,
                "--adapter-dir", str(root / "store"), "--redis-url", redis_url_for_tests(),
                "--redis-key-prefix", prefix, "--num-kv-blocks", "128",
                "--port", str(port), "--log-level", "warning"), env=env, stdout=out,
                stderr=out)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, log=log)
            yield UIServer(url, admin_key)
        finally:
            stop_gracefully(proc, 120)
            shutil.rmtree(ray_tmp, ignore_errors=True)


def _in_process(model_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """The same greedy completions from one engine in this process (the offline ``LLM``:
    the browser fixture's event loop may be running in this thread)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    llm = LLM(str(model_dir), progress=False, num_kv_blocks=128, max_lora_rank=16)
    try:
        outs = llm.generate([tokenizer.encode(p) for p in prompts],
                            SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return [o.outputs[0].text for o in outs]
    finally:
        llm.close()


def _settled_pools(server: UIServer) -> list[dict[str, Any]]:
    """/admin/api/engine's pools once both have published after their last request."""
    deadline = time.monotonic() + 60
    last = None
    while True:
        with admin(server) as http:
            body = http.get("/admin/api/engine").json()
        now = [[p[f] for f in POOL_FIGURES] + [p["num_running"]] for p in body["pools"]]
        if now == last and len(now) == 2 and not any(p["num_running"] for p in body["pools"]):
            pools: list[dict[str, Any]] = body["pools"]
            return pools
        assert time.monotonic() < deadline, body["pools"]
        last = now
        time.sleep(1.5)  # replicas publish each second


def test_completions_go_through_both_pools_and_match_one_engine(
        pd_server: UIServer, tiny_llama_dir: Path) -> None:
    _, key = new_tenant(pd_server)
    client = openai.OpenAI(base_url=f"{pd_server.url}/v1", api_key=key, max_retries=0,
                           timeout=120)
    want, want_streamed = _in_process(tiny_llama_dir, [PROMPT, PROMPT + " "], 8)
    plain = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8,
                                      temperature=0)
    assert plain.choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=SERVED, prompt=PROMPT + " ", max_tokens=8, temperature=0, stream=True))
    assert streamed == want_streamed
    pools = _settled_pools(pd_server)
    assert [p["role"] for p in pools] == ["prefill", "decode"]
    assert [p["num_replicas"] for p in pools] == [1, 1]
    prefill, decode = pools
    assert prefill["kv_transfer_exported"] >= 2 and decode["kv_transfer_imported"] >= 1
    assert decode["kv_transfer_refused"] == 0
    with admin(pd_server) as http:
        replicas = http.get("/admin/api/engine").json()["replicas"]
    assert [(r["replica"], r["role"]) for r in replicas] == [(0, "decode"), (1, "prefill")]


def test_the_engine_page_shows_both_pools(pd_server: UIServer, browser: Any,
                                          screenshots: Path) -> None:
    _, key = new_tenant(pd_server)
    openai.OpenAI(base_url=f"{pd_server.url}/v1", api_key=key, max_retries=0,
                  timeout=120).completions.create(model=SERVED, prompt=PROMPT * 2,
                                                  max_tokens=4, temperature=0)
    pools = _settled_pools(pd_server)
    page = signed_in_page(browser, pd_server, "engine")
    errors = watch_errors(page)
    want = [[p["role"], *(f"{p[f]:,}" for f in POOL_FIGURES)] for p in pools]
    page.wait_for_function(
        """(want) => {
             const rows = [...document.querySelectorAll('#engine-pools tbody tr')];
             const got = rows.map((r) => [r.querySelector('td').textContent,
               ...[...r.querySelectorAll('[data-figure]')].map((s) => s.textContent)]);
             return JSON.stringify(got) === JSON.stringify(want);
           }""", arg=want, timeout=30_000)
    assert page.locator("#engine-pools").is_visible()
    cells = page.locator("#engine-replicas tbody tr td:first-child").all_text_contents()
    assert cells == ["0 (decode)", "1 (prefill)"]
    page.screenshot(path=str(screenshots / "engine-pools.png"), full_page=True)
    assert errors == []
