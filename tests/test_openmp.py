"""The OpenMP wait policy loraplex gives torch's libgomp, read back from the runtime itself.

``OMP_DISPLAY_ENV=VERBOSE`` makes libgomp print the values it took when torch loaded it, so
these tests see what the runtime got, not what a variable says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from loraplex.openmp import WAIT_VARIABLES, apply_defaults


def _runtime_wait(code: str, **env: str) -> tuple[str, str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    policy = re.search(r"OMP_WAIT_POLICY = '(\w+)'", result.stderr)
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr)
    assert policy and spin, result.stderr
    return policy[1], spin[1], result.stderr


@pytest.mark.parametrize("code", [
    "import loraplex.llm",            # the offline API
    "import loraplex.engine.client",  # the server's engine thread
    "import loraplex, torch",         # torch imported by the user after loraplex
])
def test_idle_openmp_threads_sleep_instead_of_spinning(code: str) -> None:
    # libgomp's own default spins 300,000 times: under load that starved the caller.
    assert _runtime_wait(code)[:2] == ("PASSIVE", "1000")


@pytest.mark.parametrize(("env", "expected"), [
    ({"OMP_WAIT_POLICY": "ACTIVE"}, ("ACTIVE", "30000000000")),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, ("PASSIVE", "0")),
    ({"GOMP_SPINCOUNT": "50"}, ("PASSIVE", "50")),
])
def test_a_wait_the_user_chose_is_kept(env: dict[str, str], expected: tuple[str, str]) -> None:
    assert _runtime_wait("import loraplex.llm", **env)[:2] == expected


def test_torch_loaded_first_is_reported() -> None:
    policy, spin, stderr = _runtime_wait("import torch, loraplex")
    assert spin == "300000"  # too late for libgomp: the runtime kept its spin
    assert "torch was imported before loraplex" in stderr


def test_apply_defaults_leaves_a_chosen_wait_alone() -> None:
    chosen = {"GOMP_SPINCOUNT": "10"}
    assert apply_defaults(chosen, loaded=()) is False and chosen == {"GOMP_SPINCOUNT": "10"}
    fresh: dict[str, str] = {}
    assert apply_defaults(fresh, loaded=()) is True
    assert fresh == {"GOMP_SPINCOUNT": "1000"}
