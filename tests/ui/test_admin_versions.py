"""An adapter's versions in the admin UI, in a real browser: which one is current, the
canary split in progress with each version's share, promote (confirmed by a second
click), split and cancel as one action each, and refusals explained in the row. What the
page shows is checked against the admin API, and calls as the tenant reach the version
the page says. Screenshots go to ``artifacts/screenshots/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from test_admin_figures import FILES, admin, new_tenant, signed_in_page, watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py


def _state(server: UIServer, tenant: str) -> dict[str, Any]:
    with admin(server) as http:
        response = http.get(f"/admin/api/tenants/{tenant}/adapters/bot")
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _answered_by(server: UIServer, key: str, user: str) -> int:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "bot", "prompt": "Hi", "max_tokens": 1, "user": user})
    assert response.status_code == 200, response.text
    return int(response.headers["X-Loraplex-Adapter-Version"])


def test_versions_promote_split_and_cancel(browser: Any, ui_server: UIServer,
                                           llama_adapters: dict[str, Path],
                                           screenshots: Path) -> None:
    from playwright.sync_api import expect

    tenant, key = new_tenant(ui_server)
    with admin(ui_server) as http:
        for spec in ("r4", "r8qv", "r4"):
            files = {name: (name, (llama_adapters[spec] / name).read_bytes())
                     for name in FILES}
            response = http.post(f"/admin/api/tenants/{tenant}/adapters",
                                 data={"name": "bot"}, files=files)
            assert response.status_code == 201, response.text
    page = signed_in_page(browser, ui_server, "adapters")
    errors = watch_errors(page)  # the refusal below is on purpose
    page.select_option("#page .page-head select", tenant)

    def row(version: int) -> Any:
        return page.locator("#adapter-list tr", has=page.locator(
            "td[data-label=Version]", has_text=f"v{version} "))

    # The latest version is current and takes every request.
    expect(row(3).locator("td[data-label=Version]")).to_contain_text("current")
    expect(row(3).locator(".traffic")).to_have_text("100% of traffic")
    expect(row(1).locator(".traffic")).to_have_text("0% of traffic")
    assert row(3).locator("button.promote").count() == 0

    # Promote asks for a second click, then version 1 is current (a rollback).
    promote = row(1).locator("button.promote")
    promote.click()
    expect(promote).to_have_text("Make v1 current?")
    assert _state(ui_server, tenant)["current_version"] == 3  # nothing yet
    promote.click()
    expect(row(1).locator("td[data-label=Version]")).to_contain_text("current")
    assert _state(ui_server, tenant)["current_version"] == 1
    assert _answered_by(ui_server, key, "anyone") == 1

    # A refused split is explained in its row and changes nothing.
    row(2).locator("input.percent").fill("150")
    row(2).locator("button.split").click()
    refusal = row(2).locator("p.error[role=alert]")
    expect(refusal).to_contain_text("percent must be a number from 0 to 100")
    page.screenshot(path=str(screenshots / "adapter-versions-refused.png"), full_page=True)
    assert _state(ui_server, tenant)["split"] is None

    # Split 25% onto version 2: both rows show their share, the canary is marked.
    row(2).locator("input.percent").fill("25")
    row(2).locator("button.split").click()
    expect(row(2).locator(".traffic")).to_have_text("25% of traffic")
    expect(row(1).locator(".traffic")).to_have_text("75% of traffic")
    expect(row(2).locator("td[data-label=Version]")).to_contain_text("canary")
    assert _state(ui_server, tenant)["split"] == {"version": 2, "percent": 25.0}
    sides = {_answered_by(ui_server, key, f"user-{i}") for i in range(40)}
    assert sides == {1, 2}
    page.screenshot(path=str(screenshots / "adapter-versions-split.png"), full_page=True)

    # Cancel: one click, every request goes to the current version again.
    row(1).locator("button.cancel-split").click()
    expect(row(2).locator(".traffic")).to_have_text("0% of traffic")
    expect(row(1).locator(".traffic")).to_have_text("100% of traffic")
    assert _state(ui_server, tenant)["split"] is None
    assert {_answered_by(ui_server, key, f"user-{i}") for i in range(20)} == {1}
    assert row(1).locator("button.cancel-split").count() == 0
    page.screenshot(path=str(screenshots / "adapter-versions.png"), full_page=True)
    assert not errors, errors
    page.close()


def test_an_older_lists_late_answer_does_not_replace_the_chosen_tenants(
        browser: Any, ui_server: UIServer, llama_adapters: dict[str, Path]) -> None:
    """The page first lists every tenant's adapters; choosing a tenant while that answer is
    still on its way must leave the chosen tenant's list showing once the older answer
    lands (it once replaced it, so a row matched versions of other tenants)."""
    from playwright.sync_api import expect

    tenant, _ = new_tenant(ui_server)
    other, _ = new_tenant(ui_server)
    with admin(ui_server) as http:
        for owner in (tenant, other):
            files = {name: (name, (llama_adapters["r4"] / name).read_bytes()) for name in FILES}
            response = http.post(f"/admin/api/tenants/{owner}/adapters",
                                 data={"name": "bot"}, files=files)
            assert response.status_code == 201, response.text
    page = browser.new_page()
    held: list[Any] = []

    def hold_unfiltered(route: Any) -> None:
        if "tenant=" in route.request.url:
            route.continue_()
        else:
            held.append(route)

    page.route("**/admin/api/adapters?*", hold_unfiltered)
    page.goto(f"{ui_server.url}/admin")
    page.fill("#admin-key", ui_server.admin_key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#page[data-page=tenants]")
    page.click("#nav a[data-page=adapters]")
    page.wait_for_selector("#page .page-head select option[value='" + tenant + "']",
                           state="attached")
    assert len(held) == 1  # the unfiltered list is on its way
    page.select_option("#page .page-head select", tenant)
    rows = page.locator("#adapter-list tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text(f"{tenant}/bot")
    with page.expect_response(lambda r: "/admin/api/adapters?" in r.url
                              and "tenant=" not in r.url) as late:
        held[0].continue_()
    late.value.finished()
    page.wait_for_timeout(300)  # the page has handled the late answer by now
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text(f"{tenant}/bot")
    page.close()
