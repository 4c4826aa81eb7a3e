"""Each adapter version's measured effect in the admin UI, in a real browser: the upload
answer says it (and warns when it is indistinguishable from zero), and the versions list
shows it per version as the admin API reports it. Screenshots go to
``artifacts/screenshots/``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_admin_figures import FILES, admin, new_tenant, signed_in_page, watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py


def _faint(source: Path, out: Path) -> Path:
    """The adapter with every lora_B times 1e-4: admitted, but its effect is ~0."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(source, out))
    tensors = load_file(str(folder / FILES[1]))
    save_file({k: v * 1e-4 if ".lora_B." in k else v for k, v in tensors.items()},
              str(folder / FILES[1]), metadata={"format": "pt"})
    return folder


def _shown(effect: dict[str, Any]) -> str:
    """What the page shows of an effect (admin_ui/pages/adapters.js effectText)."""
    kl = effect["kl"]
    text = "0" if kl == 0 else f"{kl:.1e}".replace("e-0", "e-") if kl < 0.001 \
        else f"{float(f'{kl:.2g}'):g}"
    changed = round(effect["changed"] * effect["prompts"])
    return f"KL {text} · {changed}/{effect['prompts']} changed"


def test_versions_show_their_measured_effect(browser: Any, ui_server: UIServer,
                                             llama_adapters: dict[str, Path],
                                             tmp_path: Path, screenshots: Path) -> None:
    from playwright.sync_api import expect

    tenant, _ = new_tenant(ui_server)
    page = signed_in_page(browser, ui_server, "adapters")
    errors = watch_errors(page)

    def upload(name: str, folder: Path) -> None:
        page.select_option("#upload-adapter select >> nth=0", tenant)
        page.fill("#upload-adapter input:not([type])", name)
        page.set_input_files("#upload-adapter input[type=file]",
                             [str(folder / f) for f in FILES])
        page.click("#upload-adapter button[type=submit]")
        expect(page.locator("#upload-done")).to_contain_text(f"{tenant}/{name} version 1")

    upload("real", llama_adapters["r4"])
    expect(page.locator("#upload-done")).to_contain_text(re.compile(
        r"Measured effect: KL [0-9.e-]+ · [0-4]/4 changed\."))
    expect(page.locator("#upload-warning")).to_be_hidden()

    upload("faint", _faint(llama_adapters["r4"], tmp_path / "faint"))
    expect(page.locator("#upload-warning")).to_contain_text("indistinguishable from zero")
    page.screenshot(path=str(screenshots / "adapter-effect-warning.png"), full_page=True)

    with admin(ui_server) as http:
        listed = http.get(f"/admin/api/adapters?tenant={tenant}").json()["data"]
    effects = {a["name"]: a["effect"] for a in listed}
    assert effects["real"]["kl"] > 1e-3 and effects["faint"]["kl"] < 1e-6
    page.select_option("#page .page-head select", tenant)
    for name, effect in effects.items():
        row = page.locator("#adapter-list tr", has_text=f"{tenant}/{name}")
        expect(row.locator(".effect")).to_have_text(_shown(effect))
    page.screenshot(path=str(screenshots / "adapter-effect.png"), full_page=True)
    assert errors == []
