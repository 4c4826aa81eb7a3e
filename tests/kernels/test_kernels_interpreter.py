"""Runs ``interp_cases.py`` under ``TRITON_INTERPRET=1`` in a child pytest.

The interpreter switch is read when a kernel is defined, and setting it in this process
would turn every Triton kernel of every test directory into interpreted code; a child
process keeps it to these cases.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("interp_cases.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group", ["shrink", "expand", "store_kv", "attention"])
def test_triton_interpreter(group: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-k", group,
         "-p", "no:cacheprovider", "--rootdir", str(ROOT)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
    )
    report = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1]
    # A child that skipped or deselected everything would also exit 0.
    assert re.search(r"\d+ passed", summary), report
    assert "skipped" not in summary and "error" not in summary, report
