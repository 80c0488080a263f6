"""The package's layers, read from its own imports (ast): every import counts, those inside functions and
under ``TYPE_CHECKING`` too, since each is a dependency of the design even when it is not one at import time.

A module may import its own layer or the ones below it, never one above, and the graph has no circle. A
*back-reference*, an import under ``TYPE_CHECKING`` of the module that imports this one at run time (the
owner that makes its objects), would close a circle that only a type checker sees; there are none: a handle
names its owner by a Protocol of its own layer or below (ContextOwner for the Model that makes a Context),
which the owner's class matches. The graph the checks read leaves back-references out, so that one shows
as itself (test_there_are_no_back_references) rather than as a circle."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from layers import LAYERS, WORKER_MAY_IMPORT

PACKAGE = Path(__file__).resolve().parents[2] / "lloyal_pool"


@dataclass
class Imports:
    """A module's imports of the package's modules: those that run (at import time or in a function), and
    those only a type checker reads."""

    running: set[str] = field(default_factory=set)
    typing: set[str] = field(default_factory=set)


def module_names(package: Path) -> dict[str, Path]:
    """Every module of the package by its name relative to the package ("" for the package itself)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, here: list[str], known: set[str]) -> set[str]:
    found: set[str] = set()
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module and (node.module == "lloyal_pool" or node.module.startswith("lloyal_pool.")):
            target = node.module.removeprefix("lloyal_pool").lstrip(".")
        else:
            return found
        for alias in node.names:
            sub = f"{target}.{alias.name}" if target else alias.name
            found.add(sub if sub in known else target)
    else:
        for alias in node.names:
            if alias.name == "lloyal_pool" or alias.name.startswith("lloyal_pool."):
                found.add(alias.name.removeprefix("lloyal_pool").lstrip("."))
    return found


def imports_of(name: str, path: Path, known: Iterable[str]) -> Imports:
    """The package's modules that ``name`` imports anywhere in its source. ``from . import x`` names the
    module x, not the package that holds it."""
    known = set(known)
    here = name.split(".") if name else []
    if path.name != "__init__.py":
        here = here[:-1]
    out = Imports()

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (out.typing if typing_only else out.running).update(_targets(node, here, known))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only or (isinstance(node, ast.If) and _type_checking(node) and child in node.body))

    visit(ast.parse(path.read_text(), str(path)), False)
    for found in (out.running, out.typing):
        found.discard(name)
        found &= known
    out.typing -= out.running
    return out


def graph(package: Path) -> dict[str, set[str]]:
    """Each module's imports, back-references left out."""
    names = module_names(package)
    imports = {name: imports_of(name, path, names) for name, path in names.items()}
    return {name: i.running | {t for t in i.typing if name not in imports[t].running} for name, i in imports.items()}


def back_references(package: Path) -> set[tuple[str, str]]:
    names = module_names(package)
    imports = {name: imports_of(name, path, names) for name, path in names.items()}
    return {(name, t) for name, i in imports.items() for t in i.typing if name in imports[t].running}


def rank(layers: list[tuple[str, set[str]]]) -> dict[str, tuple[int, str]]:
    return {module: (i, layer) for i, (layer, modules) in enumerate(layers) for module in modules}


def upward(edges: Mapping[str, set[str]], layers: list[tuple[str, set[str]]]) -> set[tuple[str, str]]:
    """The imports that reach above their own layer, and the worker's imports outside what it may load."""
    where = rank(layers)
    bad = set()
    for source, targets in edges.items():
        for target in targets:
            (low, _), (high, layer) = where[source], where[target]
            if high > low or (where[source][1] == "worker" and layer not in WORKER_MAY_IMPORT):
                bad.add((source, target))
    return bad


def circle(edges: Mapping[str, set[str]]) -> list[str]:
    """A circle of imports, as the modules along it (the first again at the end), or [] when there is none."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def test_every_module_has_a_layer() -> None:
    placed = set().union(*(modules for _, modules in LAYERS))
    names = set(module_names(PACKAGE))
    assert names - placed == set(), "modules with no layer in LAYERS"
    assert placed - names == set(), "LAYERS names modules that do not exist"


def test_no_module_imports_upward() -> None:
    assert upward(graph(PACKAGE), LAYERS) == set()


def test_the_import_graph_has_no_circle() -> None:
    assert circle(graph(PACKAGE)) == []


def test_there_are_no_back_references() -> None:
    # What the other two checks leave out, and none: a handle that needs its owner's type names a Protocol
    # (lloyal_pool/_owners.py, or one in its own module), never the owner's module.
    assert back_references(PACKAGE) == set()


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for relative, source in files.items():
        path = tmp_path / "lloyal_pool" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return graph(tmp_path / "lloyal_pool")


def test_the_checks_find_a_planted_upward_import_and_circle(tmp_path: Path) -> None:
    # An upward import inside a function and the circle it closes, an upward one under TYPE_CHECKING, and
    # a back-reference (shm names protocol, which imports it), which counts as neither.
    edges = _plant(tmp_path, {
        "__init__.py": "",
        "errors.py": "def f():\n    from .client import Pool\n",
        "client.py": "from lloyal_pool import errors\n",
        "worker/__init__.py": "",
        "worker/engine.py": "from .. import protocol, client\n",
        "protocol.py": "import typing\nfrom . import shm\nif typing.TYPE_CHECKING:\n    from .client import Pool\n",
        "shm.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .protocol import Request\n",
    })
    assert edges["errors"] == {"client"}
    assert edges["client"] == {"errors"}
    assert edges["worker.engine"] == {"protocol", "client"}
    assert edges["protocol"] == {"shm", "client"}
    assert edges["shm"] == set()
    assert back_references(tmp_path / "lloyal_pool") == {("shm", "protocol")}
    layers = [("wire", {"errors", "protocol", "shm"}), ("worker", {"worker", "worker.engine"}),
              ("handles", {"client"}), ("fronts", {""})]
    assert upward(edges, layers) == {("errors", "client"), ("worker.engine", "client"), ("protocol", "client")}
    assert sorted(circle(edges)[:-1]) == ["client", "errors"]


def test_importing_the_package_loads_no_module_until_a_name_is_used() -> None:
    # What a worker pays for `python -m lloyal_pool.worker`: the package's __init__ and nothing else.
    code = ("import sys, lloyal_pool; print(sorted(m for m in sys.modules if m.startswith('lloyal_pool')));"
            "lloyal_pool.Pool; print('lloyal_pool.pool' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.splitlines()
    assert out == ["['lloyal_pool']", "True"]


def test_each_public_name_is_the_object_its_module_defines() -> None:
    import importlib

    import lloyal_pool

    where = {**lloyal_pool._WHERE, "metrics": None}
    assert sorted(where) == sorted(lloyal_pool.__all__) == sorted(dir(lloyal_pool))
    for name, module in where.items():
        defined = importlib.import_module(f"lloyal_pool.{module or name}")
        assert getattr(lloyal_pool, name) is (defined if module is None else getattr(defined, name)), name
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        lloyal_pool.Nothing  # noqa: B018
