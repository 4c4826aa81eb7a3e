"""vLLM's extra routes on a live server: /tokenize, /detokenize, /version, loading and
unloading adapters by path (only from the allowed folder), /metrics with a scrape token, and
max_tokens bounded by the context when no cap is set."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from loraplex.config import SchedulerConfig, ServerConfig

SCRAPE_TOKEN = "scrape-" + "s" * 24
MAX_BODY = 32 * 1024


@dataclass
class Setup:
    server: Any  # conftest's OwnServer
    allowed: Path
    outside: Path  # an adapter folder outside the allowed one

    def post(self, path: str, body: Any, key: str | None = None,
             tenant: str = "alice") -> httpx.Response:
        headers = {"Authorization": f"Bearer {key if key is not None else self.server.keys[tenant]}"}
        if isinstance(body, bytes):  # JSON text httpx would not write (a lone surrogate)
            return httpx.post(f"{self.server.url}{path}", content=body, timeout=60,
                              headers=headers | {"Content-Type": "application/json"})
        return httpx.post(f"{self.server.url}{path}", json=body, headers=headers, timeout=60)

    def adapters(self, tenant: str) -> list[tuple[str, int]]:
        listed = self.server.get("/v1/adapters", self.server.keys[tenant]).json()["data"]
        return sorted((a["name"], a["version"]) for a in listed)

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.server.url}/v1", api_key=self.server.keys[tenant],
                             max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def setup(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory,
          own_server: Callable[..., contextlib.AbstractContextManager[Any]]) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("vllm_routes")
    allowed = root / "allowed"
    allowed.mkdir()
    shutil.copytree(llama_adapters["r4"], allowed / "r4")
    shutil.copytree(llama_adapters["r8qv"], allowed / "r8qv")
    outside = root / "outside"
    shutil.copytree(llama_adapters["r16rs"], outside)
    os.symlink(outside, allowed / "escape")  # a folder link out of the allowed folder
    (allowed / "half").mkdir()  # a folder whose weights are a link out of it
    shutil.copy(outside / "adapter_config.json", allowed / "half")
    os.symlink(outside / "adapter_model.safetensors", allowed / "half" / "adapter_model.safetensors")
    config = ServerConfig(served_model_name="tiny", max_n=2, max_body_bytes=MAX_BODY,
                          metrics_token=SCRAPE_TOKEN, allowed_lora_dirs=(str(allowed),))
    tenants = {"alice": {}, "bob": {}, "carol": {}}
    with own_server(root / "server", tiny_llama_dir, tenants,
                    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
                    config) as server:
        yield Setup(server, allowed, outside)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


# --- /tokenize, /detokenize, /version ----------------------------------------------------


def test_tokenize_as_vllm_answers(setup: Setup, tokenizer: Any) -> None:
    r = setup.post("/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tokenizer.encode("hello world")
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 512
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    bare = setup.post("/tokenize", {"model": "tiny", "prompt": "hello world",
                                    "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("hello world", add_special_tokens=False)
    assert bare["token_strs"] is None
    chat = setup.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tokenize=False, add_generation_prompt=True)
    assert chat.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


def test_detokenize_round_trips(setup: Setup, tokenizer: Any) -> None:
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    r = setup.post("/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode(ids)}


def test_an_adapter_tokenizes_as_the_base_model_but_only_for_who_may_see_it(
        setup: Setup) -> None:
    assert setup.post("/v1/load_lora_adapter", {"lora_name": "bobs", "lora_path": "r4"},
                      tenant="bob").status_code == 200
    base = setup.post("/tokenize", {"prompt": "same tokens"}, tenant="bob").json()
    own = setup.post("/tokenize", {"model": "bobs", "prompt": "same tokens"}, tenant="bob")
    assert own.status_code == 200 and own.json() == base
    for body in ({"model": "bob/bobs", "prompt": "x"}, {"model": "bobs", "prompt": "x"},
                 {"model": "nope", "prompt": "x"}):
        r = setup.post("/tokenize", body, tenant="carol")
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
    assert setup.post("/detokenize", {"model": "bob/bobs", "tokens": [1]},
                      tenant="carol").status_code == 404


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/version",
                                  "/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
@pytest.mark.parametrize("key", ["", "lpx-" + "x" * 43, "wrong", SCRAPE_TOKEN])
def test_every_new_route_needs_a_tenant_key(setup: Setup, path: str, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"{setup.server.url}{path}"
    r = (httpx.get(url, headers=headers) if path == "/version"
         else httpx.post(url, json={"prompt": "x", "tokens": [1], "lora_name": "r4",
                                    "lora_path": "r4"}, headers=headers))
    assert r.status_code == 401, r.text
    assert r.json()["error"]["message"]


def test_version(setup: Setup) -> None:
    r = setup.server.get("/version", setup.server.keys["alice"])
    assert r.status_code == 200 and isinstance(r.json()["version"], str)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                   "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"model": 3, "prompt": "a"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1, 10**30]}, "tokens[1]"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_bodies_are_named(setup: Setup, path: str, body: dict[str, Any] | bytes,
                              param: str) -> None:
    r = setup.post(path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/load_lora_adapter",
                                  "/v1/unload_lora_adapter"])
def test_huge_bodies_are_refused_before_reading(setup: Setup, path: str) -> None:
    huge = "a" * (MAX_BODY + 1)
    r = setup.post(path, {"prompt": huge, "tokens": [1] * MAX_BODY, "lora_name": huge,
                          "lora_path": huge})
    assert r.status_code == 413, r.text
    assert setup.adapters("alice") == []


# --- loading and unloading by path ---------------------------------------------------------


def test_load_registers_for_the_caller_idempotently_and_unload_deletes(setup: Setup) -> None:
    r = setup.post("/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "r8qv"},
                   tenant="carol")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'mine' added successfully."
    # Absolute inside the allowed folder, the same files: no new version.
    again = setup.post("/v1/load_lora_adapter",
                       {"lora_name": "mine", "lora_path": str(setup.allowed / "r8qv"),
                        "load_inplace": True}, tenant="carol")
    assert again.status_code == 200, again.text
    assert setup.adapters("carol") == [("mine", 1)]
    other = setup.post("/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "r4"},
                       tenant="carol")
    assert other.status_code == 200 and setup.adapters("carol") == [("mine", 1), ("mine", 2)]
    with setup.client("carol") as client:
        assert "mine" in [m.id for m in client.models.list()]
        done = client.completions.create(model="mine", prompt="hello", max_tokens=2)
        assert done.model == "mine"
    # Another tenant can neither call nor unload it.
    assert setup.post("/v1/unload_lora_adapter", {"lora_name": "mine"},
                      tenant="alice").status_code == 404
    assert setup.post("/v1/unload_lora_adapter", {"lora_name": "carol/mine"},
                      tenant="alice").status_code in (400, 404)
    assert setup.adapters("carol") == [("mine", 1), ("mine", 2)]
    r = setup.post("/v1/unload_lora_adapter", {"lora_name": "mine", "lora_int_id": 1},
                   tenant="carol")
    assert r.status_code == 200 and r.text == \
        "Success: LoRA adapter 'mine' removed successfully."
    assert setup.adapters("carol") == []
    assert setup.post("/v1/unload_lora_adapter", {"lora_name": "mine"},
                      tenant="carol").status_code == 404


def _traversals(setup: Setup) -> list[str]:
    return ["../outside", "r4/../../outside", str(setup.outside), "escape", "half",
            "/etc", "/", "..", "r4\0", "/" + "a" * 5000, str(setup.allowed) + "/../outside"]


def test_paths_out_of_the_allowed_folder_are_refused_and_nothing_is_registered(
        setup: Setup) -> None:
    for path in _traversals(setup):
        r = setup.post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": path})
        assert r.status_code == 403, (path, r.text)
        assert "allowed" in r.json()["error"]["message"]
        assert str(setup.outside) not in r.text
    missing = setup.post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "nope"})
    assert missing.status_code == 404, missing.text
    assert setup.adapters("alice") == []


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"lora_path": "r4"}, 400, "lora_name"),
    ({"lora_name": "ok"}, 400, "lora_path"),
    ({"lora_name": "../x", "lora_path": "r4"}, 400, "name"),
    ({"lora_name": "tiny", "lora_path": "r4"}, 400, "name"),
    ({"lora_name": "x" * 300, "lora_path": "r4"}, 400, "name"),
    ({"lora_name": "ok", "lora_path": 7}, 400, "lora_path"),
    ({"lora_name": "ok", "lora_path": "r4", "load_inplace": "yes"}, 400, "load_inplace"),
    ({"lora_name": "ok", "lora_path": "r4", "other": 1}, 400, "other"),
])
def test_bad_load_bodies(setup: Setup, body: dict[str, Any], status: int,
                         param: str) -> None:
    r = setup.post("/v1/load_lora_adapter", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert setup.adapters("alice") == []


def test_a_folder_that_is_no_adapter_is_refused(setup: Setup) -> None:
    (setup.allowed / "empty").mkdir(exist_ok=True)
    r = setup.post("/v1/load_lora_adapter", {"lora_name": "empty", "lora_path": "empty"})
    assert r.status_code == 422, r.text
    assert str(setup.allowed) not in r.text
    assert setup.adapters("alice") == []


def test_load_is_refused_where_no_folder_is_allowed(
        tiny_llama_dir: Path, tmp_path: Path, llama_adapters: dict[str, Path],
        own_server: Callable[..., contextlib.AbstractContextManager[Any]]) -> None:
    with own_server(tmp_path, tiny_llama_dir, {"alice": {}},
                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
                    ServerConfig(served_model_name="tiny", max_tokens_limit=8)) as server:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "a", "lora_path": str(llama_adapters["r4"])},
                       headers={"Authorization": f"Bearer {server.keys['alice']}"})
        assert r.status_code == 403 and "--allowed-lora-dir" in r.text
        # An operator's cap still bounds max_tokens.
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.keys["alice"],
                           max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model="tiny", prompt="hi", max_tokens=9)
            assert caught.value.body["param"] == "max_tokens"  # type: ignore[index]
        # The scrape token is not configured here: only admin keys open /metrics.
        assert server.get("/metrics", SCRAPE_TOKEN).status_code == 401


# --- /metrics and max_tokens -----------------------------------------------------------------


def test_metrics_take_the_scrape_token_or_an_admin_key(setup: Setup) -> None:
    assert setup.server.get("/metrics", SCRAPE_TOKEN).status_code == 200
    assert setup.server.get("/metrics").status_code == 200  # admin
    assert setup.server.get("/metrics", setup.server.keys["alice"]).status_code == 403
    assert setup.server.get("/metrics", SCRAPE_TOKEN + "x").status_code == 401
    # The token opens nothing else.
    assert setup.server.get("/v1/models", SCRAPE_TOKEN).status_code == 401
    assert setup.server.get("/admin/api/engine", SCRAPE_TOKEN).status_code == 401


def test_max_tokens_is_bounded_by_the_context_without_a_cap(setup: Setup) -> None:
    doc = httpx.get(f"{setup.server.url}/openapi.json").json()
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["maximum"] == 512
    with setup.client("alice") as client:
        done = client.completions.create(model="tiny", prompt="hi", max_tokens=500)
        assert done.usage is not None and done.usage.completion_tokens <= 500
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt="hi", max_tokens=512)
        assert caught.value.code == "context_length_exceeded"
