"""The Engine page's adapter slots, in a real browser, name the replica each slot belongs
to, as /admin/api/engine does (the embedded server: one replica)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_admin_figures import FILES, admin, complete, new_tenant, signed_in_page, watch_errors

pytestmark = pytest.mark.browser

UIServer = Any  # tests/ui/conftest.py


def test_adapter_slots_name_their_replica(browser: Any, ui_server: UIServer,
                                          ui_adapters: dict[str, Path]) -> None:
    tenant, key = new_tenant(ui_server)
    with admin(ui_server) as http:
        files = {name: (name, (ui_adapters["good"] / name).read_bytes()) for name in FILES}
        made = http.post(f"/admin/api/tenants/{tenant}/adapters", data={"name": "dial"},
                         files=files)
        assert made.status_code == 201, made.text
        identity = f"{made.json()['id']}@{made.json()['digest'][:12]}"
        complete(ui_server, key, "dial", 2)  # into a device slot, where it stays
        stats = http.get("/admin/api/engine").json()
    expected = [[str(r["replica"]), str(i)] for r in stats["replicas"]
                for i in range(len(r["slots"]))]
    where = [(str(r["replica"]), str(slot["slot"])) for r in stats["replicas"]
             for slot in r["slots"] if slot and slot["identity"] == identity]
    assert len(stats["replicas"]) == 1 and where == [("0", where[0][1])], stats

    page = signed_in_page(browser, ui_server, "engine")
    errors = watch_errors(page)
    page.wait_for_function(
        "(id) => document.querySelector('#engine-slots')?.textContent.includes(id)",
        arg=identity, timeout=30_000)
    rows = json.loads(page.evaluate(
        "() => JSON.stringify([...document.querySelectorAll('#engine-slots tbody tr')]"
        ".map(r => [...r.cells].map(c => [c.dataset.label, c.textContent])))"))
    # Every slot of every replica, each named by replica ordinal and its index there.
    assert [[cells[0][0], cells[1][0]] for cells in rows] == [["Replica", "Slot"]] * len(rows)
    assert [[cells[0][1], cells[1][1]] for cells in rows] == expected
    held = [(cells[0][1], cells[1][1]) for cells in rows if cells[4][1] == identity]
    assert held == where
    # The same label as the replica's row in the Replicas table.
    assert page.locator("#engine-replicas td[data-label=Replica]").all_text_contents() \
        == [where[0][0]]
    assert errors == []
    page.close()
