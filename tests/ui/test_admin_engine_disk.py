"""The Engine page's KV disk tier, in a real browser: with the tier on (a server of its own,
``ui_disk_server``), the deployment's card and each replica's row show the figures
/admin/api/engine gives (blocks and bytes on disk, the budget, disk hit tokens, writes,
evictions, refused files) once traffic has made every one of them move; on the shared
server, which has no tier, both say "off". The page with the tier on goes to
``artifacts/screenshots/engine-disk-tier.png``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_admin_figures import SERVED, admin, new_tenant, signed_in_page, watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py
FIGURES = ("kv_disk_blocks", "kv_disk_bytes_used", "kv_disk_max_bytes", "kv_disk_hit_tokens",
           "kv_disk_writes", "kv_disk_evictions", "kv_disk_refused")
BYTES = ("kv_disk_bytes_used", "kv_disk_max_bytes")


def _fmt_bytes(n: int) -> str:
    """admin_ui/dom.js fmtBytes."""
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    if n < 1024**3:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024**3:.2f} GiB"


def _shown(stats: dict[str, Any], field: str) -> str:
    return _fmt_bytes(stats[field]) if field in BYTES else f"{stats[field]:,}"


def _engine(server: UIServer) -> dict[str, Any]:
    with admin(server) as http:
        response = http.get("/admin/api/engine")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _settled(server: UIServer) -> dict[str, Any]:
    """/admin/api/engine once nothing runs and the disk writer has stopped moving the
    figures (its writes land after the requests end)."""
    last = None
    deadline = time.monotonic() + 30
    while True:
        stats = _engine(server)
        now = [stats["num_running"], stats["num_waiting"], *(stats[f] for f in FIGURES)]
        if now == last and not stats["num_running"] and not stats["num_waiting"]:
            return stats
        assert time.monotonic() < deadline, stats
        last = now
        time.sleep(0.5)


def _complete(server: UIServer, key: str, prompt: list[int]) -> None:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": SERVED, "prompt": prompt, "max_tokens": 2,
                                "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text


def _prompt(k: int) -> list[int]:
    return [(37 * k + 5 * j) % 250 + 3 for j in range(24)]  # 6 full blocks of 4 tokens


def _page_figures(page: Any, scope: str) -> list[dict[str, str]]:
    """Per element of ``scope``, its ``data-figure`` spans: field -> text."""
    return json.loads(page.evaluate(
        """(scope) => JSON.stringify([...document.querySelectorAll(scope)].map(el =>
              Object.fromEntries([...el.querySelectorAll('[data-figure]')]
                .map(s => [s.dataset.figure, s.textContent]))))""", scope))


def test_engine_page_shows_the_disk_tier_as_the_api_does(
        browser: Any, ui_disk_server: UIServer, screenshots: Path) -> None:
    server = ui_disk_server
    _, key = new_tenant(server)
    # Six prompts through a 16-block pool evict each other's blocks to disk (writes) and
    # overflow the disk budget (evictions); the last ones again find theirs on disk.
    for k in range(6):
        _complete(server, key, _prompt(k))
    for k in (4, 3):
        _complete(server, key, _prompt(k))
    stats = _settled(server)
    assert stats["kv_disk_hit_tokens"] > 0 and stats["kv_disk_writes"] > 0, stats
    assert stats["kv_disk_evictions"] > 0, stats
    # Damage every block file on disk: the next lookups refuse them (and recompute).
    assert server.kv_disk_dir is not None
    files = sorted(server.kv_disk_dir.rglob("*.kvb"))
    assert files
    for path in files:
        raw = path.read_bytes()
        path.write_bytes(raw[:-40] + bytes([raw[-40] ^ 0x01]) + raw[-39:])
    for k in (5, 4, 3, 2):
        _complete(server, key, _prompt(k))
    stats = _settled(server)
    assert stats["kv_disk_refused"] > 0, stats
    assert all(stats[f] > 0 for f in FIGURES), stats
    assert len(stats["replicas"]) == 1

    page = signed_in_page(browser, server, "engine")
    errors = watch_errors(page)
    # Refreshed every 2 s: wait for a render of the settled figures.
    page.wait_for_function(
        """(n) => document.querySelector('#engine-disk [data-figure=kv_disk_refused]')
              ?.textContent === n""", arg=f"{stats['kv_disk_refused']:,}", timeout=30_000)
    card = page.locator("#engine-disk")
    assert card.locator(".label").text_content() == "KV disk tier"
    assert card.locator(".value").text_content() == _fmt_bytes(stats["kv_disk_bytes_used"])
    [shown] = _page_figures(page, "#engine-disk")
    assert shown == {f: _shown(stats, f) for f in FIGURES}
    # The card's meter is the budget's fill (the browser keeps 4 decimals of a %).
    width = card.locator(".meter span").evaluate("s => s.style.width")
    assert float(width[:-1]) == pytest.approx(
        100 * stats["kv_disk_bytes_used"] / stats["kv_disk_max_bytes"], abs=1e-3)
    rows = _page_figures(page, "#engine-replicas td[data-label='Disk tier']")
    assert rows == [{f: _shown(r, f) for f in FIGURES} for r in stats["replicas"]]
    assert _engine(server)["kv_disk_refused"] == stats["kv_disk_refused"]  # still settled
    assert errors == []
    page.screenshot(path=str(screenshots / "engine-disk-tier.png"), full_page=True)
    page.close()


def test_engine_page_says_off_without_a_disk_tier(browser: Any, ui_server: UIServer) -> None:
    stats = _engine(ui_server)
    assert stats["kv_disk_max_bytes"] == 0
    assert all(r["kv_disk_max_bytes"] == 0 for r in stats["replicas"])
    page = signed_in_page(browser, ui_server, "engine")
    errors = watch_errors(page)
    page.wait_for_selector("#engine-disk")
    card = page.locator("#engine-disk")
    assert card.locator(".value").text_content() == "off"
    assert card.locator("[data-figure]").count() == 0
    cells = page.locator("#engine-replicas td[data-label='Disk tier']")
    assert cells.all_text_contents() == ["off"] * len(stats["replicas"])
    assert errors == []
    page.close()
