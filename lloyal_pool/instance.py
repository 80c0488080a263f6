"""Instance: one worker process, an isolated engine that loads models and runs batched requests on them."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from . import protocol as p
from ._aio import settle
from ._batched import BatchedCalls
from ._core import WorkerCore
from ._files import beneath, irregular_path
from ._futures import check_timeout, events, mapped, wait
from ._process import WorkerProcess
from .batching import Batcher
from .context import Context
from .errors import (
    BadRequestError,
    InvalidArgumentError,
    LloyalError,
    ModelLoadError,
    PoolClosedError,
    StaleHandleError,
)
from .lora import LoraAdapter
from .migration import move
from .model import MemorySource, Model, ModelBytes
from .params import Device, whole

ProgressCallback = Callable[[float], None]
"""Model loading progress: the fraction loaded, 0.0 to 1.0."""


class Instance(BatchedCalls):
    """One worker process: an isolated engine that may hold several models and many contexts.
    ``generate``/``stream``/``submit`` (and ``agenerate``/``astream``) run independent requests on a
    model's Batcher: continuous batching in this worker."""

    def __init__(self, proc: WorkerProcess, core: WorkerCore | None = None) -> None:
        # The owner of everything this worker holds (a recovery gives it a replacement worker).
        self._core = core if core is not None else WorkerCore(proc)
        self._prepared: dict[str, Model | Context | LoraAdapter] = {}
        # The models loaded and not closed (a Model dropped without close() is still loaded): what crash
        # recovery loads again, and what a batched request may name.
        self._models: set[Model] = set()
        self._on_model_loaded: Callable[[], None] | None = None  # the pool's: its spares load the model too
        # The pool's: a live worker's batcher of a model, for the batched requests of one that died.
        self._reroute: Callable[[Model], Batcher | None] | None = None

    @property
    def _proc(self) -> WorkerProcess:
        """The worker process serving this instance now."""
        return self._core.proc

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"<Instance worker={self.worker_id} pid={self.pid} variant={self.variant} {state}>"

    @property
    def worker_id(self) -> int:
        """The worker's number in its pool, unique per Pool (a replacement gets a new one)."""
        return int(self._proc.worker_id)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return int(self._proc.pid)

    @property
    def alive(self) -> bool:
        """False once the worker has died or its pool was closed; then its handles are stale."""
        return self._proc.alive

    @property
    def variant(self) -> str:
        """The GPU backend the worker runs on ("cuda", "vulkan"), or "cpu": the one asked for, or "cpu"
        when that one could not load and the pool is not strict."""
        return str(self._proc.hello.get("variant"))

    @property
    def cpu_kernels(self) -> str:
        """The level of ggml's CPU kernels the worker runs ("haswell", "sapphirerapids", ...): the best
        this CPU runs, or the one the pool's ``cpu`` named. ``build_info["cpu"]`` says why, and which
        instruction sets they use."""
        return str(self.build_info.get("cpu", {}).get("kernels", ""))

    @property
    def threads(self) -> int:
        """The n_threads a context in this worker gets unless it asks for another number."""
        return int(self._proc.hello.get("threads", 0))

    @property
    def build_info(self) -> dict[str, Any]:
        """What the handshake reported: llama.cpp build, system info, default threads, and ``cpu``: the CPU
        kernels (``kernels``, the level; ``requested``; ``reason``; ``features``, the instruction sets)."""
        return dict(self._proc.hello.get("build", {}))

    @property
    def sandbox(self) -> dict[str, Any]:
        """What confines the worker, as it reported after applying it: ``landlock`` (the kernel's Landlock
        ABI, 0 where it has none), ``writes_scoped`` (writes only beneath its private directory and the
        pool's ``writable_dirs``), ``reads_scoped`` (reads only beneath ``allowed_dirs`` and the system's
        directories), ``tcp_blocked`` (TCP bind/connect refused), ``scoped`` (abstract Unix sockets and
        signals kept inside), ``ip_sockets_blocked`` (a seccomp filter: no IPv4/IPv6 socket at all, UDP
        included), ``network`` (what the pool asked for)."""
        return {k: v for k, v in self._proc.hello.get("sandbox", {}).items() if k != "transfer_fd"}

    @property
    def prepared(self) -> dict[str, Model | Context | LoraAdapter]:
        """In an instance forked from a Snapshot: the handles its prepare() returned, by name, bound to
        this instance (empty otherwise)."""
        return dict(self._prepared)

    @property
    def models(self) -> list[Model]:
        """The models loaded in this worker and not closed, in the order they were loaded."""
        return sorted((m for m in list(self._models) if not m._closed), key=lambda m: m._serial)

    def _model(self, model: Model | str | None) -> Model:
        """The loaded model a batched request names: a Model of this worker, a name (path, file name or
        stem), or None for the only one."""
        loaded = self.models
        if isinstance(model, Model):
            if model.instance is not self:
                raise InvalidArgumentError(f"{model!r} is loaded in another worker")
            return model
        if model is None:
            if len(loaded) != 1:
                raise InvalidArgumentError(f"worker {self.worker_id} holds {len(loaded)} models: name one (model=)")
            return loaded[0]
        if not isinstance(model, str):
            raise BadRequestError(f"model is a Model, a name or None, got {type(model).__name__}")
        for m in loaded:
            name = os.path.basename(m.path)
            if model in (m.path, name, os.path.splitext(name)[0]):
                return m
        raise InvalidArgumentError(f"no model named {model!r} is loaded in worker {self.worker_id}")

    def _route(self, model: Model | str | None, prompt: str | Sequence[int],
               lora: Iterable[str] = ()) -> tuple[Batcher, list[int]]:
        batcher = self._model(model).batcher()
        return batcher, batcher.tokens(prompt)

    def close(self, timeout: float = 5.0) -> None:
        """Ends this worker (shutdown, then kill after ``timeout``); its handles go stale. For a forked
        instance this is how it ends before its pool does; a pool's own instance can be started again
        with Pool.replace(). Idempotent."""
        error = PoolClosedError(f"worker {self.worker_id} was closed")
        self._stop_batchers(error)
        self._core.shutdown()
        self._proc.close(timeout)
        self._core.closed(error)

    def _stop_batchers(self, error: LloyalError) -> None:
        """Ends the loops of this worker's batchers (without waiting: a loop ends at its next call, which
        fails once the worker is closed), so that no idle loop thread outlives the worker."""
        for model in list(self._models):
            if model._batcher is not None:
                model._batcher.close(error, wait=False)

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time in seconds; CallTimeoutError when there is no answer within ``timeout``."""
        check_timeout(timeout)
        t0 = time.perf_counter()
        wait(self._core.call(p.Ping()), timeout, what="ping")
        return time.perf_counter() - t0

    def load_model(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                   vocab_only: bool = False, repack: bool = True, progress: ProgressCallback | None = None,
                   timeout: float | None = None) -> Model:
        """Loads a GGUF model into this worker and returns its handle; blocks until it is loaded.
        ``n_gpu_layers`` layers go to the GPU (GPU variants only), ``use_mmap`` maps the file instead of
        reading it, ``vocab_only`` loads the vocabulary alone (tokenize, templates; no contexts).
        ``progress(fraction)`` is called on a client thread as the load proceeds; an exception it raises
        is raised here once the load ends (the model is freed again). ModelLoadError for a
        missing, unreadable or invalid file, or one outside the pool's ``allowed_dirs``; the worker keeps
        serving. ``timeout``: seconds to wait at most (CallTimeoutError; the load goes on in the worker)."""
        check_timeout(timeout)
        return wait(self.load_model_async(path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap,
                                          vocab_only=vocab_only, repack=repack, progress=progress), timeout,
                    what="load_model")

    def load_model_async(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                         vocab_only: bool = False, repack: bool = True,
                         progress: ProgressCallback | None = None) -> Future[Model]:
        """load_model() without waiting: a Future of the Model."""
        abspath = os.path.abspath(os.fspath(path))
        why = irregular_path(abspath)
        if why is not None:  # the worker refuses it too; here it costs no round trip
            raise ModelLoadError(f"cannot load a model: {why}")
        allowed = self._proc.options.allowed_dirs
        if allowed is not None and self._proc.options.sandbox and not beneath(abspath, allowed):
            raise ModelLoadError(f"{abspath} is outside the pool's allowed_dirs {list(allowed)}: the worker "
                                 "may not read it (Pool(allowed_dirs=...))")
        return self._load(abspath, p.LoadModel(path=abspath, n_gpu_layers=whole(n_gpu_layers, "n_gpu_layers"),
                                               use_mmap=bool(use_mmap), vocab_only=bool(vocab_only),
                                               repack=bool(repack)), progress)

    def load_model_from_memory(self, data: ModelBytes, *, n_gpu_layers: int = 0, use_mmap: bool = True,
                               vocab_only: bool = False, repack: bool = True,
                               progress: ProgressCallback | None = None, timeout: float | None = None) -> Model:
        """load_model() for a GGUF held in memory (go-llama's in-memory filesystem): its bytes (bytes,
        bytearray, a memoryview, e.g. of an mmap) or an open descriptor or binary file that reads it from
        offset 0 (a memfd, a file; not a pipe). It reaches the worker as a sealed memfd that the worker
        reads like a file, never through a frame, and without any path: the pool's ``allowed_dirs`` do
        not apply. ``data`` is kept (a descriptor duplicated) while the model lives, to load it again in a
        recovered worker: do not change it meanwhile. ``Model.path`` is ``"<memory: N bytes>"``.
        ModelLoadError for data that is not a GGUF file, as for a path."""
        check_timeout(timeout)
        source = MemorySource(data)
        req = p.LoadModel(path="", n_gpu_layers=whole(n_gpu_layers, "n_gpu_layers"), use_mmap=bool(use_mmap),
                          vocab_only=bool(vocab_only), repack=bool(repack))
        return wait(self._load(f"<memory: {source.size} bytes>", req, progress, source), timeout,
                    what="load_model_from_memory")

    def _load(self, path: str, req: p.LoadModel, progress: ProgressCallback | None,
              source: MemorySource | None = None) -> Future[Model]:
        if progress is not None and not callable(progress):
            raise BadRequestError(f"the progress callback must be callable, got {type(progress).__name__}")
        failed: list[BaseException] = []

        def guarded(fraction: float) -> None:
            if progress is not None and not failed:
                try:
                    progress(fraction)
                except BaseException as exc:
                    failed.append(exc)

        def loaded(r: p.ModelLoaded) -> Model:
            model = Model(self, r.model, r.info, path, req, source)
            if failed:
                # The worker loaded it all the same: free it, from a thread of its own (this runs on the
                # reader thread, which must not wait for a reply), and fail the call with the error.
                threading.Thread(target=_close_quietly, args=(model,), daemon=True,
                                 name="lloyal-free-model").start()
                raise failed[0]
            if self._on_model_loaded is not None:
                self._on_model_loaded()
            return model

        on_event = events(progress=None if progress is None else guarded)
        fut = self._core.call(req, on_event) if source is None else source.load(self._core.proc, req, on_event)
        return mapped(fut, loaded)

    def _load_like(self, model: Model) -> Model:
        """Loads here the model another worker loaded, the same way (a path, or the same bytes)."""
        return self._load(model.path, model._load, None, model._source).result()

    async def aload_model(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                          vocab_only: bool = False, progress: ProgressCallback | None = None) -> Model:
        """load_model() for asyncio. A load cannot be interrupted: cancelling the awaiting task lets it
        finish in the worker, which then frees the model again."""
        fut = self.load_model_async(path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, vocab_only=vocab_only,
                                    progress=progress)

        def free_when_loaded() -> None:
            def free(f: Future[Model]) -> None:
                if f.exception() is None:
                    threading.Thread(target=_close_quietly, args=(f.result(),), daemon=True,
                                     name="lloyal-free-model").start()
            fut.add_done_callback(free)

        return await settle(fut, free_when_loaded)

    def _take_context(self, ctx: Context) -> None:
        """Context.move_to(self): the target checked here, then moved (migration.py)."""
        if ctx.closed:
            raise StaleHandleError(f"context handle {ctx.handle} was closed")
        if ctx.instance is self:
            raise InvalidArgumentError(f"the context already lives in worker {self.worker_id}")
        if not self.alive or not self._core.machine.accepting:
            raise PoolClosedError(f"worker {self.worker_id} is closed, dead or being drained: it cannot take a "
                                  "context")
        for model in self.models:
            if model.path == ctx.model.path and not model._load.vocab_only:
                move(ctx, model)
                return
        raise InvalidArgumentError(f"worker {self.worker_id} has not loaded {os.path.basename(ctx.model.path)} "
                                   "(the context's model): load it there first")

    def drain_contexts(self) -> list[Context]:
        """The contexts of this worker's models that are not closed (what Pool.drain moves)."""
        return [c for m in self.models for c in list(m._contexts) if not c.closed]

    def json_schema_to_grammar(self, schema: str | Mapping[str, Any]) -> str:
        """llama.cpp's own JSON schema -> GBNF converter."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return self._core.call(p.JsonSchemaToGrammar(schema=text)).result()

    def devices(self) -> list[Device]:
        """The devices the worker's ggml backends registered, in their order: the CPU in every variant,
        and in a GPU variant each GPU it sees (the variant only loads when it sees one)."""
        return self._core.call(p.Devices()).result()

    def stats(self) -> dict[str, Any]:
        """RSS, CPU, threads and state of the worker process (psutil); under Pool(max_resident_contexts=N)
        also ``paging``: ``budget`` (N), ``resident`` and ``paged`` (contexts), ``page_outs``,
        ``page_ins``, ``page_in_ms_mean``, ``page_bytes`` (the paged-out states' size) and
        ``page_disk_bytes`` (the disk their files take) and ``page_dir``."""
        out = self._proc.stats()
        if self._core.machine.budget is not None:
            out["paging"] = self._core.paging_stats()
        return out

    def kill(self) -> None:
        """SIGKILL the worker now (its waiting calls raise WorkerCrashedError)."""
        self._proc.kill()

    def fault(self, kind: str, **args: Any) -> Future[Any]:
        """Test-only: ask the worker to crash in a given way (needs LLOYAL_POOL_TEST_FAULTS=1)."""
        return self._core.call(p.Fault(kind=kind, **args))


def _close_quietly(model: Model) -> None:
    try:
        model.close()
    except LloyalError:
        pass  # the worker or the pool went away meanwhile: nothing is left to free
