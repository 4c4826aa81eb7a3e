"""Tenants' storage quotas over HTTP, against a live server (PostgreSQL, the real Redis):
set through the admin API, reported in the tenant's JSON, in ``/v1/adapters`` and in the
usage view; an upload over a quota is an OpenAI-style 413 (bytes) or 409 (versions) naming
the quota, with nothing kept; deleting gives the quota back; concurrent uploads cannot both
fit.

The server is ``test_admin_api``'s, started once more for this module.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_admin_api import Admin, api, complete, folder_files, schema_url, upload

__all__ = ["api", "schema_url"]  # the fixtures this module's tests use

FILES = ("adapter_config.json", "adapter_model.safetensors")


def _size(folder: Path) -> int:
    return sum((folder / name).stat().st_size for name in FILES)


def _on_disk(api: Admin) -> list[str]:
    """Every file in the store (staging included), relative to its root."""
    return sorted(str(p.relative_to(api.store)) for p in api.store.rglob("*") if p.is_file())


def _storage(api: Admin, key: str) -> dict[str, Any]:
    response = api.http.get("/v1/adapters", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    storage: dict[str, Any] = response.json()["storage"]
    return storage


def _refused(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", param, "quota_exceeded")
    message: str = error["message"]
    return message


def _post(api: Admin, key: str, name: str, files: Any) -> httpx.Response:
    return api.http.post("/v1/adapters", data={"name": name}, files=files,
                         headers={"Authorization": f"Bearer {key}"})


def test_byte_quota(api: Admin, llama_adapters: dict[str, Path]) -> None:
    small, other = llama_adapters["r4"], llama_adapters["r8qv"]
    quota = _size(small) + _size(other) - 1
    name, key = api.tenant("bytes", max_storage_bytes=quota)
    tenant = api.ok("GET", f"/admin/api/tenants/{name}")
    assert (tenant["max_storage_bytes"], tenant["storage_bytes"]) == (quota, 0)

    made = upload(api, "/v1/adapters", "a", folder_files(small), key=key)
    assert _storage(api, key) == {"storage_bytes": _size(small), "max_storage_bytes": quota,
                                  "num_adapter_versions": 1, "max_adapter_versions": None}
    before = _on_disk(api)

    # Over what is left: refused, and the store, the staging area and the rows unchanged.
    message = _refused(_post(api, key, "b", folder_files(other)), 413, "max_storage_bytes")
    assert f"{quota - _size(small)} bytes left" in message
    assert _on_disk(api) == before
    assert _storage(api, key)["storage_bytes"] == _size(small)
    listed = api.http.get("/v1/adapters?include_deleted=true",
                          headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert [a["name"] for a in listed] == ["a"]
    assert complete(api, key, "a").choices[0].text  # what was kept still serves

    # The admin route refuses the same, naming the quota.
    response = api.http.post(f"/admin/api/tenants/{name}/adapters", data={"name": "b"},
                             files=folder_files(other))
    _refused(response, 413, "max_storage_bytes")
    assert _on_disk(api) == before

    # Deleting the version gives its bytes back (its files are removed at once).
    assert api.http.delete("/v1/adapters/a", headers={
        "Authorization": f"Bearer {key}"}).status_code == 200
    assert made["digest"] not in " ".join(_on_disk(api))
    assert _storage(api, key)["storage_bytes"] == 0
    upload(api, "/v1/adapters", "b", folder_files(other), key=key)
    usage = api.ok("GET", f"/admin/api/usage?tenant={name}")
    assert usage["storage"] == [{"tenant": name, "storage_bytes": _size(other),
                                 "max_storage_bytes": quota, "num_adapter_versions": 1,
                                 "max_adapter_versions": None}]


def test_a_full_tenant_is_refused_before_its_body_is_read(
        api: Admin, llama_adapters: dict[str, Path]) -> None:
    _, key = api.tenant("full", max_storage_bytes=1)
    before = _on_disk(api)
    # The openai client's own error for a 413 (it has no class of its own).
    with pytest.raises(openai.APIStatusError) as info:
        api.openai(key).post("/adapters", cast_to=object, body=None, files=[
            ("adapter_config.json", ("adapter_config.json",
                                     (llama_adapters["r4"] / FILES[0]).read_bytes()))],
            options={"headers": {"Content-Type": "multipart/form-data"}})
    assert info.value.status_code == 413
    assert "max_storage_bytes" in str(info.value)
    assert _on_disk(api) == before


def test_version_quota(api: Admin, llama_adapters: dict[str, Path]) -> None:
    name, key = api.tenant("versions", max_adapter_versions=2)
    for spec in ("r4", "r8qv"):
        upload(api, "/v1/adapters", "a", folder_files(llama_adapters[spec]), key=key)
    before = _on_disk(api)
    message = _refused(_post(api, key, "b", folder_files(llama_adapters["r16rs"])), 409,
                       "max_adapter_versions")
    assert "2 active adapter versions" in message
    assert _on_disk(api) == before
    assert _storage(api, key)["num_adapter_versions"] == 2
    # Lowering a quota below what is stored is allowed; deleting frees versions at once.
    api.ok("PATCH", f"/admin/api/tenants/{name}", json={"max_adapter_versions": 1})
    assert api.http.delete("/v1/adapters/a?version=1", headers={
        "Authorization": f"Bearer {key}"}).status_code == 200
    _refused(_post(api, key, "b", folder_files(llama_adapters["r16rs"])), 409,
             "max_adapter_versions")
    api.ok("PATCH", f"/admin/api/tenants/{name}", json={"max_adapter_versions": None})
    upload(api, "/v1/adapters", "b", folder_files(llama_adapters["r16rs"]), key=key)


def test_concurrent_uploads_cannot_both_fit(api: Admin,
                                            llama_adapters: dict[str, Path]) -> None:
    # Four names, one content (charged per version): exactly one fits.
    src = llama_adapters["r8qv"]
    _, key = api.tenant("race", max_storage_bytes=_size(src) + 10)
    names = [f"n{i}" for i in range(4)]
    start = threading.Barrier(len(names))
    statuses: list[int] = []

    def run(name: str) -> None:
        start.wait()
        statuses.append(_post(api, key, name, folder_files(src)).status_code)

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [201, 413, 413, 413], statuses
    storage = _storage(api, key)
    assert (storage["num_adapter_versions"], storage["storage_bytes"]) == (1, _size(src))
    assert not list((api.store / ".tmp").glob("upload-*"))


def test_quotas_are_checked_like_the_other_settings(api: Admin) -> None:
    name, _ = api.tenant("checks")
    for field, bad in (("max_storage_bytes", 0), ("max_storage_bytes", 2**63),
                       ("max_storage_bytes", "1G"), ("max_storage_bytes", 1.5),
                       ("max_adapter_versions", True), ("max_adapter_versions", -1)):
        error = api.error("PATCH", f"/admin/api/tenants/{name}", 400,
                          json={"weight": 3, field: bad})
        assert error["param"] == field
        error = api.error("POST", "/admin/api/tenants", 400,
                          json={"name": f"{name}-x", field: bad})
        assert error["param"] == field
    tenant = api.ok("GET", f"/admin/api/tenants/{name}")
    assert (tenant["weight"], tenant["max_storage_bytes"]) == (1.0, None)  # nothing applied
    changed = api.ok("PATCH", f"/admin/api/tenants/{name}",
                     json={"max_storage_bytes": 2**63 - 1, "max_adapter_versions": 7})
    assert (changed["max_storage_bytes"], changed["max_adapter_versions"]) == (2**63 - 1, 7)
    listed = {t["name"]: t for t in api.ok("GET", "/admin/api/tenants")["data"]}
    assert listed[name]["max_adapter_versions"] == 7
