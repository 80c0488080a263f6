#!/usr/bin/env python3
"""The chaos storm: every never-away feature of a pool on at once, several caller threads doing random work
on shared contexts, and workers SIGKILLed (and SIGSTOPped) at random, with every call accounted for.

    .venv/bin/python bench/chaos.py [--duration 600] [--threads 3] [--contexts 8] [--seed 1]
                                    [--kill-every 4:9] [--stop-ratio 0.15] [--model gemma|tiny|PATH]
                                    [--json-out F]

One Pool(2, recover=True, spares=1, checkpoint_tokens=128, max_resident_contexts=3, hang_timeout=3): the
caller threads pick a context at random and do one of: a whole-prompt greedy or seeded generate; a
seeded stream, paused and resumed on the way; a stream moved to the other worker mid-way by another
thread; a move of an idle context; reset + eval + an appended generate; a chat turn; checkpoint();
save_state() and load_state(). Now and then a thread drains a worker (Pool.drain) or plays with branches
on a context of their own. A disruptor thread SIGKILLs a random worker every ``--kill-every`` seconds
(a share ``--stop-ratio`` of them SIGSTOP instead, which the hang watch must find).

It passes when: no call hangs (each returns or raises within ``CALL_BOUND`` s); no error is untyped (a
LloyalError subclass); every greedy or seeded result equals the same call alone in a fresh context of a
pool of its own, on this machine (cache_bit_exact=True, so that a reused prefix does not change the
micro-batches); after the storm every context answers correctly; and once the pool is closed no process,
memfd, /dev/shm entry, page file or descriptor of it is left (bench/soak.py's accounting).
tests/test_chaos.py runs a short version of the same code.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from soak import Snapshot, leaks

from lloyal_pool import Context, LloyalError, Model, Pool, Result

T = TypeVar("T")
CALL_BOUND = 180.0
"""Seconds one operation may take, kills and recoveries included, before it counts as hung."""

WORDS = ("the lighthouse keeper", "a red fox", "the old river", "seven ravens", "a paper boat", "the north wind",
         "a sleeping giant", "the clockmaker", "a glass of milk", "the last train")


@dataclass
class ChaosConfig:
    duration: float = 600.0
    threads: int = 3
    contexts: int = 8
    seed: int = 1
    kill_every: tuple[float, float] = (4.0, 9.0)
    stop_ratio: float = 0.15
    model: str = "gemma"
    n_predict: int = 24
    verbose: bool = True


@dataclass
class Counts:
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    typed: collections.Counter[str] = field(default_factory=collections.Counter)
    samples: dict[str, list[str]] = field(default_factory=dict)  # a few messages of each (op, class)
    untyped: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    disruptions: collections.Counter[str] = field(default_factory=collections.Counter)


class References:
    """The same calls alone, in a fresh context of a pool of its own on this machine (no recovery, nothing
    killed): what every greedy or seeded result must equal. ``cases`` fixes the prompts and params the
    callers draw from, so that each reference is computed once."""

    def __init__(self, path: str, cfg: ChaosConfig) -> None:
        self.pool = Pool(1)
        self.model = self.pool[0].load_model(path)
        rng = random.Random(cfg.seed)
        base: dict[str, Any] = {"n_predict": cfg.n_predict, "ignore_eos": True, "cache_bit_exact": True}
        self.cases: list[tuple[str, dict[str, Any]]] = []
        for i in range(8):
            a, b = rng.sample(WORDS, 2)
            params = {**base, "temperature": 0.0} if i % 2 else {**base, "temperature": 0.8, "seed": 7 + i,
                                                                 "top_k": 40}
            self.cases.append((f"Once upon a time {a} met {b}, and", params))
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()

    def _alone(self, key: tuple[Any, ...], fn: Callable[[Context], Any]) -> Any:
        with self._lock:
            if key not in self._cache:
                ctx = self.model.new_context(n_ctx=1024)
                try:
                    self._cache[key] = fn(ctx)
                finally:
                    ctx.close()
            return self._cache[key]

    def generate(self, i: int) -> str:
        prompt, params = self.cases[i]
        return str(self._alone(("generate", i), lambda c: c.generate(prompt, **params).text))

    def append(self, i: int) -> str:
        prompt, params = self.cases[i]

        def run(c: Context) -> str:
            c.eval(prompt)
            return c.generate(" Then", append=True, **params).text

        return str(self._alone(("append", i), run))

    def state(self, i: int) -> str:
        prompt, params = self.cases[i]

        def run(c: Context) -> str:
            c.generate(prompt, **{**params, "n_predict": 4})
            return c.generate(" and", append=True, **params).text

        return str(self._alone(("state", i), run))

    def chat(self, i: int) -> tuple[str, str]:
        prompt, params = self.cases[i]

        def run(c: Context) -> tuple[str, str]:
            session = c.chat("You are terse.", template="chatml")
            return session.send(prompt, **params).text, session.send("And then?", **params).text

        return tuple(self._alone(("chat", i), run))  # type: ignore[return-value]

    def warm(self) -> None:
        for i in range(len(self.cases)):
            self.generate(i)
            self.append(i)
            self.state(i)
            self.chat(i)

    def close(self) -> None:
        self.pool.close()


class Storm:
    """One run: build with a ChaosConfig, run() returns the report (a JSON-ready dict)."""

    def __init__(self, cfg: ChaosConfig, path: str) -> None:
        self.cfg = cfg
        self.path = path
        self.rng = random.Random(cfg.seed)
        self.stop = threading.Event()
        self.counts = Counts()
        self.t0 = time.monotonic()
        self.refs = References(path, cfg)
        self.locks: list[threading.Lock] = []
        self.contexts: list[Context] = []
        self.models: list[Model] = []
        self.where: list[dict[str, Any]] = []  # where each context was after the storm
        self.pool: Pool | None = None
        self._counts_lock = threading.Lock()

    def log(self, msg: str) -> None:
        if self.cfg.verbose:
            print(f"[chaos {time.monotonic() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def _case(self, rng: random.Random) -> tuple[int, str, dict[str, Any]]:
        i = rng.randrange(len(self.refs.cases))
        prompt, params = self.refs.cases[i]
        return i, prompt, params

    # -- accounting ----------------------------------------------------------------------------------
    def account(self, op: str, fn: Callable[[], T]) -> T | None:
        """Runs one operation with a bound: its value, or None when it raised a LloyalError (counted by
        class); anything else is untyped; past CALL_BOUND it is hung (with the threads' stacks)."""
        box: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append(("ok", fn()))
            except BaseException as exc:
                box.append(("err", exc))
            finally:
                done.set()

        t = threading.Thread(target=run, daemon=True, name=f"chaos-{op}")
        t.start()
        with self._counts_lock:
            self.counts.calls[op] += 1
        if not done.wait(CALL_BOUND):
            stacks = "".join(f"\n--- {th.name}\n" + "".join(traceback.format_stack(frame))
                             for th in threading.enumerate() if (frame := sys._current_frames().get(th.ident)))
            with self._counts_lock:
                self.counts.hung.append(f"{op} did not end within {CALL_BOUND:g}s\n{self._states()}{stacks}")
            self.stop.set()
            return None
        kind, value = box[0]
        if kind == "ok":
            return value  # type: ignore[no-any-return]
        with self._counts_lock:
            if isinstance(value, LloyalError):
                self.counts.typed[type(value).__name__] += 1
                seen = self.counts.samples.setdefault(f"{op}: {type(value).__name__}", [])
                if len(seen) < 3:
                    seen.append(str(value).split("\n")[0][:300])
            else:
                self.counts.untyped.append(f"{op}: {''.join(traceback.format_exception(value))}")
        return None

    def check(self, what: str, got: str, want: str) -> None:
        if got != want:
            with self._counts_lock:
                self.counts.mismatches.append(f"{what}: got {got!r}, want {want!r}")

    # -- the callers' operations -------------------------------------------------------------------
    def op_generate(self, rng: random.Random, ctx: Context) -> None:
        i, prompt, params = self._case(rng)
        result = self.account("generate", lambda: ctx.generate(prompt, **params))
        if result is not None:
            self.check("generate", result.text, self.refs.generate(i))

    def op_stream(self, rng: random.Random, ctx: Context, *, pause: bool, move: bool) -> None:
        i, prompt, params = self._case(rng)
        pieces: list[str] = []
        pool = self.pool
        assert pool is not None

        def run() -> Result:
            with ctx.stream(prompt, **params) as stream:
                for k, piece in enumerate(stream):
                    pieces.append(piece)
                    if pause and k == 5 and stream.pause():
                        time.sleep(0.05)
                        stream.resume()
                    if move and k == 8:
                        others = [x for x in pool.instances if x is not ctx.instance and x.alive]
                        if others:
                            self._move_aside(ctx, others[0])
                return stream.result

        result = self.account("stream", run)
        if result is not None:
            want = self.refs.generate(i)
            self.check("stream pieces", "".join(pieces), want)
            self.check("stream result", result.text, want)

    def _move_aside(self, ctx: Context, target: Any) -> None:
        """Another thread moves ctx while this one goes on iterating its stream."""
        threading.Thread(target=lambda: self.account("move_mid_stream", lambda: ctx.move_to(target)),
                         daemon=True).start()

    def op_move(self, rng: random.Random, ctx: Context) -> None:
        pool = self.pool
        assert pool is not None
        others = [x for x in pool.instances if x is not ctx.instance and x.alive]
        if others:
            self.account("move", lambda: ctx.move_to(rng.choice(others)))

    def op_append(self, rng: random.Random, ctx: Context) -> None:
        i, prompt, params = self._case(rng)

        def run() -> str:
            ctx.reset()
            ctx.eval(prompt)
            return ctx.generate(" Then", append=True, **params).text

        text = self.account("reset_eval_append", run)
        if text is not None:
            self.check("reset, eval, append", text, self.refs.append(i))

    def op_state(self, rng: random.Random, ctx: Context) -> None:
        i, prompt, params = self._case(rng)

        def run() -> str:
            ctx.generate(prompt, **{**params, "n_predict": 4})
            data = ctx.save_state()
            ctx.reset()
            ctx.load_state(data)
            ctx.checkpoint()
            return ctx.generate(" and", append=True, **params).text

        text = self.account("save_load_checkpoint", run)
        if text is not None:
            self.check("save, load, checkpoint", text, self.refs.state(i))

    def op_chat(self, rng: random.Random, ctx: Context) -> None:
        i, prompt, params = self._case(rng)

        def run() -> tuple[str, str]:
            session = ctx.chat("You are terse.", template="chatml")
            return session.send(prompt, **params).text, session.send("And then?", **params).text

        turns = self.account("chat", run)
        if turns is not None:
            want = self.refs.chat(i)
            self.check("chat turn 1", turns[0], want[0])
            self.check("chat turn 2", turns[1], want[1])

    def op_branches(self, rng: random.Random) -> None:
        pool = self.pool
        assert pool is not None
        model = rng.choice([m for inst in pool.instances for m in inst.models])  # not a drained worker's

        prompt = self.refs.cases[rng.randrange(len(self.refs.cases))][0]

        def run() -> int:
            ctx = model.new_context(n_ctx=256, n_seq_max=4)
            try:
                root = ctx.branch(prompt)
                child = root.fork()
                for _ in range(3):
                    ctx.branches.step([root, child])
                return root.position
            finally:
                ctx.close()

        self.account("branches", run)

    def op_drain(self, rng: random.Random) -> None:
        pool = self.pool
        assert pool is not None
        self.account("drain", lambda: pool.drain(rng.randrange(len(pool))))
        self.models = [m for inst in pool.instances for m in inst.models]

    def caller(self, index: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + index)
        while not self.stop.is_set():
            i = rng.randrange(len(self.contexts))
            ctx, lock = self.contexts[i], self.locks[i]
            choice = rng.random()
            if choice < 0.05:
                self.op_drain(rng)
                continue
            if choice < 0.10:
                self.op_branches(rng)
                continue
            if choice < 0.22:
                self.op_move(rng, ctx)  # no lock: a move of a context another thread is using
                continue
            with lock:
                if choice < 0.40:
                    self.op_generate(rng, ctx)
                elif choice < 0.60:
                    self.op_stream(rng, ctx, pause=True, move=rng.random() < 0.5)
                elif choice < 0.75:
                    self.op_append(rng, ctx)
                elif choice < 0.88:
                    self.op_state(rng, ctx)
                else:
                    self.op_chat(rng, ctx)

    def _states(self) -> str:
        """Every context's lifecycle state, one line each (for a report on a call that hung)."""
        lines = []
        for ctx in self.contexts:
            state, core = ctx._link.state, ctx._link.core
            with core._lock:
                gens = [(g.phase.value, getattr(g.why, "value", None)) for g in state.gens]
                lines.append(f"ctx {state.handle}: {state.status.value} hold={state.hold} queued="
                             f"{[type(c.req).__name__ for c in state.queued]} inflight="
                             f"{[(type(c.req).__name__, c.state) for c in state.inflight]} deferred="
                             f"{len(state.deferred)} gens={gens} move={state.move_token is not None} "
                             f"core={core.proc.worker_id}:{core.machine.phase} pool_has_core="
                             f"{self.pool is not None and any(i._core is core for i in self.pool.instances)} "
                             f"machine_inflight={len(core.machine.inflight)} queued={len(core.machine.queued)}")
        return "\n".join(lines)

    def _where(self, ctx: Context) -> dict[str, Any]:
        """Where a context is, as its handle and its core see it (for a report on one that fails)."""
        state, core = ctx._link.state, ctx._link.core
        pool = self.pool
        return {"status": state.status.value, "handle": state.handle, "core_phase": core.machine.phase,
                "core_in_pool": pool is not None and any(i._core is core for i in pool.instances),
                "model_in_pool": pool is not None and ctx.instance in pool.instances,
                "in_machine": state in core.machine.contexts}

    def disruptor(self) -> None:
        pool = self.pool
        assert pool is not None
        lo, hi = self.cfg.kill_every
        while not self.stop.wait(self.rng.uniform(lo, hi)):
            live = [inst for inst in pool.instances if inst.alive]
            if not live:
                continue
            inst = self.rng.choice(live)
            stop = self.rng.random() < self.cfg.stop_ratio
            try:
                os.kill(inst.pid, signal.SIGSTOP if stop else signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.counts.disruptions["SIGSTOP" if stop else "SIGKILL"] += 1
            self.log(f"{'SIGSTOP' if stop else 'SIGKILL'} worker {inst.worker_id} (pid {inst.pid})")

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.log("computing the references (each call alone, in a pool of its own)")
        self.refs.warm()
        before = Snapshot.take()
        private_tmp = tempfile.mkdtemp(prefix="chaos-")
        old_tempdir, tempfile.tempdir = tempfile.tempdir, private_tmp
        report: dict[str, Any] = {}
        try:
            with Pool(2, recover=True, spares=1, checkpoint_tokens=128, max_resident_contexts=3,
                      hang_timeout=3.0, page_dir=private_tmp) as pool:
                self.pool = pool
                temp_dir = pool.temp_dir
                self.models = [inst.load_model(self.path) for inst in pool]
                for i in range(self.cfg.contexts):
                    ctx = self.models[i % len(self.models)].new_context(n_ctx=1024)
                    self.contexts.append(ctx)
                    self.locks.append(threading.Lock())
                threads = [threading.Thread(target=self.caller, args=(k,), daemon=True, name=f"chaos-caller{k}")
                           for k in range(self.cfg.threads)]
                disruptor = threading.Thread(target=self.disruptor, daemon=True, name="chaos-disruptor")
                for t in threads:
                    t.start()
                disruptor.start()
                self.stop.wait(self.cfg.duration)
                self.stop.set()
                for t in [*threads, disruptor]:
                    t.join(CALL_BOUND + 30)
                stuck = [t.name for t in threads if t.is_alive()]
                # After the storm: every context answers, correctly.
                self.where = [self._where(ctx) for ctx in self.contexts]
                after_ok = 0
                for k, ctx in enumerate(self.contexts):
                    i = k % len(self.refs.cases)
                    prompt, params = self.refs.cases[i]
                    result = self.account("after", lambda c=ctx, pr=prompt, pa=params: c.generate(pr, **pa))
                    if result is not None and result.text == self.refs.generate(i):
                        after_ok += 1
                    elif result is not None:
                        self.check("after the storm", result.text, self.refs.generate(i))
                close_t0 = time.monotonic()
            close_s = time.monotonic() - close_t0
            found, elsewhere = leaks(before, temp_dir, private_tmp)
        finally:
            tempfile.tempdir = old_tempdir
            self.refs.close()
        c = self.counts
        report = {
            "config": {**self.cfg.__dict__, "kill_every": list(self.cfg.kill_every)}, "model": self.path,
            "duration_s": round(time.monotonic() - self.t0, 1), "calls": dict(c.calls),
            "calls_total": sum(c.calls.values()),
            "typed_errors": dict(c.typed), "typed_samples": c.samples, "untyped": c.untyped,
            "mismatches": c.mismatches, "hung": c.hung, "stuck_threads": stuck, "where": self.where,
            "disruptions": dict(c.disruptions), "contexts_answering_after": after_ok,
            "contexts": len(self.contexts), "close_s": round(close_s, 3), "leaks": found, "elsewhere": elsewhere,
        }
        report["passed"] = (not c.untyped and not c.mismatches and not c.hung and not stuck
                            and after_ok == len(self.contexts) and not any(found.values()))
        return report


def summary(report: dict[str, Any]) -> str:
    lines = [f"chaos: {report['duration_s']} s, {report['calls_total']} calls, "
             f"disruptions {report['disruptions']}",
             f"  calls by op: {report['calls']}",
             f"  typed errors by class: {report['typed_errors']}",
             f"  untyped: {len(report['untyped'])}, mismatches: {len(report['mismatches'])}, "
             f"hung: {len(report['hung'])}, stuck threads: {report['stuck_threads']}",
             f"  contexts answering correctly after the storm: "
             f"{report['contexts_answering_after']}/{report['contexts']}",
             f"  pool.close(): {report['close_s']} s; left behind: {({k: v for k, v in report['leaks'].items() if v})}",
             f"  PASSED: {report['passed']}"]
    for what in ("untyped", "mismatches", "hung"):
        for item in report[what][:3]:
            lines.append(f"  {what}: {item[:3000]}")
    return "\n".join(lines)


def model_path(name: str) -> str:
    if name == "gemma":
        from lloyal_pool.models import default_model_path

        return str(default_model_path())
    if name == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tinymodel import tiny_model_path

        return str(tiny_model_path(Path(__file__).resolve().parent.parent / ".cache" / "test-models"))
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kill-every", default="4:9", help="seconds between disruptions, lo:hi (default 4:9)")
    ap.add_argument("--stop-ratio", type=float, default=0.15)
    ap.add_argument("--model", default="gemma", help="gemma, tiny or a GGUF path")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    lo, hi = (float(x) for x in args.kill_every.split(":"))
    cfg = ChaosConfig(duration=args.duration, threads=args.threads, contexts=args.contexts, seed=args.seed,
                      kill_every=(lo, hi), stop_ratio=args.stop_ratio, model=args.model)
    print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    report = Storm(cfg, model_path(args.model)).run()
    print(summary(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
