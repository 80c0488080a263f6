"""Every public name is documented, and the API reference (scripts/docs: pdoc) builds from the docstrings.

Public: the names in ``lloyal_pool.__all__`` and what the reference pages of the public modules show (the
package, client, branches, params, errors, metrics), with the public methods and properties of every class.
"""

from __future__ import annotations

import ast
import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, TypeVar

import lloyal_pool

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_MODULES = ("lloyal_pool", "lloyal_pool.client", "lloyal_pool.branches", "lloyal_pool.params",
                  "lloyal_pool.errors", "lloyal_pool.metrics", "lloyal_pool.chat", "lloyal_pool.session",
                  "lloyal_pool.snapshot", "lloyal_pool.batching", "lloyal_pool.serve", "lloyal_pool.ray")


def _has_doc(obj: object) -> bool:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return isinstance(doc, str) and bool(doc.strip())


def _documented_variables(module: types.ModuleType) -> set[str]:
    """Module-level names with a docstring as pdoc reads one: a string right after the assignment, or a
    ``#:`` comment right above it."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return set()
    lines = source.splitlines()
    body = ast.parse(source).body
    out: set[str] = set()
    for i, node in enumerate(body):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        doc_after = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                     and isinstance(after.value.value, str))
        doc_above = node.lineno >= 2 and lines[node.lineno - 2].lstrip().startswith("#:")
        if doc_after or doc_above:
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _public_names(module: types.ModuleType) -> list[str]:
    """``__all__``, or else what the module defines: its classes and functions, and its variables (not
    type variables)."""
    declared = getattr(module, "__all__", None)
    if declared is not None:
        return list(declared)
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or isinstance(obj, (types.ModuleType, TypeVar)):
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if obj.__module__ == module.__name__:
                names.append(name)
        elif name in _assigned(module):
            names.append(name)
    return names


def _assigned(module: types.ModuleType) -> set[str]:
    try:
        body = ast.parse(inspect.getsource(module)).body
    except (OSError, TypeError):
        return set()
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def _member_function(member: object) -> Any:
    """The function behind a class member that the reference documents (method, property, class or static
    method), or None for anything else (fields, enum members, constants)."""
    if isinstance(member, property):
        return member.fget
    if isinstance(member, (classmethod, staticmethod)):
        return member.__func__
    if inspect.isfunction(member):
        return member
    return None


def missing_docstrings(modules: list[types.ModuleType]) -> list[str]:
    """Every public name of these modules without a docstring, as module.name or module.Class.member."""
    missing: set[str] = set()
    for module in modules:
        if not _has_doc(module):
            missing.add(module.__name__)
        variable_docs = _documented_variables(module)
        module_doc = module.__doc__ or ""
        for name in _public_names(module):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                continue  # documented as a module of its own
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                # A type alias or constant: documented where it is assigned, or in the module's docstring.
                if name not in variable_docs and f"``{name}``" not in module_doc:
                    missing.add(f"{module.__name__}.{name}")
                continue
            where = f"{obj.__module__}.{obj.__qualname__}"
            if not _has_doc(obj):
                missing.add(where)
            if inspect.isclass(obj):
                for member_name, member in vars(obj).items():
                    fn = _member_function(member)
                    if not member_name.startswith("_") and fn is not None and not _has_doc(fn):
                        missing.add(f"{where}.{member_name}")
    return sorted(missing)


def _public_modules() -> list[types.ModuleType]:
    modules = [importlib.import_module(name) for name in PUBLIC_MODULES]
    # ... and any module the package exports (its __all__ names metrics).
    exported = [getattr(lloyal_pool, name) for name in lloyal_pool.__all__]
    modules += [obj for obj in exported if isinstance(obj, types.ModuleType)]
    return modules


def test_every_public_name_has_a_docstring() -> None:
    missing = missing_docstrings(_public_modules())
    assert not missing, f"{len(missing)} public names have no docstring:\n" + "\n".join(missing)


def test_the_check_finds_what_is_missing(tmp_path: Path) -> None:
    # The check itself, on a module that lacks docstrings in each place it looks.
    (tmp_path / "fake_public.py").write_text(textwrap.dedent('''
        """A module."""
        from typing import Callable

        Alias = Callable[[int], None]
        Described = Callable[[int], None]
        """A documented alias."""
        #: A documented constant.
        LIMIT = 3


        class Documented:
            """A class."""

            def method(self) -> None:
                """A method."""


        class Bare:
            def method(self) -> None: ...

            @property
            def prop(self) -> int:
                return 0

            @classmethod
            def make(cls) -> "Bare":
                return cls()

            def _private(self) -> None: ...


        def function() -> None: ...
    '''))
    spec = importlib.util.spec_from_file_location("fake_public", tmp_path / "fake_public.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert missing_docstrings([module]) == ["fake_public.Alias", "fake_public.Bare", "fake_public.Bare.make",
                                            "fake_public.Bare.method", "fake_public.Bare.prop",
                                            "fake_public.function"]


def _text(page: str) -> str:
    """A page's text, tags dropped and whitespace collapsed."""
    page = re.sub(r"<(script|style)\b.*?</\1>", "", page, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())


def test_the_api_reference_builds_from_the_docstrings(tmp_path: Path) -> None:
    out = tmp_path / "api"
    env = {**os.environ, "LLOYAL_DOCS_PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "docs"), str(out)], capture_output=True, text=True,
                         env=env, timeout=300)
    # The script fails if building the reference imported any lloyal_pool.worker module (llama.cpp's side).
    assert run.returncode == 0, run.stdout + run.stderr
    pages = sorted(str(p.relative_to(out)) for p in out.rglob("*.html"))
    assert pages == ["index.html", "lloyal_pool.html", "lloyal_pool/batching.html", "lloyal_pool/branches.html",
                     "lloyal_pool/chat.html", "lloyal_pool/client.html", "lloyal_pool/errors.html",
                     "lloyal_pool/metrics.html", "lloyal_pool/params.html", "lloyal_pool/ray.html",
                     "lloyal_pool/serve.html", "lloyal_pool/session.html", "lloyal_pool/snapshot.html"]
    package = (out / "lloyal_pool.html").read_text()
    client = (out / "lloyal_pool" / "client.html").read_text()
    errors = (out / "lloyal_pool" / "errors.html").read_text()
    for anchor in ("Context.generate", "Stream.result", "StaleHandleError", "Pool", "KV.keep", "PromptProgress"):
        assert f'id="{anchor}"' in package, anchor
    assert 'id="Context.generate"' in client and 'id="Stream.result"' in client
    assert 'id="StaleHandleError"' in errors
    # The docstrings themselves are on the pages, not only the names.
    assert "Blocks until the generation ends" in _text(client)
    assert "whose worker died" in _text(errors)
    assert "progress(done, total)" in _text(package)
