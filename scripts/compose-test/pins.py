"""Whether an environment installs what the tests run with: its `pip list --format=freeze`
(on standard input) against constraints.txt.

    podman run --rm IMAGE pip list --format=freeze | python pins.py constraints.txt

Every installed distribution must be pinned in constraints.txt at the version installed
(a local label such as torch's +cpu aside); pip, setuptools and wheel (the build tools)
and loraplex itself are left out. Prints one line: how many matched, or each mismatch and
each package the constraints do not name; exit status 1 on any. ``drift`` is the rule
itself; tests/test_install.py applies it to the suite's own environment.
"""

from __future__ import annotations

import re
import sys

BUILD_TOOLS = {"pip", "setuptools", "wheel", "loraplex"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: list[str]) -> dict[str, str]:
    """name -> version of every ``name==version`` line (comments and blanks skipped)."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        name, sep, version = line.partition("==")
        if sep:
            found[normalize(name)] = version.strip().split("+", 1)[0]
    return found


def drift(installed: dict[str, str], wanted: dict[str, str]) -> list[str]:
    """Each installed package (name -> version; the build tools and loraplex aside) that
    ``wanted`` (``pins`` of constraints.txt) does not pin at its version, one line each."""
    found = {normalize(name): version.split("+", 1)[0] for name, version in installed.items()}
    found = {name: version for name, version in found.items() if name not in BUILD_TOOLS}
    return ([f"{name} {version} (constraints: {wanted[name]})"
             for name, version in sorted(found.items())
             if name in wanted and wanted[name] != version]
            + [f"{name} {version} (not in constraints)"
               for name, version in sorted(found.items()) if name not in wanted])


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        wanted = pins(f.read().splitlines())
    installed = pins(sys.stdin.read().splitlines())
    counted = [name for name in installed if name not in BUILD_TOOLS]
    if not counted:
        print("no packages read from pip list")
        return 1
    problems = drift(installed, wanted)
    if problems:
        print("; ".join(problems))
        return 1
    print(f"all {len(counted)} installed packages at their constraints.txt versions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
