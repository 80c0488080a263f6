#!/usr/bin/env python3
"""A bounded soak: many client threads on a few workers, with interrupts, bad input and workers killed or
stopped at random, accounting for every call and for everything left behind after close().

    .venv/bin/python bench/soak.py [--duration 600] [--threads 16] [--workers 3] [--kill-every 20]
                                   [--hang-timeout 3] [--models gemma,tiny] [--json-out F] [--png-out F]

For ``--duration`` seconds, ``--threads`` client threads (each bound to one worker) issue generate, stream,
branch (create, fork, step or produce + commit, prune) and scoring calls (score, score_choices) on Gemma 3
270M and the tiny test model. Some calls are interrupted from another thread (Context.interrupt,
Stream.close), some carry a per-call ``timeout=``, some are bad on purpose (token ids outside the
vocabulary, a grammar that does not parse, context parameters out of range, a prompt longer than the
context) and must raise the LloyalError subclass that says so. Every ``--kill-every`` seconds a random
worker is SIGKILLed or SIGSTOPped; the pool's hang watch (``hang_timeout``) must find a stopped one. A
thread subscribed to the pool's "died" events replaces dead workers (Pool.replace) and loads the models
again; the client threads then create their contexts on the new instance.

Every call ends as a result, a typed error (counted by type) or LOST: it raised something that is not a
LloyalError, or had not returned when the run ended. After close(): child processes, memfds (descriptors
and mappings), /dev/shm entries, descriptors, the pool's temporary directory and any lloyal-* temporary
directory made during the run must all be gone. The parent's RSS is sampled every second; its growth is
taken between two quiet points with the same workers mapped: after the warm-up round, and after the run
once every worker is replaced and has answered a ping.

Targets: 0 lost, 0 leaked, parent RSS growth < 20 MiB (also: every bad input raised its typed error, every
stop was found). The exit status is 1 when one is missed. A JSON report and a PNG (calls and errors per
second, the parent's RSS, each kill and stop marked; needs matplotlib) go to bench/results/ by default.
tests/test_soak.py runs a short version of the same code.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import heapq
import json
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import psutil

import lloyal_pool
from lloyal_pool import (
    CallTimeoutError,
    Context,
    ContextError,
    ContextOverflowError,
    GrammarError,
    Instance,
    InterruptedByClient,
    InvalidTokenError,
    LloyalError,
    Model,
    Pool,
    StaleHandleError,
    WorkerError,
    WorkerEvent,
)

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent

TARGET_RSS_GROWTH_MIB = 20.0
PROMPTS = (
    "Once upon a time, in a village by the sea,",
    "The capital of France is",
    "Write a short poem about the rain.",
    "List three colours:",
    "In 1969 the first people walked on",
    "def fibonacci(n):",
    "The quick brown fox",
    "Explain why the sky is blue in one sentence.",
)
CHOICES = (" yes", " no", " maybe", " Paris", " the moon")
# Error types that a well-behaved call may meet in a soak: its worker killed, stopped or gone, its own
# interrupt or timeout. Anything else on a good call is reported as unexpected (not a target).
EXPECTED_ON_GOOD_CALLS = (WorkerError, StaleHandleError, CallTimeoutError, InterruptedByClient)


@dataclass
class SoakConfig:
    """What one soak run does."""

    duration: float = 600.0
    threads: int = 16
    workers: int = 3
    kill_every: float = 20.0
    hang_timeout: float = 3.0
    models: tuple[str, ...] = ("gemma", "tiny")
    stop_ratio: float = 0.5  # the share of disruptions that are SIGSTOP rather than SIGKILL
    seed: int = 1
    n_ctx: int = 512
    warmup_rounds: int = 1
    verbose: bool = True
    model_paths: dict[str, str] = field(default_factory=dict)  # name -> path; found when empty


# -- accounting --------------------------------------------------------------------------------------
@dataclass
class _Open:
    op: str
    thread: str
    since: float
    bad: bool


class Ledger:
    """Every call, from begin() to end(): outcome counts per operation and per second, and the calls in
    flight (those still open when the run ends are LOST)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._lock = threading.Lock()
        self._ids = 0
        self.open: dict[int, _Open] = {}
        self.by_op: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.errors: collections.Counter[str] = collections.Counter()
        self.per_second: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.lost: list[dict[str, Any]] = []
        self.unexpected: collections.Counter[str] = collections.Counter()
        self.unexpected_samples: list[str] = []
        self.bad_made: collections.Counter[str] = collections.Counter()
        self.bad_typed: collections.Counter[str] = collections.Counter()
        self.bad_other_typed: collections.Counter[str] = collections.Counter()
        self.bad_accepted: list[str] = []
        self.interrupted_results = 0
        self.late = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def count(self, counter: collections.Counter[str], key: str) -> None:
        with self._lock:
            counter[key] += 1

    def begin(self, op: str, bad: bool = False) -> int:
        with self._lock:
            self._ids += 1
            self.open[self._ids] = _Open(op, threading.current_thread().name, self.now(), bad)
            return self._ids

    def end(self, token: int, outcome: str, exc: BaseException | None = None, *, case: str = "",
            expect: tuple[type[BaseException], ...] = ()) -> None:
        with self._lock:
            call = self.open.pop(token, None)
            if call is None:  # it returned after the run had declared it LOST
                self.late += 1
                return
            sec = max(0, int(self.now()))
            counts = self.by_op[call.op]
            counts["calls"] += 1
            if outcome == "ok":
                counts["ok"] += 1
                self.per_second[sec]["ok"] += 1
                if call.bad:
                    self.bad_accepted.append(case)
            elif outcome == "error":
                assert exc is not None
                name = type(exc).__name__
                counts["error:" + name] += 1
                self.errors[name] += 1
                self.per_second[sec]["error"] += 1
                self.per_second[sec]["bad" if call.bad else _family(exc)] += 1
                if call.bad:
                    (self.bad_typed if isinstance(exc, expect) else self.bad_other_typed)[f"{case}:{name}"] += 1
                elif not isinstance(exc, EXPECTED_ON_GOOD_CALLS):
                    self.unexpected[f"{call.op}:{name}"] += 1
                    if len(self.unexpected_samples) < 10:
                        self.unexpected_samples.append(f"{call.op}: {name}: {str(exc)[:300]}")
            else:
                counts["lost"] += 1
                self.per_second[sec]["lost"] += 1
                self.lost.append({"op": call.op, "thread": call.thread, "since_s": round(call.since, 3),
                                  "how": "raised a non-LloyalError",
                                  "error": "".join(traceback.format_exception(exc))[-2000:] if exc else ""})

    def close_open(self) -> None:
        """Marks every call still open as LOST (it never returned)."""
        with self._lock:
            for call in self.open.values():
                self.by_op[call.op]["calls"] += 1
                self.by_op[call.op]["lost"] += 1
                self.lost.append({"op": call.op, "thread": call.thread, "since_s": round(call.since, 3),
                                  "how": "never returned", "error": ""})
            self.open.clear()

    def totals(self) -> dict[str, int]:
        with self._lock:
            calls = sum(c["calls"] for c in self.by_op.values())
            ok = sum(c["ok"] for c in self.by_op.values())
            lost = sum(c["lost"] for c in self.by_op.values())
        return {"calls": calls, "results": ok, "typed_errors": calls - ok - lost, "lost": lost}


def _family(exc: BaseException) -> str:
    if isinstance(exc, (WorkerError, StaleHandleError)):
        return "worker"
    if isinstance(exc, (CallTimeoutError, InterruptedByClient)):
        return "interrupt"
    return "other"


class Scheduler:
    """One thread that runs callbacks at given times: the interrupts and stream closes 'from another
    thread' (a Timer thread each would churn hundreds of threads)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cond = threading.Condition()
        self._n = 0
        self._stopped = False
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="soak-scheduler", daemon=True)
        self._thread.start()

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        with self._cond:
            self._n += 1
            heapq.heappush(self._heap, (time.monotonic() + delay, self._n, fn))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._stopped:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception as exc:  # an interrupt of something already gone must be a no-op
                if len(self.errors) < 20:
                    self.errors.append(repr(exc))

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)


# -- what lives on the machine (for the leak checks) -------------------------------------------------
def _fd_targets() -> dict[str, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own descriptor, or one closed meanwhile
    return out


def _memfd_maps() -> set[str]:
    with open("/proc/self/maps") as f:
        return {" ".join(line.split()[4:]) for line in f if "memfd:" in line}


def _tmp_entries() -> set[str]:
    root = "/tmp"
    return {os.path.join(root, n) for n in os.listdir(root) if n.startswith("lloyal")} if os.path.isdir(root) else set()


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _children() -> dict[int, str]:
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            out[child.pid] = " ".join(child.cmdline())[:200] or child.name()
        except psutil.Error:
            pass
    return out


@dataclass
class Snapshot:
    """What this process holds that a pool could leak."""

    fds: dict[str, str]
    memfd_maps: set[str]
    tmp: set[str]
    dev_shm: set[str]
    children: dict[int, str]
    threads: dict[int | None, str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(_fd_targets(), _memfd_maps(), _tmp_entries(), _dev_shm(), _children(),
                   {t.ident: t.name for t in threading.enumerate()})


def _foreign(path: str) -> bool:
    """Whether a temporary directory belongs to a live process that is not ours (another pool on the
    machine: its janitor names the directory on its command line, its workers work inside it)."""
    ours = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        if proc.info["pid"] in ours:
            continue
        cmd = " ".join(proc.info.get("cmdline") or [])
        cwd = proc.info.get("cwd") or ""
        if path in cmd or cwd.startswith(path):
            return True
    return False


def leaks(before: Snapshot, temp_dir: str, private_tmp: str) -> tuple[dict[str, list[str]], list[str]]:
    """What is here now that was not before the pool, the pool being closed: its processes, memfds,
    descriptors, shared-memory names and temporary files. This process made its temporary files in
    ``private_tmp`` (tempfile.tempdir during the run; a worker writes only inside its pool's directory),
    so whatever is left there is ours. Also returned: lloyal* entries new in /tmp, which other processes
    on the machine may have made (reported, not counted)."""
    gc.collect()
    deadline = time.monotonic() + 10.0
    while True:
        after = Snapshot.take()
        left = sorted(os.path.join(private_tmp, n) for n in os.listdir(private_tmp))
        if os.path.exists(temp_dir) and temp_dir not in left:
            left.append(temp_dir)
        found = {
            "processes": [f"{pid} {cmd}" for pid, cmd in after.children.items() if pid not in before.children],
            "memfd_fds": [f"{fd} -> {t}" for fd, t in after.fds.items()
                          if "memfd:" in t and before.fds.get(fd) != t],
            "memfd_maps": sorted(after.memfd_maps - before.memfd_maps),
            "fds": [f"{fd} -> {t}" for fd, t in after.fds.items() if fd not in before.fds],
            "dev_shm": sorted(after.dev_shm - before.dev_shm),
            "temp_files": left,
            # The spawner thread serves every pool of the process for its lifetime, by design.
            "threads": sorted(name for ident, name in after.threads.items()
                              if ident not in before.threads and name != "lloyal-spawner"),
        }
        # Something on its way out (a child being reaped) gets a few seconds; a leak stays.
        if not any(found.values()) or time.monotonic() > deadline:
            elsewhere = sorted(p for p in after.tmp - before.tmp if os.path.exists(p) and not _foreign(p))
            return found, elsewhere
        time.sleep(0.5)


def _rss() -> tuple[float, float, float]:
    """(RSS, anonymous, shared memory) of this process in MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssShmem:")):
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", 0.0), fields.get("RssAnon", 0.0), fields.get("RssShmem", 0.0)


# -- the soak ----------------------------------------------------------------------------------------
@dataclass
class Slot:
    """One worker place of the pool as the clients see it: the instance and its loaded models, and an
    epoch that grows with each replacement. ``ready`` is False while it is being replaced."""

    instance: Instance
    models: dict[str, Model]
    epoch: int = 0
    ready: bool = True


@dataclass
class Disruption:
    t: float
    action: str  # "SIGKILL" | "SIGSTOP"
    worker_id: int
    pid: int
    died_t: float | None = None
    died_as: str = ""
    replaced_t: float | None = None


class Soak:
    """One run: build with a SoakConfig, run() returns the report (a JSON-ready dict)."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.slots: list[Slot] = []
        self.deaths: queue.SimpleQueue[tuple[WorkerEvent, float] | None] = queue.SimpleQueue()
        self.disruptions: list[Disruption] = []
        self.replacements: list[dict[str, Any]] = []
        self.rss: list[tuple[float, float, float, float]] = []
        self.paths = dict(cfg.model_paths) or find_models(cfg.models)
        self.t0 = time.monotonic()
        self.ledger = Ledger(self.t0)
        self.scheduler: Scheduler | None = None
        self.pool: Pool | None = None
        self.interrupts: collections.Counter[str] = collections.Counter()
        self.disrupted: set[int] = set()  # worker ids already killed or stopped
        self.phase = "setup"

    def log(self, msg: str) -> None:
        if self.cfg.verbose:
            print(f"[soak {self.ledger.now():7.1f}s] {msg}", file=sys.stderr, flush=True)

    def call(self, op: str, fn: Callable[[], T], *, bad: str = "",
             expect: tuple[type[BaseException], ...] = ()) -> tuple[bool, T | None, BaseException | None]:
        """Runs one accounted call: (returned, its value, its LloyalError)."""
        token = self.ledger.begin(op, bad=bool(bad))
        try:
            value = fn()
        except LloyalError as exc:
            self.ledger.end(token, "error", exc, case=bad, expect=expect)
            return False, None, exc
        except Exception as exc:
            self.ledger.end(token, "lost", exc)
            return False, None, exc
        self.ledger.end(token, "ok", case=bad)
        return True, value, None

    # -- set-up and the workers' replacement -------------------------------------------------------
    def _load(self, instance: Instance) -> dict[str, Model] | None:
        models = {}
        for name, path in self.paths.items():
            ok, model, _ = self.call("load_model", lambda p=path: instance.load_model(p, timeout=120))  # type: ignore[misc]
            if not ok or model is None:
                return None
            models[name] = model
        return models

    def _on_event(self, event: WorkerEvent) -> None:
        if event.kind == "died":
            # The replacer thread does the work: a callback must return promptly.
            self.deaths.put((event, self.ledger.now()))

    def _replacer(self) -> None:
        assert self.pool is not None
        while True:
            item = self.deaths.get()
            if item is None:
                return
            event, when = item
            for d in self.disruptions:
                if d.worker_id == event.worker_id and d.died_t is None:
                    d.died_t, d.died_as = when, type(event.error).__name__
            index = next((i for i, s in enumerate(self.slots) if s.instance.worker_id == event.worker_id), None)
            if index is None:
                continue
            with self.cond:
                self.slots[index].ready = False
            self._replace(index, event.worker_id)

    def _replace(self, index: int, old_id: int) -> None:
        assert self.pool is not None
        pool = self.pool
        for _attempt in range(5):
            ok, fresh, _ = self.call("replace", lambda: pool.replace(index))
            if not ok or fresh is None:
                if self.pool.closed:
                    return
                time.sleep(0.5)
                continue
            models = self._load(fresh)
            if models is None:
                with self.cond:
                    self.slots[index].instance = fresh
                if not fresh.alive:
                    return  # killed while loading: its own "died" event follows
                continue  # a load that failed otherwise: another worker

            with self.cond:
                slot = self.slots[index]
                slot.instance, slot.models, slot.epoch, slot.ready = fresh, models, slot.epoch + 1, True
                self.cond.notify_all()
            now = self.ledger.now()
            self.replacements.append({"t": round(now, 3), "index": index, "old_worker": old_id,
                                      "new_worker": fresh.worker_id})
            for d in self.disruptions:
                if d.worker_id == old_id and d.replaced_t is None:
                    d.replaced_t = now
            self.log(f"worker {old_id} replaced by worker {fresh.worker_id} (place {index})")
            return

    # -- disruptions ----------------------------------------------------------------------------------
    def _killer(self) -> None:
        rng = random.Random(self.cfg.seed + 1)
        actions = random.Random(self.cfg.seed + 2)  # its own: the sequence of actions does not hang on timing
        next_at = self.cfg.kill_every
        while not self.stop.wait(max(0.0, next_at - self.ledger.now())):
            next_at += self.cfg.kill_every
            with self.cond:
                ready = [s for s in self.slots
                         if s.ready and s.instance.alive and s.instance.worker_id not in self.disrupted]
                if not ready:
                    continue
                slot = rng.choice(ready)
                action = "SIGSTOP" if actions.random() < self.cfg.stop_ratio else "SIGKILL"
                inst = slot.instance
                d = Disruption(self.ledger.now(), action, inst.worker_id, inst.pid)
                self.disruptions.append(d)
                self.disrupted.add(inst.worker_id)
            try:
                os.kill(inst.pid, signal.SIGSTOP if action == "SIGSTOP" else signal.SIGKILL)
            except ProcessLookupError:
                d.action += " (already gone)"
            self.log(f"{action} worker {inst.worker_id} (pid {inst.pid})")

    def _sampler(self, done: threading.Event) -> None:
        while True:
            rss, anon, shmem = _rss()
            self.rss.append((round(self.ledger.now(), 3), round(rss, 2), round(anon, 2), round(shmem, 2)))
            if done.wait(1.0):
                return

    # -- the run --------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Runs the soak; returns the report. This process's temporary files go to a private directory
        meanwhile (tempfile.tempdir), so that what is left in it after close() is known to be ours."""
        private_tmp = tempfile.mkdtemp(prefix="soak-tmp-")
        saved, tempfile.tempdir = tempfile.tempdir, private_tmp
        try:
            return self._run(private_tmp)
        finally:
            tempfile.tempdir = saved
            try:
                os.rmdir(private_tmp)
            except OSError:
                pass  # not empty: reported as a leak, kept for a look

    def _run(self, private_tmp: str) -> dict[str, Any]:
        cfg = self.cfg
        before = Snapshot.take()
        rss_at_entry = _rss()[0]
        sampler_done = threading.Event()
        sampler = threading.Thread(target=self._sampler, args=(sampler_done,), name="soak-rss", daemon=True)
        sampler.start()
        self.scheduler = Scheduler()
        self.pool = pool = Pool(cfg.workers, hang_timeout=cfg.hang_timeout)
        temp_dir = pool.temp_dir
        pool.subscribe(self._on_event)
        for inst in pool.instances:
            models = self._load(inst)
            if models is None:
                raise RuntimeError(f"could not load the models into {inst!r}")
            self.slots.append(Slot(inst, models))
        replacer = threading.Thread(target=self._replacer, name="soak-replacer", daemon=True)
        replacer.start()
        clients = [Client(self, i) for i in range(cfg.threads)]
        threads = [threading.Thread(target=c.run, name=f"soak-client{i}", daemon=True) for i, c in enumerate(clients)]

        # Warm-up: every client makes each kind of call once, with nothing disrupted, so that what the
        # first calls allocate for good (imports, caches, thread stacks) is in the starting RSS.
        self.phase = "warmup"
        for c in clients:
            c.rounds_left = cfg.warmup_rounds
        for t in threads:
            t.start()
        for c in clients:
            c.warm.wait()
        gc.collect()
        rss_start = _rss()
        self.ledger.t0 = self.t0 = time.monotonic()
        self.rss.clear()
        self.phase = "run"
        self.log(f"warm-up done (parent RSS {rss_start[0]:.1f} MiB); running {cfg.duration:g}s, "
                 f"{cfg.threads} threads on {cfg.workers} workers, a disruption every {cfg.kill_every:g}s")
        for c in clients:
            c.go.set()
        killer = threading.Thread(target=self._killer, name="soak-killer", daemon=True)
        killer.start()
        last = 0.0
        while self.ledger.now() < cfg.duration:
            time.sleep(min(1.0, cfg.duration - self.ledger.now()))
            if cfg.verbose and self.ledger.now() - last >= 30:
                last = self.ledger.now()
                self.log(f"{self.ledger.totals()}")
        self.stop.set()
        t_end = self.ledger.now()
        killer.join()

        # The clients end their current call. One waiting on a stopped worker needs the hang watch, one
        # with a timeout its grace: hang_timeout and a margin bound it; what is still open after that
        # never returned, and is LOST.
        grace = 3 * cfg.hang_timeout + 60.0
        deadline = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]

        # Quiet point: every stop resumed or found, every worker replaced and answering.
        for d in self.disruptions:
            if d.action == "SIGSTOP" and d.died_t is None:
                try:
                    os.kill(d.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.deaths.put(None)
        replacer.join(timeout=180)
        for i, slot in enumerate(self.slots):
            if not slot.instance.alive:
                self._replace(i, slot.instance.worker_id)
        for inst in pool.instances:
            self.call("ping", lambda inst=inst: inst.ping(timeout=30))  # type: ignore[misc]
        self.ledger.close_open()  # what is open now never returned: LOST
        self.slots.clear()
        for c in clients:
            c.drop()
        gc.collect()
        time.sleep(1.0)
        rss_end = _rss()
        pool.close()
        self.scheduler.stop()
        for t in threads:  # a stuck client gets PoolClosedError now; its call stays LOST
            t.join(timeout=10)
        gc.collect()
        rss_closed = _rss()
        sampler_done.set()
        sampler.join()
        found, elsewhere = leaks(before, temp_dir, private_tmp)
        report = self._report(t_end, stuck, found, rss_at_entry, rss_start, rss_end, rss_closed)
        report["new_lloyal_entries_in_tmp_by_others"] = elsewhere
        return report

    def _report(self, t_end: float, stuck: list[str], found: dict[str, list[str]], rss_at_entry: float,
                rss_start: tuple[float, float, float], rss_end: tuple[float, float, float],
                rss_closed: tuple[float, float, float]) -> dict[str, Any]:
        cfg, led = self.cfg, self.ledger
        totals = led.totals()
        stops = [d for d in self.disruptions if d.action == "SIGSTOP"]
        # A stop made in the last hang_timeout (+ a margin) of the run may not have been found in time.
        undetected = [d for d in stops if d.died_t is None and d.t < t_end - cfg.hang_timeout - 10]
        n_leaked = sum(len(v) for v in found.values())
        growth = rss_end[0] - rss_start[0]
        seconds = int(t_end) + 1
        per_s = [dict(led.per_second.get(s, {})) for s in range(seconds)]
        targets: dict[str, dict[str, Any]] = {
            "lost": {"value": totals["lost"], "target": 0, "met": totals["lost"] == 0},
            "leaked": {"value": n_leaked, "target": 0, "met": n_leaked == 0},
            "rss_growth_mib": {"value": round(growth, 2), "target": f"< {TARGET_RSS_GROWTH_MIB:g}",
                               "met": growth < TARGET_RSS_GROWTH_MIB},
            "bad_input_accepted": {"value": len(led.bad_accepted), "target": 0, "met": not led.bad_accepted},
            "stops_not_found": {"value": len(undetected), "target": 0, "met": not undetected},
        }
        return {
            "config": {k: v for k, v in dataclasses.asdict(cfg).items()},
            "models": self.paths,
            "duration_s": round(t_end, 2),
            "totals": totals,
            "calls_per_second": round(totals["calls"] / max(t_end, 1e-9), 2),
            "by_op": {op: dict(c) for op, c in sorted(led.by_op.items())},
            "errors_by_type": dict(led.errors.most_common()),
            "lost": led.lost,
            "returned_after_declared_lost": led.late,
            "stuck_threads": stuck,
            "unexpected_errors_on_good_calls": dict(led.unexpected),
            "unexpected_samples": led.unexpected_samples,
            "bad_inputs": {"made": dict(led.bad_made), "raised_expected_type": dict(led.bad_typed),
                           "raised_other_lloyal_error": dict(led.bad_other_typed), "accepted": led.bad_accepted},
            "interrupts": dict(self.interrupts),
            "interrupted_results": led.interrupted_results,
            "scheduler_errors": self.scheduler.errors if self.scheduler else [],
            "disruptions": [dataclasses.asdict(d) for d in self.disruptions],
            "stop_found_after_s": [round(d.died_t - d.t, 2) for d in stops if d.died_t is not None],
            "kill_reported_after_s": [round(d.died_t - d.t, 3) for d in self.disruptions
                                      if d.action == "SIGKILL" and d.died_t is not None],
            "replacements": self.replacements,
            "rss_mib": {"at_entry": round(rss_at_entry, 2), "start": round(rss_start[0], 2),
                        "end": round(rss_end[0], 2), "after_close": round(rss_closed[0], 2),
                        "growth": round(growth, 2), "anon_start": round(rss_start[1], 2),
                        "anon_end": round(rss_end[1], 2), "shmem_start": round(rss_start[2], 2),
                        "shmem_end": round(rss_end[2], 2),
                        "max": round(max((r[1] for r in self.rss), default=0.0), 2),
                        "samples": self.rss},
            "timeline": per_s,
            "leaks": found,
            "targets": targets,
            "passed": all(t["met"] for t in targets.values()),
        }


class Client:
    """One client thread, bound to one worker place: a generation context and a branch context there,
    created again on each new instance, and a random mix of calls on them."""

    WEIGHTS: ClassVar[dict[str, int]] = {"generate": 20, "stream": 15, "branch": 18, "score": 12,
                                         "score_choices": 10, "bad": 15, "cycle": 3, "eval": 7}

    def __init__(self, soak: Soak, index: int) -> None:
        self.soak = soak
        self.index = index
        self.place = index % soak.cfg.workers
        self.rng = random.Random(soak.cfg.seed * 1000 + index)
        self.ctx: Context | None = None
        self.bctx: Context | None = None
        self.model: Model | None = None
        self.epoch = -1
        # Roughly how many tokens the generation context holds (an upper bound): appends and evals stop
        # short of n_ctx, so a good call never overflows.
        self.fill = 0
        # Whether the context holds the logits of its last position, which score_choices needs: a
        # generation, score or eval that ended normally leaves them; an interrupt or a reset does not.
        self.primed = False
        self.rounds_left = 0
        self.warm = threading.Event()
        self.go = threading.Event()

    def drop(self) -> None:
        self.ctx = self.bctx = self.model = None

    def run(self) -> None:
        ops = list(self.WEIGHTS)
        weights = list(self.WEIGHTS.values())
        try:
            for _ in range(self.rounds_left):  # the warm-up: each kind once, in order
                for op in ops:
                    if self._contexts():
                        getattr(self, "op_" + op)()
        finally:
            self.warm.set()
        self.go.wait()
        while not self.soak.stop.is_set():
            if not self._contexts():
                continue
            getattr(self, "op_" + self.rng.choices(ops, weights)[0])()

    def _contexts(self) -> bool:
        """Makes sure the contexts live on the place's current instance; False when there is none yet."""
        soak = self.soak
        with soak.cond:
            slot = soak.slots[self.place] if soak.slots else None
            if slot is None or not slot.ready:
                soak.cond.wait(0.2)
                return False
            if not slot.instance.alive:
                soak.cond.wait(0.2)  # its death is being handled
                return False
            if self.ctx is not None and slot.epoch == self.epoch and self.ctx.instance.alive:
                return True
            epoch, models = slot.epoch, dict(slot.models)
        self.drop()
        self.model = models[self.rng.choice(sorted(models))]
        n_ctx = soak.cfg.n_ctx
        model = self.model
        ok, ctx, _ = soak.call("new_context", lambda: model.new_context(n_ctx=n_ctx))
        ok2, bctx, _ = soak.call("new_context", lambda: model.new_context(n_ctx=n_ctx, n_seq_max=4))
        if not (ok and ok2):
            return False
        self.ctx, self.bctx, self.epoch, self.fill, self.primed = ctx, bctx, epoch, 0, False
        return True

    def _interrupt_soon(self, fn: Callable[[], None], kind: str) -> None:
        assert self.soak.scheduler is not None
        self.soak.ledger.count(self.soak.interrupts, kind)
        self.soak.scheduler.at(self.rng.uniform(0.005, 0.4), fn)

    STEP = 64  # tokens a prompt of PROMPTS (BOS included) and a generation of up to 48 take at most

    def _room(self) -> bool:
        return self.fill + self.STEP <= self.soak.cfg.n_ctx

    def _timeout(self) -> float | None:
        return self.rng.uniform(0.05, 0.6) if self.rng.random() < 0.12 else None

    def _count_interrupted(self, value: object) -> bool:
        if getattr(value, "stop_reason", None) == "interrupted":
            with self.soak.ledger._lock:
                self.soak.ledger.interrupted_results += 1
            return True
        return False

    # -- the operations -------------------------------------------------------------------------------
    def op_generate(self) -> None:
        ctx, rng = self.ctx, self.rng
        assert ctx is not None
        if rng.random() < 0.15:
            self._interrupt_soon(ctx.interrupt, "context.interrupt")
        kw: dict[str, Any] = {"n_predict": rng.randint(4, 40), "timeout": self._timeout()}
        if rng.random() < 0.5:
            kw.update(temperature=0.8, top_k=40, seed=rng.randrange(1 << 30))
        kw["append"] = rng.random() < 0.3 and self._room()
        self.fill = self.fill + self.STEP if kw["append"] else self.STEP
        prompt = rng.choice(PROMPTS)
        ok, result, _ = self.soak.call("generate", lambda: ctx.generate(prompt, **kw))
        self.primed = ok and not self._count_interrupted(result)

    def op_stream(self) -> None:
        ctx, rng = self.ctx, self.rng
        assert ctx is not None
        n_predict, timeout = rng.randint(4, 48), self._timeout()
        self.fill = self.STEP
        close_at = rng.randint(1, 8) if rng.random() < 0.15 else None
        remote = rng.random() < 0.2

        def run() -> object:
            stream = ctx.stream(rng.choice(PROMPTS), n_predict=n_predict, timeout=timeout)
            if remote:
                self._interrupt_soon(stream.close, "stream.close")
            for i, _ in enumerate(stream):
                if close_at is not None and i + 1 >= close_at:
                    stream.close()
                    break
            return stream.result

        ok, result, _ = self.soak.call("stream", run)
        self.primed = ok and not self._count_interrupted(result)

    def op_branch(self) -> None:
        bctx, rng, soak = self.bctx, self.rng, self.soak
        assert bctx is not None
        if len(bctx.branches):
            ok, _, _ = soak.call("context_reset", bctx.reset)  # what an interrupted or failed round left
            if not ok:
                return
        ok, root, _ = soak.call("branch_create", lambda: bctx.branch(
            rng.choice(PROMPTS), temperature=0.8, top_k=40, seed=rng.randrange(1 << 30)))
        if not ok or root is None:
            return
        kids = []
        for i in range(2):
            ok, kid, _ = soak.call("branch_fork", lambda i=i: root.fork(reseed=i + 1))  # type: ignore[misc]
            if not ok or kid is None:
                return
            kids.append(kid)
        if rng.random() < 0.15:
            self._interrupt_soon(bctx.interrupt, "branch.interrupt")
        for _ in range(rng.randint(2, 10)):
            if rng.random() < 0.5:
                ok, _, _ = soak.call("branch_step", lambda: bctx.branches.step(kids))
            else:
                kid = rng.choice(kids)
                ok, produced, _ = soak.call("branch_produce", kid.produce)
                if ok and produced is not None and not produced.is_stop:
                    token = produced.token
                    ok, _, _ = soak.call("branch_commit", lambda k=kid, t=token: k.commit(t))  # type: ignore[misc]
            if not ok:
                return
        soak.call("branch_prune", root.prune_subtree)

    def op_score(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        text, timeout = self.rng.choice(PROMPTS), self._timeout()
        self.fill = self.STEP
        self.primed, _, _ = self.soak.call("score", lambda: ctx.score(text, timeout=timeout))

    def op_score_choices(self) -> None:
        if not self.primed:
            self.op_score()
            if not self.primed:
                return
        ctx = self.ctx
        assert ctx is not None
        choices = self.rng.sample(CHOICES, self.rng.randint(2, 4))
        self.soak.call("score_choices", lambda: ctx.score_choices(choices, timeout=self._timeout()))

    def op_eval(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        if self.rng.random() < 0.15:
            self._interrupt_soon(ctx.interrupt, "context.interrupt")
        if not self._room():
            ok, _, _ = self.soak.call("context_reset", ctx.reset)
            self.primed = False
            if not ok:
                return
            self.fill = 0
        self.fill += self.STEP
        text = self.rng.choice(PROMPTS)
        ok, result, _ = self.soak.call("eval", lambda: ctx.eval(text, timeout=self._timeout()))
        self.primed = ok and result is not None and not result.interrupted

    def op_cycle(self) -> None:
        """Frees the contexts and makes new ones on the same instance (context create/free cycles)."""
        ctx, bctx = self.ctx, self.bctx
        assert ctx is not None and bctx is not None
        self.soak.call("context_close", ctx.close)
        self.soak.call("context_close", bctx.close)
        self.ctx = None
        self.epoch = -1

    def op_bad(self) -> None:
        ctx, bctx, model = self.ctx, self.bctx, self.model
        assert ctx is not None and bctx is not None and model is not None
        n_vocab = model.n_vocab
        cases: Sequence[tuple[str, tuple[type[BaseException], ...], Callable[[], object]]] = (
            ("generate_token_id_past_vocab", (InvalidTokenError,),
             lambda: ctx.generate([1, n_vocab + 7], n_predict=2)),
            ("generate_negative_token_id", (InvalidTokenError,), lambda: ctx.generate([1, -3], n_predict=2)),
            ("generate_bad_grammar", (GrammarError,), lambda: ctx.generate("Hi", n_predict=2, grammar="root ::= (")),
            ("branch_bad_grammar", (GrammarError,), lambda: bctx.branch("Hi", grammar="root ::= [a-")),
            ("branch_token_id_past_vocab", (InvalidTokenError,), lambda: bctx.branch([1, n_vocab])),
            ("score_token_id_past_vocab", (InvalidTokenError,), lambda: ctx.score([1, 2, n_vocab + 1])),
            ("score_choices_token_id_past_vocab", (InvalidTokenError,),
             lambda: ctx.score_choices([[2], [n_vocab + 5]])),
            ("eval_token_id_past_vocab", (InvalidTokenError,), lambda: ctx.eval([n_vocab + 2])),
            ("prompt_longer_than_context", (ContextOverflowError,),
             lambda: ctx.generate("word " * (4 * self.soak.cfg.n_ctx), n_predict=2)),
            ("context_n_ctx_negative", (ContextError,), lambda: model.new_context(n_ctx=-5)),
            ("context_bad_n_seq_max", (ContextError,), lambda: model.new_context(n_ctx=256, n_seq_max=0)),
            ("context_unknown_pooling", (ContextError,),
             lambda: model.new_context(n_ctx=256, embeddings=True, pooling="nonsense")),
            *_bad_sampler_cases(ctx),
        )
        case, expect, fn = self.rng.choice(cases)
        self.soak.ledger.count(self.soak.ledger.bad_made, case)
        ok, value, _ = self.soak.call("bad:" + case, fn, bad=case, expect=expect)
        if ok and isinstance(value, Context):
            self.soak.call("context_close", value.close)  # accepted (reported): do not let it pile up


def _bad_sampler_cases(ctx: Context) -> list[tuple[str, tuple[type[BaseException], ...], Callable[[], object]]]:
    """Sampler parameters out of range, which the worker's native checks refuse: as InvalidArgumentError
    where the library has that type (before it, a plain ValueError, not a LloyalError: these cases are
    left out then)."""
    invalid = getattr(lloyal_pool, "InvalidArgumentError", None)
    if invalid is None:
        return []
    return [
        ("sampler_top_k_negative", (invalid,), lambda: ctx.generate("Hi", n_predict=2, top_k=-4)),
        ("sampler_min_p_above_one", (invalid,), lambda: ctx.generate("Hi", n_predict=2, min_p=3.0)),
        ("sampler_mirostat_unknown", (invalid,), lambda: ctx.generate("Hi", n_predict=2, mirostat=7)),
        ("sampler_repeat_last_n", (invalid,), lambda: ctx.generate("Hi", n_predict=2, repeat_last_n=-9)),
    ]


def find_models(names: Sequence[str]) -> dict[str, str]:
    """Paths of the named models: "gemma" (the default model), "tiny" (the suite's tiny random model)."""
    out = {}
    for name in names:
        if name == "gemma":
            from lloyal_pool import default_model_path

            out[name] = str(default_model_path())
        elif name == "tiny":
            sys.path.insert(0, str(ROOT / "tests"))
            from tinymodel import tiny_model_path  # type: ignore[import-not-found]

            out[name] = str(tiny_model_path(ROOT / ".cache" / "test-models"))
        else:
            out[Path(name).stem] = str(Path(name).resolve())
    return out


# -- output --------------------------------------------------------------------------------------------
def summary(report: dict[str, Any]) -> str:
    """The report in a few lines."""
    t, r = report["totals"], report["rss_mib"]
    lines = [
        f"soak: {report['duration_s']:.0f}s, {report['config']['threads']} threads on {report['config']['workers']} "
        f"workers ({', '.join(report['models'])}), a disruption every {report['config']['kill_every']:g}s",
        f"  calls {t['calls']} ({report['calls_per_second']:.1f}/s): results {t['results']}, typed errors "
        f"{t['typed_errors']}, LOST {t['lost']}",
        "  errors by type: " + ", ".join(f"{k} {v}" for k, v in report["errors_by_type"].items()),
        f"  bad inputs: {sum(report['bad_inputs']['made'].values())} made, "
        f"{sum(report['bad_inputs']['raised_expected_type'].values())} raised their type, "
        f"{sum(report['bad_inputs']['raised_other_lloyal_error'].values())} another LloyalError (worker gone), "
        f"{len(report['bad_inputs']['accepted'])} accepted",
        f"  interrupts scheduled: {report['interrupts']}; results ending 'interrupted': "
        f"{report['interrupted_results']}",
    ]
    kills = [d for d in report["disruptions"] if d["action"] == "SIGKILL"]
    stops = [d for d in report["disruptions"] if d["action"] == "SIGSTOP"]
    found = report["stop_found_after_s"]
    lines.append(f"  disruptions: {len(kills)} SIGKILL, {len(stops)} SIGSTOP (found after "
                 f"{min(found, default=0):.1f}-{max(found, default=0):.1f}s), "
                 f"{len(report['replacements'])} replacements")
    if report["unexpected_errors_on_good_calls"]:
        lines.append(f"  unexpected errors on good calls: {report['unexpected_errors_on_good_calls']}")
    lines.append(f"  parent RSS: {r['start']:.1f} MiB after warm-up -> {r['end']:.1f} MiB at the end "
                 f"(growth {r['growth']:+.1f}; anon {r['anon_start']:.1f} -> {r['anon_end']:.1f}; "
                 f"max {r['max']:.1f}); {r['after_close']:.1f} after close")
    leaked = {k: v for k, v in report["leaks"].items() if v}
    lines.append(f"  leaked after close: {leaked or 'nothing'}")
    for name, tgt in report["targets"].items():
        lines.append(f"  target {name}: {tgt['value']} (want {tgt['target']}) {'ok' if tgt['met'] else 'MISSED'}")
    for lost in report["lost"][:5]:
        lines.append(f"  LOST {lost['op']} on {lost['thread']} at {lost['since_s']}s: {lost['how']}\n"
                     + lost["error"][-800:])
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Draws calls and errors per second and the parent's RSS, with each kill and stop marked. False
    (nothing drawn) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    per_s = report["timeline"]
    xs = list(range(len(per_s)))
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(12, 8), sharex=True)
    ax1.plot(xs, [s.get("ok", 0) + s.get("error", 0) + s.get("lost", 0) for s in per_s], lw=0.8, label="calls")
    ax1.plot(xs, [s.get("ok", 0) for s in per_s], lw=0.8, label="results")
    ax1.set_ylabel("calls / s")
    for key, label in (("worker", "worker died / stale"), ("interrupt", "timeout / interrupted"),
                       ("bad", "bad input (typed)"), ("other", "other typed"), ("lost", "LOST")):
        ys = [s.get(key, 0) for s in per_s]
        if any(ys):
            ax2.plot(xs, ys, lw=0.8, label=label)
    ax2.set_ylabel("errors / s")
    samples = report["rss_mib"]["samples"]
    ax3.plot([s[0] for s in samples], [s[1] for s in samples], lw=1, label="RSS")
    ax3.plot([s[0] for s in samples], [s[2] for s in samples], lw=1, label="anonymous")
    ax3.set_ylabel("parent MiB")
    ax3.set_xlabel("seconds")
    for ax in (ax1, ax2, ax3):
        for d in report["disruptions"]:
            kill = d["action"].startswith("SIGKILL")
            ax.axvline(d["t"], color="red" if kill else "orange", ls="-" if kill else "--", lw=0.7)
            if not kill and d["died_t"] is not None:
                ax.axvline(d["died_t"], color="purple", ls=":", lw=0.7)
        ax.legend(loc="upper right", fontsize=7)
    t = report["totals"]
    ax1.set_title(f"soak: {t['calls']} calls, {t['typed_errors']} typed errors, {t['lost']} lost; red: SIGKILL, "
                  f"orange: SIGSTOP, purple: the stop found hung", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--threads", type=int, default=16, help="client threads (default 16)")
    ap.add_argument("--workers", type=int, default=3, help="workers (default 3)")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between disruptions (default 20)")
    ap.add_argument("--hang-timeout", type=float, default=3.0, help="the pool's hang_timeout (default 3)")
    ap.add_argument("--stop-ratio", type=float, default=0.5, help="share of disruptions that are SIGSTOP")
    ap.add_argument("--models", default="gemma,tiny", help="gemma, tiny or GGUF paths, comma-separated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json-out", default=str(ROOT / "bench" / "results" / "soak.json"))
    ap.add_argument("--png-out", default=str(ROOT / "bench" / "results" / "soak.png"))
    args = ap.parse_args(argv)
    cfg = SoakConfig(duration=args.duration, threads=args.threads, workers=args.workers,
                     kill_every=args.kill_every, hang_timeout=args.hang_timeout, stop_ratio=args.stop_ratio,
                     models=tuple(m for m in args.models.split(",") if m), seed=args.seed)
    report = Soak(cfg).run()
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    drawn = plot(report, Path(args.png_out))
    print(summary(report))
    print(f"report: {out}" + (f"; plot: {args.png_out}" if drawn else "; no plot (matplotlib is not installed)"))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
