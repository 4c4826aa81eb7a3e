"""The compose stack end to end, from the host, with the official `openai` client.

Run by scripts/test-compose with the project's virtualenv python (openai, httpx, peft):

    e2e.py adapters DIR         builds the two test adapters into DIR (the harness runs this
                                while the stack starts)
    e2e.py setup STATE_FILE     tenants, keys and adapters (CLI in the container, and an
                                HTTP upload), chat and stream on both adapters, isolation,
                                prefix blocks evicted to the KV disk tier's volume; writes what the second phase needs to STATE_FILE
    e2e.py after-restart STATE_FILE
                                the same keys, adapters, usage and KV disk blocks (read by
                                their tenant only) after the stack was taken down (volumes
                                kept) and brought up again
    e2e.py ray STATE_FILE       the same volumes under the `ray` profile: two gateways
                                (LPX_TEST_API, LPX_TEST_API2) in front of engine replicas on
                                Ray Serve; /ready, the replicas listed, an HTTP upload, chat
                                and stream through both gateways, isolation

Environment: LPX_TEST_ADAPTERS (the adapters phase's DIR), LPX_TEST_API (http://127.0.0.1:PORT), LPX_TEST_ADMIN_KEY, LPX_TEST_CONTAINER
(the loraplex container, for `podman exec`; in the ray phase the first gateway's),
LPX_TEST_PODMAN (podman's path), LPX_TEST_API2 (the ray profile's second gateway),
LPX_TEST_RAY_REPLICAS (the engine replicas it deploys).
Prints one line per check and ends with `e2e PHASE: N passed, M failed`; exit status 1 on
any failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai

API = os.environ.get("LPX_TEST_API", "http://127.0.0.1:0")
API2 = os.environ.get("LPX_TEST_API2", "http://127.0.0.1:0")
RAY_REPLICAS = int(os.environ.get("LPX_TEST_RAY_REPLICAS", "2"))
ADMIN_KEY = os.environ.get("LPX_TEST_ADMIN_KEY", "")
CONTAINER = os.environ.get("LPX_TEST_CONTAINER", "")
PODMAN = os.environ.get("LPX_TEST_PODMAN", "podman")
BASE_MODEL = "smollm2-135m-instruct"
# The demo model's attention shapes (SmolLM2-135M): the adapter is built for these.
DEMO_SHAPES = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
               "num_key_value_heads": 3, "head_dim": 64}
PROMPT = [{"role": "user", "content": "Name three colours."}]
TIMEOUT_S = 120

# Loopback only, whatever the environment says.
assert urlsplit(API).hostname == "127.0.0.1", API
assert urlsplit(API2).hostname == "127.0.0.1", API2


class Checks:
    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.passed = 0
        self.failed = 0

    def run(self, name: str, fn: Callable[[], object]) -> Any:
        start = time.monotonic()
        try:
            result = fn()
        except Exception as exc:  # a failed check is reported, the others still run
            self.failed += 1
            detail = "".join(traceback.format_exception_only(exc)).strip()
            print(f"FAIL  {name}: {detail[:2000]}", flush=True)
            return None
        self.passed += 1
        print(f"ok    {name} ({time.monotonic() - start:.1f} s)", flush=True)
        return result

    def finish(self) -> int:
        print(f"e2e {self.phase}: {self.passed} passed, {self.failed} failed", flush=True)
        return 1 if self.failed else 0


def cli(*args: str) -> Any:
    """`loraplex ARGS --json` inside the loraplex container."""
    result = subprocess.run([PODMAN, "exec", CONTAINER, "loraplex", *args, "--json"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    if result.returncode != 0:
        raise AssertionError(f"loraplex {' '.join(args)}: exit {result.returncode}: "
                             f"{result.stderr[-1500:]}")
    return json.loads(result.stdout)


def client(key: str, api: str = API) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)


def build_adapter(out_dir: Path, seed: int) -> Path:
    """A random rank-4 PEFT LoRA (q_proj, v_proj) for the demo model, safetensors only.

    Built on a model with the demo model's attention shapes but a tiny vocabulary and MLP
    (neither is targeted), so no weights of the real model are needed here."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**DEMO_SHAPES, intermediate_size=16, vocab_size=64,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False, lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 2.0 / (param.shape[-1] ** 0.5))
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    config_path = out_dir / "adapter_config.json"
    data = json.loads(config_path.read_text())
    data["base_model_name_or_path"] = BASE_MODEL
    config_path.write_text(json.dumps(data, indent=2))
    files = sorted(p.name for p in out_dir.iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"] or \
        files == ["adapter_config.json", "adapter_model.safetensors"], files
    (out_dir / "README.md").unlink(missing_ok=True)
    return out_dir


def build_adapters(checks: Checks, out: Path) -> None:
    checks.run("build adapter 1 (peft, rank 4, safetensors)",
               lambda: build_adapter(out / "support", seed=1))
    checks.run("build adapter 2 (peft, rank 4, safetensors)",
               lambda: build_adapter(out / "second", seed=2))


def chat(key: str, model: str, stream: bool, api: str = API) -> str:
    c = client(key, api)
    if not stream:
        reply = c.chat.completions.create(model=model, messages=PROMPT,  # type: ignore[arg-type]
                                          max_tokens=8, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason in ("length", "stop"), choice
        assert reply.model == model, reply.model
        assert reply.usage is not None and reply.usage.completion_tokens > 0, reply.usage
        return choice.message.content or ""
    parts: list[str] = []
    finish = None
    with c.chat.completions.create(model=model, messages=PROMPT,  # type: ignore[arg-type]
                                   max_tokens=8, temperature=0, stream=True) as events:
        for event in events:
            for choice in event.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    assert finish in ("length", "stop"), finish
    text = "".join(parts)
    assert text, "the stream carried no text"
    return text


def expect_not_found(key: str, model: str, api: str = API) -> None:
    try:
        client(key, api).chat.completions.create(model=model, messages=PROMPT,  # type: ignore[arg-type]
                                            max_tokens=4)
    except openai.NotFoundError:
        return
    raise AssertionError(f"{model} answered for another tenant's key")


def usage(key: str) -> dict[str, Any]:
    r = httpx.get(f"{API}/v1/usage", headers={"Authorization": f"Bearer {key}"},
                  timeout=TIMEOUT_S)
    r.raise_for_status()
    totals: dict[str, Any] = r.json()["totals"]
    return totals


def engine_stats() -> dict[str, Any]:
    r = httpx.get(f"{API}/admin/api/engine", timeout=TIMEOUT_S,
                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, (r.status_code, r.text)
    return dict(r.json())


def long_prompt(n: int) -> str:
    """About 30 blocks of tokens (the test pool holds 96): the next four evict all of the
    first (a lookup reads the disk only from a prefix's first block on)."""
    return f"Disk tier check {n}. " + " ".join(f"clause {n}-{i} applies;" for i in range(80))


def complete(key: str, prompt: str) -> None:
    client(key).completions.create(model=BASE_MODEL, prompt=prompt, max_tokens=1)


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.5)


def model_ids(key: str, api: str = API) -> set[str]:
    return {m.id for m in client(key, api).models.list()}


def upload(key: str, name: str, folder: Path, api: str = API) -> Any:
    files = [(f, (f, (folder / f).read_bytes(), "application/octet-stream"))
             for f in ("adapter_config.json", "adapter_model.safetensors")]
    r = httpx.post(f"{api}/v1/adapters", headers={"Authorization": f"Bearer {key}"},
                   data={"name": name}, files=files, timeout=TIMEOUT_S)
    assert r.status_code == 201, (r.status_code, r.text)
    return r.json()


def setup(state_file: Path) -> int:
    checks = Checks("setup")
    state: dict[str, Any] = {}
    def health() -> None:
        body = httpx.get(f"{API}/health", timeout=30).json()
        assert body == {"status": "ok"}, body

    checks.run("GET /health", health)
    checks.run("admin key lists models", lambda: model_ids(ADMIN_KEY))

    checks.run("CLI: tenants create acme, globex",
               lambda: [cli("tenants", "create", name) for name in ("acme", "globex")])
    state["acme_key"] = checks.run("CLI: keys create --tenant acme",
                                   lambda: cli("keys", "create", "--tenant", "acme")["key"])
    state["globex_key"] = checks.run(
        "CLI: keys create --tenant globex",
        lambda: cli("keys", "create", "--tenant", "globex")["key"])
    acme, globex = state["acme_key"], state["globex_key"]
    if not acme or not globex:
        return checks.finish()

    with tempfile.TemporaryDirectory(prefix="lpx-compose-adapters-") as tmp:
        built = Path(os.environ.get("LPX_TEST_ADAPTERS") or tmp)
        if not (built / "second" / "adapter_model.safetensors").is_file():
            build_adapters(checks, built)
        first, second = built / "support", built / "second"

        def add_with_cli() -> Any:
            assert first is not None
            inside = "/tmp/lpx-compose-test-support"
            subprocess.run([PODMAN, "cp", str(first), f"{CONTAINER}:{inside}"], check=True,
                           timeout=TIMEOUT_S)
            try:
                return cli("adapters", "add", "--tenant", "acme", "--name", "support", inside)
            finally:
                subprocess.run([PODMAN, "exec", "--user", "root", CONTAINER,
                                "rm", "-rf", inside], timeout=TIMEOUT_S, check=False)

        checks.run("CLI: adapters add --tenant acme --name support", add_with_cli)

        checks.run("HTTP: POST /v1/adapters (acme/second)",
                   lambda: upload(acme, "second", second))

    def listed() -> None:
        ids = model_ids(acme)  # a tenant's own adapters are listed by their bare names
        assert {BASE_MODEL, "support", "second"} <= ids, ids

    checks.run("acme's /v1/models lists the base model and both adapters", listed)
    outputs: dict[str, str] = {}
    for model in (BASE_MODEL, "acme/support", "acme/second"):
        outputs[model] = checks.run(f"chat {model}", lambda m=model: chat(acme, m, False))
        checks.run(f"stream {model}", lambda m=model: chat(acme, m, True))

    def adapters_apply() -> None:
        base = outputs.get(BASE_MODEL)
        assert base is not None
        assert outputs.get("acme/support") != base or outputs.get("acme/second") != base, \
            f"both adapters answered exactly as the base model: {base!r}"

    checks.run("the adapters change the output", adapters_apply)
    for model in ("acme/support", "acme/second"):
        checks.run(f"isolation: globex gets 404 for {model}",
                   lambda m=model: expect_not_found(globex, m))

    def globex_sees_nothing() -> None:
        ids = model_ids(globex)
        assert not ids & {"support", "second", "acme/support", "acme/second"}, ids

    checks.run("isolation: globex's /v1/models shows no acme adapter", globex_sees_nothing)

    def metered() -> dict[str, Any]:
        totals = usage(acme)
        assert totals["requests"] >= 6, totals
        return totals

    state["acme_usage"] = checks.run("usage metered for acme", metered)

    def blocks_reach_the_disk() -> None:
        for n in range(6):  # past the pool: the first prompt's blocks are evicted, to disk
            complete(acme, long_prompt(n))
        wait_for("evicted blocks written to the kvcache volume",
                 lambda: engine_stats()["kv_disk_blocks"] >= 64)

    checks.run("KV disk tier: evicted prefix blocks written to its volume",
               blocks_reach_the_disk)
    state_file.write_text(json.dumps(state))
    return checks.finish()


def after_restart(state_file: Path) -> int:
    checks = Checks("after-restart")
    state = json.loads(state_file.read_text())
    acme, globex = state["acme_key"], state["globex_key"]

    def tenants() -> None:
        names = {t["name"] for t in cli("tenants", "list")}
        assert {"acme", "globex"} <= names, names

    checks.run("CLI: tenants survived", tenants)

    def adapters() -> None:
        rows = cli("adapters", "list", "--tenant", "acme")
        names = {row["name"] for row in rows}
        assert {"support", "second"} <= names, rows

    checks.run("CLI: adapters survived", adapters)

    def keys_and_models() -> None:
        ids = model_ids(acme)
        assert {BASE_MODEL, "support", "second"} <= ids, ids

    checks.run("acme's key survived; both adapters listed", keys_and_models)
    for model in ("acme/support", "acme/second"):
        checks.run(f"chat {model} (files survived in the adapters volume)",
                   lambda m=model: chat(acme, m, False))
        checks.run(f"stream {model}", lambda m=model: chat(acme, m, True))
    checks.run("isolation: globex's key survived and still gets 404",
               lambda: expect_not_found(globex, "acme/support"))

    def usage_survived() -> None:
        before = state.get("acme_usage") or {}
        after = usage(acme)
        assert after["requests"] >= before.get("requests", 1) + 4, (before, after)
        assert after["total_tokens"] > before.get("total_tokens", 0), (before, after)

    checks.run("usage survived (and grew)", usage_survived)

    def disk_blocks_survive_for_their_tenant_only() -> None:
        assert engine_stats()["kv_disk_blocks"] > 0, "the volume's blocks were not indexed"
        before = engine_stats()["kv_disk_hit_tokens"]
        complete(globex, long_prompt(0))  # the same text under another tenant's salt
        assert engine_stats()["kv_disk_hit_tokens"] == before, "globex read acme's blocks"
        complete(acme, long_prompt(0))
        assert engine_stats()["kv_disk_hit_tokens"] > before, "acme's blocks were not read"

    checks.run("KV disk tier: blocks survived the restart, read by their tenant only",
               disk_blocks_survive_for_their_tenant_only)
    return checks.finish()


def ray_profile(state_file: Path) -> int:
    """The ray profile on the default stack's volumes: its tenants, keys and adapters."""
    checks = Checks("ray")
    state = json.loads(state_file.read_text())
    acme, globex = state["acme_key"], state["globex_key"]
    gateways = {"gateway": API, "gateway-2": API2}
    for label, api in gateways.items():
        checks.run(f"{label}: GET /ready",
                   lambda a=api: httpx.get(f"{a}/ready", timeout=30).raise_for_status())

    def replicas_listed(api: str) -> list[int]:
        # Each replica publishes its figures every second; all of them within 30 s.
        deadline = time.monotonic() + 30
        while True:
            r = httpx.get(f"{api}/admin/api/engine", timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            r.raise_for_status()
            ordinals = sorted(rep["replica"] for rep in r.json()["replicas"])
            if ordinals == list(range(RAY_REPLICAS)) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert ordinals == list(range(RAY_REPLICAS)), r.json()["replicas"]
        return ordinals

    for label, api in gateways.items():
        checks.run(f"{label}: /admin/api/engine lists {RAY_REPLICAS} replicas",
                   lambda a=api: replicas_listed(a))

    with tempfile.TemporaryDirectory(prefix="lpx-compose-adapters-") as tmp:
        third = Path(tmp) / "third"
        checks.run("build adapter 3 (peft, rank 4, safetensors)",
                   lambda: build_adapter(third, seed=3))
        checks.run("HTTP: POST /v1/adapters (acme/third) through gateway",
                   lambda: upload(acme, "third", third, API))

    def listed(api: str) -> None:
        ids = model_ids(acme, api)
        assert {BASE_MODEL, "support", "second", "third"} <= ids, ids

    for label, api in gateways.items():
        checks.run(f"{label}: acme's /v1/models lists the base model and three adapters",
                   lambda a=api: listed(a))
    outputs: dict[tuple[str, str], str] = {}
    for label, api in gateways.items():
        for model in (BASE_MODEL, "acme/support", "acme/third"):
            outputs[label, model] = checks.run(f"{label}: chat {model}",
                                               lambda m=model, a=api: chat(acme, m, False, a))
            checks.run(f"{label}: stream {model}", lambda m=model, a=api: chat(acme, m, True, a))

    def same_answers() -> None:
        for model in (BASE_MODEL, "acme/support", "acme/third"):
            one, two = outputs.get(("gateway", model)), outputs.get(("gateway-2", model))
            assert one is not None and one == two, (model, one, two)
        base = outputs["gateway", BASE_MODEL]
        assert base not in (outputs["gateway", "acme/third"], outputs["gateway", "acme/support"]) \
            or outputs["gateway", "acme/third"] != outputs["gateway", "acme/support"], \
            f"both adapters answered exactly as the base model: {base!r}"

    checks.run("both gateways answer alike (greedy); the adapters apply", same_answers)
    for label, api in gateways.items():
        checks.run(f"{label}: isolation: globex gets 404 for acme/third",
                   lambda a=api: expect_not_found(globex, "acme/third", a))
    return checks.finish()


def main() -> int:
    phase, state_file = sys.argv[1], Path(sys.argv[2])
    if phase == "adapters":
        checks = Checks("adapters")
        build_adapters(checks, state_file)
        return checks.finish()
    if phase == "setup":
        return setup(state_file)
    if phase == "after-restart":
        return after_restart(state_file)
    if phase == "ray":
        return ray_profile(state_file)
    raise SystemExit(f"unknown phase {phase!r}")


if __name__ == "__main__":
    sys.exit(main())
