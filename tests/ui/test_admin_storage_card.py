"""A tenant's storage quotas set in the admin UI, in a real browser, and read back through
the admin API: sizes with K/M/G suffixes, the version count, used / quota shown beside
them; a refused value is explained in its row and changes nothing."""

from __future__ import annotations

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
QUOTAS = ("max_storage_bytes", "max_adapter_versions")


def _quotas(server: UIServer, name: str) -> tuple[Any, ...]:
    return tenant_fields(server, name, QUOTAS)


def _save(page: Any, row: Any, status: int) -> None:
    save_row(page, row, "Save quotas", status)


def test_storage_quotas_set_in_the_ui_are_what_the_api_reads(
        browser: Any, ui_server: UIServer) -> None:
    from playwright.sync_api import expect

    name, _ = new_tenant(ui_server)
    with admin(ui_server) as http:  # set through the API: the page shows it
        assert http.patch(f"/admin/api/tenants/{name}",
                          json={"max_adapter_versions": 4}).status_code == 200
    page = signed_in_page(browser, ui_server, "tenants")
    errors = watch_errors(page)
    row = page.locator("#tenant-storage tr", has=page.locator(".storage-tenant",
                                                              has_text=name))
    expect(row.locator("input[data-quota=max_storage_bytes]")).to_have_value("")
    expect(row.locator("input[data-quota=max_adapter_versions]")).to_have_value("4")
    expect(row.locator(".storage-used")).to_have_text("0 B / unlimited")
    expect(row.locator(".versions-used")).to_have_text("0 / 4 (0%)")

    row.locator("input[data-quota=max_storage_bytes]").fill("500M")
    row.locator("input[data-quota=max_adapter_versions]").fill("12")
    _save(page, row, 200)
    assert _quotas(ui_server, name) == (500 << 20, 12)
    expect(row.locator("input[data-quota=max_storage_bytes]")).to_have_value("500M")
    expect(row.locator(".storage-used")).to_have_text("0 B / 500.0 MiB (0%)")

    # A size that is no size is refused in its row, naming the field; nothing changes.
    row.locator("input[data-quota=max_storage_bytes]").fill("lots")
    row.locator("input[data-quota=max_adapter_versions]").fill("3")
    _save(page, row, 400)
    expect(row.locator("p.error[role=alert]")).to_contain_text("max_storage_bytes must be")
    assert _quotas(ui_server, name) == (500 << 20, 12)

    # Emptied, both are unlimited again.
    row.locator("input[data-quota=max_storage_bytes]").fill("")
    row.locator("input[data-quota=max_adapter_versions]").fill("")
    _save(page, row, 200)
    assert _quotas(ui_server, name) == (None, None)
    row.locator("input[data-quota=max_storage_bytes]").fill("2g")
    _save(page, row, 200)
    assert _quotas(ui_server, name) == (2 << 30, None)
    assert errors == []
    page.close()
