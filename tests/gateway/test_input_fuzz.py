"""Generated inputs against a live server, once on SQLite and once on PostgreSQL: never a
5xx, and the same answer on both (each test states the one status an input class gets).

Covers every string that reaches SQL (model names with or without an ``@`` version,
tenant and adapter names in paths and queries, key names), any value of a tenant's
scheduling settings and storage quotas, any body of a promote, a canary split or a pin
(and any version an unpin names), every
query parameter the OpenAPI document declares, and the
multipart upload parser. Examples are capped and derandomized so the run stays short.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

LiveServer = Any  # tests/gateway/conftest.py's LiveServer

FUZZ = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text that breaks databases differently: NUL (PostgreSQL refuses it), lone surrogates
# (no database stores them), look-alike digits, and whatever hypothesis makes.
AWKWARD = st.sampled_from(["a\x00b", "\x00", "\ud800", "x\udfffy", "¹", "٣", "alice\n",
                           " fuzzer", "FUZZER", "a" * 300, ""])
JSON_TEXT = AWKWARD | st.text(max_size=40)
URL_TEXT = st.sampled_from(["a\x00b", "\x00", "¹", "٣", "fuzzer\n", "%00", "a" * 300]) \
    | st.text(st.characters(codec="utf-8"), max_size=40)


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


class Caller:
    """One connection pool to one fuzz server, as its tenant or its admin."""

    def __init__(self, live: LiveServer, http: httpx.Client) -> None:
        self.live = live
        self.http = http

    def __call__(self, method: str, path: str, *, admin: bool = False, body: Any = None,
                 **kwargs: Any) -> httpx.Response:
        key = self.live.admin_key if admin else self.live.keys["fuzzer"]
        headers = {"Authorization": f"Bearer {key}"} | kwargs.pop("headers", {})
        content = kwargs.pop("content", None)
        if body is not None:  # ASCII-escaped, so lone surrogates travel as \\ud800
            content = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        response = self.http.request(method, path, headers=headers, content=content,
                                     **kwargs)
        assert response.status_code < 500, (method, path, response.text)
        return response


@pytest.fixture(scope="module")
def send(fuzz_live: LiveServer) -> Iterator[Caller]:
    with httpx.Client(base_url=fuzz_live.url, timeout=30) as http:
        yield Caller(fuzz_live, http)


def test_what_the_hostile_tester_found_is_4xx(send: Caller) -> None:
    long_boundary = "b" * 300
    upload = send("POST", "/v1/adapters", content=b"--" + long_boundary.encode(),
                  headers={"Content-Type": f"multipart/form-data; boundary={long_boundary}"})
    assert upload.status_code == 400 and "Boundary" in upload.json()["error"]["message"]
    for raw in ("¹", "٣", "+1", " 1", "1_0", "99999999999999999999999"):
        version = send("DELETE", "/v1/adapters/nope", params={"version": raw})
        assert version.status_code == 400 and version.json()["error"]["param"] == "version"
    completion = send("POST", "/v1/completions",
                      body={"model": "a\x00b", "prompt": "hi", "max_tokens": 1})
    assert completion.status_code == 404
    assert send("DELETE", "/v1/adapters/a%00b").status_code == 404
    assert send("GET", "/admin/api/keys?tenant=a%00b", admin=True).status_code == 404
    key = send("POST", "/admin/api/tenants/fuzzer/keys", admin=True,
               body={"name": "ci\x00"})
    assert key.status_code == 400 and "NUL" in key.json()["error"]["message"]


# Model names with an '@' version: digits, look-alikes, signs, huge numbers, and any text.
VERSION_TEXT = st.sampled_from(["1", "v1", "01", "0", "-1", "+1", "1.0", " 1", "1 ", "v",
                                "٣", "¹", "1@2", "2147483647", "2147483648", "9" * 5000,
                                "\x00", "1\n"]) | st.integers(0, 2**40).map(str) | JSON_TEXT
MODEL_TEXT = JSON_TEXT | st.builds(lambda name, tail: f"{name}@{tail}",
                                   st.sampled_from(["x", "fuzzer/x", "a\x00b", ""]) | JSON_TEXT,
                                   VERSION_TEXT)


@FUZZ
@given(model=MODEL_TEXT)
def test_any_model_name_is_404_unless_it_is_served(fuzz_live: LiveServer, send: Caller,
                                                   model: str) -> None:
    response = send("POST", "/v1/completions",
                    body={"model": model, "prompt": "hi", "max_tokens": 1})
    expected = (200 if model == fuzz_live.served_name
                else 400 if not model or _has_surrogate(model) else 404)
    assert response.status_code == expected, (model, response.text)
    if not _has_surrogate(model) and model not in ("", ".", ".."):
        retrieved = send("GET", f"/v1/models/{quote(model, safe='')}")
        assert retrieved.status_code == (200 if model == fuzz_live.served_name else 404)


@FUZZ
@given(name=URL_TEXT)
def test_any_tenant_or_adapter_name_in_a_path_or_query_is_404(send: Caller,
                                                              name: str) -> None:
    assume(name not in ("", ".", "..") and name not in ("fuzzer", "ops"))
    segment = quote(name, safe="")
    for method, path in (("GET", f"/admin/api/tenants/{segment}"),
                         ("GET", f"/admin/api/tenants/{segment}/keys"),
                         ("GET", f"/admin/api/tenants/{segment}/adapters"),
                         ("GET", f"/admin/api/keys?{urlencode({'tenant': name})}"),
                         ("GET", f"/admin/api/adapters?{urlencode({'tenant': name})}"),
                         ("GET", f"/admin/api/usage?{urlencode({'tenant': name})}"),
                         ("DELETE", f"/admin/api/tenants/fuzzer/adapters/{segment}"),
                         ("GET", f"/admin/api/tenants/fuzzer/adapters/{segment}"),
                         ("DELETE", f"/admin/api/tenants/fuzzer/adapters/{segment}/split"),
                         ("DELETE", f"/admin/api/tenants/{segment}/adapters/x/split")):
        response = send(method, path, admin=True)
        assert response.status_code == 404, (method, path, response.text)
    for path, body in ((f"/admin/api/tenants/fuzzer/adapters/{segment}/promote",
                        {"version": 1}),
                       (f"/admin/api/tenants/{segment}/adapters/x/promote", {"version": 1}),
                       (f"/admin/api/tenants/fuzzer/adapters/{segment}/split",
                        {"version": 1, "percent": 5}),
                       (f"/admin/api/tenants/fuzzer/adapters/{segment}/pin", {"version": 1}),
                       (f"/admin/api/tenants/{segment}/adapters/x/pin", {"version": 1})):
        response = send("POST", path, admin=True, body=body)
        assert response.status_code == 404, (path, response.text)
    for path in (f"/admin/api/tenants/fuzzer/adapters/{segment}/pin?version=1",
                 f"/admin/api/tenants/{segment}/adapters/x/pin?version=1"):
        response = send("DELETE", path, admin=True)
        assert response.status_code == 404, (path, response.text)
    assert send("DELETE", f"/v1/adapters/{segment}").status_code == 404
    assert send("GET", f"/v1/adapters/{segment}").status_code == 404
    assert send("DELETE", f"/v1/adapters/{segment}/split").status_code == 404
    assert send("POST", f"/v1/adapters/{segment}/promote",
                body={"version": 1}).status_code == 404
    assert send("POST", f"/v1/adapters/{segment}/split",
                body={"version": 2, "percent": 50}).status_code == 404


FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def versioned(send: Caller, llama_adapters: dict[str, Path]) -> str:
    """The fuzzer's adapter ``fz`` at versions 1 and 2, uploaded through the API."""
    if send("GET", "/v1/adapters/fz").status_code == 404:
        for spec in ("r4", "r8qv"):
            files = {name: (llama_adapters[spec] / name).read_bytes() for name in FILES}
            response = send.http.post("/v1/adapters", data={"name": "fz"}, files=files,
                                      headers={"Authorization":
                                               f"Bearer {send.live.keys['fuzzer']}"})
            assert response.status_code == 201, response.text
    return "fz"


def _existing_version(tail: str) -> bool:
    """The documented rule of a version after '@', written out again as the oracle: ASCII
    digits (after an optional 'v') naming a version fz has, 1 or 2."""
    return re.fullmatch(r"v?0*[12]", tail, re.ASCII) is not None


@FUZZ
@given(owner=st.sampled_from(["", "fuzzer/"]), tail=VERSION_TEXT)
def test_any_version_of_a_real_adapter_is_served_or_404(send: Caller, versioned: str,
                                                        owner: str, tail: str) -> None:
    model = f"{owner}{versioned}@{tail}"
    response = send("POST", "/v1/completions",
                    body={"model": model, "prompt": "hi", "max_tokens": 1})
    expected = (400 if _has_surrogate(model) else 200 if _existing_version(tail) else 404)
    assert response.status_code == expected, (model, response.text)
    if expected == 200:
        assert response.headers["X-Loraplex-Adapter-Version"] == tail.lstrip("v").lstrip("0")
    elif expected == 404:
        assert len(response.json()["error"]["message"]) < 300


VERSION_VALUES = (st.none() | st.booleans() | st.integers(-2, 4) | st.integers(2**31 - 2, 2**31 + 1)
                  | st.integers() | st.floats() | st.sampled_from(["1", "2", "v1", "1e2"])
                  | JSON_TEXT | st.lists(st.integers(), max_size=2))
PERCENT_VALUES = (st.none() | st.booleans() | st.integers(-2, 102) | st.floats()
                  | st.floats(-0.5, 100.5) | st.sampled_from(["10", "10%", "nan"]) | JSON_TEXT)


def _is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


@FUZZ
@given(version=VERSION_VALUES, percent=PERCENT_VALUES, split=st.booleans(),
       admin=st.booleans())
def test_any_promote_or_split_body_is_answered_or_refused_naming_it(
        send: Caller, versioned: str, version: Any, percent: Any, split: bool,
        admin: bool) -> None:
    base = (f"/admin/api/tenants/fuzzer/adapters/{versioned}" if admin
            else f"/v1/adapters/{versioned}")
    before = send("GET", base, admin=admin).json()
    body = {"version": version, "percent": percent} if split else {"version": version}
    response = send("POST", f"{base}/{'split' if split else 'promote'}", admin=admin,
                    body=body)
    good_percent = (isinstance(percent, int | float) and not isinstance(percent, bool)
                    and 0 <= percent <= 100)
    if isinstance(version, float) and version.is_integer():
        version = int(version)  # JSON Schema's integers include 2.0
    if not _is_int(version, 1, 2**31 - 1):
        expected, param = 400, "version"
    elif split and not good_percent:
        expected, param = 400, "percent"
    elif version not in (1, 2):
        expected, param = 404, "model"
    elif split and version == before["current_version"]:
        expected, param = 409, None
    else:
        expected, param = 200, None
    assert response.status_code == expected, (body, response.text)
    if expected != 200:
        assert response.json()["error"]["param"] == param, response.text
        assert send("GET", base, admin=admin).json() == before
    else:
        state = response.json()
        if split:
            assert state["split"] == {"version": version, "percent": float(percent)}
            assert state["current_version"] == before["current_version"]
        else:
            assert (state["current_version"], state["split"]) == (version, None)


@FUZZ
@given(version=VERSION_VALUES, occupied=st.booleans())
def test_any_pin_body_is_answered_or_refused_naming_it(send: Caller, versioned: str,
                                                       version: Any, occupied: bool) -> None:
    """The server has 2 slots, so one pin: with the other version pinned (``occupied``),
    pinning a good version is 409. Every answer but a 200 changes nothing."""
    base = f"/admin/api/tenants/fuzzer/adapters/{versioned}"
    if occupied:
        response = send("POST", f"{base}/pin", admin=True, body={"version": 2})
        assert response.status_code == 200, response.text
    before = send("GET", base, admin=True).json()
    response = send("POST", f"{base}/pin", admin=True, body={"version": version})
    if isinstance(version, float) and version.is_integer():
        version = int(version)
    if not _is_int(version, 1, 2**31 - 1):
        expected, param = 400, "version"
    elif version not in (1, 2):
        expected, param = 404, "model"
    elif occupied and version != 2:
        expected, param = 409, None
    else:
        expected, param = 200, None
    assert response.status_code == expected, (version, response.text)
    if expected != 200:
        assert response.json()["error"]["param"] == param, response.text
        assert send("GET", base, admin=True).json() == before
    else:
        pinned = {v["version"]: v["pinned"] for v in response.json()["versions"]}
        assert pinned == {1: version == 1, 2: version == 2 or occupied}
    for number in (1, 2):  # no pin is left for the next example
        assert send("DELETE", f"{base}/pin?version={number}", admin=True).status_code == 200
    assert not any(v["pinned"] for v in send("GET", base, admin=True).json()["versions"])


@FUZZ
@given(tail=VERSION_TEXT)
def test_any_version_an_unpin_names_is_answered_or_400(send: Caller, versioned: str,
                                                       tail: str) -> None:
    assume(not _has_surrogate(tail))  # no URL can carry one
    base = f"/admin/api/tenants/fuzzer/adapters/{versioned}"
    before = send("GET", base, admin=True).json()
    response = send("DELETE", f"{base}/pin?{urlencode({'version': tail})}", admin=True)
    number = int(tail) if re.fullmatch(r"[0-9]{1,10}", tail, re.ASCII) else 0
    expected = (200 if number in (1, 2) else 404 if 1 <= number <= 2**31 - 1 else 400)
    assert response.status_code == expected, (tail, response.text)
    if expected == 400:
        assert response.json()["error"]["param"] == "version", response.text
    assert send("GET", base, admin=True).json() == before


@FUZZ
@given(name=JSON_TEXT)
def test_any_key_name_is_stored_or_400(send: Caller, name: str) -> None:
    response = send("POST", "/admin/api/tenants/fuzzer/keys", admin=True,
                    body={"name": name, "role": "tenant"})
    storable = "\x00" not in name and not _has_surrogate(name) and len(name) <= 128
    assert response.status_code == (201 if storable else 400), (name, response.text)
    if storable:
        send("DELETE", f"/admin/api/keys/{response.json()['id']}", admin=True)


SCHEDULING = ("weight", "priority_class", "max_kv_fraction", "slo_ttft_ms", "slo_tpot_ms",
              "max_storage_bytes", "max_adapter_versions")  # and the storage quotas
SETTING_VALUES = (st.none() | st.booleans() | st.integers() | st.integers(-2, 3_600_002)
                  | st.integers(2**31 - 2, 2**31 + 1) | st.integers(2**63 - 2, 2**63 + 1)
                  | st.floats(allow_nan=False, allow_infinity=False) | st.floats(-0.5, 1001)
                  | st.sampled_from(["interactive", "batch", "Batch", "1", "0.5"]) | JSON_TEXT
                  | st.lists(st.integers(), max_size=2))


def _valid_setting(field: str, value: Any) -> bool:
    """The documented rule of each setting, written out again as the test's oracle."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if field == "weight":
        return number and 0.01 <= value <= 1000
    if field == "priority_class":
        return value in ("interactive", "batch")
    if value is None:  # the server's default, or unlimited
        return True
    if field in ("max_storage_bytes", "max_adapter_versions"):
        bound = 2**63 - 1 if field == "max_storage_bytes" else 2**31 - 1
        return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= bound
    if field == "max_kv_fraction":
        return number and 0 < value <= 1
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 3_600_000


@pytest.fixture(scope="module")
def settings_tenant(send: Caller) -> str:
    """A tenant of the fuzz server's own for the settings, so ``fuzzer``'s share of the
    engine stays as the other fuzz tests expect."""
    name = "sched-fuzz"
    if send("GET", f"/admin/api/tenants/{name}", admin=True).status_code == 404:
        assert send("POST", "/admin/api/tenants", admin=True,
                    body={"name": name}).status_code == 201
    return name


@FUZZ
@given(field=st.sampled_from(SCHEDULING), value=SETTING_VALUES)
def test_any_scheduling_setting_is_stored_or_400_naming_it(
        send: Caller, settings_tenant: str, field: str, value: Any) -> None:
    path = f"/admin/api/tenants/{settings_tenant}"
    before = send("GET", path, admin=True).json()
    response = send("PATCH", path, admin=True, body={field: value})
    if _valid_setting(field, value):
        assert response.status_code == 200, (field, value, response.text)
        assert response.json()[field] == value, (field, value, response.text)
    else:
        assert response.status_code == 400, (field, value, response.text)
        assert response.json()["error"]["param"] == field, response.text
        assert send("GET", path, admin=True).json() == before


def _query_operations(live: LiveServer) -> list[tuple[str, str, list[str]]]:
    with httpx.Client(base_url=live.url) as http:
        doc = http.get("/openapi.json").json()
    fill = {"{tenant}": "fuzzer", "{name}": "nope"}
    ops = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            names = [p["name"] for p in op.get("parameters", []) if p.get("in") == "query"] \
                if method != "parameters" else []
            if names:
                for param, value in fill.items():
                    path = path.replace(param, value)
                ops.append((method.upper(), path, names))
    return ops


@FUZZ
@given(values=st.lists(URL_TEXT, min_size=4, max_size=4))
def test_every_query_parameter_takes_any_text(fuzz_live: LiveServer, send: Caller,
                                              values: list[str]) -> None:
    ops = _query_operations(fuzz_live)
    assert len(ops) >= 6  # the document's query parameters, not a hand-picked few
    for method, path, names in ops:
        params = dict(zip(names, values, strict=False))
        response = send(method, path, admin=path.startswith("/admin"),
                        params=params)
        assert response.status_code in (200, 400, 404), (method, path, params, response.text)


BOUNDARY_CHARS = string.ascii_letters + string.digits + "'()+_,-./:=? "
FIELD_NAMES = st.sampled_from(["name", "visibility", "adapter_config.json",
                               "adapter_model.safetensors", "archive", "file"]) | JSON_TEXT
PART = st.tuples(FIELD_NAMES, st.none() | JSON_TEXT, st.binary(max_size=64))


def _multipart(boundary: bytes, parts: list[tuple[str, str | None, bytes]]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = b'form-data; name="' + name.encode("utf-8", "surrogatepass") + b'"'
        if filename is not None:
            disposition += b'; filename="' + filename.encode("utf-8", "surrogatepass") + b'"'
        out += b"--" + boundary + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n"
        out += data + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


@FUZZ
@given(boundary=st.text(BOUNDARY_CHARS, min_size=1, max_size=300).map(str.strip)
       .filter(bool),
       parts=st.lists(PART, max_size=5), cut=st.none() | st.integers(0, 400),
       admin=st.booleans())
def test_any_multipart_upload_is_refused_with_a_4xx(
        send: Caller, boundary: str, parts: list[tuple[str, str | None, bytes]],
        cut: int | None, admin: bool) -> None:
    body = _multipart(boundary.encode(), parts)
    if cut is not None:
        body = body[:cut]
    path = "/admin/api/tenants/fuzzer/adapters" if admin else "/v1/adapters"
    response = send("POST", path, admin=admin, content=body,
                    headers={"Content-Type": f'multipart/form-data; boundary="{boundary}"'})
    assert response.status_code in (400, 413, 422), (parts, response.text)
    assert response.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["multipart/form-data", "multipart/form-data; "
                                          "boundary=", "text/plain", "multipart/mixed; b=1"])
def test_an_upload_without_a_multipart_boundary_is_400(send: Caller,
                                                       content_type: str) -> None:
    response = send("POST", "/v1/adapters", content=b"--x--\r\n",
                    headers={"Content-Type": content_type})
    assert response.status_code == 400


_REGEX_PIECES = st.sampled_from(["a", ".", ".*", "[a-z]", "(ab|c)", "\\d", "x?", "y+",
                                 "{2,5}", "{1000}", "(", ")", "|", "\\", "(?:a*)*", "😀",
                                 "\x00", "\ud800"])
_SCHEMA_LEAVES = st.sampled_from([
    {"type": "string"}, {"type": "integer", "multipleOf": 1073741824}, {"$ref": "#"},
    {"type": "string", "maxLength": "a" * 96 + "😀"}, {"type": "string", "pattern": "(a"},
    {"type": "strnig"}, {"enum": []}, {"type": "string", "pattern": "^a{1000000}$"}])
_SCHEMAS = st.recursive(_SCHEMA_LEAVES, lambda inner: st.one_of(
    st.builds(lambda p: {"type": "object", "properties": p},
              st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)),
    st.builds(lambda parts: {"allOf": parts}, st.lists(inner, min_size=1, max_size=3))),
    max_leaves=6)
GRAMMAR_FUZZ = settings(max_examples=15, deadline=None, database=None, derandomize=True,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])


@GRAMMAR_FUZZ
@given(field=st.sampled_from(["guided_regex", "guided_grammar"]),
       pieces=st.lists(_REGEX_PIECES, min_size=1, max_size=12),
       repeat=st.sampled_from([1, 20, 500]))
def test_any_regex_or_grammar_is_answered_or_refused_naming_it(
        fuzz_live: LiveServer, send: Caller, field: str, pieces: list[str],
        repeat: int) -> None:
    """Generated, panicking, costly and malformed regexes and grammars: each a 200 or a
    400 naming its field, within the grammar sandbox's limits; never a 5xx."""
    # 1,000 characters: under the fuzz server's 16 KB body, escaped as the client sends them
    source = ("".join(pieces) * repeat)[:1000]
    if field == "guided_grammar":
        source = f"start: /{source}/"
    response = send("POST", "/v1/completions", body={
        "model": fuzz_live.served_name, "prompt": "hi", "max_tokens": 2, field: source})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"] == field, response.text


@GRAMMAR_FUZZ
@given(schema=_SCHEMAS, as_text=st.booleans())
def test_any_json_schema_is_answered_or_refused_naming_it(
        fuzz_live: LiveServer, send: Caller, schema: dict[str, Any], as_text: bool) -> None:
    response = send("POST", "/v1/completions", body={
        "model": fuzz_live.served_name, "prompt": "hi", "max_tokens": 2,
        "guided_json": json.dumps(schema) if as_text else schema})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "guided_json", response.text


# --- vLLM's routes: tokenize, detokenize, load and unload by path ------------------------

PATH_TEXT = st.sampled_from(["r4", "./r4", "r4/", "../r4", "/", "/etc/passwd", "..", "\x00",
                             "r4\x00", "%2e%2e", "a" * 5000, "0" * 300, "r4/" + "x" * 300, "", "~", "~/r4",
                             "//r4"]) \
    | JSON_TEXT


@FUZZ
@given(model=st.none() | MODEL_TEXT, prompt=JSON_TEXT, strs=st.booleans())
def test_any_tokenize_model_or_prompt_is_answered_or_4xx(fuzz_live: LiveServer, send: Caller,
                                                         model: str | None, prompt: str,
                                                         strs: bool) -> None:
    body = {"prompt": prompt, "return_token_strs": strs} | ({} if model is None
                                                            else {"model": model})
    response = send("POST", "/tokenize", body=body)
    if model is not None and (not model or _has_surrogate(model)):
        expected = 400
    elif model not in (None, fuzz_live.served_name):
        expected = 404
    else:
        expected = 400 if _has_surrogate(prompt) else 200
    assert response.status_code == expected, (body, response.text)
    if expected == 200:
        ids = response.json()["tokens"]
        back = send("POST", "/detokenize", body={"tokens": ids})
        assert back.status_code == 200, back.text


@FUZZ
@given(tokens=st.lists(st.integers(-2**70, 2**70) | st.sampled_from([0, 1, 2, 255]),
                       max_size=20))
def test_any_detokenize_ids_are_answered_or_400_naming_one(send: Caller,
                                                           tokens: list[int]) -> None:
    response = send("POST", "/detokenize", body={"tokens": tokens})
    vocab = send.live.client.description.vocab_size
    bad = [i for i, t in enumerate(tokens) if not 0 <= t < vocab]
    if bad:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == f"tokens[{bad[0]}]"
    else:
        assert response.status_code == 200, response.text


@FUZZ
@given(name=JSON_TEXT)
def test_any_lora_name_is_loaded_and_unloaded_or_400(send: Caller, name: str) -> None:
    loaded = send("POST", "/v1/load_lora_adapter", body={"lora_name": name, "lora_path": "r4"})
    assert loaded.status_code in (200, 400), (name, loaded.text)
    if loaded.status_code == 400:
        assert loaded.json()["error"]["param"] in ("name", "lora_name"), loaded.text
    unloaded = send("POST", "/v1/unload_lora_adapter", body={"lora_name": name})
    expected = (200,) if loaded.status_code == 200 else (400, 404)
    assert unloaded.status_code in expected, (name, unloaded.text)


@FUZZ
@given(path=PATH_TEXT)
def test_any_lora_path_is_loaded_only_inside_the_allowed_folder(send: Caller,
                                                                path: str) -> None:
    response = send("POST", "/v1/load_lora_adapter", body={"lora_name": "fzpath",
                                                          "lora_path": path})
    if _has_surrogate(path) or not path:
        assert response.status_code == 400, (path, response.text)
    elif response.status_code == 200:  # only the one adapter of the allowed folder
        assert send("POST", "/v1/unload_lora_adapter",
                    body={"lora_name": "fzpath"}).status_code == 200
        assert path.strip("/").replace("./", "").rstrip("/").endswith("r4"), path
    else:
        assert response.status_code in (403, 404), (path, response.text)
