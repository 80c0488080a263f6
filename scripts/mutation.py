#!/usr/bin/env python3
"""Sampled mutation testing of the parent-side modules with cosmic-ray (docs/TESTING.md).

Every mutant of a module against the whole suite would take days on a small machine, so this runs a seeded
random sample of each module's mutants against the test subset that exercises it (mutation.toml), and gives
the score with a 95% Wilson interval:

    python scripts/mutation.py map                                   # once per test change: who covers what
    python scripts/mutation.py run shm --seed 1 --sample 60        # resumable: done mutants are kept
    python scripts/mutation.py run shm --seed 1 --only NAME ...      # re-run some (names from `show`)
    python scripts/mutation.py show shm --seed 1 [--all]              # the survivors' diffs
    python scripts/mutation.py equivalent shm --seed 1 NAME "why"    # a survivor no test can kill
    python scripts/mutation.py report [--seed 1]                     # the per-module table

cosmic-ray writes each mutant into the source file itself and puts the original back after its test run.
That is what makes it work with the editable install: its import finder maps lloyal_pool's modules to
these very files (a copy of the package elsewhere on sys.path would be ignored), for the parent and for
the workers alike (`python -I -m lloyal_pool.worker` still reads site-packages' .pth). A mutant of shm.py
therefore runs on both sides of the region, as a change to it would. No environment variable is involved.

Which tests run against a mutant: with a map (``map`` runs the whole suite once under coverage, recording
which test ran each line of the parent's side, and how long each test takes), the tests that ran the
mutated line, files in order of their cost, up to --budget seconds of them; a line no test ran in the
parent (code that runs only in a worker or a subprocess, or nowhere) gets the module's subset from
mutation.toml instead. Without a map, always that subset. The budget only makes kills cheap: a mutant that
survives its budgeted tests is run again against every test that ran its line (unless --no-confirm), so a
survivor is one the whole suite lets live.

Sessions live in .mutation/ (cosmic-ray's sqlite work database, one per module and seed; the mutants not
in the sample are recorded as skipped, so cosmic-ray's own `cr-report`/`cr-html` show the sample too).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = ROOT / ".mutation"
CONFIG = ROOT / "mutation.toml"


def _config() -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import toml as tomllib  # type: ignore[no-redef]  # cosmic-ray's own dependency
    with open(CONFIG, "rb") as f:
        return tomllib.load(f)  # type: ignore[arg-type]


def _modules() -> dict[str, dict[str, Any]]:
    """The samples by module; ``tests = "same as X"`` takes sample X's subset."""
    samples = dict(_config()["sample"])
    for sample in samples.values():
        if isinstance(sample["tests"], str):
            sample["tests"] = samples[sample["tests"].removeprefix("same as ")]["tests"]
    return samples


def _session(module: str, seed: int) -> Path:
    return SESSIONS / f"{module}-seed{seed}.sqlite"


def _name(mutation: Any) -> str:
    """A mutant's stable name: its operator and occurrence (cosmic-ray's job ids are random)."""
    return f"{mutation.operator_name}#{mutation.occurrence}"


MAP = SESSIONS / "map.json"


def cmd_map(args: argparse.Namespace) -> None:
    """Runs the whole suite under coverage with a context per test, and keeps, per mutated module and line,
    the tests that ran it, and each test's duration (setup and teardown included: the first test of a
    module pays for its fixtures)."""
    import subprocess
    import xml.etree.ElementTree as ET

    SESSIONS.mkdir(exist_ok=True)
    data_file, junit = SESSIONS / "coverage.sqlite", SESSIONS / "junit.xml"
    if not args.reuse:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cov=lloyal_pool",
                        "--cov-context=test", "--cov-report=", f"--junitxml={junit}", "tests"],
                       cwd=ROOT, env={**__import__("os").environ, "COVERAGE_FILE": str(data_file)}, check=False)
    from coverage import CoverageData

    cov = CoverageData(basename=str(data_file))
    cov.read()
    lines: dict[str, dict[str, list[str]]] = {}
    for module in _modules().values():
        target = str((ROOT / module["path"]).resolve())
        by_line: dict[str, set[str]] = {}
        for line, contexts in cov.contexts_by_lineno(target).items():
            for context in contexts:
                if context:  # "" is import time, outside any test
                    by_line.setdefault(str(line), set()).add(context.rsplit("|", 1)[0])
        lines[module["path"]] = {line: sorted(ids) for line, ids in by_line.items()}
    durations: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if any(child.tag in ("failure", "error", "skipped") for child in case):
            continue  # only tests that pass unmutated can tell a mutant
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        durations[f"{path}::{case.get('name')}"] = float(case.get("time") or 0)
    MAP.write_text(json.dumps({"lines": lines, "durations": durations}))
    covered = {path: len(by_line) for path, by_line in lines.items()}
    print(f"map: {len(durations)} tests; lines run per module: {covered}")


def _covering_tests(module: dict[str, Any], mutation: Any, budget: float) -> tuple[list[str], str, float | None]:
    """The tests to run against a mutant, how they were chosen, and their unmutated duration (None for
    the subset)."""
    if not MAP.exists():
        return module["tests"], "subset", None
    data = json.loads(MAP.read_text())
    by_line = data["lines"].get(module["path"], {})
    first, last = mutation.start_pos[0], mutation.end_pos[0]
    cost = data["durations"]
    ids = sorted({t for line in range(first, last + 1) for t in by_line.get(str(line), []) if t in cost})
    if not ids:
        # A default value or a decorator runs at import, outside every test: the tests that run the
        # function's body are the ones that meet it.
        body = _enclosing_body(ROOT / module["path"], first)
        ids = sorted({t for line in body for t in by_line.get(str(line), []) if t in cost})
    if not ids:
        return module["tests"], "subset (no test ran the line in the parent)", None
    files: dict[str, list[str]] = {}
    for test in ids:
        files.setdefault(test.split("::", 1)[0], []).append(test)
    # A file's tests stay together (their module fixtures are built once); cheap files first, so that a
    # mutant a cheap test kills costs little under -x.
    ordered = sorted(files.values(), key=lambda tests: sum(cost.get(t, 1.0) for t in tests))
    chosen: list[str] = []
    spent = 0.0
    for tests in ordered:
        file_cost = sum(cost.get(t, 1.0) for t in tests)
        if chosen and spent + file_cost > budget:
            break
        chosen += tests
        spent += file_cost
    left = len(ids) - len(chosen)
    how = f"{len(chosen)} covering tests, {spent:.0f}s" + (f" ({left} over budget left out)" if left else "")
    return chosen, how, spent


def _enclosing_body(path: Path, line: int) -> range:
    """The body lines of the innermost function whose signature or decorators hold ``line``."""
    found = range(0)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            head = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if head <= line < node.body[0].lineno:
                found = range(node.body[0].lineno, (node.end_lineno or node.lineno) + 1)
    return found


def _drop_bytecode(path: Path) -> None:
    # Workers run in isolated mode (-I ignores PYTHONDONTWRITEBYTECODE) and cache the mutant's bytecode; a
    # later mutant of the same size written within the same second would pass for it. Compile afresh.
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def _test_command(tests: list[str]) -> str:
    return " ".join([shlex.quote(sys.executable), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                     *map(shlex.quote, tests)])


def _annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the module's annotations are. Every module here has ``from __future__ import annotations``, so
    an annotation is a string nobody evaluates: cosmic-ray's mutants of it (``str | None`` -> ``str & None``,
    half of client.py's) are equivalent by construction and are left out of the population."""
    spans = []
    for node in ast.walk(ast.parse(path.read_text())):
        found: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            found += [node.returns, *(arg.annotation for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs,
                                                                  a.vararg, a.kwarg] if arg is not None)]
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        spans += [((x.lineno, x.col_offset), (x.end_lineno or x.lineno, x.end_col_offset or 0))
                  for x in found if x is not None]
    return spans


def _compiles(source: str, mutation: Any) -> bool:
    """Whether the mutant is Python at all: cosmic-ray also turns the ``*`` of a keyword-only signature
    into ``//`` and the like, a syntax error that any test would "kill". Those are left out of the sample."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    operator = cosmic_ray.plugins.get_operator(mutation.operator_name)(**(mutation.operator_args or {}))
    code = mutate_code(source, operator, mutation.occurrence)
    try:
        compile(code or "", "<mutant>", "exec")
    except SyntaxError:
        return False
    return code is not None


def _open(module: str, seed: int, sample: int) -> tuple[Any, list[Any], dict[str, Any]]:
    """The module's session (created on first use), its sample in the order it runs, and the counts of
    the population it was drawn from."""
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    SESSIONS.mkdir(exist_ok=True)
    path = _session(module, seed)
    meta_path = path.with_suffix(".json")
    fresh = not path.exists()
    db = WorkDB(str(path), WorkDB.Mode.create)
    source = ROOT / _modules()[module]["path"]
    if fresh:
        init([source], db, {})
    items = {w.job_id: w for w in db.work_items}
    if not fresh:
        meta = json.loads(meta_path.read_text())
        return db, [items[job_id] for job_id in meta["chosen"]], meta
    spans = _annotation_spans(source)
    ordered = sorted(items.values(), key=lambda w: (w.mutations[0].operator_name, w.mutations[0].occurrence))
    population = [w for w in ordered if not any(a <= tuple(w.mutations[0].start_pos) < b for a, b in spans)]
    chosen: list[Any] = []
    invalid = 0
    text = source.read_text()
    for w in random.Random(seed).sample(population, len(population)):
        if len(chosen) == sample:
            break
        if _compiles(text, w.mutations[0]):
            chosen.append(w)
        else:
            invalid += 1
    meta = {"mutants": len(items), "in_annotations": len(items) - len(population), "sample": sample,
            "invalid_seen": invalid, "chosen": [w.job_id for w in chosen]}
    meta_path.write_text(json.dumps(meta))
    ids = set(meta["chosen"])
    db.set_multiple_results([job_id for job_id in items if job_id not in ids],
                            WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    path.with_suffix(".sample.txt").write_text("".join(
        f"{_name(w.mutations[0])}\t{w.mutations[0].definition_name}\tline {w.mutations[0].start_pos[0]}\n"
        for w in chosen))
    return db, chosen, meta


def _outcome(result: Any) -> str:
    """killed, timeout, survived, or what went wrong (no-test: the operator found nothing to change)."""
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    if result.worker_outcome != WorkerOutcome.NORMAL:
        return str(result.worker_outcome.value)
    if result.test_outcome == TestOutcome.SURVIVED:
        return "survived"
    if result.test_outcome == TestOutcome.KILLED:
        return "timeout" if result.output == "timeout" else "killed"
    return "incompetent"


def _baseline(path: Path, tests: list[str]) -> float:
    """The unmutated subset must pass; its duration sets the per-mutant timeout."""
    from cosmic_ray.testing import run_tests
    from cosmic_ray.work_item import TestOutcome

    _drop_bytecode(path)
    start = time.monotonic()
    outcome, output = run_tests(_test_command(tests), 3600)
    took = time.monotonic() - start
    if outcome != TestOutcome.SURVIVED:
        sys.exit(f"the unmutated test subset fails:\n{output[-4000:]}")
    return took


def _stop_cleanly() -> None:
    """SIGTERM or SIGINT (even where a background shell ignores it) end the run between two lines of
    Python, so cosmic-ray puts the original source back; the test run under way, in its own session, goes
    with it."""
    import os
    import signal

    def stop(signum: int, frame: object) -> None:
        import psutil

        for child in psutil.Process().children():
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def cmd_run(args: argparse.Namespace) -> None:
    module = _modules()[args.module]
    path = ROOT / module["path"]
    tests = args.tests or module["tests"]
    db, chosen, _ = _open(args.module, args.seed, args.sample)
    done = dict(db.results)
    if args.only:
        wanted = set(args.only)
        chosen = [w for w in chosen if _name(w.mutations[0]) in wanted]
        todo = chosen
    else:
        todo = [w for w in chosen if w.job_id not in done]
    if args.max is not None:  # the sample's order is random too: a prefix of it is a smaller random sample
        todo = todo[:args.max]
    if not todo:
        print(f"{args.module}: nothing to run ({len(chosen)} sampled, all done)")
        return
    _stop_cleanly()
    timeout = args.timeout
    if timeout is None:
        took = _baseline(path, tests) if args.tests or not MAP.exists() else 0.0
        timeout = 2 * max(took, args.budget) + 60
        print(f"{args.module}: timeout per mutant {timeout:.0f}s", flush=True)
    for i, item in enumerate(todo, 1):
        if args.pause_while:
            while Path(args.pause_while).exists():
                time.sleep(30)
        mutation = item.mutations[0]
        run_tests, how, expected = (tests, "given", None) if args.tests else _covering_tests(module, mutation,
                                                                                             args.budget)
        # A mutant that loops forever in one cheap test need not cost the subset's timeout.
        limit = timeout if expected is None or args.timeout else min(timeout, 3 * expected + 60)
        start = time.monotonic()
        result = _mutate_and_test(path, item.mutations, run_tests, limit)
        if args.confirm and not args.tests and _outcome(result) == "survived":
            # The budget is for speed only: a survivor is one that every test running its line lets live.
            every, how_all, expected = _covering_tests(module, mutation, math.inf)
            if len(every) > len(run_tests):
                result = _mutate_and_test(path, item.mutations, every, 3 * (expected or 0.0) + 60)
                how += f"; confirmed against all {how_all}"
        db.set_result(item.job_id, result)
        print(f"[{i}/{len(todo)}] {_name(mutation)} {mutation.definition_name} line {mutation.start_pos[0]}: "
              f"{_outcome(result)} ({time.monotonic() - start:.0f}s; {how})", flush=True)


def _mutate_and_test(path: Path, mutations: Any, tests: list[str], limit: float) -> Any:
    from cosmic_ray.mutating import mutate_and_test

    _drop_bytecode(path)
    try:
        return mutate_and_test(mutations, _test_command(tests), limit)
    finally:
        _drop_bytecode(path)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _equivalents_path(module: str, seed: int) -> Path:
    return SESSIONS / f"{module}-seed{seed}.equivalent.json"


def _equivalents(module: str, seed: int) -> dict[str, str]:
    """Survivors judged equivalent (no test could tell them from the original), name -> why."""
    path = _equivalents_path(module, seed)
    return json.loads(path.read_text()) if path.exists() else {}


def cmd_equivalent(args: argparse.Namespace) -> None:
    marked = _equivalents(args.module, args.seed)
    marked[args.name] = args.why
    _equivalents_path(args.module, args.seed).write_text(json.dumps(marked, indent=1, sort_keys=True))


def cmd_report(args: argparse.Namespace) -> None:
    from cosmic_ray.work_db import WorkDB

    rows = []
    for path in sorted(SESSIONS.glob("*-seed*.sqlite")):
        module, seed = path.stem.rsplit("-seed", 1)
        if args.seed is not None and int(seed) != args.seed:
            continue
        db = WorkDB(str(path), WorkDB.Mode.open)
        counts: dict[str, int] = {}
        marked = _equivalents(module, int(seed))
        names = {w.job_id: _name(w.mutations[0]) for w in db.work_items}
        for job_id, result in db.results:
            outcome = _outcome(result)
            if outcome == "survived" and names[job_id] in marked:
                outcome = "equivalent"
            counts[outcome] = counts.get(outcome, 0) + 1
        db.close()
        counts.pop("skipped", None)
        meta = json.loads(path.with_suffix(".json").read_text())
        rows.append((module, int(seed), meta["mutants"] - meta["in_annotations"], counts))
    # The score leaves out the equivalent mutants (they are no test's to kill); "raw" counts them as survivors.
    print(f"{'module':10} {'seed':>4} {'of':>5} {'run':>4} {'killed':>6} {'timeout':>7} {'survived':>8} "
          f"{'equiv':>5} {'other':>5} {'raw':>6} {'score':>6}  95% CI")
    for module, seed, population, c in rows:
        killed, timed_out, survived = c.get("killed", 0), c.get("timeout", 0), c.get("survived", 0)
        equivalent = c.get("equivalent", 0)
        other = sum(c.values()) - killed - timed_out - survived - equivalent
        n = killed + timed_out + survived
        lo, hi = wilson(killed + timed_out, n)
        score = (killed + timed_out) / n if n else 0.0
        raw = (killed + timed_out) / (n + equivalent) if n + equivalent else 0.0
        print(f"{module:10} {seed:>4} {population:>5} {n + equivalent:>4} {killed:>6} {timed_out:>7} {survived:>8} "
              f"{equivalent:>5} {other:>5} {raw:>6.1%} {score:>6.1%}  {lo:.1%}-{hi:.1%}")


def cmd_show(args: argparse.Namespace) -> None:
    from cosmic_ray.work_db import WorkDB

    db = WorkDB(str(_session(args.module, args.seed)), WorkDB.Mode.open)
    results = dict(db.results)
    equivalent = _equivalents(args.module, args.seed)
    for item in sorted(db.work_items, key=lambda w: w.mutations[0].start_pos):
        result = results.get(item.job_id)
        if result is None:
            continue
        outcome = _outcome(result)
        if outcome == "skipped" or (outcome in ("killed", "timeout") and not args.all):
            continue
        mutation = item.mutations[0]
        why = equivalent.get(_name(mutation))
        if why is not None:
            outcome = f"equivalent ({why})"
        print(f"=== {_name(mutation)} {mutation.definition_name} line {mutation.start_pos[0]}: {outcome}")
        print(result.diff or "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run a module's sample (resumes where it stopped)")
    run.add_argument("module", choices=sorted(_modules()))
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--sample", type=int, default=60, help="mutants drawn (default 60)")
    run.add_argument("--tests", nargs="+", help="the test subset (default: the module's in mutation.toml)")
    run.add_argument("--timeout", type=float, help="seconds per mutant (default: 2x the budget or the "
                     "unmutated subset's time, + 60)")
    run.add_argument("--budget", type=float, default=150.0,
                     help="seconds of covering tests (by the map's durations) a mutant runs at most (default 150)")
    run.add_argument("--no-confirm", dest="confirm", action="store_false",
                     help="count a survivor of the budgeted tests as such, without running it against every "
                     "covering test")
    run.add_argument("--only", nargs="+", help="run these mutants again (names as `show` prints them)")
    run.add_argument("--max", type=int, help="stop after this many mutants")
    run.add_argument("--pause-while", metavar="FILE", help="wait between mutants while FILE exists")
    run.set_defaults(func=cmd_run)
    equiv = sub.add_parser("equivalent", help="mark a survivor as equivalent to the original, with why")
    equiv.add_argument("module", choices=sorted(_modules()))
    equiv.add_argument("--seed", type=int, default=1)
    equiv.add_argument("name", help="as `show` prints it")
    equiv.add_argument("why")
    equiv.set_defaults(func=cmd_equivalent)
    mapping = sub.add_parser("map", help="run the suite under coverage: which tests run each line")
    mapping.add_argument("--reuse", action="store_true", help="rebuild the map from the last coverage run")
    mapping.set_defaults(func=cmd_map)
    report = sub.add_parser("report", help="the per-module table")
    report.add_argument("--seed", type=int)
    report.set_defaults(func=cmd_report)
    show = sub.add_parser("show", help="the surviving mutants' diffs")
    show.add_argument("module", choices=sorted(_modules()))
    show.add_argument("--seed", type=int, default=1)
    show.add_argument("--all", action="store_true", help="killed ones too")
    show.set_defaults(func=cmd_show)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
