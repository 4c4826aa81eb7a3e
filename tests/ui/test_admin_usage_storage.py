"""The Usage page, in a real browser, shows each tenant's adapter storage against its
quotas: the same bytes and versions /admin/api/usage reports."""

from __future__ import annotations

import json
import math
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
from test_admin_figures import FILES, admin, new_tenant, signed_in_page, watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py


def fmt_bytes(n: int) -> str:
    """dom.js's fmtBytes (toFixed rounds the exact value half up)."""
    if n < 1024:
        return f"{n} B"
    unit, power, places = (("KiB", 1, "0.1") if n < 1024 ** 2 else
                           ("MiB", 2, "0.1") if n < 1024 ** 3 else ("GiB", 3, "0.01"))
    value = (Decimal(n) / 1024 ** power).quantize(Decimal(places), rounding=ROUND_HALF_UP)
    return f"{value} {unit}"


def used(n: int, quota: int | None, fmt: Any) -> str:
    """dom.js's fmtUsed."""
    pct = f" ({math.floor(100 * n / quota + 0.5)}%)" if quota else ""
    return f"{fmt(n)} / {'unlimited' if quota is None else fmt(quota)}{pct}"


def test_usage_page_shows_storage_against_quotas(browser: Any, ui_server: UIServer,
                                                 ui_adapters: dict[str, Path]) -> None:
    from playwright.sync_api import expect

    tenant, _ = new_tenant(ui_server)
    with admin(ui_server) as http:
        assert http.patch(f"/admin/api/tenants/{tenant}", json={
            "max_storage_bytes": 3 << 20, "max_adapter_versions": 3}).status_code == 200
        files = {name: (name, (ui_adapters["good"] / name).read_bytes()) for name in FILES}
        made = http.post(f"/admin/api/tenants/{tenant}/adapters", data={"name": "ledger"},
                         files=files)
        assert made.status_code == 201, made.text
        report = http.get("/admin/api/usage").json()
        described = http.get(f"/admin/api/tenants/{tenant}").json()
    [stored] = [s for s in report["storage"] if s["tenant"] == tenant]
    assert stored["storage_bytes"] > 0 and stored["num_adapter_versions"] == 1
    assert {k: described[k] for k in stored if k != "tenant"} == \
        {k: v for k, v in stored.items() if k != "tenant"}

    page = signed_in_page(browser, ui_server, "usage")
    errors = watch_errors(page)
    row = page.locator("#usage-storage tr", has=page.locator(".storage-tenant",
                                                             has_text=tenant))
    expect(row.locator(".storage-used")).to_have_text(
        used(stored["storage_bytes"], 3 << 20, fmt_bytes))
    expect(row.locator(".versions-used")).to_have_text("1 / 3 (33%)")
    # Every tenant the API lists has its row, with the API's figures.
    shown = json.loads(page.evaluate(
        "() => JSON.stringify([...document.querySelectorAll('#usage-storage tbody tr')]"
        ".map(r => [...r.cells].map(c => c.textContent)))"))
    assert {name: (stored_text, versions) for name, stored_text, versions in shown} == {
        s["tenant"]: (used(s["storage_bytes"], s["max_storage_bytes"], fmt_bytes),
                      used(s["num_adapter_versions"], s["max_adapter_versions"],
                           lambda n: f"{n:,}"))
        for s in report["storage"]}
    # One tenant chosen: its storage only.
    page.select_option("#page form select >> nth=1", tenant)
    expect(page.locator("#usage-storage tbody tr")).to_have_count(1)
    expect(page.locator("#usage-storage .storage-tenant")).to_have_text(tenant)
    assert errors == []
    page.close()
