#!/usr/bin/env python3
"""A desktop window (Tkinter) that streams a reply: Generate starts one, Stop ends it, and a worker killed
mid-reply (try `kill -9` on the pid in the title) is replaced by Pool(recover=True) while the reply goes on.
The window stays responsive throughout: the stream is read on a background thread, and the pieces reach the
Tk thread through a queue that a Tk timer empties."""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
import tkinter as tk
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Context, GenerateParams, Pool, Result, StopReason, Stream, WorkerEvent

# How often the Tk thread empties the queue: about a frame, so pieces appear as smoothly as the screen
# can show them, and an idle window costs next to nothing.
POLL_MS = 16
# The instrument for responsiveness: while a reply streams, a timer due every TICK_MS records how late
# each tick is. A UI thread that blocked (on the pool, on a lock, on the GIL) shows up as one long gap.
TICK_MS = 5


def reply_params(n_predict: int, seed: int, **extra: Any) -> GenerateParams:
    """Sampled, but with a fixed seed: Pool(recover=True) can only replay a generation it can reproduce,
    and a random seed would make a reply cut short by a crash fail instead of completing. cache_prompt is
    off so that the replay decodes exactly what the first run decoded (a run that reused a cached prefix
    can differ from a fresh decode at a near tie), and the pieces the window already shows stay true."""
    return GenerateParams(temperature=0.7, seed=seed, n_predict=n_predict, cache_prompt=False, **extra)


@dataclass
class Run:
    """One Generate click as the Tk thread saw it: what the window shows, and what a test reads."""

    prompt: str
    started: float
    pieces: int = 0
    text: list[str] = field(default_factory=list)
    stop_clicked: float | None = None
    stream_ended: float | None = None  # when the client thread saw the stream end
    shown_ended: float | None = None  # when the Tk thread learnt of it (up to POLL_MS later)
    max_stall: float = 0.0  # the longest gap between TICK_MS ticks while this run streamed
    worker_died: bool = False  # the worker died during the run (recovery replaces it and replays the run)
    result: Result | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.shown_ended is not None

    @property
    def stop_latency(self) -> float | None:
        """Seconds from the Stop click to the end of the stream, or None without a Stop."""
        if self.stop_clicked is None or self.stream_ended is None:
            return None
        return self.stream_ended - self.stop_clicked


class _Job:
    """What the Tk thread and the client thread of one run share, and nothing more: the stream (set once
    by the client thread) and a Stop flag for a click that comes before the stream exists."""

    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.stop = threading.Event()


@dataclass
class _Piece:
    job: _Job
    text: str


@dataclass
class _Ended:
    job: _Job
    at: float
    result: Result | None
    error: BaseException | None


def _read(ctx: Context, params: GenerateParams, prompt: str, job: _Job, inbox: queue.Queue[Any]) -> None:
    """The client thread: reads the stream and posts what it reads. It holds no widget, nor the app: a Tk
    object that a thread other than Tk's frees can crash Tcl."""
    result: Result | None = None
    error: BaseException | None = None
    try:
        with ctx.stream(prompt, params) as stream:
            job.stream = stream
            # Stop set its flag before reading job.stream, and this thread set job.stream before reading
            # the flag: whichever came second, one of the two interrupts the stream.
            if job.stop.is_set():
                stream.interrupt()
            for piece in stream:
                inbox.put(_Piece(job, piece))
            result = stream.result
    except Exception as exc:  # shown in the status line; the window goes on
        error = exc
    inbox.put(_Ended(job, time.perf_counter(), result, error))


class DesktopApp:
    """The window. Its button methods (generate, stop) are what a test calls, through the buttons."""

    def __init__(self, root: tk.Tk, pool: Pool, ctx: Context, params: GenerateParams,
                 prompt: str = "Tell me a story about a lighthouse keeper.") -> None:
        self.root, self.pool, self.ctx, self.params = root, pool, ctx, params
        self.runs: list[Run] = []
        self._job: _Job | None = None
        self._thread: threading.Thread | None = None
        # Everything the client threads (the stream's reader, the pool's event callbacks) have for the
        # window goes through here: Tk is not thread-safe, and only the Tk thread touches a widget.
        self._inbox: queue.Queue[_Piece | _Ended | WorkerEvent] = queue.Queue()
        self._last_tick = 0.0
        self._closed = False

        root.title(f"lloyal_pool desktop — worker pid {pool[0].pid}")
        root.geometry("720x480")
        top = tk.Frame(root)
        top.pack(fill="x", padx=6, pady=6)
        self.prompt = tk.Entry(top)
        self.prompt.insert(0, prompt)
        self.prompt.pack(side="left", fill="x", expand=True)
        self.generate_button = tk.Button(top, text="Generate", command=self.generate)
        self.generate_button.pack(side="left", padx=(6, 0))
        self.stop_button = tk.Button(top, text="Stop", command=self.stop, state="disabled")
        self.stop_button.pack(side="left", padx=(6, 0))
        self.prompt.bind("<Return>", lambda _: self.generate_button.invoke())
        self.status = tk.Label(root, text="ready", anchor="w")
        self.status.pack(side="bottom", fill="x", padx=6, pady=(0, 6))
        self.reply = tk.Text(root, wrap="word", height=20)
        self.reply.pack(fill="both", expand=True, padx=6)

        self._unsubscribe = pool.subscribe(self._inbox.put)
        root.protocol("WM_DELETE_WINDOW", self.close)
        root.after(POLL_MS, self._poll)

    # -- what the buttons do (Tk thread) --------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._job is not None

    def generate(self) -> None:
        if self._job is not None:
            return
        run = Run(self.prompt.get(), time.perf_counter())
        self.runs.append(run)
        self._job = job = _Job()
        self.reply.delete("1.0", "end")
        self.generate_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self._set_status("generating…")
        self._last_tick = run.started
        self.root.after(TICK_MS, self._tick, run)
        # ctx.stream() is called on the client thread too: it waits while a recovery is rebuilding the
        # worker, and the Tk thread must never wait on the pool.
        self._thread = threading.Thread(target=_read, args=(self.ctx, self.params, run.prompt, job, self._inbox),
                                        daemon=True, name="desktop-stream")
        self._thread.start()

    def stop(self) -> None:
        job = self._job
        if job is None or job.stop.is_set():
            return
        self.runs[-1].stop_clicked = time.perf_counter()
        job.stop.set()
        stream = job.stream
        if stream is not None:
            stream.interrupt()  # from this thread, at once: it writes one word in shared memory
        self.stop_button.configure(state="disabled")
        self._set_status("stopping…")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        if self._job is not None:
            self._job.stop.set()
            if self._job.stream is not None:
                self._job.stream.interrupt()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.root.destroy()

    # -- the Tk thread's timers -----------------------------------------------------------------------
    def _poll(self) -> None:
        if self._closed:
            return
        try:
            while True:
                self._handle(self._inbox.get_nowait())
        except queue.Empty:
            pass
        self.root.after(POLL_MS, self._poll)

    def _handle(self, item: _Piece | _Ended | WorkerEvent) -> None:
        run = self.runs[-1] if self.runs else None
        if isinstance(item, WorkerEvent):
            if item.kind == "died":
                self._set_status(f"worker {item.pid} died; recovering…")
                if run is not None and not run.done:
                    run.worker_died = True
            elif item.kind == "recovered":
                self.root.title(f"lloyal_pool desktop — worker pid {self.pool[0].pid}")
                if self._job is not None:
                    self._set_status("worker replaced; the reply goes on")
                else:  # a death between replies: "recovering…" must not stay on once it is over
                    self._set_status(f"worker replaced (pid {self.pool[0].pid}); ready")
            return
        if run is None or item.job is not self._job:
            return
        if isinstance(item, _Piece):
            run.pieces += 1
            run.text.append(item.text)
            self.reply.insert("end", item.text)
            self.reply.see("end")
            return
        run.stream_ended, run.shown_ended = item.at, time.perf_counter()
        run.result, run.error = item.result, item.error
        self._job = None
        self.generate_button.configure(state="normal")
        self.stop_button.configure(state="disabled")
        self._set_status(self._summary(run))

    def _tick(self, run: Run) -> None:
        now = time.perf_counter()
        run.max_stall = max(run.max_stall, now - self._last_tick)
        self._last_tick = now
        if not run.done and not self._closed:
            self.root.after(TICK_MS, self._tick, run)

    def _set_status(self, text: str) -> None:
        self.status.configure(text=text)

    @staticmethod
    def _summary(run: Run) -> str:
        if run.error is not None:
            return f"failed: {type(run.error).__name__}: {run.error}"
        assert run.result is not None
        r = run.result
        verb = "stopped" if r.stop_reason == StopReason.INTERRUPTED else "finished"
        text = f"{verb}: {r.n_decoded} tokens ({r.stop_reason}), {r.decode_tokens_per_second:.0f} tok/s"
        if run.stop_latency is not None:
            text += f" · {run.stop_latency * 1000:.1f} ms after Stop"
        if run.worker_died:
            text += " · worker replaced mid-reply"
        return text + f" · longest UI stall {run.max_stall * 1000:.0f} ms"


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--n-predict", type=int, default=256, help="most tokens per reply")
    ap.add_argument("--seed", type=int, default=42, help="the sampling seed (fixed, so a crash can be replayed)")
    ap.add_argument("--prompt", default="Tell me a story about a lighthouse keeper.")
    args = ap.parse_args()
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(model_path(args.model)).new_context(n_ctx=2048)
        root = tk.Tk()
        app = DesktopApp(root, pool, ctx, reply_params(args.n_predict, args.seed), prompt=args.prompt)
        # Ctrl-C in the terminal closes the window as its close button does (the handler runs at the next
        # Tk timer, within POLL_MS, since Python code only runs between Tk's events).
        signal.signal(signal.SIGINT, lambda *_: root.after_idle(app.close))
        root.mainloop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
