"""The error tree. Imported by both sides of the process boundary and by the native module.

    LloyalError
    ├── RemoteError               an unexpected exception inside a worker (remote traceback attached)
    ├── ModelLoadError            missing/unreadable/invalid GGUF
    ├── ContextError              invalid context parameters, context creation failed
    ├── InvalidTokenError         a token id outside [0, n_vocab), or one that is not an integer
    ├── InvalidArgumentError      a value out of its range (NaN logits, a negative shm_bytes, ...)
    ├── ContextOverflowError      the tokens do not fit in the context window
    ├── GrammarError              a GBNF grammar or JSON schema that does not parse
    ├── DecodeError               llama_decode failed (KV full, compute error)
    ├── StaleHandleError          a handle that was closed, or whose model was closed or worker died
    ├── BranchError               a branch operation that cannot be done as asked
    ├── InterruptedByClient       an all-or-nothing operation (commit, prefill) interrupted; nothing changed
    ├── LoraError                 a LoRA adapter that cannot be loaded or applied (file, model, scale)
    ├── ResultTooLargeError       a result (embeddings) that does not fit the worker's shared memory
    ├── TemplateError             a chat template that is missing, does not parse or fails to render
    ├── StateError                a saved context state that cannot be used (garbage, truncated, corrupted,
    │                             another model or format version, a file that cannot be read or written)
    ├── ProtocolError             a frame that cannot be encoded or decoded, or a reply of the wrong type
    │   └── BadRequestError       a request with an unknown op, or a field missing or of the wrong type
    ├── PoolClosedError           the pool was closed
    ├── CallTimeoutError          a call's ``timeout=`` passed (also a TimeoutError); the call was stopped
    └── WorkerError
        ├── WorkerStartupError    the worker did not complete its handshake
        └── WorkerCrashedError    the worker process died (exit code or signal, stderr tail)
            ├── WorkerHungError   it showed no sign of life for the pool's hang_timeout and was killed
            └── DeadWorkerError   a call on a handle of a worker that had already died (also a
                                  StaleHandleError): how it died

Errors raised inside a worker travel as (type name, message, remote traceback) and are raised again in the
client as the class of the same name; the remote traceback is kept on ``remote_traceback`` and chained
as ``__cause__``. Built-in ValueError/TypeError/KeyError/FileNotFoundError keep their type too.
"""

from __future__ import annotations

import builtins
import signal
from typing import Any


class LloyalError(Exception):
    """Base of every error lloyal_pool raises on purpose."""

    remote_traceback: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (a RayPool's actors send errors to the driver) without calling __init__ again:
        # some take arguments that differ from the ``args`` they keep.
        return _unpickled, (type(self), self.args, self.__dict__)


def _unpickled(cls: type[LloyalError], args: tuple[Any, ...], state: dict[str, Any]) -> LloyalError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class RemoteError(LloyalError):
    """An exception inside a worker that has no counterpart here; ``remote_type`` names it."""

    def __init__(self, message: str, remote_type: str = "Exception") -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type


class ModelLoadError(LloyalError):
    """A model that could not be loaded (Instance.load_model): a missing file, a directory, a file that
    is not a GGUF llama.cpp can load. Also raised by default_model_path() when the default model's
    package is not installed. The worker keeps serving."""


class ContextError(LloyalError):
    """A context that cannot be made or cannot do what was asked: invalid ContextParams (an unknown
    name, a value of the wrong type or range), a model loaded with vocab_only, llama.cpp refusing to
    create the context, generating in an embedding context (or embedding in a generation one), branches
    on a context that holds an eval/generate history, or a KV state that cannot be saved or loaded."""


class InvalidTokenError(LloyalError, ValueError):
    """A token id outside [0, n_vocab), or one that is not an integer (a float such as 818.9, a bool, a
    str), in a prompt, a commit, a logit bias or anything else that takes token ids. It is checked before
    anything is decoded: the context is unchanged."""


class InvalidArgumentError(LloyalError, ValueError):
    """A value that cannot be taken, refused where it enters, before anything is sent or changed: a
    logit that is NaN or +inf (``set_logits``; -inf, which bans a token, is allowed), a logit bias that is
    NaN or +inf, a sampler parameter out of its range, a ``Pool`` option out of range (``shm_bytes``,
    ``threads_per_worker``). The option's name is in the message."""


class ContextOverflowError(LloyalError):
    """The tokens do not fit: a prompt (with the tokens already held, for eval or ``append``) longer than
    the context window, or an embed() or rerank() input longer than one decode takes. Nothing was
    decoded."""


class GrammarError(LloyalError, ValueError):
    """A grammar that cannot be used: GBNF that does not parse, an invalid JSON schema or trigger
    pattern, an empty grammar, or a committed token the branch's grammar does not allow there. Raised
    when the grammar is set or the request is made, before anything is generated."""


class DecodeError(LloyalError):
    """llama_decode failed: no KV slot for the batch (the cache is full), a batch it rejected, or a
    compute error; or llama.cpp returned no logits or embeddings where it should have. Branch commits
    and prefills are all or nothing: after a DecodeError every branch is as it was."""


class StaleHandleError(LloyalError):
    """A handle that no longer names anything, raised when it is used: a Model, Context, LoraAdapter or
    Branch that was closed (or pruned, detached, retained away), whose model was closed, or whose worker
    died (Pool.replace() starts a fresh worker, in which models must be loaded again). Calls that were
    already waiting when a worker died raise WorkerCrashedError instead."""


class BranchError(LloyalError):
    """A branch operation that cannot be done as asked: pruning a branch that has children, the same
    branch twice in one batch, no free sequence to lease, writing to a sequence a branch owns."""


class LoraError(LloyalError):
    """A LoRA adapter that cannot be loaded or applied: a missing file, not a GGUF adapter, an adapter for
    another architecture or other tensor shapes, an adapter loaded by another Model handle, a scale that
    is not finite, one adapter twice in one configuration, or a configuration change on a context that
    holds branches or detached sequences."""


class ResultTooLargeError(LloyalError):
    """A result that does not fit the worker's shared-memory region (embeddings of too many tokens at
    once): nothing was computed. Embed fewer texts per call, or create the Pool with a larger shm_bytes."""


class TemplateError(LloyalError):
    """A chat template that cannot be used: the model has none and none was given, or the template does
    not parse or fails to render (llama.cpp's Jinja engine says why)."""


class StateError(LloyalError):
    """A saved context state that cannot be used: not a state at all (garbage, truncated, corrupted), one
    of another model or format version, or a file that cannot be read or written. The context it was
    meant for is left as it was."""


class MigrationError(LloyalError):
    """A context could not be moved to another worker (Context.move_to, Pool.drain): the target failed
    (it died, ran out of memory, could not take the state). The context stays where it was, whole and
    serving, its paused or running stream going on there; ``__cause__`` is the target's error."""


class SnapshotError(LloyalError):
    """A snapshot that cannot be made or forked: prepare() returned something that is not a handle of
    the instance it was given, the prepared worker runs native threads (it could not fork safely), or
    the snapshot is closed or frozen (a frozen instance serves only forks)."""


class InterruptedByClient(LloyalError):
    """An all-or-nothing operation (branch commit, prefill) was interrupted; nothing was changed."""


class ProtocolError(LloyalError):
    """A frame that breaks the protocol: a request that cannot be encoded (a value msgpack cannot carry,
    a frame over the size limit), a malformed frame or a reply of the wrong type. A worker that sends
    garbage is killed (its calls then raise WorkerCrashedError); a protocol version mismatch at start-up
    is a WorkerStartupError."""


class BadRequestError(ProtocolError, TypeError):
    """A request the worker cannot take: an unknown operation, an unknown or missing field, or a field of
    the wrong type (protocol.parse_request). It fails that request only; the worker goes on serving. The
    client raises it too, before sending, for an argument of the wrong type: a ``bytes`` prompt (decode
    it to text first), a logit bias that is not a mapping, a prompt that is neither text nor token ids."""


class PoolClosedError(LloyalError):
    """The pool was closed: raised by calls made on its handles afterwards, by calls still waiting when
    it closed, and by Pool.replace()."""


class WorkerError(LloyalError):
    """A worker process failed as a whole; ``worker_id``, ``pid`` and ``stderr_tail`` say which and why."""

    def __init__(self, message: str, *, worker_id: int | None = None, pid: int | None = None,
                 stderr_tail: str = "") -> None:
        self.worker_id = worker_id
        self.pid = pid
        self.stderr_tail = stderr_tail
        text = message
        if stderr_tail.strip():
            text += "\n--- worker stderr (tail) ---\n" + stderr_tail.rstrip()
        super().__init__(text)


class WorkerStartupError(WorkerError):
    """A worker that did not complete its handshake (Pool(), Pool.replace()): it exited or failed while
    starting (a native module that cannot load, a strict variant that is missing), spoke another protocol
    version, or sent nothing within ``start_timeout``. The message says how it ended; ``stderr_tail``
    holds its last output."""


class WorkerCrashedError(WorkerError):
    """The worker died. ``returncode`` is the raw status (negative: killed by that signal)."""

    def __init__(self, message: str, *, returncode: int | None = None, worker_id: int | None = None,
                 pid: int | None = None, stderr_tail: str = "") -> None:
        self.returncode = returncode
        super().__init__(message, worker_id=worker_id, pid=pid, stderr_tail=stderr_tail)

    @property
    def signal_name(self) -> str | None:
        """The signal that killed the worker ("SIGKILL", "SIGSEGV", ...), or None when it exited by itself
        or its status is unknown."""
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"


class WorkerHungError(WorkerCrashedError):
    """The worker had requests to serve and showed no sign of life (its heartbeat word in shared memory
    stood still) for the pool's ``hang_timeout``: stopped (SIGSTOP), deadlocked, or stuck in a native loop.
    The pool killed it; ``returncode`` is that kill's status and ``hung_for`` the seconds it stood still."""

    def __init__(self, message: str, *, hung_for: float = 0.0, returncode: int | None = None,
                 worker_id: int | None = None, pid: int | None = None, stderr_tail: str = "") -> None:
        self.hung_for = hung_for
        super().__init__(message, returncode=returncode, worker_id=worker_id, pid=pid, stderr_tail=stderr_tail)


class DeadWorkerError(WorkerCrashedError, StaleHandleError):
    """A call on a handle whose worker had already died (while idle, or in an earlier call): says how it
    died, as WorkerCrashedError does, and is also a StaleHandleError (the handle is of no use any more;
    Pool.replace() starts a fresh worker)."""


class ContextLostError(DeadWorkerError):
    """A context whose worker died and whose history crash recovery could not rebuild (branches, raw KV
    edits, or a worker that died before the state could be saved): it came back empty in the replacement.
    Raised once, by the first call that needs the history (the message says what was lost); every call
    after it, and any call that replaces the whole history (a generate without append, reset()), works on
    the empty context."""


class CallTimeoutError(LloyalError, TimeoutError):
    """A call's ``timeout=`` passed before it ended. A call that decodes (generate, eval, score, ...) was
    interrupted, so its context is free again and holds what an interrupt leaves; any other call may still
    complete in its worker, unobserved. Also a built-in TimeoutError. ``result``: what the interrupted
    call returned when it ended in time (a generation's partial Result, stop_reason "interrupted"), else
    None."""

    result: object = None


def describe_exit(returncode: int | None) -> str:
    """'killed by SIGKILL (-9)', 'exited with code 70', 'still running'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = {
            "SIGKILL": " (killed: by the pool, another process or the OOM killer)",
            "SIGSEGV": " (segmentation fault in native code)",
            "SIGABRT": " (abort: a failed assertion or GGML_ABORT)",
            "SIGBUS": " (bus error: a mapped model file or shared memory changed size)",
            "SIGILL": " (illegal instruction: a native build for another CPU)",
        }.get(name, "")
        return f"killed by {name} ({returncode}){hint}"
    return f"exited with code {returncode}"


_BUILTIN_PASSTHROUGH = ("ValueError", "TypeError", "KeyError", "IndexError", "FileNotFoundError",
                        "NotImplementedError", "MemoryError", "OverflowError")


def error_class(name: str) -> type[BaseException] | None:
    """The class a remote error of this name is raised as here, or None (then: RemoteError)."""
    obj = globals().get(name)
    if isinstance(obj, type) and issubclass(obj, LloyalError) and obj is not RemoteError:
        return obj
    if name in _BUILTIN_PASSTHROUGH:
        cls = getattr(builtins, name)
        assert isinstance(cls, type)
        return cls
    return None


def rebuild(type_name: str, message: str, remote_tb: str | None) -> BaseException:
    """The client-side exception for an error frame, with the remote traceback attached."""
    cls = error_class(type_name)
    exc: BaseException
    if cls is None:
        exc = RemoteError(message, type_name)
    elif issubclass(cls, WorkerError):
        exc = cls(message)
    else:
        try:
            exc = cls(message)
        except Exception:
            exc = RemoteError(message, type_name)
    if remote_tb:
        if isinstance(exc, LloyalError):
            exc.remote_traceback = remote_tb
        exc.__cause__ = _RemoteTraceback(remote_tb)
    return exc


class _RemoteTraceback(Exception):
    """Carries the worker's formatted traceback so it prints under the client's own."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\n--- remote traceback (worker) ---\n" + self.tb


def copy_error(err: BaseException) -> BaseException:
    """A fresh exception per waiting call, so tracebacks do not pile onto one shared instance."""
    if isinstance(err, WorkerCrashedError):
        first = str(err).split("\n--- worker stderr")[0]
        details: dict[str, Any] = {"returncode": err.returncode, "worker_id": err.worker_id, "pid": err.pid,
                                   "stderr_tail": err.stderr_tail}
        if isinstance(err, WorkerHungError):
            details["hung_for"] = err.hung_for
        new: BaseException = type(err)(first, **details)
    else:
        new = type(err)(*err.args)
    return new


__all__ = [
    "BadRequestError", "BranchError", "CallTimeoutError", "ContextError", "ContextLostError", "ContextOverflowError",
    "DeadWorkerError", "DecodeError", "GrammarError", "InterruptedByClient", "InvalidArgumentError",
    "InvalidTokenError", "LloyalError", "LoraError", "ModelLoadError", "PoolClosedError", "ProtocolError",
    "RemoteError", "ResultTooLargeError", "SnapshotError", "StaleHandleError", "StateError", "TemplateError",
    "WorkerCrashedError", "WorkerError", "WorkerHungError", "WorkerStartupError", "describe_exit", "error_class",
    "rebuild",
]
