"""Scale-out on Ray (``pip install "lloyal_pool[ray]"``): the same workers, run by Ray actors across a
cluster, behind a RayPool that takes independent requests as a Pool does.

    RayPool (the driver) ──Ray calls──▶ ModelActor on some node ──pipes, shared memory──▶ worker (llama.cpp)

Each actor is a parent process like any application: it holds a Pool of one sandboxed worker with the
model loaded and its Batcher running. So llama.cpp never runs inside a Ray process (a crash in it kills
the worker, which the actor reports as WorkerCrashedError), and the driver loads neither llama.cpp nor the
native module. Ray places the actors by the CPUs and GPUs they ask for; the model is found on each node
by that node (``model``: a path, expanded there, or a function run there), so nodes may keep their files
in different places.

The driver routes every request to an actor as Pool does to its workers: one with a free slot, then the
one that lately served a prompt sharing a long prefix with this one (whose slot cache holds it: chat
turns stay where their conversation is), then the least loaded. Pieces come back through a Ray
streaming generator; interrupt() is a separate call that reaches the actor while the request runs. A
dead actor (its process or node gone, or its worker crashed) fails its requests with WorkerCrashedError,
is reported to subscribe() callbacks and is replaced by a fresh actor, which Ray may place elsewhere.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

try:
    import ray
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - the extra is part of the test environment
    raise ImportError(f"lloyal_pool.ray needs Ray: pip install 'lloyal_pool[ray]' ({exc})") from None

from . import protocol as p
from ._aio import closed_in_thread
from ._batched import BatchedCalls
from ._embedder import Embedder
from ._futures import running
from .batching import BatchRequest, choice_params
from .chat import ChatMessage
from .errors import (
    InvalidArgumentError,
    LloyalError,
    ModelLoadError,
    PoolClosedError,
    RemoteError,
    WorkerCrashedError,
    WorkerStartupError,
)
from .lifecycle import Subscribers, WorkerEvent
from .model import Model
from .models import default_model_path
from .params import GenerateParams, Result, whole
from .pool import Pool
from .routing import ROUTER, common_prefix

__all__ = ["ModelActor", "RayPool", "RayWorker"]

# Requests are routed as a Pool routes them (routing.Router), an actor's cached prefix being the longest
# it shares with the prompts it was sent last.
RECENT_PROMPTS = 32  # per actor, for affinity
_END = object()
_log = logging.getLogger(__name__)

ModelSource = str | os.PathLike[str] | Callable[[], str | os.PathLike[str]] | None


def resolve_model(model: ModelSource) -> str:
    """The model's path on this node: ``model`` with ``~`` and environment variables expanded here, the
    path a function returns when run here, or (None) the default model installed here."""
    if model is None:
        path = str(default_model_path())
    elif callable(model):
        path = os.fspath(model())
    else:
        path = os.path.expandvars(os.path.expanduser(os.fspath(model)))
    if not os.path.isfile(path):
        raise ModelLoadError(f"the model {path!r} is not a file on node {socket.gethostname()}")
    return path


class ModelActor:
    """A node's side of a RayPool (run as a Ray actor by RayPool, threaded: requests run side by side,
    and an interrupt reaches one while it runs). A start-up failure is kept and raised by describe(),
    so that the driver sees its type (ModelLoadError for a missing model) rather than a dead actor."""

    def __init__(self, model: ModelSource, load: Mapping[str, Any], batcher: Mapping[str, Any],
                 pool: Mapping[str, Any]) -> None:
        self._live: dict[str, BatchRequest] = {}
        # Interrupts that arrived before their request did (kept bounded: one may come after its end).
        self._early: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._error: Exception | None = None
        self._pool: Pool | None = None
        try:
            path = resolve_model(model)
            # The GPUs Ray gave this actor are its worker's (a worker's environment is otherwise empty).
            env = {"CUDA_VISIBLE_DEVICES": None, **(pool.get("env") or {})}
            self._pool = Pool(1, **{**pool, "env": env})
            self._model: Model = self._pool[0].load_model(path, **load)
            self._model.batcher(**batcher)
            self._embedder = Embedder(self._model)
        except Exception as exc:  # kept for describe(): the driver then sees it with its type
            self._error = exc
            if self._pool is not None:
                self._pool.close()

    def _ready(self) -> Pool:
        if self._error is not None:
            raise self._error
        assert self._pool is not None
        return self._pool

    @ray.method(concurrency_group="control")
    def describe(self) -> dict[str, Any]:
        """Where it runs and what it holds (RayWorker's attributes); its start-up error, if it had one."""
        pool = self._ready()
        return {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
                "pid": os.getpid(), "worker_pid": pool[0].pid, "model_path": self._model.path,
                "slots": self._model.batcher().slots, "has_chat_template": self._model.info.chat_template is not None}

    def run(self, rid: str, prompt: str | list[int], gen: GenerateParams, pieces: bool) -> Iterator[str | Result]:
        """One request, as a Ray streaming generator: its pieces (when asked for), then its Result."""
        out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        handle = self._ready().submit(prompt, gen, on_piece=out.put if pieces else None)
        with self._lock:
            self._live[rid] = handle
            early = rid in self._early
            self._early.pop(rid, None)
        if early:
            handle.interrupt()
        handle.future.add_done_callback(lambda _: out.put(_END))
        try:
            while (item := out.get()) is not _END:
                yield item
            yield handle.future.result()
        finally:
            with self._lock:
                self._live.pop(rid, None)
            handle.interrupt()  # a no-op once it ended; otherwise the driver has gone

    @ray.method(concurrency_group="control")
    def interrupt(self, rid: str) -> None:
        """Ends request ``rid`` at its next step (one that has not arrived yet, as soon as it does)."""
        with self._lock:
            handle = self._live.get(rid)
            if handle is None:
                self._early[rid] = None
                while len(self._early) > 1024:
                    self._early.popitem(last=False)
                return
        handle.interrupt()

    @ray.method(concurrency_group="control")
    def gauge(self) -> tuple[bool, int, int]:
        """Whether its worker is alive, and its batcher's active and queued requests."""
        pool = self._ready()
        b = self._model._batcher
        alive = pool[0].alive
        return alive, (b.active if alive and b is not None else 0), (b.queued if alive and b is not None else 0)

    def stats(self) -> dict[str, Any]:
        """Its worker's Instance.stats()."""
        return self._ready()[0].stats()

    def format_chat(self, messages: Sequence[Mapping[str, Any]], template: str | None,
                    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str) -> p.ChatPrompt:
        """The model's chat format applied to ``messages`` (what the HTTP endpoint generates from)."""
        self._ready()
        return self._model._format_chat(messages, template=template, tools=tools, tool_choice=tool_choice)

    def parse_chat(self, text: str, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                   messages: Sequence[Mapping[str, Any]], tool_choice: str, partial: bool) -> ChatMessage:
        """A generated assistant turn parsed by the chat format (content, reasoning, tool calls)."""
        self._ready()
        return self._model._parse_chat(text, template=template, tools=tools, messages=messages,
                                       tool_choice=tool_choice, partial=partial)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Model.tokenize on its worker."""
        self._ready()
        return self._model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def embed(self, inputs: Sequence[str | list[int]]) -> tuple[list[np.ndarray], int]:
        """Mean-pooled embeddings of ``inputs`` (an embedding context made at the first call), and the
        number of tokens they hold."""
        self._ready()
        return self._embedder.embed(inputs)

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens``, control tokens written out (the HTTP endpoint's /detokenize)."""
        from .serve.backend import detokenize

        self._ready()
        return detokenize(self._model, tokens)

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        """Each token's bytes (the HTTP endpoint's /tokenize with_pieces)."""
        from .serve.backend import token_pieces

        self._ready()
        return token_pieces(self._model, tokens)

    def served_model(self) -> Any:
        """Its model as the HTTP endpoint's /props shows it (a lloyal_pool.serve.backend.ServedModel)."""
        from .serve.backend import served_model

        self._ready()
        return served_model(self._model)

    @ray.method(concurrency_group="control")
    def shutdown(self) -> None:
        """Closes its Pool (the worker ends); the driver kills the actor after."""
        if self._pool is not None:
            self._pool.close()


class RayWorker:
    """One actor of a RayPool, as the driver sees it: where it runs (``node_id``, ``hostname``, ``pid`` of
    the actor, ``worker_pid`` of its llama.cpp worker), whether it is ``alive`` and its ``load`` (requests
    sent to it and not yet ended)."""

    def __init__(self, index: int, worker_id: int, actor: Any, info: Mapping[str, Any]) -> None:
        self.index = index
        self.worker_id = worker_id
        self.actor = actor
        self.node_id: str = info["node_id"]
        self.hostname: str = info["hostname"]
        self.pid: int = info["pid"]
        self.worker_pid: int = info["worker_pid"]
        self.model_path: str = info["model_path"]
        self.slots: int = info["slots"]
        self.has_chat_template: bool = info["has_chat_template"]
        self.alive = True
        self.load = 0
        self._recent: collections.deque[str | tuple[int, ...]] = collections.deque(maxlen=RECENT_PROMPTS)

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"<RayWorker {self.worker_id} on {self.hostname} pid={self.pid} {state} load={self.load}>"

    def affinity(self, key: str | tuple[int, ...]) -> int:
        """The longest prefix ``key`` shares with a prompt this actor was sent lately (characters for
        text, tokens for token ids): what its worker may hold cached."""
        return max((common_prefix(key, seen) for seen in self._recent if type(seen) is type(key)), default=0)

    def stats(self) -> dict[str, Any]:
        """Its worker's Instance.stats()."""
        stats: dict[str, Any] = _get(self, self.actor.stats.remote())
        return stats


def _get(member: RayWorker, ref: Any, timeout: float | None = None) -> Any:
    try:
        return ray.get(ref, timeout=timeout)
    except BaseException as exc:
        raise _translated(member, exc) from None


def _translated(member: RayWorker, exc: BaseException) -> BaseException:
    """What a failed Ray call means to the caller: the actor's own error as it was raised, a dead actor
    as WorkerCrashedError."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
            return cause if isinstance(cause, LloyalError) else RemoteError(str(cause), type(cause).__name__)
        return RemoteError(str(exc), type(exc).__name__)
    if isinstance(exc, ray.exceptions.RayActorError):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return WorkerCrashedError(f"the Ray actor of worker {member.worker_id} on {member.hostname} is gone: {first}",
                                  worker_id=member.worker_id, pid=member.pid)
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return WorkerStartupError(f"worker {member.worker_id}'s actor did not answer in time: {exc}",
                                  worker_id=member.worker_id)
    return exc


class RayPool(BatchedCalls, Subscribers):
    """``size`` ModelActors on a Ray cluster, each a Pool of one worker holding ``model`` with its Batcher
    (``slots`` x ``n_ctx_slot``, ``chunk``): ``generate``/``stream``/``submit`` and their asyncio twins
    route independent requests among them as Pool's do. Connects to the cluster Ray is initialized with
    (``ray.init(...)`` first to choose one; otherwise Ray's default: RAY_ADDRESS, or a local one).

    ``model``: a path (``~`` and ``$VARS`` expanded on each node), a function each node runs to find it,
    or None for the default model installed on the nodes (ModelLoadError, naming the node, for a file a
    node lacks). ``num_cpus``/``num_gpus``: what each actor reserves, so what Ray places it by; a worker
    computes with ``threads_per_worker`` threads (default: its CPUs). ``n_gpu_layers``: load_model's.
    ``pool_options``: the worker's Pool options (variant, memory_limit, hang_timeout, sandbox, ...);
    ``actor_options``: Ray's own for each actor (resources, scheduling_strategy, runtime_env, ...).
    ``replace_dead``: start a fresh actor in place of one that died (default). The constructor waits up
    to ``start_timeout`` seconds for every actor to load the model.

    Differences from Pool: the items (``pool[i]``) are RayWorkers, not Instances (there are no handles
    to a remote worker's models and contexts); requests name no model (every actor holds the one);
    subscribe() events carry no instance.

    >>> with RayPool(2, "~/models/model.gguf", num_cpus=4) as pool:
    ...     print(pool.generate("Once upon a time", n_predict=32).text)
    """

    def __init__(self, size: int = 1, model: ModelSource = None, *, num_cpus: float = 1, num_gpus: float = 0,
                 threads_per_worker: int | None = None, n_gpu_layers: int = 0, slots: int = 8,
                 n_ctx_slot: int = 2048, chunk: int = 128, replace_dead: bool = True, start_timeout: float = 300.0,
                 pool_options: Mapping[str, Any] | None = None,
                 actor_options: Mapping[str, Any] | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError(f"a RayPool needs an int of at least one worker, got size={size!r}")
        if not num_cpus > 0 or num_gpus < 0:
            raise InvalidArgumentError(f"num_cpus must be > 0 and num_gpus >= 0, got {num_cpus}, {num_gpus}")
        slots = whole(slots, "slots")
        if slots < 1:
            raise InvalidArgumentError(f"a worker needs slots >= 1, got {slots}")
        self.replace_dead = bool(replace_dead)
        self.start_timeout = float(start_timeout)
        threads = threads_per_worker or max(1, int(num_cpus))
        self._spec = (model, {"n_gpu_layers": n_gpu_layers},
                      {"slots": slots, "n_ctx_slot": n_ctx_slot, "chunk": chunk},
                      {"threads_per_worker": threads, **(pool_options or {})})
        self._actor_options = {"num_cpus": num_cpus, "num_gpus": num_gpus,
                               # Threads for the requests (more wait in Ray's queue, as they would for a
                               # slot); interrupts and gauges have threads of their own, so that a full
                               # actor still hears them.
                               "max_concurrency": 4 * slots, **(actor_options or {})}
        self._lock = threading.Lock()
        self._closed = False
        self._next_worker_id = 0
        self._members: list[RayWorker] = []
        self._subscribers: list[Callable[[WorkerEvent], None]] = []
        self._subscribers_lock = threading.Lock()
        self._actors: list[Any] = []  # everything started, for the finalizer
        self._finalizer = weakref.finalize(self, _kill_all, self._actors)
        try:
            started = [self._start() for _ in range(size)]  # all at once: the loads overlap
            self._members = [self._started(i, *s) for i, s in enumerate(started)]
        except BaseException:
            self.close()
            raise

    def _start(self) -> tuple[int, Any]:
        with self._lock:
            if self._closed:
                raise PoolClosedError("the pool is closed")
            worker_id = self._next_worker_id
            self._next_worker_id += 1
        actor = _remote_actor().options(**self._actor_options).remote(*self._spec)
        with self._lock:
            self._actors.append(actor)
        return worker_id, actor

    def _started(self, index: int, worker_id: int, actor: Any) -> RayWorker:
        """The actor, once it holds the model (its start-up error otherwise, and it is stopped)."""
        probe = RayWorker(index, worker_id, actor, {"node_id": "", "hostname": "?", "pid": 0, "worker_pid": 0,
                                                    "model_path": "", "slots": 0, "has_chat_template": False})
        try:
            info = _get(probe, actor.describe.remote(), self.start_timeout)
        except BaseException:
            _kill_all([actor])
            raise
        return RayWorker(index, worker_id, actor, info)

    # -- the Pool's interface ---------------------------------------------------------------------------
    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RayPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __len__(self) -> int:
        return len(self._members)

    def __getitem__(self, index: int) -> RayWorker:
        return self._members[index]

    def __iter__(self) -> Iterator[RayWorker]:
        return iter(list(self._members))

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    def replace(self, index: int | RayWorker) -> RayWorker:
        """Starts a fresh actor in the place of ``pool[index]`` (dead or alive: a live one is stopped) and
        waits until it holds the model."""
        if self._closed:
            raise PoolClosedError("the pool is closed")
        i = index.index if isinstance(index, RayWorker) else index
        old = self._members[i]
        old.alive = False
        _kill_all([old.actor])
        fresh = self._started(i, *self._start())
        with self._lock:
            if self._closed:
                _kill_all([fresh.actor])
                raise PoolClosedError("the pool was closed while a worker was replaced")
            self._members[i] = fresh
            if old.actor in self._actors:
                self._actors.remove(old.actor)
        self._emit(WorkerEvent("replaced", fresh.worker_id, fresh.pid, index=i))
        return fresh

    def _died(self, member: RayWorker, error: WorkerCrashedError) -> None:
        with self._lock:
            if not member.alive or self._closed or self._members[member.index] is not member:
                return
            member.alive = False
        self._emit(WorkerEvent("died", member.worker_id, member.pid, error=error, index=member.index))
        _kill_all([member.actor])  # a worker that crashed leaves its actor running, and useless
        if self.replace_dead:
            threading.Thread(target=self._replace_quietly, args=(member.index,), daemon=True,
                             name=f"lloyal-ray-replace-{member.index}").start()

    def _replace_quietly(self, index: int) -> None:
        try:
            self.replace(index)
        except LloyalError as exc:
            if not self._closed:
                _log.error("could not replace worker %d: %s", index, exc)

    def stats(self) -> list[dict[str, Any]]:
        """Instance.stats() of every actor's worker, in index order."""
        return [m.stats() for m in self._members]

    def close(self, timeout: float = 5.0) -> None:
        """Stops every actor (its worker shut down, then the actor killed); requests still running fail
        with PoolClosedError. Idempotent."""
        with self._lock:
            self._closed = True
            actors = list(self._actors)
        try:
            ray.wait([a.shutdown.remote() for a in actors], num_returns=len(actors), timeout=timeout)
        except Exception:  # a dead actor or a gone cluster: killing is all that is left to do
            pass
        _kill_all(actors)
        self._finalizer.detach()

    async def aclose(self, timeout: float = 5.0) -> None:
        """close() for asyncio, on a thread of the loop's executor."""
        await closed_in_thread(self.close, timeout)

    # -- requests ------------------------------------------------------------------------------------------
    def _pick(self, prompt: str | list[int]) -> RayWorker:
        key: str | tuple[int, ...] = prompt if isinstance(prompt, str) else tuple(prompt)
        with self._lock:
            if self._closed:
                raise PoolClosedError("the pool is closed")
            live = [m for m in self._members if m.alive]
            if not live:
                raise WorkerCrashedError("no live worker can take the request (their actors died; replace_dead "
                                         "starts fresh ones)")
            chosen = ROUTER.pick(live, key)
            chosen.load += 1
            chosen._recent.append(key)
        return chosen

    def submit(self, prompt: str | Sequence[int], params: GenerateParams | None = None, *,
               model: Model | str | None = None, on_piece: Callable[[str], None] | None = None,
               **overrides: Any) -> BatchRequest:
        """Sends an independent generation to an actor: its ``future`` is the Result's, its
        ``interrupt()`` ends it. ``model`` may name the model (any name maps to the one the actors hold);
        ``on_piece`` is called, on a thread of the pool's, with each piece of text as it arrives."""
        if isinstance(model, Model):
            raise InvalidArgumentError("a RayPool's requests cannot name a Model handle (they live in another "
                                       "process); pass its name or nothing")
        gen = GenerateParams.of(params, overrides)
        if not isinstance(prompt, str):
            prompt = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidArgumentError("a prompt is text or a sequence of token ids")
        member = self._pick(prompt)
        rid = uuid.uuid4().hex
        future: Future[Result] = running()
        threading.Thread(target=self._pump, args=(member, rid, prompt, gen, on_piece, future), daemon=True,
                         name=f"lloyal-ray-request-{rid[:8]}").start()

        def interrupt() -> None:
            if not future.done():
                member.actor.interrupt.remote(rid)

        return BatchRequest(future, interrupt)

    def submit_many(self, prompt: str | Sequence[int], params: GenerateParams | None = None, n: int = 1, *,
                    model: Model | str | None = None, on_piece: Callable[[int, str], None] | None = None,
                    **overrides: Any) -> list[BatchRequest]:
        """``n`` choices of one prompt (seeds as choice_params gives them), each sent as its own request:
        the router keeps a prompt where it went last, so they meet on one actor, whose batcher decodes
        the prompt once for all that arrive together."""
        gen = GenerateParams.of(params, overrides)
        if whole(n, "n") < 1:
            raise InvalidArgumentError(f"n must be at least 1, got {n}")
        if on_piece is not None and not callable(on_piece):
            raise InvalidArgumentError(f"on_piece must be callable, got {type(on_piece).__name__}")

        def pieces(i: int) -> Callable[[str], None] | None:
            return None if on_piece is None else lambda piece: on_piece(i, piece)

        return [self.submit(prompt, choice_params(gen, i), model=model, on_piece=pieces(i)) for i in range(n)]

    def _pump(self, member: RayWorker, rid: str, prompt: str | list[int], gen: GenerateParams,
              on_piece: Callable[[str], None] | None, future: Future[Result]) -> None:
        try:
            refs = member.actor.run.options(num_returns="streaming").remote(rid, prompt, gen, on_piece is not None)
            for ref in refs:
                item = ray.get(ref)
                if isinstance(item, Result):
                    future.set_result(item)
                elif on_piece is not None:
                    on_piece(item)
            if not future.done():
                raise RemoteError("the actor ended the request without a result", "ProtocolError")
        except BaseException as exc:
            error = PoolClosedError("the pool was closed while the request ran") if self._closed else _translated(
                member, exc)
            if not future.done():
                future.set_exception(error)
            if error is exc:  # not the actor's: on_piece raised, say; the request must not run on
                try:
                    member.actor.interrupt.remote(rid)
                except Exception:
                    pass
            if isinstance(error, WorkerCrashedError):
                self._died(member, error)
        finally:
            with self._lock:
                member.load -= 1

    def serving_backend(self) -> Any:
        """The HTTP endpoint's view of this pool (lloyal_pool.serve.create_app(ray_pool))."""
        return _RayBackend(self)


class _RayBackend:
    """lloyal_pool.serve's Backend over a RayPool: questions go to the least loaded live actor."""

    def __init__(self, pool: RayPool) -> None:
        self.pool = pool

    def _any(self) -> RayWorker:
        live = [m for m in self.pool if m.alive]
        if not live:
            raise WorkerCrashedError("no live worker (their actors died)")
        return min(live, key=lambda m: m.load)

    def _ask(self, method: str, *args: Any) -> Any:
        member = self._any()
        return _get(member, getattr(member.actor, method).remote(*args))

    def model_path(self) -> str:
        return self._any().model_path

    def submit(self, prompt: str | list[int], gen: GenerateParams,
               on_piece: Callable[[str], None] | None) -> BatchRequest:
        return self.pool.submit(prompt, gen, on_piece=on_piece)

    def submit_many(self, prompt: str | list[int], gen: GenerateParams, n: int,
                    on_piece: Callable[[int, str], None] | None) -> list[BatchRequest]:
        return self.pool.submit_many(prompt, gen, n, on_piece=on_piece)

    def echo(self, prompt: str | list[int], logprobs: int | None) -> Any:
        from .serve.schemas import APIError, Echo

        if logprobs is not None:
            raise APIError(400, "echo with logprobs scores the prompt on a worker of this machine's pool; a Ray "
                                "pool does not yet", param="echo")
        if isinstance(prompt, str):
            return Echo(prompt, [], [])
        raise APIError(400, "echo of a token prompt is served by a pool on this machine, not yet a Ray pool",
                       param="echo")

    def format_chat(self, messages: Sequence[Mapping[str, Any]], *, template: str | None,
                    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str) -> p.ChatPrompt:
        fmt: p.ChatPrompt = self._ask("format_chat", list(messages), template, tools, tool_choice)
        return fmt

    def parse_chat(self, text: str, *, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
                   messages: Sequence[Mapping[str, Any]], tool_choice: str, partial: bool) -> ChatMessage:
        message: ChatMessage = self._ask("parse_chat", text, template, tools, list(messages), tool_choice, partial)
        return message

    def embed(self, inputs: Sequence[str | list[int]]) -> tuple[list[np.ndarray], int]:
        vectors, n_tokens = self._ask("embed", list(inputs))
        return vectors, n_tokens

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tokens: list[int] = self._ask("tokenize", text, add_special, parse_special)
        return tokens

    def detokenize(self, tokens: Sequence[int]) -> str:
        text: str = self._ask("detokenize", list(tokens))
        return text

    def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        pieces: list[bytes] = self._ask("token_pieces", list(tokens))
        return pieces

    def served_model(self) -> tuple[Any, int]:
        return self._ask("served_model"), sum(m.slots for m in self.pool if m.alive)

    def gauges(self) -> list[Any]:
        from .serve.backend import WorkerGauge

        out = []
        for m in self.pool:
            alive, active, queued = False, 0, 0
            if m.alive:
                try:
                    alive, active, queued = _get(m, m.actor.gauge.remote(), 10.0)
                except LloyalError:
                    pass
            out.append(WorkerGauge(f"{m.worker_id}@{m.hostname}", alive, active, queued))
        return out


_REMOTE: Any = None


def _remote_actor() -> Any:
    global _REMOTE
    if _REMOTE is None:
        _REMOTE = ray.remote(concurrency_groups={"control": 2})(ModelActor)  # type: ignore[call-overload]
    return _REMOTE


def _kill_all(actors: Sequence[Any]) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone, or the cluster is
            pass
