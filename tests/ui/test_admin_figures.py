"""The figures the admin pages show, read in a real browser against a live server: the
Engine page's KV cache headline, and the Usage page's totals when stacked by tenant."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py
SERVED = "tiny-llama"
FILES = ("adapter_config.json", "adapter_model.safetensors")


def admin(server: UIServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60,
                        headers={"Authorization": f"Bearer {server.admin_key}"})


def new_tenant(server: UIServer) -> tuple[str, str]:
    name = f"fig-{uuid.uuid4().hex[:6]}"
    with admin(server) as http:
        assert http.post("/admin/api/tenants", json={"name": name}).status_code == 201
        response = http.post(f"/admin/api/tenants/{name}/keys", json={})
        assert response.status_code == 201
    key: str = response.json()["key"]
    return name, key


def complete(server: UIServer, key: str, model: str, max_tokens: int) -> None:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          # ignore_eos: a sampled EOS would end a request short of max_tokens
                          json={"model": model, "prompt": "Hello", "max_tokens": max_tokens,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text


def wait_metered(server: UIServer, key: str, completion_tokens: int) -> None:
    """Until the usage flusher has written the tenant's completions (bounded)."""
    deadline = time.monotonic() + 30
    while True:
        response = httpx.get(f"{server.url}/v1/usage", timeout=30,
                             headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        if response.json()["totals"]["completion_tokens"] >= completion_tokens:
            return
        assert time.monotonic() < deadline, response.json()
        time.sleep(0.1)


def tenant_fields(server: UIServer, name: str, fields: tuple[str, ...]) -> tuple[Any, ...]:
    """``fields`` of the tenant as the admin API reads them."""
    with admin(server) as http:
        response = http.get(f"/admin/api/tenants/{name}")
    assert response.status_code == 200, response.text
    return tuple(response.json()[field] for field in fields)


def watch_errors(page: Any) -> list[str]:
    """The page's script errors and console errors, as they come. 4xx answers are logged
    by the browser ("Failed to load resource"): refusals a test provokes on purpose; any
    other console error is a bug of the page."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" and
            not msg.text.startswith("Failed to load resource") else None)
    return errors


def save_row(page: Any, row: Any, button: str, status: int) -> None:
    """Clicks the row's ``button`` and checks the PATCH it sends is answered ``status``."""
    with page.expect_response(lambda r: r.request.method == "PATCH") as answered:
        row.locator("button", has_text=button).click()
    assert answered.value.status == status


def signed_in_page(browser: Any, server: UIServer, page_name: str) -> Any:
    page = browser.new_page()
    page.goto(f"{server.url}/admin")
    page.fill("#admin-key", server.admin_key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#page[data-page=tenants]")
    page.click(f"#nav a[data-page={page_name}]")
    page.wait_for_selector(f"#page[data-page={page_name}]")
    return page


@pytest.fixture
def busy_engine(ui_server: UIServer) -> Iterator[None]:
    """Streams run back to back until the test ends, so live requests hold KV blocks."""
    _, key = new_tenant(ui_server)
    stop = threading.Event()

    def run() -> None:
        body = {"model": SERVED, "prompt": [5] * 21, "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=ui_server.url, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as http:
            while not stop.is_set():
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def test_engine_page_headline_is_pool_use(browser: Any, ui_server: UIServer,
                                          busy_engine: None) -> None:
    page = signed_in_page(browser, ui_server, "engine")
    card = page.locator("#engine-stats .stat", has_text="KV cache")
    # Refreshed every 2 s: wait for a render taken while requests held blocks.
    page.wait_for_function(
        """() => [...document.querySelectorAll('#engine-stats .stat')]
              .some(c => /KV cache/.test(c.textContent)
                         && /^[1-9][\\d,]* of /.test(c.querySelector('.sub').textContent))""",
        timeout=30_000)
    # One read of one render: the headline and the line under it belong together.
    shown = json.loads(card.evaluate(
        "c => JSON.stringify([c.querySelector('.value').textContent, "
        "c.querySelector('.sub').textContent])"))
    value, sub = shown
    used, total = (int(n.replace(",", ""))
                   for n in re.match(r"([\d,]+) of ([\d,]+) blocks used", sub).groups())  # type: ignore[union-attr]
    # The page rounds half up (toFixed), Python half to even: compare to the rounding step.
    assert value.endswith("%") and abs(float(value[:-1]) - 100 * used / total) <= 0.05 + 1e-9
    assert re.search(r"\d+\.\d% fill of held blocks", sub)
    page.close()


def test_engine_page_shows_speculation_by_adapter(browser: Any, ui_server: UIServer,
                                                 busy_engine: None) -> None:
    page = signed_in_page(browser, ui_server, "engine")
    # The busy streams repeat one token: prompt lookup proposes at every step.
    page.wait_for_function(
        """() => [...document.querySelectorAll('#engine-spec tbody tr')]
              .some(r => /base model/.test(r.textContent))""", timeout=30_000)
    cells = json.loads(page.evaluate(
        """() => JSON.stringify([...[...document.querySelectorAll('#engine-spec tbody tr')]
              .find(r => /base model/.test(r.textContent))
              .querySelectorAll('td')].map(td => td.textContent))"""))
    drafts, proposed, accepted = (int(c.replace(",", "")) for c in cells[1:4])
    assert 0 < drafts <= proposed and accepted <= proposed
    assert cells[4].endswith("%")
    card = page.locator("#engine-stats .stat", has_text="Speculation accepted")
    assert "proposed tokens" in card.text_content()  # type: ignore[operator]
    page.close()


def test_usage_totals_stacked_by_tenant_name_the_tenant(
        browser: Any, ui_server: UIServer, ui_adapters: dict[str, Path]) -> None:
    tenant, key = new_tenant(ui_server)
    with admin(ui_server) as http:
        files = {name: (name, (ui_adapters["good"] / name).read_bytes()) for name in FILES}
        response = http.post(f"/admin/api/tenants/{tenant}/adapters", data={"name": "tone"},
                             files=files)
        assert response.status_code == 201, response.text
    complete(ui_server, key, SERVED, 3)
    complete(ui_server, key, "tone", 2)
    wait_metered(ui_server, key, completion_tokens=5)
    page = signed_in_page(browser, ui_server, "usage")
    assert page.locator("#page form select >> nth=2").input_value() == "tenant"
    row = page.locator("#usage-totals tr", has=page.locator("td", has_text=tenant))
    page.wait_for_selector(f"#usage-chart rect[data-series={tenant}]")
    cells = row.locator("td").all_text_contents()
    assert cells[0] == tenant
    # The tenant's row sums both models and says so, instead of naming the first one.
    assert cells[1] == f"{tenant}/tone v1, {SERVED} (base)"
    assert cells[2] == "2" and cells[4] == "5"
    page.select_option("#page form select >> nth=2", "model")
    by_model = page.locator("#usage-totals tr", has=page.locator("td", has_text=tenant))
    page.wait_for_function(
        f"() => [...document.querySelectorAll('#usage-totals tr')]"
        f".filter(r => r.textContent.includes('{tenant}')).length === 2", timeout=10_000)
    models = sorted(r.locator("td").nth(1).text_content() for r in by_model.all())
    assert models == sorted([f"{SERVED} (base)", f"{tenant}/tone v1"])
    page.close()


def test_engine_page_lists_each_replica(browser: Any, ui_server: UIServer,
                                        ui_adapters: dict[str, Path], busy_engine: None) -> None:
    tenant, key = new_tenant(ui_server)
    with admin(ui_server) as http:
        files = {name: (name, (ui_adapters["good"] / name).read_bytes()) for name in FILES}
        made = http.post(f"/admin/api/tenants/{tenant}/adapters", data={"name": "lens"},
                         files=files)
        assert made.status_code == 201, made.text
    identity = f"{made.json()['id']}@{made.json()['digest'][:12]}"
    complete(ui_server, key, "lens", 2)  # into a device slot, where it stays meanwhile
    page = signed_in_page(browser, ui_server, "engine")
    # Refreshed every 2 s: wait for a render taken while a stream ran.
    page.wait_for_function(
        """(model) => {
             const row = document.querySelector('#engine-replicas tbody tr');
             return row !== null && row.textContent.includes(model)
                    && Number(row.querySelector('td[data-label=Running]').textContent) >= 1;
           }""", arg=f"{tenant}/lens", timeout=30_000)
    rows = json.loads(page.evaluate(
        "() => JSON.stringify([...document.querySelectorAll('#engine-replicas tbody tr')]"
        ".map(r => [...r.cells].map(c => c.textContent)))"))
    assert len(rows) == 1  # in process: one replica
    replica, waiting, running, kv, disk, slots, adapters, host = rows[0]
    assert disk == "off"  # this server has no KV disk tier
    assert replica == "0" and waiting.isdigit() and int(running) >= 1
    # Live streams hold blocks: the pool is in use.
    assert re.fullmatch(r"\d+\.\d%", kv) and float(kv[:-1]) > 0
    in_use, max_loras = (int(n) for n in slots.split(" / "))
    assert max_loras == 2 and 1 <= in_use <= 2
    assert f"{tenant}/lens {identity}" in adapters
    assert re.fullmatch(r"\d / 4", host)
    page.close()
