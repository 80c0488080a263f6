"""docs/SEEDS.md maps every entry point of the seed projects (lloyal.node, go-llama) to the lloyal_pool name
that provides it. A rename or a removal in the package must not leave the map pointing at nothing, so every
name in it is looked up here, in the source and by import (no model, no native module)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT / "docs" / "SEEDS.md"
HEADER = ("Seed entry point", "lloyal_pool", "Notes")
NONE = "—"

# What the mapping covered when it was written: a table that shrinks below this lost rows, which a check of
# the names alone would never notice.
MIN_ROWS = {"lloyal.node": 62, "go-llama": 86}

_KWARG = re.compile(r"(lloyal_pool(?:\.\w+)*)\((\w+)=\)")
_DOTTED = re.compile(r"lloyal_pool(?:\.\w+)*")
_ENV = re.compile(r"\$([A-Z][A-Z0-9_]*)")
_EXAMPLE = re.compile(r"examples/[\w-]+/")
_CLI = re.compile(r"lloyal-pool ([a-z][a-z-]*)")


class Row(NamedTuple):
    seed: str
    entry: str
    names: str
    notes: str


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def seed_rows(text: str) -> list[Row]:
    """The rows of every table headed like the seed tables, each tagged with the ``##`` section it is in."""
    rows: list[Row] = []
    seed = ""
    in_table = False
    for line in text.splitlines():
        if line.startswith("## "):
            seed = line[3:].strip()
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if tuple(cells) == HEADER:
            in_table = True
        elif in_table and not set(line) <= set("|-: "):
            cells += [""] * (3 - len(cells))
            rows.append(Row(seed, cells[0], cells[1], " | ".join(cells[2:]).strip(" |")))
    return rows


def _resolve(dotted: str) -> Any:
    """The object a dotted name stands for: the longest prefix that is a module, then attributes. Raises
    AttributeError or ImportError when there is none."""
    parts = dotted.split(".")
    i = 1
    while i < len(parts):
        try:
            if importlib.util.find_spec(".".join(parts[: i + 1])) is None:
                break
        except ModuleNotFoundError:  # the prefix is a class, not a package
            break
        i += 1
    obj: Any = importlib.import_module(".".join(parts[:i]))
    for attr in parts[i:]:
        owner = obj
        try:
            obj = getattr(owner, attr)
        except AttributeError:
            # A dataclass field without a default is no class attribute, yet it is part of the API.
            if not (dataclasses.is_dataclass(owner) and attr in {f.name for f in dataclasses.fields(owner)}):
                raise
            obj = None
    return obj


def _takes(dotted: str, param: str) -> bool:
    target = _resolve(dotted)
    if dataclasses.is_dataclass(target) and param in {f.name for f in dataclasses.fields(target)}:
        return True
    # msgspec Structs (the parameter and result types) list their fields here.
    if param in getattr(target, "__struct_fields__", ()):
        return True
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    # **overrides would accept any name, which proves nothing about this one.
    return param in parameters and parameters[param].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                 inspect.Parameter.VAR_KEYWORD)


def _sources() -> str:
    files = [*sorted((ROOT / "lloyal_pool").rglob("*.py")), ROOT / "tests" / "conftest.py"]
    return "\n".join(path.read_text() for path in files if path.is_file())


def name_problem(name: str, root: Path = ROOT, sources: str | None = None) -> str | None:
    """Why one backticked name of the lloyal_pool column does not exist, or None when it does."""
    if m := _KWARG.fullmatch(name):
        try:
            return None if _takes(m[1], m[2]) else f"{m[1]} takes no parameter {m[2]!r}"
        except (AttributeError, ImportError) as err:
            return f"{m[1]} does not resolve: {err}"
    if _DOTTED.fullmatch(name):
        try:
            _resolve(name)
        except (AttributeError, ImportError) as err:
            return f"does not resolve: {err}"
        return None
    if m := _ENV.fullmatch(name):
        text = _sources() if sources is None else sources
        return None if re.search(rf"\b{m[1]}\b", text) else "no such environment variable in the sources"
    if _EXAMPLE.fullmatch(name):
        return None if (root / name).is_dir() else "no such example directory"
    if m := _CLI.fullmatch(name):
        cli = (root / "lloyal_pool" / "cli.py").read_text()
        return None if re.search(rf"add_parser\(\s*\"{m[1]}\"", cli) else "no such subcommand in cli.py"
    return "not one of the forms docs/SEEDS.md allows"


def row_problems(row: Row, root: Path = ROOT, sources: str | None = None) -> list[str]:
    where = f"{row.seed}: {row.entry or '(no entry point)'}"
    if not row.entry:
        return [f"{where}: the seed entry point is empty"]
    if row.names == NONE:
        return [] if row.notes else [f"{where}: {NONE} without a reason in Notes"]
    names = re.findall(r"`([^`]+)`", row.names)
    # Text outside the backticks would be a name nobody checks.
    if not names or re.sub(r"`[^`]+`", "", row.names).strip(" ,"):
        return [f"{where}: the lloyal_pool cell is not a list of backticked names: {row.names!r}"]
    return [f"{where}: `{name}` {problem}" for name in names
            if (problem := name_problem(name, root, sources)) is not None]


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return seed_rows(SEEDS.read_text())


def test_every_name_in_the_seed_map_exists(rows: list[Row]) -> None:
    sources = _sources()
    problems = [problem for row in rows for problem in row_problems(row, sources=sources)]
    assert not problems, f"{len(problems)} names in docs/SEEDS.md do not exist:\n" + "\n".join(problems)


def test_the_seed_map_keeps_every_row(rows: list[Row]) -> None:
    counts = {seed: sum(row.seed == seed for row in rows) for seed in MIN_ROWS}
    assert all(counts[seed] >= least for seed, least in MIN_ROWS.items()), counts
    assert {row.seed for row in rows} == set(MIN_ROWS), "a seed table outside the known sections"


PLANTED = """
## planted

| Seed entry point | lloyal_pool | Notes |
|---|---|---|
| `good` | `lloyal_pool.Pool`, `lloyal_pool.Pool(recover=)`, `lloyal_pool.Branch.perplexity` | |
| `kwarg of a struct` | `lloyal_pool.ContextParams(n_seq_max=)`, `lloyal_pool.Result.text` | |
| `good env` | `$LLOYAL_POOL_CPU` | |
| `good example` | `examples/streaming/`, `lloyal-pool serve` | |
| `reasoned` | — | Go-only plumbing |
| `bogus method` | `lloyal_pool.Context.no_such_method` | |
| `bogus module` | `lloyal_pool.no_such_module.thing` | |
| `bogus parameter` | `lloyal_pool.Pool(no_such_option=)` | |
| `only **overrides` | `lloyal_pool.Model.new_context(n_ctx=)` | |
| `bogus env` | `$LLOYAL_POOL_NO_SUCH_VARIABLE` | |
| `prefix of an env` | `$LLOYAL_POOL_VARIANT_STRI` | |
| `bogus example` | `examples/no_such_example/` | |
| `bogus command` | `lloyal-pool no-such-command` | |
| `unreasoned` | — | |
| `empty` | | |
| `unbackticked` | lloyal_pool.Pool | |
| `not a form` | `Pool` | |
"""


def test_the_checker_reports_what_does_not_exist() -> None:
    """The check can fail: a planted table's bogus names are reported, its real ones are not."""
    rows = seed_rows(PLANTED)
    assert len(rows) == 17
    reported = {row.entry.strip("`"): row_problems(row) for row in rows}
    good = {"good", "kwarg of a struct", "good env", "good example", "reasoned"}
    assert {entry for entry, problems in reported.items() if not problems} == good, reported
    assert all(len(reported[entry]) == 1 for entry in set(reported) - good), reported
