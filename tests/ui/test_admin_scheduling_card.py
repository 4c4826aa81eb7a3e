"""A tenant's scheduling settings set in the admin UI, in a real browser, and read back
through the admin API: weight and class on creation, then weight, class, KV fraction and
SLOs on the tenant page; a refused value is explained in its row and changes nothing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from test_admin_figures import (
    admin,
    new_tenant,
    save_row,
    signed_in_page,
    tenant_fields,
    watch_errors,
)

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py
SETTINGS = ("weight", "priority_class", "max_kv_fraction", "slo_ttft_ms", "slo_tpot_ms")


def _settings(server: UIServer, name: str) -> tuple[Any, ...]:
    return tenant_fields(server, name, SETTINGS)


def _save(page: Any, row: Any, status: int) -> None:
    save_row(page, row, "Save scheduling", status)


def test_scheduling_settings_set_in_the_ui_are_what_the_api_reads(
        browser: Any, ui_server: UIServer) -> None:
    from playwright.sync_api import expect

    name, _ = new_tenant(ui_server)
    with admin(ui_server) as http:  # set through the API: the page shows it
        assert http.patch(f"/admin/api/tenants/{name}",
                          json={"slo_tpot_ms": 40}).status_code == 200
    page = signed_in_page(browser, ui_server, "tenants")
    errors = watch_errors(page)
    row = page.locator("#tenant-scheduling tr", has=page.locator(".scheduled-tenant",
                                                                 has_text=name))
    expect(row.locator("input[data-setting=weight]")).to_have_value("1")
    expect(row.locator("select[data-setting=priority_class]")).to_have_value("interactive")
    expect(row.locator("input[data-setting=max_kv_fraction]")).to_have_value("")
    expect(row.locator("input[data-setting=slo_tpot_ms]")).to_have_value("40")

    row.locator("input[data-setting=weight]").fill("2.5")
    row.locator("select[data-setting=priority_class]").select_option("batch")
    row.locator("input[data-setting=max_kv_fraction]").fill("0.5")
    row.locator("input[data-setting=slo_ttft_ms]").fill("800")
    _save(page, row, 200)
    assert _settings(ui_server, name) == (2.5, "batch", 0.5, 800, 40)
    expect(row.locator("input[data-setting=weight]")).to_have_value("2.5")  # re-rendered
    expect(row.locator("select[data-setting=priority_class]")).to_have_value("batch")

    # A weight of 0 is refused in its row, naming the field; nothing changes.
    row.locator("input[data-setting=weight]").fill("0")
    row.locator("input[data-setting=slo_ttft_ms]").fill("900")
    _save(page, row, 400)
    expect(row.locator("p.error[role=alert]")).to_contain_text("weight must be")
    assert _settings(ui_server, name) == (2.5, "batch", 0.5, 800, 40)

    # Emptied, the KV fraction and SLO go back to the server's defaults.
    row.locator("input[data-setting=weight]").fill("3")
    row.locator("input[data-setting=max_kv_fraction]").fill("")
    row.locator("input[data-setting=slo_tpot_ms]").fill("")
    _save(page, row, 200)
    assert _settings(ui_server, name) == (3.0, "batch", None, 900, None)
    assert errors == []
    page.close()


def test_weight_and_class_are_set_on_creation(browser: Any, ui_server: UIServer) -> None:
    from playwright.sync_api import expect

    page = signed_in_page(browser, ui_server, "tenants")
    errors = watch_errors(page)
    name = f"ui-{uuid.uuid4().hex[:6]}"
    form = page.locator("#create-tenant")
    form.locator("input[placeholder=acme]").fill(name)
    form.locator("input[data-setting=weight]").fill("7")
    form.locator("select[data-setting=priority_class]").select_option("batch")
    form.locator("button[type=submit]").click()
    row = page.locator("#tenant-scheduling tr", has=page.locator(".scheduled-tenant",
                                                                 has_text=name))
    expect(row.locator("input[data-setting=weight]")).to_have_value("7")
    assert _settings(ui_server, name) == (7.0, "batch", None, None, None)
    # The form is ready for the next tenant, with the defaults again.
    expect(form.locator("select[data-setting=priority_class]")).to_have_value("interactive")
    expect(form.locator("input[data-setting=weight]")).to_have_value("")
    assert errors == []
    page.close()
