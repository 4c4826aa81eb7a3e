"""`loraplex generate` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from loraplex import LLM, LoRARequest, SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_generate_prints_the_completion(tiny_llama_dir: Path,
                                        llama_adapters: dict[str, Path]) -> None:
    adapter = llama_adapters["r4"]
    proc = _cli("generate", "--model", str(tiny_llama_dir), "--prompt", "hello world",
                "--adapter", str(adapter), "--max-tokens", "6", "--num-kv-blocks", "16")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, progress=False)
    expected = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=6),
                            LoRARequest("r4", str(adapter)))[0].outputs[0].text
    assert proc.stdout == expected + "\n"
    assert "loading" in proc.stderr  # model loading shows progress


def test_generate_refuses_a_bad_adapter_in_one_line(tiny_llama_dir: Path,
                                                    llama_adapters: dict[str, Path],
                                                    tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["r4"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["r"] = 128
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    proc = _cli("generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--adapter",
                str(bad), "--max-lora-rank", "64", "--num-kv-blocks", "16")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loraplex: error:") and "128" in last and "64" in last
    assert "Traceback" not in proc.stderr


def test_generate_refuses_a_missing_model(tmp_path: Path) -> None:
    proc = _cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "config.json" in proc.stderr and "Traceback" not in proc.stderr
