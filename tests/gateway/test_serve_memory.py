"""``loraplex serve`` on the demo model holds at most 1.5x the model's own weights beyond
its imports and its KV pool (docs/engine.md, "Memory")."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from servers import clean_env, free_port, serve_command, stop_gracefully, wait_ready

from loraplex.model.demo import prepare_demo_model

pytestmark = pytest.mark.server

NUM_KV_BLOCKS = 64
BLOCK_SIZE = 16
# What `loraplex serve` has imported once it serves, the tokenizer classes the model load
# pulls in lazily included: the baseline the engine's memory is measured from.
IMPORTS = ("import loraplex.cli, loraplex.cli_serve, uvicorn, loraplex.engine.client, "
           "loraplex.gateway.app, loraplex.model.runner, safetensors, tqdm; "
           "from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast")


def vm_rss(status: str) -> int:
    """Resident bytes from the text of a /proc/<pid>/status."""
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def imports_rss() -> int:
    code = f"{IMPORTS}; print(open('/proc/self/status').read())"
    return vm_rss(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                 text=True, check=True).stdout)


def float32_weight_bytes(model_dir: Path) -> int:
    """The checkpoint's weights as the engine holds them (float32; a tied head once)."""
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            total += sum(4 * math.prod(handle.get_slice(k).get_shape())
                         for k in handle.keys())  # noqa: SIM118
    return total


def kv_pool_bytes(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * BLOCK_SIZE * cfg["num_key_value_heads"] * head_dim
    return NUM_KV_BLOCKS * per_block * 4


@pytest.mark.slow
def test_serve_holds_at_most_one_and_a_half_times_the_weights(tmp_path: Path) -> None:
    model_dir = prepare_demo_model(progress=False)
    port = free_port()
    proc = subprocess.Popen(
        serve_command("--model", str(model_dir), "--port", str(port),
                      "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
                      "--log-level", "warning"),
        env=clean_env(tmp_path / "home"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        served = vm_rss(Path(f"/proc/{proc.pid}/status").read_text())
    finally:
        stop_gracefully(proc)
    weights = float32_weight_bytes(model_dir)
    engine = served - imports_rss() - kv_pool_bytes(model_dir)
    mib = 1 << 20
    assert engine <= 1.5 * weights, (
        f"engine {engine / mib:.0f} MiB (RSS {served / mib:.0f} MiB less imports and KV) "
        f"> 1.5 x weights {weights / mib:.0f} MiB")
