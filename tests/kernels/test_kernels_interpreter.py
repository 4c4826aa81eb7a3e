"""Runs ``interp_cases.py`` under ``TRITON_INTERPRET=1`` in one child pytest.

The interpreter switch is read when a kernel is defined, and setting it in this process
would turn every Triton kernel of every test directory into interpreted code; a child
process keeps it to these cases. The child runs once (its start-up dominates) and each
test here reports one group of its cases from the child's JUnit XML.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("interp_cases.py")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ChildRun:
    returncode: int
    output: str
    cases: dict[str, str]  # test name -> "passed" | "failed" | "error" | "skipped"


@pytest.fixture(scope="module")
def child_run(tmp_path_factory: pytest.TempPathFactory) -> ChildRun:
    report = tmp_path_factory.mktemp("interpreter") / "junit.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        # confcutdir: the shared tests/conftest.py builds models these cases never use.
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider",
         "--rootdir", str(ROOT), "--confcutdir", str(CASES.parent), "--junitxml", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
    )
    output = proc.stdout[-12000:] + proc.stderr[-4000:]
    cases: dict[str, str] = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
            cases[case.attrib["name"]] = outcome
    return ChildRun(proc.returncode, output, cases)


@pytest.mark.parametrize("prefix", ["test_shrink", "test_expand", "test_sgmv_random",
                                    "test_store_kv", "test_attention"])
def test_triton_interpreter(child_run: ChildRun, prefix: str) -> None:
    group = {n: o for n, o in child_run.cases.items() if n.startswith(prefix)}
    # An empty group means the child crashed, skipped, or lost these cases.
    assert group, f"no {prefix}* cases ran in the child\n{child_run.output}"
    bad = {n: o for n, o in group.items() if o != "passed"}
    assert not bad, f"{bad}\n{child_run.output}"


def test_triton_interpreter_child_exit(child_run: ChildRun) -> None:
    assert child_run.returncode == 0, child_run.output
