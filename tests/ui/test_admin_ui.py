"""The admin UI in a real browser: sign in, create a tenant, issue a key, upload a good and
a bad adapter, then call the new adapter with the new key through the ``openai`` client.

Screenshots of every page (and of a narrow window) go to ``artifacts/screenshots/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_admin_figures import watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py
FILES = ("adapter_config.json", "adapter_model.safetensors")


def _go(page: Any, server: UIServer, name: str) -> None:
    page.click(f"#nav a[data-page={name}]")
    page.wait_for_selector(f"#page[data-page={name}]")


def test_admin_flow(browser: Any, ui_server: UIServer, ui_adapters: dict[str, Path],
                    screenshots: Path) -> None:
    from playwright.sync_api import expect

    page = browser.new_page()
    errors = watch_errors(page)  # the refusals below are on purpose
    page.goto(f"{ui_server.url}/admin")

    # Sign in: a wrong key is refused in place, the admin key opens the tenants page.
    page.fill("#admin-key", "lpx-wrong")
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#sign-in-error")).to_contain_text("Incorrect API key")
    page.fill("#admin-key", ui_server.admin_key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#page[data-page=tenants]")
    assert ui_server.admin_key not in page.url
    assert page.evaluate("sessionStorage.getItem('loraplex.adminKey')") == ui_server.admin_key
    assert page.evaluate("localStorage.length") == 0

    # Tenants: a bad name is explained next to the form; a good one is listed.
    page.fill("#create-tenant input >> nth=0", "Web Co")
    page.evaluate("document.querySelector('#create-tenant input').removeAttribute('pattern')")
    page.click("#create-tenant button[type=submit]")
    expect(page.locator("#page .error").first).to_contain_text("invalid tenant name")
    page.fill("#create-tenant input >> nth=0", "webco")
    page.fill("#create-tenant input >> nth=1", "600")
    page.click("#create-tenant button[type=submit]")
    row = page.locator("tr", has=page.locator(".tenant-name", has_text="webco"))
    expect(row).to_contain_text("active")
    expect(page.locator("#page .error").first).to_be_hidden()
    page.screenshot(path=str(screenshots / "tenants.png"), full_page=True)

    # Keys: issued once, with a copy button.
    _go(page, ui_server, "keys")
    page.select_option("#issue-key select >> nth=0", "webco")
    page.fill("#issue-key input", "ui-test")
    page.click("#issue-key button[type=submit]")
    secret = page.locator("#issued-key input")
    expect(secret).to_have_value(re.compile(r"^lpx-"))
    key = secret.input_value()
    page.click("#issued-key button")
    expect(page.locator("#issued-key [role=status]")).not_to_be_empty()
    expect(page.locator("#page table")).to_contain_text("ui-test")
    page.screenshot(path=str(screenshots / "keys.png"), full_page=True)

    # Adapters: a real adapter is stored and listed, a bad one is refused with the reason.
    _go(page, ui_server, "adapters")
    page.select_option("#upload-adapter select >> nth=0", "webco")
    page.fill("#upload-adapter input[type=text], #upload-adapter input:not([type])", "helper")
    page.set_input_files("#upload-adapter input[type=file]",
                         [str(ui_adapters["good"] / f) for f in FILES])
    page.click("#upload-adapter button[type=submit]")
    expect(page.locator("#upload-done")).to_contain_text("webco/helper version 1")
    expect(page.locator("#adapter-list")).to_contain_text("webco/helper")
    page.select_option("#upload-adapter select >> nth=0", "webco")
    page.fill("#upload-adapter input:not([type])", "too-big")
    page.set_input_files("#upload-adapter input[type=file]",
                         [str(ui_adapters["bad"] / f) for f in FILES])
    page.click("#upload-adapter button[type=submit]")
    expect(page.locator("#upload-error")).to_contain_text("rank")
    expect(page.locator("#upload-done")).to_be_hidden()
    expect(page.locator("#adapter-list")).not_to_contain_text("too-big")
    page.screenshot(path=str(screenshots / "adapters.png"), full_page=True)

    # The new key and adapter work through the OpenAI client.
    client = openai.OpenAI(base_url=f"{ui_server.url}/v1", api_key=key, max_retries=0,
                           timeout=60)
    for _ in range(3):
        out = client.completions.create(model="helper", prompt="Hello", max_tokens=5,
                                        temperature=0)
        assert out.choices[0].text and out.usage.completion_tokens == 5

    _go(page, ui_server, "usage")
    page.wait_for_selector("#usage-chart rect[data-series=webco]")
    expect(page.locator("#usage-totals table")).to_contain_text("webco/helper v1")
    page.screenshot(path=str(screenshots / "usage.png"), full_page=True)

    _go(page, ui_server, "engine")
    expect(page.locator("#engine-slots")).to_contain_text("webco/helper")
    first = page.locator("#engine-updated").text_content()
    page.wait_for_function(
        "prev => document.querySelector('#engine-updated').textContent !== prev", arg=first)
    page.screenshot(path=str(screenshots / "engine.png"), full_page=True)

    # Revoking the key from the UI locks it out.
    _go(page, ui_server, "keys")
    revoke = page.locator("tr", has_text="ui-test").locator("button", has_text="Revoke")
    revoke.click()
    page.locator("tr", has_text="ui-test").locator("button", has_text="Confirm").click()
    expect(page.locator("tr", has_text="ui-test")).to_contain_text("revoked")
    assert httpx.get(f"{ui_server.url}/v1/models",
                     headers={"Authorization": f"Bearer {key}"}).status_code == 401

    # A narrow window: nothing overflows sideways.
    page.set_viewport_size({"width": 400, "height": 860})
    for name in ("tenants", "adapters"):
        _go(page, ui_server, name)
        page.wait_for_selector("#page table")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 400, f"{name} page is {width}px wide in a 400px window"
        page.screenshot(path=str(screenshots / f"{name}-narrow.png"), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 900})

    # Signing out forgets the key.
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert page.evaluate("sessionStorage.length") == 0
    assert errors == []
    page.close()
