"""Pool: N worker processes, each an Instance, started with one set of options and closed together; it
routes batched requests among them, replaces dead workers, recovers crashed ones (recover=True) and takes
snapshots."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from . import variants
from ._aio import closed_in_thread
from ._batched import BatchedCalls
from ._core import WorkerCore
from ._futures import check_timeout
from ._launch import LOG_LEVELS, TempRoot, WorkerOptions
from ._process import WorkerProcess
from ._watch import HangWatch
from .batching import Batcher
from .context import Context
from .errors import InvalidArgumentError, LloyalError, PoolClosedError, WorkerCrashedError
from .instance import Instance
from .lifecycle import Subscribers, WorkerEvent
from .lora import LoraAdapter
from .model import Model
from .routing import ROUTER
from .shm import DEFAULT_SIZE, check_size
from .snapshot import Snapshot
from .spares import Spare, Spares
from .variants import fork_obstacle

#: The most threads a context takes (ggml's GGML_MAX_N_THREADS).
MAX_THREADS = 512


def _check_options(size: int, shm_bytes: object, shm_backend: object, threads_per_worker: object,
                   memory_limit: object, start_timeout: object, native_log_level: object,
                   choices: Mapping[str, object], flags: Mapping[str, object]) -> None:
    """Pool options that would otherwise be taken silently (a negative thread count, an unknown log level,
    the string "no" for a flag), fail later as a bare TypeError, or bring on the OOM killer (a region
    larger than the machine holds). ``choices``: the options that name something (variant, cpu): a str
    or None each, resolved by variants.py."""
    if threads_per_worker is not None and (isinstance(threads_per_worker, bool) or not isinstance(
            threads_per_worker, int) or not 1 <= threads_per_worker <= MAX_THREADS):
        raise InvalidArgumentError(f"threads_per_worker must be an int in [1, {MAX_THREADS}] or None (the CPUs "
                                   f"shared among the workers), got {threads_per_worker!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)
                                     or memory_limit <= 0):
        raise InvalidArgumentError(f"memory_limit is a positive int of bytes or None, got {memory_limit!r}")
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
        raise InvalidArgumentError(f"start_timeout is a number of seconds > 0, got {start_timeout!r}")
    if native_log_level not in LOG_LEVELS:
        raise InvalidArgumentError(f"native_log_level is one of {', '.join(LOG_LEVELS)}; got {native_log_level!r}")
    for name, value in choices.items():
        if value is not None and not isinstance(value, str):
            raise InvalidArgumentError(f"{name} is a str or None, got {value!r}")
    for name, value in flags.items():
        if not isinstance(value, bool) and not (name == "strict_variant" and value is None):
            raise InvalidArgumentError(f"{name} is True or False, got {value!r}")
    if shm_backend not in ("auto", "memfd", "posix"):
        raise InvalidArgumentError(f"shm_backend is 'auto', 'memfd' or 'posix', got {shm_backend!r}")
    check_size(shm_bytes, shm_backend, size)


def _dirs(name: str, dirs: object) -> tuple[str, ...]:
    """Directories as real paths. A lone path is refused rather than taken as a sequence of its
    characters, which would have made "/" (the first one) allowed."""
    if isinstance(dirs, (str, bytes, os.PathLike)):
        raise InvalidArgumentError(f"{name} is a list of directories; got the single path {dirs!r}: "
                                   f"write [{dirs!r}]")
    try:
        items = list(dirs)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(f"{name} is a list of directories, got {dirs!r}") from None
    for d in items:
        if not isinstance(d, (str, os.PathLike)):
            raise InvalidArgumentError(f"{name}: {d!r} is not a path")
    return tuple(os.path.realpath(os.fspath(d)) for d in items)


def _close_procs(procs: list[WorkerProcess], timeout: float, watch: HangWatch | None = None,
                 temp: TempRoot | None = None, cores: list[WorkerCore] | None = None) -> None:
    # Module-level and holding no reference to the Pool, so weakref.finalize can run it after the Pool is
    # collected or at interpreter exit. What runs is interrupted first, so that each worker reads its
    # SHUTDOWN at once instead of after the generation it runs.
    if watch is not None:
        watch.stop()
    for core in cores or ():
        core.shutdown()
    threads = [threading.Thread(target=p.close, args=(timeout,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    procs.clear()
    for core in cores or ():
        core.closed(PoolClosedError("the pool was closed"))
    if temp is not None:
        temp.close()



def _death_relay(pool_ref: weakref.ref[Pool]) -> Callable[[WorkerProcess, WorkerCrashedError], None]:
    # A weak reference: a worker's reader thread must not keep its pool alive.
    def on_death(proc: WorkerProcess, error: WorkerCrashedError) -> None:
        pool = pool_ref()
        if pool is not None:
            pool._emit(WorkerEvent("died", proc.worker_id, proc.pid, error=error))

    return on_death


class Pool(BatchedCalls, Subscribers):
    """N worker processes, each an isolated engine instance. The constructor starts ``size`` workers and
    blocks until every one has completed its handshake (WorkerStartupError otherwise, after the others
    are stopped); ``Pool(0)`` starts none, for an application that only forks snapshots. ``pool[i]`` is
    the i-th Instance. ``generate``/``stream``/``submit`` (and their asyncio twins) route independent
    requests to the live workers that hold the model, batched in each.

    ``variant``: the GPU backend ("cuda", "vulkan", "auto"; default LLOYAL_POOL_VARIANT, else "cpu"),
    falling back to the CPU unless ``strict_variant``. ``cpu``: the level of ggml's CPU kernels ("auto",
    the best this CPU runs, or a level this install holds such as "haswell"; default LLOYAL_POOL_CPU,
    else "auto"). ``shm_bytes``: each worker's shared-memory
    region for logits and embeddings (``shm_backend``: "memfd", "posix" or "auto"), a row of n_vocab * 4
    bytes per context and per branch (lloyal_pool.shm_bytes_for), allocated up front: at least 12 KiB,
    and for all workers together no more than the machine has available (InvalidArgumentError). ``memory_limit``: a
    cap in bytes on a worker's data (RLIMIT_DATA), so that it fails an allocation instead of growing (a
    context that does not fit raises ContextError naming memory_limit). ``start_timeout``: seconds a
    worker has for its handshake. ``env``: a worker's whole environment, empty by default (the interpreter
    needs none of ours); a value of None passes our value of that variable through, if we have one
    (e.g. ``env={"CUDA_VISIBLE_DEVICES": None}``). ``native_log_level``:
    the llama.cpp messages forwarded to the ``lloyal_pool.worker.<id>`` loggers ("debug" ... "none").
    ``threads_per_worker``: a context's default n_threads, 1 to 512 (default: the CPUs shared among the
    workers).
    ``hang_timeout``: seconds a worker with calls waiting may show no sign of life (its heartbeat, which
    it advances at every interrupt check of its decode and sampling loops and at every request) before
    the pool kills it and fails its calls with WorkerHungError; None turns the watch off. A single native
    step with no interrupt check (tokenizing hundreds of megabytes, a state of many gigabytes, a GPU
    kernel compile) must fit in it. ``subscribe()`` tells an application of deaths and replacements.
    ``recover``: a worker that dies is replaced in place, its models and contexts rebuilt
    (docs/RELIABILITY.md); ``spares``: that many spare workers kept ready, with the models the pool's
    workers hold loaded, which recovery takes instead of starting a worker (``pool.spares``);
    ``fork_spares``: None (default) forks spares from a zygote holding the pool's models where a worker
    can fork (as Pool.snapshot does: Linux, the CPU variant, CPU kernels without AMX), so that a spare is
    ready in milliseconds and a recovery that finds none ready forks one; False starts every spare cold;
    True insists (InvalidArgumentError where spares cannot fork);
    ``checkpoint_tokens``: a context is checkpointed (its state held in this process) whenever recovering
    it would decode that many prompt tokens' worth again (a generated token counting as 16): in the
    background after the call that grew its journal, and inside a context's generation (stream(),
    generate(), a chat turn), every that many tokens of its prompt and every 1/16 of that of its
    generation (docs/RELIABILITY.md), so that recovery loads the state instead of decoding it all again.
    ``max_resident_contexts``: session paging, at most that many contexts resident per worker: the least
    recently used idle one beyond it is paged out (its state saved into an unnamed file in ``page_dir``,
    default the system's temporary directory, held by this process) and its next call pages it in again
    (docs/PAGING.md; ``Context.paged``, ``Instance.stats()["paging"]``).

    Sandbox (Linux Landlock; ``Instance.sandbox`` says what a worker's kernel enforces): a worker writes
    only beneath its private temporary directory and ``writable_dirs`` (where save_state_file may write),
    and cannot bind or connect TCP sockets, nor create any IPv4/IPv6 socket (seccomp), unless ``network``.
    ``allowed_dirs``: the only directories (besides the Python installation and system libraries) it may
    read, models included; None (default) lets it read anywhere. ``sandbox=False`` turns all of it off.

    >>> with Pool(2) as pool:
    ...     model = pool[0].load_model("model.gguf")
    ...     ctx = model.new_context(n_ctx=2048)
    ...     print(ctx.generate("Once upon a time", n_predict=32).text)
    """

    def __init__(self, size: int = 1, *, variant: str | None = None, strict_variant: bool | None = None,
                 cpu: str | None = None, shm_bytes: int = DEFAULT_SIZE, shm_backend: str = "auto",
                 memory_limit: int | None = None,
                 start_timeout: float = 60.0, env: Mapping[str, str | None] | None = None,
                 native_log_level: str = "warning", threads_per_worker: int | None = None,
                 allowed_dirs: Sequence[str | os.PathLike[str]] | None = None,
                 writable_dirs: Sequence[str | os.PathLike[str]] = (), network: bool = False,
                 sandbox: bool = True, hang_timeout: float | None = 30.0, recover: bool = False,
                 spares: int = 0, fork_spares: bool | None = None, checkpoint_tokens: int | None = None,
                 max_resident_contexts: int | None = None, page_dir: str | os.PathLike[str] | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"a Pool's size is an int of workers >= 0 (0: only snapshots' forks), "
                                       f"got size={size!r}")
        if checkpoint_tokens is not None and (isinstance(checkpoint_tokens, bool) or not isinstance(
                checkpoint_tokens, int) or checkpoint_tokens < 1):
            raise InvalidArgumentError(f"checkpoint_tokens is an int >= 1 or None, got {checkpoint_tokens!r}")
        self._checkpoint_tokens = checkpoint_tokens
        if max_resident_contexts is not None and (isinstance(max_resident_contexts, bool) or not isinstance(
                max_resident_contexts, int) or max_resident_contexts < 1):
            raise InvalidArgumentError(f"max_resident_contexts is an int >= 1 or None, got {max_resident_contexts!r}")
        if page_dir is not None and not (isinstance(page_dir, (str, os.PathLike)) and os.path.isdir(page_dir)
                                         and os.access(page_dir, os.W_OK)):
            raise InvalidArgumentError(f"page_dir is a writable directory or None, got {page_dir!r}")
        self._paging = (max_resident_contexts,
                        os.path.realpath(tempfile.gettempdir() if page_dir is None else os.fspath(page_dir)))
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise InvalidArgumentError(f"spares is an int of ready workers >= 0, got spares={spares!r}")
        if fork_spares is not None and not isinstance(fork_spares, bool):
            raise InvalidArgumentError(f"fork_spares is True, False or None, got {fork_spares!r}")
        if hang_timeout is not None and (isinstance(hang_timeout, bool) or not isinstance(
                hang_timeout, (int, float)) or not hang_timeout > 0):
            raise InvalidArgumentError(f"hang_timeout is a number of seconds > 0 or None, got {hang_timeout!r}")
        for name, value in (env or {}).items():
            if not isinstance(name, str) or not name or "=" in name or "\0" in name:
                raise InvalidArgumentError(f"env: {name!r} is not an environment variable name")
            if value is not None and (not isinstance(value, str) or "\0" in value):
                raise InvalidArgumentError(f"env[{name!r}] must be a str, or None to pass ours through; got {value!r}")
        _check_options(size, shm_bytes, shm_backend, threads_per_worker, memory_limit, start_timeout,
                       native_log_level, {"variant": variant, "cpu": cpu},
                       {"strict_variant": strict_variant, "network": network, "sandbox": sandbox, "recover": recover})
        if threads_per_worker is None:
            # Workers that together ask for more threads than there are CPUs make llama.cpp's spinning
            # thread barriers stall each other (10x slower on a loaded 2-core machine): share the CPUs.
            threads_per_worker = max(1, len(os.sched_getaffinity(0)) // max(size, 1)) if hasattr(
                os, "sched_getaffinity") else None
        self._options = WorkerOptions(variant=variants.requested(variant),
                                      strict_variant=variants.strict_requested(strict_variant),
                                      cpu=variants.requested_cpu(cpu), shm_bytes=shm_bytes,
                                      shm_backend=shm_backend, memory_limit=memory_limit,
                                      start_timeout=start_timeout, env=dict(env or {}),
                                      native_log_level=native_log_level, threads=threads_per_worker,
                                      allowed_dirs=None if allowed_dirs is None else _dirs("allowed_dirs",
                                                                                           allowed_dirs),
                                      writable_dirs=_dirs("writable_dirs", writable_dirs),
                                      network=network, sandbox=sandbox)
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._all_procs: list[WorkerProcess] = []  # everything started, for the finalizer
        self._instances: list[Instance] = []
        self._closed = False
        self._next_worker_id = 0
        self._subscribers: list[Callable[[WorkerEvent], None]] = []
        self._subscribers_lock = threading.Lock()
        self._temp = TempRoot()
        self._options = dataclasses.replace(self._options, temp_root=self._temp.path)
        self.hang_timeout = hang_timeout
        #: Whether crash recovery is on (Pool(recover=True)).
        self.recover = bool(recover)
        self._watch = None if hang_timeout is None else HangWatch(self._all_procs, float(hang_timeout))
        self._spares = Spares(spares, self._ready_worker, self._held_models, self._release)
        self._cores: list[WorkerCore] = []  # every instance's, for the finalizer
        self._host = _Host(weakref.ref(self))
        self._finalizer = weakref.finalize(self, _close_procs, self._all_procs, 5.0, self._watch, self._temp,
                                           self._cores)
        try:
            procs = [self._spawn() for _ in range(size)]  # start all, then wait: start-ups overlap
            for proc in procs:
                proc.wait_ready()
        except BaseException:
            self.close()
            raise
        self._instances = [self._instance(p) for p in procs]
        why_not = "fork_spares=False" if fork_spares is False else self._why_no_fork()
        if fork_spares and why_not:
            self.close()
            raise InvalidArgumentError(f"fork_spares=True, but spares cannot fork here: {why_not}")
        self._spares.start(fork=why_not is None)

    def _instance(self, proc: WorkerProcess) -> Instance:
        budget, page_dir = self._paging
        core = WorkerCore(proc, recover=self.recover, checkpoint_tokens=self._checkpoint_tokens, budget=budget,
                          page_dir=page_dir, host=self._host)
        with self._lock:
            self._cores.append(core)
        instance = Instance(proc, core)
        instance._reroute = self._host.reroute
        if self._spares.wanted:  # weakly: the instance's core outlives the pool in its finalizer's hands
            sync = weakref.WeakMethod(self._spares.sync)

            def loaded() -> None:
                fn = sync()
                if fn is not None:
                    fn()

            instance._on_model_loaded = loaded
        return instance

    def _why_no_fork(self) -> str | None:
        # Its workers all run the same CPU kernels: a live one says which.
        build: dict[str, Any] = next((inst.build_info for inst in self._instances if inst.alive), {})
        return fork_obstacle(self._options.variant, build)

    def _ready_worker(self, fork_from: WorkerProcess | None = None, zygote: bool = False) -> WorkerProcess:
        """A started worker (a spare, or a spares' zygote with ``zygote``; forked from the frozen zygote
        ``fork_from``), its handshake done."""
        proc = self._spawn(zygote=zygote, fork_from=fork_from)
        try:
            proc.wait_ready()
        except BaseException:
            self._release(proc)
            raise
        return proc

    def _held_models(self) -> list[Model]:
        return [m for inst in list(self._instances) if inst.alive for m in inst.models]

    @property
    def spares(self) -> int:
        """How many spare workers (Pool(spares=N)) are ready now: started, with the models the pool's
        workers hold loaded. Crash recovery (recover=True) takes one instead of starting a worker, and
        another starts in the background."""
        return self._spares.ready

    def _spawn(self, *, zygote: bool = False, fork_from: WorkerProcess | None = None) -> WorkerProcess:
        with self._lock:
            if self._closed:
                raise PoolClosedError("the pool is closed")
            worker_id = self._next_worker_id
            self._next_worker_id += 1
        proc = WorkerProcess(worker_id, self._options, zygote=zygote, fork_from=fork_from)
        proc.on_death = _death_relay(weakref.ref(self))
        with self._lock:
            self._all_procs.append(proc)
        return proc

    def _release(self, proc: WorkerProcess, timeout: float = 5.0) -> None:
        proc.close(timeout)
        with self._lock:
            if proc in self._all_procs:
                self._all_procs.remove(proc)

    def snapshot(self, prepare: Callable[[Instance], Mapping[str, Model | Context | LoraAdapter] | None], *,
                 fork: bool | None = None) -> Snapshot:
        """Runs ``prepare(instance)`` once in a fresh worker of this pool's options (load models, create
        contexts, prefill a long system prompt) and keeps it as a Snapshot, whose ``fork()`` returns new
        instances that hold the same models and contexts, ready. prepare() may return a mapping of names
        to the Model, Context and LoraAdapter handles it made: a fork's ``instance.prepared`` holds them
        by name. The snapshot and its forks belong to this pool (its close() ends them) but not to its
        list of instances.

        ``fork``: None (default) forks the prepared worker where it can (Linux, CPU variant, CPU kernels
        without AMX), else replays; True insists on forking (SnapshotError where it cannot); False replays:
        each fork is a fresh worker that loads the models and the named contexts' saved state. When forking, whatever
        prepare() decodes runs on one thread (docs/SNAPSHOTS.md says why). SnapshotError when prepare()
        returns anything else; prepare()'s own exceptions propagate; either way the worker is closed."""
        if self._closed:
            raise PoolClosedError("the pool is closed")
        return Snapshot(prepare, spawn=self._spawn, release=self._release, closed=lambda: self._closed,
                        why_no_fork=self._why_no_fork(), fork=fork)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._instances)

    def __getitem__(self, index: int) -> Instance:
        return self._instances[index]

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._instances))

    @property
    def instances(self) -> list[Instance]:
        """The workers, in index order (a copy: replace() changes the pool, not this list)."""
        return list(self._instances)

    def replace(self, instance: Instance | int) -> Instance:
        """Starts a fresh worker in the place of ``instance`` (dead or alive; a live one is closed).
        Handles from the old worker stay stale; models must be loaded again."""
        if self._closed:
            raise PoolClosedError("the pool is closed")
        index = instance if isinstance(instance, int) else self._instances.index(instance)
        gone = self._instances[index]
        old = gone._proc
        gone.close(timeout=2.0)
        proc = self._spawn()
        proc.wait_ready()
        fresh = self._instance(proc)
        with self._lock:
            self._instances[index] = fresh
            if old in self._all_procs:
                self._all_procs.remove(old)
            if gone._core in self._cores:
                self._cores.remove(gone._core)
        self._emit(WorkerEvent("replaced", proc.worker_id, proc.pid, instance=fresh, index=index))
        return fresh

    def drain(self, instance: Instance | int, *, timeout: float | None = None) -> Instance:
        """Retires a worker without losing anything on it (a rolling restart, a worker that grew too
        large): starts a fresh worker, loads there the models and LoRA adapters the old one holds, moves
        every context of the old one to it (Context.move_to: a stream running or paused on one goes on
        there), puts it in the old one's place, so that new batched requests go to it, lets the old
        one's batched requests end (at most ``timeout`` seconds; then they fail with PoolClosedError),
        and closes the old worker. Returns the fresh Instance. A context that cannot move (branches, a
        mirostat stream) raises its error before the old worker is closed: the pool is left with the
        fresh worker in place and the old one still serving what did not move, outside the pool's list
        (move or close what is left on it, then close it: Instance.close)."""
        check_timeout(timeout)
        with self._drain_lock:  # two drains of one slot would each put their own fresh worker there
            if self._closed:
                raise PoolClosedError("the pool is closed")
            if isinstance(instance, int):
                if not -len(self._instances) <= instance < len(self._instances):
                    raise InvalidArgumentError(f"the pool has no worker {instance}: it has "
                                               f"{len(self._instances)}")
                index = instance
            elif instance in self._instances:
                index = self._instances.index(instance)
            else:
                raise InvalidArgumentError(f"worker {instance.worker_id} is not in the pool (drained or "
                                           "replaced already)")
            return self._drain(index, timeout)

    def _drain(self, index: int, timeout: float | None) -> Instance:
        old = self._instances[index]
        proc = self._spawn()
        try:
            proc.wait_ready()
            fresh = self._instance(proc)
            for model in old.models:
                loaded = fresh._load_like(model)
                for adapter in model.loras:
                    loaded.load_lora(adapter.path)
        except BaseException:
            self._release(proc)
            raise
        with self._lock:
            self._instances[index] = fresh
        self._emit(WorkerEvent("replaced", proc.worker_id, proc.pid, instance=fresh, index=index))
        old._core.step(old._core.machine.refuse_moves)  # no context moves in from here on
        # Everything that can move does, before the first refusal is raised (and made on the old worker
        # meanwhile, too).
        refused: dict[Context, LloyalError] = {}
        while left := [c for c in old.drain_contexts() if c not in refused]:
            for ctx in left:
                try:
                    ctx.move_to(fresh)
                except LloyalError as exc:
                    if ctx.instance is old:  # not closed or moved by another thread meanwhile
                        refused[ctx] = exc
        for ctx, refusal in refused.items():
            if not ctx.closed and ctx.instance is old:
                raise refusal
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(m._batcher is not None and m._batcher.load for m in old.models) and old.alive and (
                deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)
        old.close()
        self._release(old._proc)
        with self._lock:
            if old._core in self._cores:
                self._cores.remove(old._core)
        return fresh

    def _route(self, model: Model | str | None, prompt: str | Sequence[int],
               lora: Iterable[str] = ()) -> tuple[Batcher, list[int]]:
        if self._closed:
            raise PoolClosedError("the pool is closed")
        if isinstance(model, Model):
            return model.instance._route(model, prompt)
        adapters = list(lora)
        batchers: list[Batcher] = []
        reasons: list[str] = []
        for inst in self._instances:
            if not inst.alive:
                reasons.append(f"worker {inst.worker_id} is dead")
                continue
            try:
                chosen = inst._model(model)
                for name in adapters:  # a worker whose model has not loaded the adapter cannot take it
                    chosen.lora(name)
                batchers.append(chosen.batcher())
            except LloyalError as exc:
                reasons.append(str(exc))
        if not batchers:
            raise InvalidArgumentError("no live worker can take the request: " + "; ".join(reasons))
        tokens = batchers[0].tokens(prompt)
        return ROUTER.pick(batchers, tokens), tokens

    def stats(self) -> list[dict[str, Any]]:
        """Instance.stats() of every worker, in index order."""
        return [inst.stats() for inst in self._instances]

    def close(self, timeout: float = 5.0) -> None:
        """Ends every worker (shutdown, then kill after timeout), reaps every process and frees every
        shared-memory region. Idempotent; also runs at interpreter exit."""
        self._closed = True
        self._spares.close()
        for inst in list(self._instances):
            inst._stop_batchers(PoolClosedError("the pool was closed while the request ran"))
        _close_procs(self._all_procs, timeout, self._watch, self._temp, self._cores)
        self._finalizer.detach()

    async def aclose(self, timeout: float = 5.0) -> None:
        """close() for asyncio: workers end on a thread of the loop's executor while other tasks go on."""
        await closed_in_thread(self.close, timeout)

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether close() was called; calls on the pool's handles then raise PoolClosedError."""
        return self._closed

    @property
    def temp_dir(self) -> str:
        """The pool's temporary directory, which holds each worker's private one (its working directory,
        the only place it may write besides ``writable_dirs``). close() removes it, and should this
        process die without closing the pool, a janitor process (a shell waiting on a pipe) does."""
        return self._temp.path



class _Host:
    """What a worker's core asks of the pool when its worker dies under recovery (_core.Host). It holds
    the pool weakly: a pool dropped without close() is not kept alive by its workers."""

    def __init__(self, pool: weakref.ref[Pool]) -> None:
        self._pool = pool

    def _live(self) -> Pool:
        pool = self._pool()
        if pool is None or pool._closed:
            raise PoolClosedError("the pool is closed")
        return pool

    def replacement(self) -> tuple[WorkerProcess, Spare | None]:
        pool = self._live()
        spare = pool._spares.take()
        if spare is not None:
            return spare.proc, spare  # ready: its handshake is done
        proc = pool._spawn()
        try:
            proc.wait_ready()
        except BaseException:
            pool._release(proc)
            raise
        return proc, None

    def reroute(self, model: Model) -> Batcher | None:
        """A live worker's batcher of the same model file, the least loaded (the batched requests of a
        worker that died go on there); None when there is none."""
        pool = self._pool()
        if pool is None or pool._closed:
            return None
        best: Batcher | None = None
        for inst in pool.instances:
            if inst is model.instance or not inst.alive:
                continue
            for other in inst.models:
                if other.path == model.path and not other._load.vocab_only:
                    try:
                        batcher = other.batcher()
                    except LloyalError:
                        continue
                    if best is None or batcher.load < best.load:
                        best = batcher
        return best

    def adopted(self, dead: WorkerProcess, proc: WorkerProcess) -> None:
        pool = self._pool()
        dead.close(timeout=1.0)
        if pool is not None:
            with pool._lock:
                if dead in pool._all_procs:
                    pool._all_procs.remove(dead)

    def recovered(self, core: WorkerCore, dead: WorkerProcess, error: WorkerCrashedError, replayed: int) -> None:
        pool = self._pool()
        if pool is None:
            return
        instance = next((i for i in pool._instances if i._core is core), None)
        index = next((k for k, i in enumerate(pool._instances) if i is instance), None)
        proc = core.proc
        pool._spares.fill_after([], at_most=5.0, idle=lambda: proc.in_flight == 0)
        pool._emit(WorkerEvent("recovered", proc.worker_id, proc.pid, error=error, instance=instance, index=index))
