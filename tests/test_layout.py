"""The package's shape, checked on the source: which module may import which, and that the
``kernels/`` folder is the ``loraplex_kernels`` package its README describes.

Parsed with ``ast`` (nothing is imported), so lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loraplex"
ROUTES = PACKAGE / "gateway" / "routes"
KERNELS = ROOT / "kernels"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, absolute, including ``from package import module``."""
    package = _module_name(path).rpartition(".")[0] if path.name != "__init__.py" \
        else _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_no_route_module_imports_a_sibling() -> None:
    routes = {_module_name(p) for p in _sources(ROUTES)} - {"loraplex.gateway.routes"}
    assert routes, "no route modules found"
    for path in _sources(ROUTES):
        siblings = set(_imports(path)) & (routes - {_module_name(path)})
        assert not siblings, f"{path.name} imports route module(s) {sorted(siblings)}"


def test_cli_modules_have_no_import_cycle() -> None:
    cli = {_module_name(p): p for p in PACKAGE.glob("cli*.py")}
    graph = {name: set(_imports(path)) & set(cli) for name, path in cli.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cyclic = sorted(name for name in graph if reaches(name, name, {name}))
    assert not cyclic, f"import cycle through {cyclic}: {graph}"


def _attribute_names(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr


def test_the_gateway_never_reaches_into_the_engine_object() -> None:
    """Only the EngineBackend protocol: no ``x.engine`` attribute in the gateway at all (its
    backend is ``gw.backend``), and none of the engine's internals imported."""
    allowed = {"loraplex.engine.backend", "loraplex.engine.outputs", "loraplex.engine.request",
               "loraplex.engine.sampling_params", "loraplex.engine.stats",
               "loraplex.engine.share",
               # The request fields' table (plain data), which SamplingParams reads too.
               "loraplex.engine.request_fields",
               # Pure compile checks (no engine state): a tool's parameters schema is checked
               # where the request is parsed, by the grammar engine that will enforce it.
               "loraplex.engine.grammar"}
    for path in _sources(PACKAGE / "gateway"):
        reached = [line for line, name in _attribute_names(path) if name == "engine"]
        assert not reached, f"{path.relative_to(PACKAGE)} uses .engine at lines {reached}"
        engine_modules = {m for m in _imports(path) if m.startswith("loraplex.engine.")
                          and m.count(".") == 2}
        assert engine_modules <= allowed, (path.name, sorted(engine_modules - allowed))


@pytest.mark.parametrize(("package", "forbidden"), [
    ("engine", ("loraplex.gateway", "loraplex.registry")),
    ("registry", ("loraplex.gateway", "loraplex.engine")),
])
def test_imports_run_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    for path in _sources(PACKAGE / package):
        bad = sorted(m for m in _imports(path) if m.startswith(forbidden))
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_the_kernels_folder_is_the_loraplex_kernels_package() -> None:
    """``kernels/`` installs as ``loraplex_kernels`` (PyPI has a ``kernels``): the mapping in
    pyproject.toml, the import resolving to this checkout's folder (found, not executed),
    and a line in kernels/README.md for every module, so a new one must be described."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["loraplex_kernels"] == "kernels"
    assert "loraplex_kernels" in setuptools["packages"]
    spec = importlib.util.find_spec("loraplex_kernels")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == KERNELS / "__init__.py", spec.origin
    readme = (KERNELS / "README.md").read_text()
    assert "loraplex_kernels" in readme
    modules = sorted(p.name for p in KERNELS.glob("*.py"))
    assert "ops.py" in modules
    undescribed = [name for name in modules if f"`{name}`" not in readme]
    assert not undescribed, f"kernels/README.md does not describe {undescribed}"


def test_the_package_imports_form_no_circle() -> None:
    """No module reaches itself through imports, type-only ones included: a circle means
    two modules that can only be read (and changed) together."""
    modules = {_module_name(p): p for p in _sources(PACKAGE)}
    graph = {name: set(_imports(path)) & set(modules) - {name}
             for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(
                path[path.index(name):] + [name]))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
