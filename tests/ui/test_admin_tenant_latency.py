"""The Engine page's Tenants card in a real browser: each tenant by name, with its share of
the scheduler, its recent latency percentiles and its SLO attainment."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_admin_figures import SERVED, admin, signed_in_page

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py
HOUR_MS = 3_600_000
# "2.4 / 4.7 ms", or "850 ms / 1.24 s" where the units differ.
LATENCY = re.compile(r"[\d.]+ / [\d.]+ m?s|[\d.]+ ms / [\d.]+ s")


def test_engine_page_shows_each_tenants_latency_and_slo_attainment(
        browser: Any, ui_server: UIServer, screenshots: Path) -> None:
    tenant = f"lat-{uuid.uuid4().hex[:6]}"
    with admin(ui_server) as http:
        # An SLO of an hour: every request meets it.
        made = http.post("/admin/api/tenants", json={"name": tenant, "weight": 2,
                                                     "slo_ttft_ms": HOUR_MS,
                                                     "slo_tpot_ms": HOUR_MS})
        assert made.status_code == 201, made.text
        key = http.post(f"/admin/api/tenants/{tenant}/keys", json={}).json()["key"]
    for _ in range(3):
        response = httpx.post(f"{ui_server.url}/v1/completions", timeout=60,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": SERVED, "prompt": "Hello", "max_tokens": 4,
                                    "ignore_eos": True})
        assert response.status_code == 200, response.text

    page = signed_in_page(browser, ui_server, "engine")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    row = page.locator("#engine-tenants tbody tr", has_text=tenant)
    row.wait_for(timeout=30_000)
    cells = json.loads(row.evaluate(
        "r => JSON.stringify(Object.fromEntries([...r.cells].map(c => [c.dataset.label, "
        "c.innerText.trim()])))"))
    assert cells["Tenant"].splitlines() == [tenant, "3 recent requests"]
    assert cells["Weight"] == "2"
    assert (cells["Waiting"], cells["Running"], cells["KV blocks"]) == ("0", "0", "0")
    assert LATENCY.fullmatch(cells["TTFT p50 / p99"]), cells
    assert LATENCY.fullmatch(cells["TPOT p50 / p99"]), cells
    assert re.fullmatch(r"\d+ / \d+", cells["TTFT steps p50 / p99"]), cells
    assert cells["SLO attainment"].splitlines() == [
        "100.0%", "SLO: TTFT ≤ 3,600 s · TPOT ≤ 3,600 s"]
    badge = row.locator("td[data-label='SLO attainment'] .badge")
    assert badge.get_attribute("class") == "badge good"
    note = page.locator("#page .card", has=page.locator("#engine-tenants")).locator("h2 + span")
    assert note.text_content() == "Latency over each tenant's last 1,000 requests in this " \
                                  "gateway process"
    page.screenshot(path=str(screenshots / "engine-tenants.png"), full_page=True)
    # A narrow window: the row becomes a card, nothing overflows sideways.
    page.set_viewport_size({"width": 400, "height": 860})
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 400, f"the engine page is {width}px wide in a 400px window"
    assert errors == []
    page.close()
