"""An accepted adapter's measured effect over HTTP (issue 56): real PEFT adapters uploaded
to a server of the test's own (the tiny Llama, its real engine), the effect in the upload
answer and in every listing, a warning for an effect indistinguishable from zero, a probe
that fails or outlasts the answer's wait, and the probe beside another tenant's work."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from servers import ttft_steps_within

from loraplex.config import SchedulerConfig, ServerConfig
from loraplex.engine.share import Share
from loraplex.errors import AdapterError, EngineOverloadedError
from loraplex.gateway.adapter_effect import (
    MIN_EFFECT_KL,
    PROBE_SHARE,
    PROMPTS,
    EffectProbes,
)

pytestmark = [pytest.mark.slow, pytest.mark.server]
FILES = ("adapter_config.json", "adapter_model.safetensors")
SERVED = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           own_server: Callable[..., contextlib.AbstractContextManager[Any]]) -> Iterator[Any]:
    tenants = {"owner": {}, "busy": {}, "quiet": {}}
    with own_server(tmp_path_factory.mktemp("effect"), tiny_llama_dir, tenants,
                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
                    ServerConfig(served_model_name=SERVED, max_tokens_limit=400,
                                 effect_probe_wait_s=60.0)) as own:
        yield own


def _probes(server: Any) -> EffectProbes:
    probes: EffectProbes = server.app.state.adapters.probes
    return probes


def _upload(server: Any, name: str, folder: Path, status: int = 201) -> dict[str, Any]:
    files = {f: (f, (folder / f).read_bytes()) for f in FILES}
    response = httpx.post(f"{server.url}/v1/adapters", data={"name": name}, files=files,
                          headers={"Authorization": f"Bearer {server.keys['owner']}"},
                          timeout=120)
    assert response.status_code == status, response.text
    data: dict[str, Any] = response.json()
    return data


def _listed(server: Any, name: str) -> list[dict[str, Any]]:
    own = server.get("/v1/adapters", server.keys["owner"]).json()["data"]
    admin = server.get("/admin/api/adapters?tenant=owner").json()["data"]
    assert [a["effect"] for a in own if a["name"] == name] == \
        [a["effect"] for a in admin if a["name"] == name]
    return [a for a in own if a["name"] == name]


def _scaled(source: Path, out: Path, factor: float) -> Path:
    """A copy of the adapter with every lora_B times ``factor``."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(source, out))
    tensors = load_file(str(folder / FILES[1]))
    save_file({k: v * factor if ".lora_B." in k else v for k, v in tensors.items()},
              str(folder / FILES[1]), metadata={"format": "pt"})
    return folder


def test_a_real_adapter_shows_a_non_zero_effect(server: Any,
                                                 llama_adapters: dict[str, Path]) -> None:
    row = _upload(server, "real", llama_adapters["r4"])
    effect = row["effect"]
    assert effect is not None and row["effect_pending"] is False and row["warnings"] == []
    assert effect["kl"] > 1e-3 and effect["prompts"] == len(PROMPTS)
    assert 0.0 <= effect["changed"] <= 1.0 and effect["measured_at"]
    (listed,) = _listed(server, "real")
    assert listed["effect"] == effect
    shown = server.get("/v1/adapters/real", server.keys["owner"]).json()["versions"]
    assert shown[0]["effect"] == effect
    # served as before
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.keys["owner"],
                       max_retries=0) as client:
        assert client.completions.create(model="real", prompt="hello", max_tokens=2,
                                         temperature=0).choices[0].text is not None


def test_an_adapter_that_changes_almost_nothing_is_a_warning(
        server: Any, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """lora_B scaled by 1e-4 passes admission (its update is well above float32's
    resolution) but its measured effect is indistinguishable from zero: stored, with a
    warning in the answer."""
    row = _upload(server, "faint", _scaled(llama_adapters["r4"], tmp_path / "faint", 1e-4))
    assert row["status"] == "active"
    assert row["effect"] is not None and row["effect"]["kl"] < MIN_EFFECT_KL
    (warning,) = row["warnings"]
    assert "indistinguishable from zero" in warning
    assert _listed(server, "faint")[0]["effect"] == row["effect"]


class _Refusing:
    """The server's backend, but its first ``times`` generations (every one: None) are
    refused with ``error``."""

    def __init__(self, inner: Any, error: Exception, times: int | None = None) -> None:
        self.inner = inner
        self.error = error
        self.left = times

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        if self.left is None or self.left > 0:
            if self.left is not None:
                self.left -= 1
            raise self.error
        async for delta in self.inner.generate(*args, **kwargs):
            yield delta


def test_a_probe_waits_for_room_in_a_full_engine(server: Any,
                                                 llama_adapters: dict[str, Path]) -> None:
    """Overloaded answers (a full engine, or a gateway's queue for busy Ray replicas) make
    the probe wait and ask again, not fail."""
    probes = _probes(server)
    real = probes.backend
    refusing = _Refusing(real, EngineOverloadedError("the engine is full"), times=6)
    probes.backend = refusing  # type: ignore[assignment]
    try:
        row = _upload(server, "crowded", llama_adapters["r8qv"])
    finally:
        probes.backend = real
    assert refusing.left == 0
    if row["effect"] is None:  # past the answer's wait: stored when it ends
        assert row["effect_pending"] is True
        deadline = time.monotonic() + 120
        while _listed(server, "crowded")[0]["effect"] is None:
            assert time.monotonic() < deadline, "the probe never ended"
            time.sleep(0.2)
        row["effect"] = _listed(server, "crowded")[0]["effect"]
    assert row["effect"]["kl"] > 0


def test_a_failed_probe_never_loses_the_upload(server: Any, llama_adapters: dict[str, Path],
                                               caplog: pytest.LogCaptureFixture) -> None:
    probes = _probes(server)
    real = probes.backend
    probes.backend = _Refusing(real, AdapterError("the weights cannot be read"))  # type: ignore[assignment]
    try:
        row = _upload(server, "refused", llama_adapters["r8qv"])
    finally:
        probes.backend = real
    assert row["status"] == "active" and row["version"] == 1
    assert row["effect"] is None and row["effect_pending"] is False and row["warnings"] == []
    assert "the effect probe of adapter version" in caplog.text
    assert "the weights cannot be read" in caplog.text
    (listed,) = _listed(server, "refused")
    assert listed["effect"] is None and listed["status"] == "active"
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.keys["owner"],
                       max_retries=0) as client:
        client.completions.create(model="refused", prompt="hello", max_tokens=2,
                                  temperature=0)


def test_a_probe_past_the_wait_is_stored_when_it_ends(
        server: Any, llama_adapters: dict[str, Path]) -> None:
    probes = _probes(server)
    probes.wait_s = 0.0
    try:
        row = _upload(server, "later", llama_adapters["r16rs"])
    finally:
        probes.wait_s = 60.0
    assert row["effect"] is None and row["effect_pending"] is True and row["warnings"] == []
    deadline = time.monotonic() + 60
    while server.get("/v1/adapters/later", server.keys["owner"]).json()["versions"][0][
            "effect"] is None:
        assert time.monotonic() < deadline, "the probe's effect was never stored"
        time.sleep(0.05)
    effect = _listed(server, "later")[0]["effect"]
    assert effect["kl"] > 1e-3


class _Recording:
    """The real backend, recording the share of every generation."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.shares: list[Share] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, *args: Any, share: Share, **kwargs: Any) -> Any:
        self.shares.append(share)
        return self.inner.generate(*args, share=share, **kwargs)


def _ttft_steps(server: Any, tenant: str) -> tuple[float, float]:
    """(requests, of which first token within 2 steps) of the tenant, from /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {server.admin_key}"}).text
    return ttft_steps_within(text, tenant, 2)


async def _beside(server: Any, folder: Path) -> tuple[dict[str, Any], str | None, int]:
    """Another tenant streams a long completion; while an upload's probe runs, a third
    sends one short request after another. Returns (the upload's answer, the stream's
    finish reason, the short requests sent)."""
    busy = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.keys["busy"],
                              max_retries=0, timeout=120)
    quiet = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.keys["quiet"],
                               max_retries=0, timeout=120)
    stream = await busy.completions.create(model=SERVED, prompt="a long story", stream=True,
                                           max_tokens=300, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    chunks = stream.__aiter__()
    await chunks.__anext__()  # its first token came: it runs

    async def drain() -> str | None:
        finish = None
        async for chunk in chunks:
            finish = chunk.choices[0].finish_reason or finish
        return finish

    rest = asyncio.create_task(drain())
    upload = asyncio.create_task(asyncio.to_thread(_upload, server, "beside", folder))
    num_sent = 0
    while not upload.done():
        await quiet.completions.create(model=SERVED, prompt=f"hi {num_sent}", max_tokens=2,
                                       temperature=0.0)
        num_sent += 1
    row = await upload
    finish = await rest
    await busy.close()
    await quiet.close()
    return row, finish, num_sent


def test_the_probe_never_delays_another_tenants_request_beyond_one_step(
        server: Any, llama_adapters: dict[str, Path]) -> None:
    """The probe's requests run as a tenant of their own in the batch class; beside a
    stream that keeps running and another tenant's requests, each of those gets its first
    token within two steps of its arrival (one when admitted in the very next step) — the
    engine's own step counts, from /metrics."""
    probes = _probes(server)
    recording = _Recording(probes.backend)
    probes.backend = recording  # type: ignore[assignment]
    try:
        row, finish, num_sent = asyncio.run(_beside(server, llama_adapters["r8mlp"]))
    finally:
        probes.backend = recording.inner
    assert row["effect"] is not None and row["effect"]["kl"] > 0
    assert recording.shares == [PROBE_SHARE] * (2 * len(PROMPTS))
    assert num_sent >= 1 and finish == "length"
    count, within = _ttft_steps(server, "quiet")
    assert count == num_sent and within == count
