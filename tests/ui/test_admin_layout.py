"""What a narrow window and a mistyped name show in the admin UI, in a real browser."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from test_admin_figures import FILES, admin, new_tenant, signed_in_page

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py


@pytest.mark.parametrize("width", [800, 1010, 1280])
def test_adapter_actions_are_in_view_at_any_width(browser: Any, ui_server: UIServer,
                                                  ui_adapters: dict[str, Path],
                                                  width: int) -> None:
    tenant, _ = new_tenant(ui_server)
    with admin(ui_server) as http:
        files = {name: (name, (ui_adapters["good"] / name).read_bytes()) for name in FILES}
        response = http.post(f"/admin/api/tenants/{tenant}/adapters",
                             data={"name": f"wide-{uuid.uuid4().hex[:4]}"}, files=files)
        assert response.status_code == 201, response.text
    page = signed_in_page(browser, ui_server, "adapters")
    page.set_viewport_size({"width": width, "height": 900})
    page.wait_for_selector("#adapter-list button:has-text('Delete')")
    wrap = page.locator("#adapter-list .table-wrap")
    right = wrap.bounding_box()["x"] + wrap.bounding_box()["width"]
    buttons = page.locator("#adapter-list button")
    assert buttons.count() >= 2
    for i in range(buttons.count()):
        box = buttons.nth(i).bounding_box()
        assert box is not None and box["x"] + box["width"] <= right + 0.5, (width, i, box)
    # A table that still overflows says so; one that fits shows no hint.
    overflows = wrap.evaluate("w => w.scrollWidth > w.clientWidth + 1")
    assert page.locator("#adapter-list .scroll-hint").is_visible() == overflows
    page.close()


@pytest.mark.parametrize(("form", "value", "words"), [
    ("#create-tenant", "Bad Name!", ("Tenant name", "not allowed", "lower-case letters")),
    ("#create-tenant", "", ("Tenant name is required",)),
])
def test_a_refused_tenant_name_is_explained_in_the_page(
        browser: Any, ui_server: UIServer, form: str, value: str, words: tuple[str, ...]) -> None:
    page = signed_in_page(browser, ui_server, "tenants")
    page.fill(f"{form} input[placeholder=acme]", value)
    page.click(f"{form} button[type=submit]")
    error = page.locator("#page p.error[role=alert]").first
    error.wait_for(state="visible", timeout=10_000)
    text = error.text_content() or ""
    assert all(word in text for word in words), text
    assert page.locator(f"{form} input[placeholder=acme]").get_attribute(
        "aria-invalid") == "true"
    page.close()


def test_a_refused_adapter_name_is_explained_in_the_page(browser: Any, ui_server: UIServer,
                                                         ui_adapters: dict[str, Path]) -> None:
    new_tenant(ui_server)
    page = signed_in_page(browser, ui_server, "adapters")
    page.fill("#upload-adapter input[placeholder=support-bot]", "-no spaces")
    page.set_input_files("#upload-adapter input[type=file]",
                         [str(ui_adapters["good"] / name) for name in FILES])
    page.click("#upload-adapter button[type=submit]")
    error = page.locator("#upload-error")
    error.wait_for(state="visible", timeout=10_000)
    assert 'Adapter name "-no spaces" is not allowed' in (error.text_content() or "")
    page.close()
