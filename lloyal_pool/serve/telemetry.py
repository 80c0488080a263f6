"""What the HTTP endpoint's /metrics shows (app.py): Prometheus counters and latency histograms of the
requests it served, and the workers' gauges (backend.WorkerGauge), in the text format."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Sequence

from ..params import Result, StopReason
from .backend import WorkerGauge

# The buckets (upper bounds, seconds) of the latency histograms: vLLM's for time to first token and for
# the time per output token; queue time shares the first.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
# When the request being served arrived (time.monotonic()): set by each route, read when it submits.
ARRIVAL: contextvars.ContextVar[float] = contextvars.ContextVar("arrival")


class Histogram:
    """A Prometheus histogram (the caller holds the metrics' lock)."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append(f'{self.name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.total}', f"{self.name}_sum {self.sum:.6f}",
                f"{self.name}_count {self.total}"]
        return out


class Timing:
    """When a generating request arrived, when its first piece of text came and when it ended, as the
    server saw them (time.monotonic(); the pieces and the end are stamped on the thread that delivers them)."""

    def __init__(self) -> None:
        self.arrival = ARRIVAL.get(time.monotonic())
        self.first: float | None = None
        self.end: float | None = None

    def piece(self) -> None:
        if self.first is None:
            self.first = time.monotonic()


class Metrics:
    """What /metrics shows. Every generating request is counted once, when it ends (whether or not its
    client still reads): its tokens and latencies, and if it was interrupted, a client that left (the
    server interrupts a request for no other reason: a plain request's client that disconnected, a stream
    that was closed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors: dict[int, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0
        self.disconnect_tokens = 0  # completion tokens of the requests whose clients left
        self.ttft = Histogram("lloyal_time_to_first_token_seconds", "From a request's arrival to its first piece "
                               "of text (to its end, for a reply with none)", TTFT_BUCKETS)
        self.itl = Histogram("lloyal_inter_token_latency_seconds", "A request's mean time between two tokens, "
                              "from its first piece of text to its end (requests of two tokens or more)", ITL_BUCKETS)
        self.queue = Histogram("lloyal_queue_seconds", "A request's time to first token less the time of the "
                                "decodes that carried its prompt: the wait for a slot, and for its turn", TTFT_BUCKETS)

    def count(self, endpoint: str) -> None:
        with self.lock:
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def ended(self, timings: Sequence[Timing], results: Sequence[Result | None]) -> None:
        """A generating request ended: choice i with results[i] (None: it failed). Its prompt counts once,
        its choices' tokens together; each choice's latencies count as a request's."""
        done = [(t, r) for t, r in zip(timings, results, strict=True) if r is not None]
        if not done:
            return
        with self.lock:
            self.prompt_tokens += done[0][1].n_prompt
            self.completion_tokens += sum(r.n_decoded for _, r in done)
            if any(r.stop_reason == StopReason.INTERRUPTED for _, r in done):
                self.disconnects += 1
                self.disconnect_tokens += sum(r.n_decoded for _, r in done)
            for timing, result in done:
                if result.n_decoded > 0:
                    end = timing.end if timing.end is not None else time.monotonic()
                    first = timing.first if timing.first is not None else end
                    ttft = max(0.0, first - timing.arrival)
                    self.ttft.observe(ttft)
                    self.queue.observe(max(0.0, ttft - result.prompt_ms / 1000.0))
                    if result.n_decoded > 1 and timing.first is not None:
                        self.itl.observe(max(0.0, end - first) / (result.n_decoded - 1))

    def error(self, status: int) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def text(self, gauges: Sequence[WorkerGauge]) -> str:
        """The Prometheus text of these counts, and of the workers' gauges."""
        lines = ["# TYPE lloyal_requests_total counter"]
        with self.lock:
            lines += [f'lloyal_requests_total{{endpoint="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            lines += ["# TYPE lloyal_errors_total counter"]
            lines += [f'lloyal_errors_total{{status="{k}"}} {v}' for k, v in sorted(self.errors.items())]
            lines += ["# TYPE lloyal_prompt_tokens_total counter", f"lloyal_prompt_tokens_total {self.prompt_tokens}",
                      "# TYPE lloyal_completion_tokens_total counter",
                      f"lloyal_completion_tokens_total {self.completion_tokens}",
                      "# TYPE lloyal_client_disconnects_total counter",
                      f"lloyal_client_disconnects_total {self.disconnects}",
                      "# TYPE lloyal_client_disconnect_tokens_total counter",
                      f"lloyal_client_disconnect_tokens_total {self.disconnect_tokens}"]
            for histogram in (self.ttft, self.itl, self.queue):
                lines += histogram.lines()
        alive = [g for g in gauges if g.alive]
        kv = [g for g in alive if g.kv_used is not None and g.kv_total is not None]  # where the backend knows
        # Each family's samples together, after its TYPE line, as the text format asks.
        families: list[tuple[str, Sequence[WorkerGauge], Callable[[WorkerGauge], int | None]]] = [
            ("lloyal_worker_alive", gauges, lambda g: int(g.alive)),
            ("lloyal_slots_active", alive, lambda g: g.active),
            ("lloyal_requests_queued", alive, lambda g: g.queued),
            ("lloyal_kv_cells_used", kv, lambda g: g.kv_used),
            ("lloyal_kv_cells_total", kv, lambda g: g.kv_total),
        ]
        for name, shown, value in families:
            lines.append(f"# TYPE {name} gauge")
            lines += [f'{name}{{worker="{g.worker}"}} {value(g)}' for g in shown]
        return "\n".join(lines) + "\n"


__all__ = ["ARRIVAL", "Histogram", "Metrics", "Timing"]
