"""The embedded default never needs Ray: importing loraplex and serving a request in
process import no module of ``ray``, even where the ``ray`` extra is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SERVE_ONE_REQUEST = r"""
import asyncio, sys
import httpx
from loraplex.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                             RegistryConfig, SchedulerConfig, ServerConfig)
from loraplex.engine.client import EngineClient
from loraplex.gateway.app import create_app
from loraplex.registry import db
from loraplex.testing import bootstrap_admin
import loraplex.cli, loraplex.cli_serve, loraplex.cli_registry, loraplex.llm

model, root = sys.argv[1], sys.argv[2]
url = f"sqlite:///{root}/registry.db"
key = bootstrap_admin(url)
client = EngineClient.from_config(EngineConfig(
    ModelConfig(model), CacheConfig(block_size=16, num_kv_blocks=32),
    LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1),
    SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)))
app = create_app(ServerConfig(served_model_name="tiny"), RegistryConfig(url, f"{root}/store"),
                 client)

async def main():
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            r = await http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
            assert r.status_code == 200, r.text

asyncio.run(main())
loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
print("RAY MODULES:", loaded)
"""


def test_serving_in_process_imports_no_ray(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", SERVE_ONE_REQUEST, str(tiny_llama_dir),
                             str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RAY MODULES: []" in result.stdout
