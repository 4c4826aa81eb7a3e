"""Pinned adapters in the admin UI, in a real browser: Pin is one action on an active
version's row; the row then carries a "pinned" badge and offers Unpin, the admin API
agrees, and the engine page shows the pin in its device slot. A pin past the server's
share of slots (one of the UI server's two) is refused and explained in its row, changing
nothing. Screenshots go to ``artifacts/screenshots/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_admin_figures import FILES, admin, new_tenant, signed_in_page, watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py


def _pinned(server: UIServer, tenant: str) -> dict[int, bool]:
    with admin(server) as http:
        response = http.get(f"/admin/api/tenants/{tenant}/adapters/bot")
    assert response.status_code == 200, response.text
    return {v["version"]: v["pinned"] for v in response.json()["versions"]}


def _engine_pins(server: UIServer) -> list[str]:
    with admin(server) as http:
        response = http.get("/admin/api/engine")
    assert response.status_code == 200, response.text
    pins: list[str] = response.json()["pinned_adapters"]
    return pins


def test_pin_refused_pin_and_unpin(browser: Any, ui_server: UIServer,
                                   llama_adapters: dict[str, Path],
                                   screenshots: Path) -> None:
    from playwright.sync_api import expect

    tenant, _ = new_tenant(ui_server)
    with admin(ui_server) as http:
        for spec in ("r4", "r8qv"):
            files = {name: (name, (llama_adapters[spec] / name).read_bytes())
                     for name in FILES}
            response = http.post(f"/admin/api/tenants/{tenant}/adapters",
                                 data={"name": "bot"}, files=files)
            assert response.status_code == 201, response.text
        identity = {v["version"]: f"{v['id']}@{v['digest'][:12]}" for v in
                    http.get(f"/admin/api/tenants/{tenant}/adapters/bot").json()["versions"]}
        assert http.get("/admin/api/engine").json()["max_pinned"] == 1
    page = signed_in_page(browser, ui_server, "adapters")
    errors = watch_errors(page)  # the refusal below is on purpose

    def show_tenant() -> None:
        """Chooses the tenant and waits for its list: until then the rows are every
        tenant's, and a row by version matches several."""
        page.select_option("#page .page-head select", tenant)
        rows = page.locator("#adapter-list tbody tr")
        expect(rows.filter(has_not_text=f"{tenant}/bot")).to_have_count(0)
        expect(rows).to_have_count(2)

    def row(version: int) -> Any:
        return page.locator("#adapter-list tr", has=page.locator(
            "td[data-label=Version]", has_text=f"v{version} "))

    show_tenant()
    expect(row(1).locator("button.pin")).to_have_text("Pin")
    expect(row(1).locator(".badge.pinned")).to_have_count(0)

    # Pin: one click; the badge shows, the button turns into Unpin, API and engine agree.
    row(1).locator("button.pin").click()
    expect(row(1).locator("td[data-label=Version] .badge.pinned")).to_have_text("pinned")
    expect(row(1).locator("button.unpin")).to_have_text("Unpin")
    assert _pinned(ui_server, tenant) == {1: True, 2: False}
    assert _engine_pins(ui_server) == [identity[1]]
    page.screenshot(path=str(screenshots / "adapter-pinned.png"), full_page=True)

    # A second pin is past the share (1 of 2 slots): refused in its row, nothing changed.
    row(2).locator("button.pin").click()
    refusal = row(2).locator("p.error[role=alert]")
    expect(refusal).to_contain_text("holds at most 1 pinned version")
    expect(refusal).to_contain_text(f"{tenant}/bot@1")
    expect(row(2).locator(".badge.pinned")).to_have_count(0)
    assert _pinned(ui_server, tenant) == {1: True, 2: False}
    assert _engine_pins(ui_server) == [identity[1]]
    page.screenshot(path=str(screenshots / "adapter-pin-refused.png"), full_page=True)

    # The engine page shows the pinned adapter in its device slot.
    page.click("#nav a[data-page=engine]")
    slot = page.locator("#engine-slots tr", has_text=identity[1])
    expect(slot.locator(".badge.pinned")).to_have_text("pinned", timeout=10000)
    expect(page.locator("#page")).to_contain_text("1 of 1 pinned")
    page.screenshot(path=str(screenshots / "engine-pinned-slot.png"), full_page=True)

    # Unpin: one click; the badge goes, API and engine agree.
    page.click("#nav a[data-page=adapters]")
    page.wait_for_selector("#page[data-page=adapters]")
    show_tenant()
    row(1).locator("button.unpin").click()
    expect(row(1).locator(".badge.pinned")).to_have_count(0)
    expect(row(1).locator("button.pin")).to_have_text("Pin")
    assert _pinned(ui_server, tenant) == {1: False, 2: False}
    assert _engine_pins(ui_server) == []
    page.screenshot(path=str(screenshots / "adapter-unpinned.png"), full_page=True)
    assert not errors, errors
    page.close()
