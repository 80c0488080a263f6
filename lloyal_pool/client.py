"""The public client: a Pool of worker processes, and handles that mirror the native objects inside them.

    Pool ──▶ Instance (one worker process = one isolated engine)
                └─▶ Model (a loaded GGUF)  ──▶ Context (a KV cache + generation)

This process never loads llama.cpp. Every handle method is a request to its worker (_process.py) and
returns when the reply arrives; ``*_async`` variants return the concurrent.futures.Future underneath.
Any thread may call; calls on one worker run in the order they were made. A worker that dies fails its
waiting calls with WorkerCrashedError and leaves its handles stale (StaleHandleError); the others keep
serving, and Pool.replace() starts a fresh one in its place.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from ._futures import mapped
from ._process import WorkerOptions, WorkerProcess
from .branches import KV, Branch, BranchStore, GrammarLike
from .errors import PoolClosedError, StaleHandleError
from .params import ContextParams, EvalResult, GenerateParams, ModelInfo, Result, SamplerParams
from .protocol import Op
from .shm import DEFAULT_SIZE

ProgressCallback = Callable[[float], None]


def _forward(key: str, fn: Callable[[Any], None] | None) -> Callable[[dict[str, Any]], None] | None:
    """An EVENT handler that passes ``event[key]`` to fn, for the events that carry it."""
    if fn is None:
        return None

    def on_event(event: dict[str, Any]) -> None:
        if key in event:
            fn(event[key])

    return on_event


class Instance:
    """One worker process: an isolated engine that may hold several models and many contexts."""

    def __init__(self, proc: WorkerProcess) -> None:
        self._proc = proc

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"<Instance worker={self.worker_id} pid={self.pid} variant={self.variant} {state}>"

    @property
    def worker_id(self) -> int:
        return int(self._proc.worker_id)

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    @property
    def alive(self) -> bool:
        return self._proc.alive

    @property
    def variant(self) -> str:
        return str(self._proc.hello.get("variant"))

    @property
    def threads(self) -> int:
        """The n_threads a context in this worker gets unless it asks for another number."""
        return int(self._proc.hello.get("threads", 0))

    @property
    def build_info(self) -> dict[str, Any]:
        """What the handshake reported: llama.cpp build, system info, default threads."""
        return dict(self._proc.hello.get("build", {}))

    def _call(self, op: Op, args: dict[str, Any],
              on_event: Callable[[dict[str, Any]], None] | None = None) -> tuple[int, Future[Any]]:
        return self._proc.call(op, args, on_event)

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time in seconds."""
        t0 = time.perf_counter()
        self._call(Op.PING, {})[1].result(timeout)
        return time.perf_counter() - t0

    def load_model(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                   vocab_only: bool = False, progress: ProgressCallback | None = None) -> Model:
        return self.load_model_async(path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap,
                                     vocab_only=vocab_only, progress=progress).result()

    def load_model_async(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                         vocab_only: bool = False, progress: ProgressCallback | None = None) -> Future[Model]:
        abspath = os.path.abspath(os.fspath(path))
        args = {"path": abspath, "n_gpu_layers": int(n_gpu_layers),
                "use_mmap": bool(use_mmap), "vocab_only": bool(vocab_only)}
        _, fut = self._call(Op.LOAD_MODEL, args, _forward("progress", progress))
        return mapped(fut, lambda r: Model(self, self._proc, int(r["model"]), ModelInfo.from_wire(r["info"]), abspath))

    def json_schema_to_grammar(self, schema: str | Mapping[str, Any]) -> str:
        """llama.cpp's own JSON schema -> GBNF converter."""
        import json

        text = schema if isinstance(schema, str) else json.dumps(schema)
        return str(self._call(Op.JSON_SCHEMA_TO_GRAMMAR, {"schema": text})[1].result())

    def stats(self) -> dict[str, Any]:
        """RSS, CPU, threads and state of the worker process (psutil)."""
        return self._proc.stats()

    def kill(self) -> None:
        """SIGKILL the worker now (its waiting calls raise WorkerCrashedError)."""
        self._proc.kill()

    def fault(self, kind: str, **args: Any) -> Future[Any]:
        """Test-only: ask the worker to crash in a given way (needs LLOYAL_POOL_TEST_FAULTS=1)."""
        return self._call(Op.FAULT, {"kind": kind, **args})[1]


class _Handle:
    def __init__(self, instance: Instance, proc: WorkerProcess, handle: int) -> None:
        self.instance = instance
        self._proc = proc
        self._handle = handle
        self._closed = False

    def _call(self, op: Op, args: dict[str, Any],
              on_event: Callable[[dict[str, Any]], None] | None = None) -> tuple[int, Future[Any]]:
        if self._closed:
            raise StaleHandleError(f"{type(self).__name__} handle {self._handle} was closed")
        return self._proc.call(op, args, on_event)


class Model(_Handle):
    """A model loaded in one worker. Contexts created from it share its weights."""

    def __init__(self, instance: Instance, proc: WorkerProcess, handle: int, info: ModelInfo, path: str) -> None:
        super().__init__(instance, proc, handle)
        self.info = info
        self.path = path

    def __repr__(self) -> str:
        return f"<Model {self.info.desc!r} worker={self.instance.worker_id} handle={self._handle}>"

    @property
    def n_vocab(self) -> int:
        return self.info.n_vocab

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        args = {"model": self._handle, "text": text, "add_special": add_special, "parse_special": parse_special}
        return list(self._call(Op.TOKENIZE, args)[1].result())

    def detokenize(self, tokens: Sequence[int], *, remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        args = {"model": self._handle, "tokens": [int(t) for t in tokens], "remove_special": remove_special,
                "unparse_special": unparse_special}
        return str(self._call(Op.DETOKENIZE, args)[1].result())

    def token_to_piece(self, token: int, *, special: bool = True) -> bytes:
        """Raw bytes: one token may be part of a multi-byte UTF-8 character."""
        args = {"model": self._handle, "token": int(token), "special": special}
        return bytes(self._call(Op.TOKEN_TO_PIECE, args)[1].result())

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, template: str | None = None,
                            add_assistant: bool = True) -> str:
        pairs = [[m["role"], m["content"]] for m in messages]
        args = {"model": self._handle, "messages": pairs, "template": template, "add_assistant": add_assistant}
        return str(self._call(Op.APPLY_CHAT_TEMPLATE, args)[1].result())

    def new_context(self, params: ContextParams | None = None, **overrides: Any) -> Context:
        if overrides:
            from dataclasses import replace

            params = replace(params or ContextParams(), **overrides)
        params = params or ContextParams()
        _, fut = self._call(Op.NEW_CONTEXT, {"model": self._handle, "params": params.to_wire()})
        return Context(self, self._proc, fut.result())

    def close(self) -> None:
        """Frees the model and every context created from it. Idempotent; a dead worker has nothing to free."""
        if self._closed:
            return
        self._closed = True
        if self._proc.alive:
            self._proc.call(Op.FREE_MODEL, {"model": self._handle})[1].result()


class Stream:
    """Text pieces as they are decoded; iterate, then read ``result``. The pieces always join to
    ``result.text`` (text that could be the start of a stop string is held back until it is not)."""

    _END = object()

    def __init__(self, context: Context) -> None:
        self._context = context
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.future: Future[Result]

    def _attach(self, fut: Future[Result]) -> None:
        self.future = fut
        fut.add_done_callback(lambda _: self._q.put(self._END))

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        item = self._q.get()
        if item is self._END:
            self._q.put(self._END)  # stay exhausted
            self.future.result()  # raises the call's error, if any
            raise StopIteration
        assert isinstance(item, str)
        return item

    @property
    def result(self) -> Result:
        return self.future.result()

    def interrupt(self) -> None:
        self._context.interrupt()


class Context(_Handle):
    """A context (KV cache) in one worker: generate, stream, evaluate, read logits, interrupt."""

    def __init__(self, model: Model, proc: WorkerProcess, desc: dict[str, Any]) -> None:
        super().__init__(model.instance, proc, int(desc["context"]))
        self.model = model
        self.n_ctx = int(desc["n_ctx"])
        self.n_batch = int(desc["n_batch"])
        self.n_ubatch = int(desc["n_ubatch"])
        self.n_seq_max = int(desc["n_seq_max"])
        self.n_threads = int(desc["n_threads"])
        self._slot = int(desc["interrupt_slot"])
        self._logits_offset = int(desc["logits_offset"])
        self._n_vocab = int(desc["n_vocab"])
        self._active: list[int] = []  # request ids of decodes in flight, oldest first
        self._active_lock = threading.Lock()
        self.branches = BranchStore(self)
        self.kv = KV(self)

    def __repr__(self) -> str:
        return f"<Context n_ctx={self.n_ctx} worker={self.instance.worker_id} handle={self._handle}>"

    def _request(self, op: Op, /, **args: Any) -> Any:
        """A request about this context, waited for."""
        return self._call(op, {"context": self._handle, **args})[1].result()

    def _decode_call(self, op: Op, args: dict[str, Any],
                     on_event: Callable[[dict[str, Any]], None] | None = None) -> Future[Any]:
        with self._active_lock:
            req_id, fut = self._call(op, args, on_event)
            self._active.append(req_id)

        def finished(_: Future[Any]) -> None:
            with self._active_lock:
                self._active.remove(req_id)

        fut.add_done_callback(finished)
        return fut

    def generate(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                 on_piece: Callable[[str], None] | None = None, **overrides: Any) -> Result:
        """Generates from prompt (text, or token ids). ``on_piece`` is called, on a client thread, with
        each piece of final text. Keyword overrides are GenerateParams fields."""
        return self.generate_async(prompt, params, on_piece=on_piece, **overrides).result()

    def generate_async(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
                       on_piece: Callable[[str], None] | None = None, **overrides: Any) -> Future[Result]:
        p = GenerateParams.of(params, overrides)
        fut = self._decode_call(Op.GENERATE, self._generate_args(prompt, p, stream=on_piece is not None),
                                _forward("piece", on_piece))
        return mapped(fut, Result.from_wire)

    def stream(self, prompt: str | Sequence[int], params: GenerateParams | None = None,
               **overrides: Any) -> Stream:
        """Like generate, but returns at once with an iterator over the pieces."""
        p = GenerateParams.of(params, overrides)
        s = Stream(self)
        fut = self._decode_call(Op.GENERATE, self._generate_args(prompt, p, stream=True),
                                _forward("piece", s._q.put))
        s._attach(mapped(fut, Result.from_wire))
        return s

    def _generate_args(self, prompt: str | Sequence[int], p: GenerateParams, stream: bool) -> dict[str, Any]:
        wire_prompt: str | list[int] = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        return {"context": self._handle, "prompt": wire_prompt, "params": p.to_wire(), "stream": stream}

    def eval(self, prompt: str | Sequence[int], *, add_special: bool | None = None,
             parse_special: bool = True) -> EvalResult:
        """Decodes prompt into the KV cache without sampling (prefill). Text gets the model's BOS only
        when the context is empty, unless add_special says otherwise."""
        return self.eval_async(prompt, add_special=add_special, parse_special=parse_special).result()

    def eval_async(self, prompt: str | Sequence[int], *, add_special: bool | None = None,
                   parse_special: bool = True) -> Future[EvalResult]:
        args: dict[str, Any] = {"context": self._handle}
        if isinstance(prompt, str):
            args.update(text=prompt, add_special=add_special, parse_special=parse_special)
        else:
            args["tokens"] = [int(t) for t in prompt]
        return mapped(self._decode_call(Op.EVAL, args), EvalResult.from_wire)

    def interrupt(self) -> None:
        """Stops the generation or prompt evaluation running on this context, from any thread, without a
        round trip: it writes the request's id into the context's word in shared memory, which the
        worker checks every token and inside each decode step. A no-op when nothing is running."""
        with self._active_lock:
            if self._active:
                self._proc.interrupt(self._slot, self._active[0])

    def logits(self, *, copy: bool = False) -> np.ndarray:
        """Logits (n_vocab float32) of the last decoded position. Without copy, a read-only view of the
        worker's shared memory: valid until the next logits() call on this context."""
        r = self._request(Op.LOGITS)
        arr = self._proc.region.floats(int(r["offset"]), int(r["count"]))
        return arr.copy() if copy else arr

    @property
    def n_past(self) -> int:
        return len(self.tokens())

    def tokens(self) -> list[int]:
        """The tokens in the KV cache, in order."""
        return list(self._request(Op.TOKENS))

    def reset(self) -> None:
        """Clears the KV cache: the next generation starts from nothing. Every branch is released."""
        self._request(Op.RESET)
        self.branches._forget_all()

    # -- branches -------------------------------------------------------------------------------------
    def branch(self, prompt: Sequence[int] | str | None = None, params: SamplerParams | None = None, *,
               grammar: GrammarLike = None, **overrides: Any) -> Branch:
        """A root branch at position 0 with its own sampler (keyword overrides are SamplerParams fields)
        and grammar, prompt prefilled (text gets the model's BOS). Needs a context without a plain
        eval/generate history; forks need n_seq_max > 1."""
        return self.branches.create(prompt, params, grammar=grammar, **overrides)

    def clear_and_reseed(self, sinks: Sequence[int], tail: Sequence[int]) -> None:
        """Infinite context for a single branch (BlinkKV): clears the whole KV cache and decodes sinks at
        position 0, then tail, into the context's only branch, which keeps its handle, sampler, grammar
        and perplexity; its position becomes len(sinks) + len(tail)."""
        args = {"context": self._handle, "sinks": [int(t) for t in sinks], "tail": [int(t) for t in tail]}
        self.branches._timed(self._decode_call(Op.CLEAR_AND_RESEED, args).result())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.branches._forget_all()
        if self._proc.alive:
            self._proc.call(Op.FREE_CONTEXT, {"context": self._handle})[1].result()


def _close_procs(procs: list[WorkerProcess], timeout: float) -> None:
    # Module-level and holding no reference to the Pool, so weakref.finalize can run it after the Pool is
    # collected or at interpreter exit.
    threads = [threading.Thread(target=p.close, args=(timeout,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    procs.clear()


class Pool:
    """N worker processes, each an isolated engine instance.

    >>> with Pool(2) as pool:
    ...     model = pool[0].load_model("model.gguf")
    ...     ctx = model.new_context(n_ctx=2048)
    ...     print(ctx.generate("Once upon a time", n_predict=32).text)
    """

    def __init__(self, size: int = 1, *, variant: str | None = None, strict_variant: bool | None = None,
                 shm_bytes: int = DEFAULT_SIZE, shm_backend: str = "auto", memory_limit: int | None = None,
                 start_timeout: float = 60.0, env: Mapping[str, str] | None = None,
                 native_log_level: str = "warning", threads_per_worker: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"a Pool needs at least one worker, got size={size}")
        if threads_per_worker is None:
            # Workers that together ask for more threads than there are CPUs make llama.cpp's spinning
            # thread barriers stall each other (10x slower on a loaded 2-core machine): share the CPUs.
            threads_per_worker = max(1, len(os.sched_getaffinity(0)) // size) if hasattr(
                os, "sched_getaffinity") else None
        self._options = WorkerOptions(variant=variant, strict_variant=strict_variant, shm_bytes=shm_bytes,
                                      shm_backend=shm_backend, memory_limit=memory_limit,
                                      start_timeout=start_timeout, env=dict(env or {}),
                                      native_log_level=native_log_level, threads=threads_per_worker)
        self._lock = threading.Lock()
        self._all_procs: list[WorkerProcess] = []  # everything started, for the finalizer
        self._instances: list[Instance] = []
        self._closed = False
        self._next_worker_id = 0
        self._finalizer = weakref.finalize(self, _close_procs, self._all_procs, 5.0)
        try:
            procs = [self._spawn() for _ in range(size)]  # start them all, then wait: start-ups overlap
            for proc in procs:
                proc.wait_ready()
        except BaseException:
            self.close()
            raise
        self._instances = [Instance(p) for p in procs]

    def _spawn(self) -> WorkerProcess:
        with self._lock:
            worker_id = self._next_worker_id
            self._next_worker_id += 1
        proc = WorkerProcess(worker_id, self._options)
        self._all_procs.append(proc)
        return proc

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
        return list(self._instances)

    def replace(self, instance: Instance | int) -> Instance:
        """Starts a fresh worker in the place of ``instance`` (dead or alive; a live one is closed).
        Handles from the old worker stay stale; models must be loaded again."""
        if self._closed:
            raise PoolClosedError("the pool is closed")
        index = instance if isinstance(instance, int) else self._instances.index(instance)
        old = self._instances[index]._proc
        old.close(timeout=2.0)
        proc = self._spawn()
        proc.wait_ready()
        with self._lock:
            self._instances[index] = Instance(proc)
            self._all_procs.remove(old)
        return self._instances[index]

    def stats(self) -> list[dict[str, Any]]:
        return [inst.stats() for inst in self._instances]

    def close(self, timeout: float = 5.0) -> None:
        """Ends every worker (shutdown, then kill after timeout), reaps every process and frees every
        shared-memory region. Idempotent; also runs at interpreter exit."""
        self._closed = True
        _close_procs(self._all_procs, timeout)
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

