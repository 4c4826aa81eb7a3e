"""The Tenants page, in a real browser, offers no Suspend on the tenant of the admin key
in use (the server refuses it): it says why instead, while other tenants keep theirs."""

from __future__ import annotations

from typing import Any

import pytest
from test_admin_figures import admin, new_tenant, signed_in_page, watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py


def test_no_suspend_offered_on_the_admin_keys_own_tenant(browser: Any,
                                                          ui_server: UIServer) -> None:
    from playwright.sync_api import expect

    other, _ = new_tenant(ui_server)
    with admin(ui_server) as http:
        tenants = http.get("/admin/api/tenants").json()["data"]
        # What the page mirrors: the server refuses to suspend the caller's own tenant.
        own = [t["name"] for t in tenants if t["is_own"]]
        assert len(own) == 1, tenants
        refused = http.patch(f"/admin/api/tenants/{own[0]}", json={"status": "suspended"})
        assert refused.status_code == 400, refused.text
        assert http.get(f"/admin/api/tenants/{other}").json()["is_own"] is False
    page = signed_in_page(browser, ui_server, "tenants")
    errors = watch_errors(page)

    def row(name: str) -> Any:
        return page.locator("#page tbody tr", has=page.locator(".tenant-name",
                                                                has_text=name))

    mine = row(own[0])
    expect(mine.locator(".own-tenant")).to_have_text(
        "Cannot be suspended: it holds the admin key you are using.")
    expect(mine.locator("button", has_text="Suspend")).to_have_count(0)
    expect(mine.locator("button", has_text="Save limits")).to_have_count(1)
    # Any other tenant can still be suspended from the page, and reactivated.
    theirs = row(other)
    expect(theirs.locator(".own-tenant")).to_have_count(0)
    theirs.locator("button", has_text="Suspend").click()
    with page.expect_response(lambda r: r.request.method == "PATCH") as answered:
        theirs.locator("button", has_text="Confirm suspend").click()
    assert answered.value.status == 200
    expect(theirs.locator(".badge")).to_have_text("suspended")
    with page.expect_response(lambda r: r.request.method == "PATCH") as answered:
        theirs.locator("button", has_text="Reactivate").click()
    assert answered.value.status == 200
    expect(theirs.locator(".badge")).to_have_text("active")
    assert errors == []
    page.close()
