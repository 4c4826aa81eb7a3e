"""``loraplex serve`` with vLLM's flags, as a vLLM user types them: ``--api-key`` and
``--lora-modules`` through the ``openai`` client, twice on one home (idempotent by digest, a
new static key retiring the old one), and the refusals that come before anything loads."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from servers import clean_env, free_port, serve_command, wait_ready
from sqlalchemy.orm import Session

from loraplex.errors import ConfigError
from loraplex.gateway.auth import ensure_admin_key, ensure_static_key
from loraplex.registry import service

pytestmark = pytest.mark.server

SCRAPE_TOKEN = "prometheus-" + "p" * 20


class _Running:
    """``loraplex serve`` with ``args`` on ``home``, ready inside the ``with``; its stderr
    once it stopped."""

    def __init__(self, model: Path, home: Path, *args: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            serve_command("--model", str(model), "--port", str(self.port),
                          "--num-kv-blocks", "64", "--served-model-name", "tiny",
                          "--log-level", "warning", *args),
            env=clean_env(home) | env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        self.stderr = ""

    def __enter__(self) -> _Running:
        wait_ready(self.url, self.proc)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            _, self.stderr = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()


def test_api_key_and_lora_modules_through_the_openai_client(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    home = tmp_path / "home"
    first_key = "token-abc123"  # vLLM's documented example: short keys are taken, warned
    modules = ["--lora-modules", f"sql={llama_adapters['r4']}",
               json.dumps({"name": "summarizer", "path": str(llama_adapters["r8qv"]),
                           "base_model_name": "whatever"})]
    env = {"LORAPLEX_METRICS_TOKEN": SCRAPE_TOKEN}
    with _Running(tiny_llama_dir, home, "--enable-lora", "--api-key", first_key, *modules,
                  env=env) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=first_key,
                           max_retries=0) as client:
            assert sorted(m.id for m in client.models.list()) == ["sql", "summarizer", "tiny"]
            for model in ("sql", "summarizer", "tiny"):
                done = client.completions.create(model=model, prompt="hello", max_tokens=3)
                assert done.model == model
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="token-abc124",
                           max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        tokens = httpx.post(f"{server.url}/tokenize", json={"model": "sql", "prompt": "hi"},
                            headers={"Authorization": f"Bearer {first_key}"})
        assert tokens.status_code == 200 and tokens.json()["count"] >= 1
        assert httpx.get(f"{server.url}/metrics", headers={
            "Authorization": f"Bearer {SCRAPE_TOKEN}"}).status_code == 200
        assert httpx.get(f"{server.url}/metrics", headers={
            "Authorization": f"Bearer {first_key}"}).status_code == 403
    assert server.proc.returncode == 0, server.stderr
    assert "warning: the --api-key is 12 characters" in server.stderr
    assert "adapter sql: registered as version 1 of tenant 'default'" in server.stderr
    assert first_key not in server.stderr

    # The same modules again register nothing; another key (from the environment) replaces
    # the first, which stops working.
    second_key = "lpx-static-" + "k" * 40
    with _Running(tiny_llama_dir, home, *modules,
                  env={"LORAPLEX_API_KEY": second_key}) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=second_key,
                           max_retries=0) as client:
            assert sorted(m.id for m in client.models.list()) == ["sql", "summarizer", "tiny"]
            listed = httpx.get(f"{server.url}/v1/adapters",
                               headers={"Authorization": f"Bearer {second_key}"}).json()
            assert sorted((a["name"], a["version"]) for a in listed["data"]) == \
                [("sql", 1), ("summarizer", 1)]
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=first_key,
                           max_retries=0) as old:
            with pytest.raises(openai.AuthenticationError):
                old.models.list()
    assert server.proc.returncode == 0, server.stderr
    assert "adapter sql: already registered as version 1" in server.stderr
    assert "warning" not in server.stderr


@pytest.mark.parametrize(("args", "words"), [
    (("--lora-modules", "no-equals-sign"), "expected name=path"),
    (("--lora-modules", '{"name": "a"}'), "expected {"),
    (("--lora-modules", '{"name": "a", "path": "/x", "rank": 4}'), "unknown key 'rank'"),
    (("--lora-modules", "a=/no/such/folder"), "not a folder"),
    (("--api-key", "has a space"), "--api-key"),
    (("--allowed-lora-dir", "/no/such/folder"), "not a folder"),
])
def test_bad_vllm_flags_are_refused_before_anything_loads(
        tiny_llama_dir: Path, tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    done = subprocess.run(serve_command("--model", str(tiny_llama_dir), "--port", "0", *args),
                          env=clean_env(tmp_path / "home"), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "home" / "loraplex.db").exists()


def test_static_key_belongs_to_the_default_tenant(session: Session) -> None:
    ensure_static_key(session, "short-key")
    ensure_static_key(session, "short-key")  # idempotent
    principal = service.authenticate(session, "short-key")
    assert principal is not None and principal.tenant_name == "default"
    assert not principal.is_admin
    keys = service.list_keys(session, principal.tenant_id)
    assert len(keys) == 1 and "short-key" not in keys[0].prefix  # never stored whole
    ensure_static_key(session, "another-key")
    assert service.authenticate(session, "short-key") is None  # retired
    with pytest.raises(ConfigError, match="revoked"):
        ensure_static_key(session, "short-key")
    admin = "lpx-" + "a" * 43
    ensure_admin_key(session, admin)
    with pytest.raises(ConfigError, match="admin"):
        ensure_static_key(session, admin)
