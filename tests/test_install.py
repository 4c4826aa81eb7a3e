"""The install the suite runs on is the pinned one: constraints.txt, pyproject and scripts/test.

A new user's fresh virtualenv must get the same packages CI got. These tests fail when the
running environment drifts from constraints.txt (a tool installed unpinned), when a
dependency of pyproject.toml has no pin, or when an extra that could pull another torch is a
range.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sysconfig
import tomllib
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in CONSTRAINTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert match, f"constraints.txt: not an exact pin: {raw!r}"
        pins[canonicalize_name(match[1])] = match[2]
    return pins


def _pins_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pins", ROOT / "scripts/compose-test/pins.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_installed_package_matches_its_pin() -> None:
    # What pip installed into this environment's site-packages, not whatever sys.path
    # shows now: `import ray` (a test may have done it) adds Ray's vendored copies
    # (ray/thirdparty_files: colorama, psutil), which are Ray's files, not installs.
    site = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    installed = {dist.metadata["Name"]: dist.version
                 for dist in importlib.metadata.distributions(path=sorted(site))}
    # The compose test's rule for its images (scripts/compose-test/pins.py), applied here.
    drift = _pins_script().drift(installed, _pins())
    assert drift == []


def test_every_declared_dependency_is_pinned() -> None:
    project = _pyproject()["project"]
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared.extend(extra)
    pins = _pins()
    missing = [spec for spec in declared
               if canonicalize_name(Requirement(spec).name) not in pins]
    assert missing == []
    for spec in declared:
        requirement = Requirement(spec)
        if canonicalize_name(requirement.name) in pins:
            assert requirement.specifier.contains(pins[canonicalize_name(requirement.name)],
                                                  prereleases=True), spec


def test_torch_and_the_ray_extra_are_exact_pins() -> None:
    # A range in either would let pip replace the CPU build with a multi-GB CUDA download.
    project = _pyproject()["project"]
    torch = [Requirement(s) for s in project["dependencies"] if s.startswith("torch")]
    assert [str(r.specifier) for r in torch] == ["==2.13.0"]
    ray = [Requirement(s) for s in project["optional-dependencies"]["ray"]]
    assert [(r.name, str(r.specifier)) for r in ray] == [("ray", "==2.60.0")]


def test_the_readme_test_command_installs_with_the_constraints() -> None:
    script = (ROOT / "scripts" / "test").read_text()
    assert "-c constraints.txt" in script
    assert "./scripts/test" in (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "./scripts/test" in ci
    result = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "test")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
