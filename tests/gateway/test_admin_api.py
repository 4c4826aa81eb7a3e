"""The admin API and the tenant's /v1/adapters, against a live server.

A server of this module's own (a PostgreSQL schema of its own, the real Redis, a 512 KiB
upload cap), so uploads, suspensions and deletes cannot disturb the other gateway tests.
Everything is created through the HTTP API, as an operator would.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import threading
import uuid
import zipfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loraplex.adapter_format import folder_digest
from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RegistryConfig,
    SchedulerConfig,
    ServerConfig,
)
from loraplex.engine.client import EngineClient
from loraplex.gateway.app import create_app
from loraplex.registry.upload import UploadLimits
from loraplex.testing import (
    bootstrap_admin,
    build_adapter,
    postgres_schema,
    redis_url_for_tests,
)

REDIS_URL = redis_url_for_tests()
SERVED = "tiny-llama"
MAX_UPLOAD = 512 * 1024
FILES = ("adapter_config.json", "adapter_model.safetensors")


class Admin:
    """The live server of this module, called as its admin."""

    def __init__(self, url: str, admin_key: str, client: EngineClient, store: Path) -> None:
        self.url = url
        self.admin_key = admin_key
        self.client = client
        self.store = store
        self.http = httpx.Client(base_url=url, timeout=60,
                                 headers={"Authorization": f"Bearer {admin_key}"})

    def ok(self, method: str, path: str, status: int = 200, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        assert response.status_code == status, response.text
        return response.json()

    def error(self, method: str, path: str, status: int, **kwargs: Any) -> dict[str, Any]:
        response = self.http.request(method, path, **kwargs)
        assert response.status_code == status, response.text
        error: dict[str, Any] = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error

    def tenant(self, prefix: str, **limits: Any) -> tuple[str, str]:
        """A new tenant and a key of it."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.ok("POST", "/admin/api/tenants", 201, json={"name": name, **limits})
        key = self.ok("POST", f"/admin/api/tenants/{name}/keys", 201, json={})["key"]
        return name, key

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=60)


def folder_files(folder: Path) -> dict[str, tuple[str, bytes]]:
    return {name: (name, (folder / name).read_bytes()) for name in FILES}


def zipped(folder: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in FILES:
            zf.write(folder / name, f"my-adapter/{name}")
    return buf.getvalue()


def tarred(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in FILES:
            tf.add(folder / name, arcname=name)
    return buf.getvalue()


@pytest.fixture(scope="module")
def schema_url() -> Iterator[str]:
    with postgres_schema("admin") as url:
        yield url


@pytest.fixture(scope="module")
def api(tiny_llama_dir: Path, schema_url: str, redis_prefix: str,
        tmp_path_factory: pytest.TempPathFactory,
        serve_app: Callable[[Any], AbstractContextManager[str]]) -> Iterator[Admin]:
    """The server, with one admin tenant ``ops``; everything else is made over HTTP."""
    admin_key = bootstrap_admin(schema_url)
    store = tmp_path_factory.mktemp("admin_store")
    config = ServerConfig(redis_url=REDIS_URL, served_model_name=SERVED,
                          rate_limit_key_prefix=f"{redis_prefix}admin:",
                          usage_flush_interval_s=0.2)
    client = EngineClient.from_config(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=16, num_kv_blocks=256),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)))
    app = create_app(config, RegistryConfig(schema_url, str(store)), client,
                     upload_limits=UploadLimits(max_upload_bytes=MAX_UPLOAD))
    try:
        with serve_app(app) as url:
            admin = Admin(url, admin_key, client, store)
            yield admin
            admin.http.close()
    finally:
        client.close()


@pytest.fixture(scope="module")
def bad_rank_adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rank 32: over the server's max_lora_rank of 16."""
    return build_adapter(tmp_path_factory.mktemp("rank32"), tiny_llama_dir, rank=32, seed=5)


def upload(api: Admin, path: str, name: str, files: Any, status: int = 201,
           key: str | None = None, **fields: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = api.http.post(path, data={"name": name, **fields}, files=files,
                             headers=headers)
    assert response.status_code == status, response.text
    data: dict[str, Any] = response.json()
    return data


def complete(api: Admin, key: str, model: str, **kwargs: Any) -> Any:
    return api.openai(key).completions.create(model=model, prompt="hello there",
                                              max_tokens=4, temperature=0, **kwargs)


ADMIN_ROUTES = [
    ("GET", "/admin/api/engine"), ("GET", "/admin/api/usage"), ("GET", "/admin/api/latency"),
    ("GET", "/admin/api/tenants"), ("POST", "/admin/api/tenants"),
    ("GET", "/admin/api/tenants/ops"), ("PATCH", "/admin/api/tenants/ops"),
    ("GET", "/admin/api/tenants/ops/keys"), ("POST", "/admin/api/tenants/ops/keys"),
    ("GET", "/admin/api/keys"), ("DELETE", "/admin/api/keys/1"),
    ("GET", "/admin/api/adapters"), ("GET", "/admin/api/tenants/ops/adapters"),
    ("POST", "/admin/api/tenants/ops/adapters"),
    ("PATCH", "/admin/api/tenants/ops/adapters/x"),
    ("DELETE", "/admin/api/tenants/ops/adapters/x"),
    ("POST", "/admin/api/tenants/ops/adapters/x/pin"),
    ("DELETE", "/admin/api/tenants/ops/adapters/x/pin?version=1"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_need_an_admin_key(api: Admin, method: str, path: str) -> None:
    with httpx.Client(base_url=api.url, timeout=30) as anonymous:
        response = anonymous.request(method, path, json={})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        _, key = api.tenant("plain")
        response = anonymous.request(method, path, json={},
                                     headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "insufficient_permissions"


def test_tenants_limits_status_and_keys(api: Admin) -> None:
    name = f"acme-{uuid.uuid4().hex[:6]}"
    created = api.ok("POST", "/admin/api/tenants", 201,
                     json={"name": name, "max_requests_per_minute": 600})
    assert (created["name"], created["status"], created["max_requests_per_minute"],
            created["max_tokens_per_minute"]) == (name, "active", 600, None)
    assert api.error("POST", "/admin/api/tenants", 409, json={"name": name})["code"] == \
        "conflict"
    assert api.error("POST", "/admin/api/tenants", 400, json={"name": "Bad Name"})["param"] \
        == "name"
    assert api.error("POST", "/admin/api/tenants", 400,
                     json={"name": "x1", "max_rpm": 3})["param"] == "max_rpm"
    assert name in [t["name"] for t in api.ok("GET", "/admin/api/tenants")["data"]]

    patched = api.ok("PATCH", f"/admin/api/tenants/{name}",
                     json={"max_requests_per_minute": None, "max_tokens_per_minute": 5000,
                           "max_concurrent_requests": 4})
    assert (patched["max_requests_per_minute"], patched["max_tokens_per_minute"],
            patched["max_concurrent_requests"]) == (None, 5000, 4)
    assert api.error("PATCH", f"/admin/api/tenants/{name}", 400,
                     json={"max_concurrent_requests": 0})["param"] == "max_concurrent_requests"
    assert api.error("PATCH", f"/admin/api/tenants/{name}", 400,
                     json={"status": "gone"})["param"] == "status"
    api.error("PATCH", "/admin/api/tenants/nobody-here", 404, json={"status": "active"})

    issued = api.ok("POST", f"/admin/api/tenants/{name}/keys", 201, json={"name": "ci"})
    key = issued["key"]
    assert key.startswith("lpx-") and issued["prefix"] == key[:len(issued["prefix"])]
    listed = api.ok("GET", f"/admin/api/tenants/{name}/keys")["data"]
    assert [k["id"] for k in listed] == [issued["id"]]
    assert all("key" not in k for k in listed)  # shown once, never again
    assert key not in json.dumps(api.ok("GET", "/admin/api/keys"))
    base = api.openai(key).models.list().data[0]
    assert base.id == SERVED
    assert base.model_extra == {"root": SERVED, "parent": None, "architecture": "Llama"}
    assert api.ok("GET", "/admin/api/engine")["architecture"] == "Llama"

    api.ok("PATCH", f"/admin/api/tenants/{name}", json={"status": "suspended"})
    with pytest.raises(openai.PermissionDeniedError):
        api.openai(key).models.list()
    assert api.ok("GET", f"/admin/api/tenants/{name}")["status"] == "suspended"
    api.ok("PATCH", f"/admin/api/tenants/{name}", json={"status": "active"})
    assert api.openai(key).models.list().data

    revoked = api.ok("DELETE", f"/admin/api/keys/{issued['id']}")
    assert revoked["status"] == "revoked" and revoked["revoked_at"]
    with pytest.raises(openai.AuthenticationError):
        api.openai(key).models.list()
    api.error("DELETE", "/admin/api/keys/99999999", 404)
    api.error("DELETE", "/admin/api/keys/99999999999999999999", 404)
    # The operator cannot lock themselves out.
    own = [k for k in api.ok("GET", "/admin/api/keys?tenant=ops")["data"]
           if k["role"] == "admin"][0]
    api.error("DELETE", f"/admin/api/keys/{own['id']}", 400)
    api.error("PATCH", "/admin/api/tenants/ops", 400, json={"status": "suspended"})


def test_upload_files_zip_and_tar_then_serve(api: Admin,
                                             llama_adapters: dict[str, Path]) -> None:
    tenant, key = api.tenant("up")
    path = f"/admin/api/tenants/{tenant}/adapters"
    first = upload(api, path, "support", folder_files(llama_adapters["r4"]))
    assert (first["name"], first["version"], first["rank"], first["visibility"],
            first["model"]) == ("support", 1, 4, "private", f"{tenant}/support")
    second = upload(api, path, "support",
                    {"archive": ("support.zip", zipped(llama_adapters["r8qv"]))},
                    visibility="public")
    assert (second["version"], second["rank"], second["visibility"]) == (2, 8, "public")
    third = upload(api, path, "other",
                   {"archive": ("other.tar.gz", tarred(llama_adapters["r16rs"]))})
    assert third["use_rslora"] is True
    # Any field name works when the file names are the adapter's own.
    fourth = upload(api, path, "loose", [("file", (n, b)) for n, b in
                                         folder_files(llama_adapters["r4"]).values()])
    assert fourth["digest"] == first["digest"]

    versions = api.ok("GET", path)["data"]
    assert [(v["name"], v["version"]) for v in versions] == \
        [("loose", 1), ("other", 1), ("support", 1), ("support", 2)]
    assert all("storage_path" not in v for v in versions)
    everyone = api.ok("GET", f"/admin/api/adapters?tenant={tenant}")["data"]
    assert [v["id"] for v in everyone] == [v["id"] for v in versions]

    out = complete(api, key, "support")
    assert out.choices[0].text and out.usage.completion_tokens == 4
    assert complete(api, key, f"{tenant}/other").choices[0].text
    assert not list(api.store.joinpath(".tmp").iterdir())  # staging folders are gone


def test_bad_uploads_are_refused_with_the_reason(api: Admin, llama_adapters: dict[str, Path],
                                                 bad_rank_adapter: Path) -> None:
    tenant, key = api.tenant("bad")
    path = f"/admin/api/tenants/{tenant}/adapters"
    error = upload(api, path, "big", folder_files(bad_rank_adapter), 422)["error"]
    assert error["code"] == "invalid_adapter" and "rank" in error["message"]
    assert str(api.store) not in error["message"]
    error = upload(api, path, "pickled", {"archive": ("adapter_model.bin", b"x" * 10)},
                   422)["error"]
    assert "pickle" in error["message"]
    files = folder_files(llama_adapters["r4"])
    error = upload(api, path, "half", {FILES[0]: files[FILES[0]]}, 422)["error"]
    assert "adapter_model.safetensors" in error["message"]
    broken = {FILES[0]: files[FILES[0]], FILES[1]: (FILES[1], b"not safetensors")}
    assert upload(api, path, "broken", broken, 422)["error"]["message"]
    assert upload(api, path, "bad name!", files, 400)["error"]["param"] == "name"
    assert upload(api, path, "x", files, 400, visibility="everyone")["error"]["param"] == \
        "visibility"
    response = api.http.post(path, files=files)  # no name
    assert response.status_code == 400 and response.json()["error"]["param"] == "name"
    response = api.http.post(path, json={"name": "x"})
    assert response.status_code == 400 and "multipart" in response.json()["error"]["message"]
    api.error("POST", "/admin/api/tenants/nobody-here/adapters", 404, files=files,
              data={"name": "x"})

    # Declared too large: refused before the body is read.
    huge = {FILES[0]: files[FILES[0]], FILES[1]: (FILES[1], os.urandom(MAX_UPLOAD + 100_000))}
    error = upload(api, path, "huge", huge, 413)["error"]
    assert error["code"] == "payload_too_large"
    # Streamed without a length (chunked): stopped by the running byte cap.
    request = api.http.build_request("POST", path, data={"name": "huge"}, files=huge)
    body = request.read()
    chunked = api.http.post(path, content=iter([body[i:i + 65536]
                                                for i in range(0, len(body), 65536)]),
                            headers={"Content-Type": request.headers["Content-Type"]})
    assert chunked.status_code == 413, chunked.text
    assert api.ok("GET", path)["data"] == []
    assert not list(api.store.joinpath(".tmp").iterdir())


def test_visibility_makes_an_adapter_usable_by_others(api: Admin,
                                                      llama_adapters: dict[str, Path]) -> None:
    owner, owner_key = api.tenant("owner")
    _, other_key = api.tenant("other")
    upload(api, f"/admin/api/tenants/{owner}/adapters", "shared",
           folder_files(llama_adapters["r8mlp"]))
    with pytest.raises(openai.NotFoundError):
        complete(api, other_key, f"{owner}/shared")
    rows = api.ok("PATCH", f"/admin/api/tenants/{owner}/adapters/shared",
                  json={"visibility": "public"})["data"]
    assert [r["visibility"] for r in rows] == ["public"]
    assert complete(api, other_key, f"{owner}/shared").choices[0].text
    api.ok("PATCH", f"/admin/api/tenants/{owner}/adapters/shared",
           json={"visibility": "private"})
    with pytest.raises(openai.NotFoundError):
        complete(api, other_key, f"{owner}/shared")
    assert complete(api, owner_key, "shared").choices[0].text
    api.error("PATCH", f"/admin/api/tenants/{owner}/adapters/shared", 400,
              json={"visibility": "world"})
    api.error("PATCH", f"/admin/api/tenants/{owner}/adapters/missing", 404,
              json={"visibility": "public"})


def _adapter_blocks(api: Admin, identity: str) -> Callable[[Any], tuple[int, bool]]:
    adapter_id, _, digest = identity.partition("@")

    def probe(engine: Any) -> tuple[int, bool]:
        kv = engine.kv
        cached = sum(1 for block_id in kv._hash_to_block.values()
                     if ("adapter", adapter_id, digest) in kv._block_keys[block_id][2])
        return cached, (adapter_id, digest) in engine.adapters._slot_of

    return probe


def _in_engine(api: Admin, fn: Callable[[Any], Any]) -> Any:
    import asyncio

    return asyncio.run(api.client.run_in_engine(fn))


def test_delete_stops_new_requests_while_running_ones_finish(
        api: Admin, llama_adapters: dict[str, Path]) -> None:
    tenant, key = api.tenant("del")
    row = upload(api, f"/admin/api/tenants/{tenant}/adapters", "gone",
                 folder_files(llama_adapters["r4"]))
    # A finished request leaves cached prefix blocks and a resident slot behind (beside
    # those of the upload's effect probe).
    probed, _ = _in_engine(api, _adapter_blocks(api, row["identity"]))
    api.openai(key).completions.create(model="gone", prompt=[7] * 40, max_tokens=2)
    assert _in_engine(api, _adapter_blocks(api, row["identity"])) == (probed + 2, True)

    stream = api.openai(key).completions.create(
        model="gone", prompt=[9] * 20, max_tokens=120, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].text is not None

    done = threading.Event()
    result: dict[str, Any] = {}

    def finish_stream() -> None:
        texts = [c.choices[0].finish_reason for c in chunks if c.choices]
        result["finish"] = [f for f in texts if f]
        done.set()

    reader = threading.Thread(target=finish_stream)
    reader.start()
    deleted = api.ok("DELETE", f"/admin/api/tenants/{tenant}/adapters/gone")
    assert [v["identity"] for v in deleted["versions"]] == [row["identity"]]
    with pytest.raises(openai.NotFoundError):
        complete(api, key, "gone")
    reader.join(60)
    assert done.is_set() and result["finish"] == ["length"]
    assert api.ok("GET", "/admin/api/adapters?include_deleted=true&tenant=" + tenant)[
        "data"][0]["status"] == "deleted"
    api.error("DELETE", f"/admin/api/tenants/{tenant}/adapters/gone", 404)


def test_delete_of_an_idle_adapter_drops_its_cache_and_slot(
        api: Admin, llama_adapters: dict[str, Path]) -> None:
    tenant, key = api.tenant("idle")
    row = upload(api, f"/admin/api/tenants/{tenant}/adapters", "idle",
                 folder_files(llama_adapters["r8qv"]))
    probe = _adapter_blocks(api, row["identity"])
    probed, _ = _in_engine(api, probe)  # the upload's effect probe's blocks
    api.openai(key).completions.create(model="idle", prompt=[11] * 40, max_tokens=2)
    assert _in_engine(api, probe) == (probed + 2, True)
    api.ok("DELETE", f"/admin/api/tenants/{tenant}/adapters/idle?version=1")
    assert _in_engine(api, probe) == (0, False)
    api.error("DELETE", f"/admin/api/tenants/{tenant}/adapters/idle?version=x", 400)


def test_engine_and_usage(api: Admin, llama_adapters: dict[str, Path]) -> None:
    tenant, key = api.tenant("eng")
    upload(api, f"/admin/api/tenants/{tenant}/adapters", "fast",
           folder_files(llama_adapters["r4"]))
    complete(api, key, "fast")
    complete(api, key, SERVED)
    stats = api.ok("GET", "/admin/api/engine")
    for field in ("num_waiting", "num_running", "kv_blocks_total", "kv_blocks_used",
                  "kv_utilization", "prefix_cache_hit_rate", "adapter_slots"):
        assert field in stats
    assert len(stats["slots"]) == 2
    assert f"{tenant}/fast" in [s["model"] for s in stats["slots"] if s]
    # The top level adds up the replicas; in process there is one, replica 0.
    (replica,) = stats["replicas"]
    assert stats["replica"] == -1 and replica["replica"] == 0
    for field in ("num_waiting", "num_running", "kv_blocks_used", "kv_pool_usage",
                  "adapter_slots", "host_adapters", "running_adapters", "waiting_adapters",
                  "max_loras", "max_cpu_loras"):
        assert replica[field] == stats[field], field
    assert replica["slots"] == stats["slots"] and replica["max_loras"] == 2
    fast = next(s for s in replica["slots"] if s and s["model"] == f"{tenant}/fast")
    assert fast["identity"] in replica["host_adapters"]
    # What /openapi.json promises of the response is there.
    doc = api.http.get("/openapi.json").json()
    declared = doc["paths"]["/admin/api/engine"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    assert set(declared["required"]) <= set(stats)
    assert set(declared["properties"]["replicas"]["items"]["required"]) <= set(replica)

    report = api.ok("GET", f"/admin/api/usage?tenant={tenant}")
    models = {r["model"]: r for r in report["data"]}
    assert set(models) == {f"{tenant}/fast", SERVED}
    assert models[f"{tenant}/fast"]["completion_tokens"] == 4
    assert report["totals"] == [{"tenant": tenant, "requests": 2,
                                 "prompt_tokens": report["totals"][0]["prompt_tokens"],
                                 "completion_tokens": 8,
                                 "total_tokens": report["totals"][0]["total_tokens"]}]
    everyone = api.ok("GET", "/admin/api/usage")
    assert tenant in {r["tenant"] for r in everyone["data"]}
    api.error("GET", "/admin/api/usage?since=yesterday", 400)
    api.error("GET", "/admin/api/usage?since=2030-01-01T00:00:00&until=2029-01-01T00:00:00",
              400)
    early = api.ok("GET", "/admin/api/usage?since=0001-01-01T00:00:00%2B14:00"
                   "&until=0001-01-02T00:00:00%2B14:00")  # before year 1 in UTC: its start
    assert early["data"] == []


def test_tenants_manage_their_own_adapters(api: Admin,
                                           llama_adapters: dict[str, Path]) -> None:
    mine, my_key = api.tenant("self")
    _, their_key = api.tenant("nosy")
    made = upload(api, "/v1/adapters", "own", folder_files(llama_adapters["r4"]), key=my_key)
    assert made["model"] == f"{mine}/own" and made["tenant"] == mine
    upload(api, "/v1/adapters", "own", {"archive": ("a.zip", zipped(llama_adapters["r8qv"]))},
           key=my_key, visibility="public")
    auth = {"Authorization": f"Bearer {my_key}"}
    listed = api.http.get("/v1/adapters", headers=auth).json()["data"]
    assert [(a["name"], a["version"], a["status"]) for a in listed] == \
        [("own", 1, "active"), ("own", 2, "active")]
    assert complete(api, my_key, "own").choices[0].text

    theirs = {"Authorization": f"Bearer {their_key}"}
    assert api.http.get("/v1/adapters", headers=theirs).json()["data"] == []
    # Public or not, another tenant's adapter cannot be deleted: it is not found.
    response = api.http.delete("/v1/adapters/own", headers=theirs)
    assert response.status_code == 404
    assert complete(api, their_key, f"{mine}/own").choices[0].text

    response = api.http.delete("/v1/adapters/own?version=1", headers=auth)
    assert response.status_code == 200 and response.json()["versions"][0]["version"] == 1
    listed = api.http.get("/v1/adapters?include_deleted=true", headers=auth).json()["data"]
    assert [(a["version"], a["status"]) for a in listed] == [(1, "deleted"), (2, "active")]
    assert api.http.delete("/v1/adapters/own", headers=auth).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(api, their_key, f"{mine}/own")
    assert api.http.get("/v1/adapters", headers=auth).json()["data"] == []
    assert api.http.delete("/v1/adapters/own", headers=auth).status_code == 404
    assert httpx.get(f"{api.url}/v1/adapters").status_code == 401
    bad = upload(api, "/v1/adapters", "x", {"archive": ("x.pt", b"1")}, 422, key=my_key)
    assert "pickle" in bad["error"]["message"]


def test_admin_ui_is_served(api: Admin) -> None:
    with httpx.Client(base_url=api.url, timeout=30) as anonymous:
        page = anonymous.get("/admin/", follow_redirects=True)
        assert page.status_code == 200 and "<html" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert anonymous.get("/admin", follow_redirects=False).status_code in (301, 307)
        assert anonymous.get("/admin/app.js").status_code == 200
        missing = anonymous.get("/admin/nothing.js")
        assert missing.status_code == 404 and "error" in missing.json()


def _with_config(src: Path, out: Path, **changes: Any) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / FILES[0]).read_text())
    config.update(changes)
    (out / FILES[0]).write_text(json.dumps(config))
    return out


def test_one_tenants_upload_changes_nothing_for_another(
        api: Admin, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """Another tenant's upload of the same weights (any config) neither blocks an upload
    nor tells whether the content was stored: the same status and the same answer."""
    owner, owner_key = api.tenant("owner")
    _, squatter_key = api.tenant("squatter")
    src = llama_adapters["r8qv"]
    alpha = json.loads((src / FILES[0]).read_text())["lora_alpha"]
    squat = upload(api, "/v1/adapters", "mine", folder_files(
        _with_config(src, tmp_path / "other", lora_alpha=alpha * 4)), key=squatter_key)
    real = upload(api, "/v1/adapters", "real", folder_files(src), key=owner_key)  # not 409
    assert real["digest"] == folder_digest(src) != squat["digest"]
    assert (real["alpha"], squat["alpha"]) == (alpha, alpha * 4)

    # The same content again by the squatter: stored already, answered exactly alike.
    again = upload(api, "/v1/adapters", "copy", folder_files(src), key=squatter_key)
    who = {"id", "tenant", "name", "model", "identity", "created_at", "effect"}
    assert set(again) == set(real)
    # Each upload is measured on its own: the same effect, measured at its own time.
    assert again["effect"]["kl"] == pytest.approx(real["effect"]["kl"], rel=1e-3)
    assert {k: v for k, v in again.items() if k not in who} == \
        {k: v for k, v in real.items() if k not in who}
    # Each is served its own scaling; identical content gives identical output.
    assert complete(api, owner_key, "real").choices[0].text == \
        complete(api, squatter_key, "copy").choices[0].text
    assert squat["identity"] != again["identity"]
    assert owner and complete(api, squatter_key, "mine").choices[0].text


@pytest.mark.parametrize("config", [
    b'{"peft_type": "LORA", "r": 8, "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"peft_type": "LORA", "r": 8, "lora_alpha": 1' + b"0" * 400 + b"}",
    b'{"peft_type": "LORA", "r": 8, "lora_alpha": NaN}',
    b'\xff\xfe{"peft_type": "LORA"}',
], ids=["deep", "400-digits", "nan", "not-utf8"])
def test_malformed_config_is_422_with_a_message(api: Admin, llama_adapters: dict[str, Path],
                                                config: bytes) -> None:
    _, key = api.tenant("cfg")
    files = folder_files(llama_adapters["r8qv"])
    files[FILES[0]] = (FILES[0], config)
    error = upload(api, "/v1/adapters", "bad", files, 422, key=key)["error"]
    assert error["code"] == "invalid_adapter" and FILES[0] in error["message"]
    assert not list(api.store.joinpath(".tmp").iterdir())


def test_an_adapter_may_not_take_the_served_models_name(
        api: Admin, llama_adapters: dict[str, Path]) -> None:
    """``model: <served name>`` always means the base model: an adapter named so could
    never be called, and /v1/models would list the name twice. Refused before the files
    are read, in any case of letters, on both upload routes."""
    tenant, key = api.tenant("shadow")
    files = folder_files(llama_adapters["r4"])
    for path, upload_key in ((f"/admin/api/tenants/{tenant}/adapters", None),
                             ("/v1/adapters", key)):
        for name in (SERVED, SERVED.upper()):
            error = upload(api, path, name, files, 400, key=upload_key)["error"]
            assert error["param"] == "name" and "served model's name" in error["message"]
    ids = [m.id for m in api.openai(key).models.list()]
    assert ids[0] == SERVED and SERVED.casefold() not in {i.casefold() for i in ids[1:]}
    assert api.http.get("/v1/adapters", headers={"Authorization": f"Bearer {key}"}).json()[
        "data"] == []  # nothing of it was kept


@pytest.mark.parametrize("change,reason", [
    ("untrained", "every lora_B is zero"),
    ("untargeted", "target_modules does not name"),
    ("tiny", "too small to change any float32 weight"),
])
def test_an_adapter_that_would_serve_something_else_is_422(
        api: Admin, llama_adapters: dict[str, Path], tmp_path: Path, change: str,
        reason: str) -> None:
    """Admission fails closed (issue 56): a real PEFT adapter whose lora_B were zeroed
    (saved untrained), whose config no longer targets a module it has weights for, or whose
    update is below float32's resolution is refused with the reason; nothing is kept."""
    from safetensors.torch import load_file, save_file

    _, key = api.tenant(f"closed-{change}")
    adapter = Path(shutil.copytree(llama_adapters["r4"], tmp_path / "a"))
    weights = adapter / FILES[1]
    tensors = load_file(str(weights))
    if change == "untargeted":
        config = json.loads((adapter / FILES[0]).read_text())
        config["target_modules"] = [m for m in config["target_modules"] if m != "k_proj"]
        (adapter / FILES[0]).write_text(json.dumps(config))
    else:
        tensors = {name: t * 0 if change == "untrained" and ".lora_B." in name
                   else t * 1e-7 if change == "tiny" else t for name, t in tensors.items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    error = upload(api, "/v1/adapters", "closed", folder_files(adapter), 422, key=key)["error"]
    assert error["code"] == "invalid_adapter" and reason in error["message"]
    assert not list(api.store.joinpath(".tmp").iterdir())
    listed = api.http.get("/v1/adapters", headers={"Authorization": f"Bearer {key}"})
    assert listed.json()["data"] == []
