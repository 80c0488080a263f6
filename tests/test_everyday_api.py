"""The API as a new user meets it: streams that stop when left, text without markup tokens, quiet logs."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lloyal_pool import GrammarError, Model, ModelLoadError, Pool, StopReason

pytestmark = pytest.mark.gemma


def test_leaving_a_stream_stops_the_generation(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        with ctx.stream("Once upon a time", n_predict=400, ignore_eos=True) as stream:
            for i, _ in enumerate(stream):
                if i == 3:
                    break
        r = stream.result  # returns soon: close() interrupted the request
        assert r.stop_reason is StopReason.INTERRUPTED and r.n_decoded < 100
        # The next call is not queued behind 400 tokens.
        assert ctx.generate("Hi", n_predict=2).n_decoded == 2

        stream = ctx.stream("Once upon a time", n_predict=400, ignore_eos=True)
        next(iter(stream))
        stream.close()
        assert stream.result.interrupted
        stream.close()  # idempotent, and after the end a no-op
    finally:
        ctx.close()


def test_an_abandoned_stream_is_interrupted(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        stream = ctx.stream("Once upon a time", n_predict=400, ignore_eos=True)
        fut = stream.future
        next(iter(stream))
        del stream
        gc.collect()
        r = fut.result(timeout=60)
        assert r.stop_reason is StopReason.INTERRUPTED and r.n_decoded < 100
    finally:
        ctx.close()


def test_a_queued_stream_can_be_interrupted_before_it_starts(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        first = ctx.generate_async("The capital of France is", n_predict=48, ignore_eos=True)
        queued = ctx.stream("Once upon a time", n_predict=200, ignore_eos=True)
        queued.interrupt()  # still behind `first` in the worker's queue
        assert not first.result(timeout=120).interrupted  # the running request is not the one stopped
        r = queued.result
        assert r.interrupted and r.n_decoded == 0 and list(queued) == []
    finally:
        ctx.close()


def test_interrupt_from_another_thread_while_iterating(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        stream = ctx.stream("Once upon a time", n_predict=400, ignore_eos=True)
        threading.Timer(0.5, stream.interrupt).start()
        pieces = list(stream)
        assert stream.result.interrupted and "".join(pieces) == stream.result.text
    finally:
        ctx.close()


def test_prompt_text_reads_control_tokens_unless_asked_not_to(gemma: Model) -> None:
    """eval's text is what the application wrote (a chat template's output): its control-token text is
    those tokens, unless parse_special=False."""
    text = "<start_of_turn>user\nHi<end_of_turn>"
    special = gemma.tokenize(text, add_special=False, parse_special=True)
    plain = gemma.tokenize(text, add_special=False, parse_special=False)
    assert len(special) < len(plain)
    ctx = gemma.new_context(n_ctx=128)
    try:
        ctx.eval(text, add_special=False)
        assert ctx.tokens() == special
        ctx.reset()
        ctx.eval(text, add_special=False, parse_special=False)
        assert ctx.tokens() == plain
    finally:
        ctx.close()


def test_text_leaves_out_markup_tokens_unless_asked(gemma: Model) -> None:
    image = gemma.tokenize("<start_of_image>", add_special=False, parse_special=True)
    assert len(image) == 1
    table = gemma.tokenize("<table>", add_special=False, parse_special=True)
    ctx = gemma.new_context(n_ctx=128)
    try:
        forced = ctx.generate("Hi", n_predict=3, logit_bias={image[0]: 100.0})
        assert forced.tokens == image * 3 and forced.text == ""
        pieces = list(ctx.stream("Hi", n_predict=3, logit_bias={image[0]: 100.0}))
        assert "".join(pieces) == ""
        shown = ctx.generate("Hi", n_predict=3, logit_bias={image[0]: 100.0}, render_special=True)
        assert shown.text == "<start_of_image>" * 3
        # HTML tags are user-defined tokens too, and they are text.
        html = ctx.generate("Hi", n_predict=1, logit_bias={table[0]: 100.0})
        assert html.tokens == table and html.text == "<table>"
        eot = gemma.tokenize("<end_of_turn>", add_special=False, parse_special=True)
        ctrl = ctx.generate("Hi", n_predict=2, logit_bias={eot[0]: 100.0}, ignore_eos=False)
        assert "<end_of_turn>" not in ctrl.text
    finally:
        ctx.close()


QUIET = """
import sys
from lloyal_pool import Pool, GrammarError
from lloyal_pool.models import default_model_path
with Pool(1) as pool:
    model = pool[0].load_model(default_model_path())
    ctx = model.new_context(n_ctx=128)
    ctx.generate("Hi", n_predict=2)
    try:
        ctx.generate("Hi", n_predict=2, grammar='root ::= "a" | ( ')
    except GrammarError as exc:
        print("error:", exc)
"""


def test_a_normal_session_is_quiet_on_stderr(gemma_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout.strip() == "error: invalid grammar: expecting ')' at the end of the grammar"


@contextmanager
def worker_log_records() -> Iterator[list[logging.LogRecord]]:
    """Every record the workers' loggers (lloyal_pool.worker.<id>) emit meanwhile, DEBUG included."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("lloyal_pool.worker")
    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_native_logs_reach_python_logging(gemma_path: Path) -> None:
    with worker_log_records() as records, Pool(1, native_log_level="debug") as pool:
        inst = pool[0]
        model = inst.load_model(gemma_path)
        with pytest.raises(GrammarError):
            model.new_context(n_ctx=64).generate("Hi", n_predict=1, grammar="root ::= (")
    names = {r.name for r in records}
    assert f"lloyal_pool.worker.{inst.worker_id}" in names
    # llama.cpp's own levels: its info and debug lines are DEBUG records; a normal load and a grammar
    # error (which the GrammarError reports) leave no warning.
    for level in ("I", "D"):  # native_log_level="debug" lets llama.cpp's debug lines through too
        assert any(r.getMessage().startswith(f"[llama.cpp {level}]") and r.levelno == logging.DEBUG
                   for r in records), level
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]


@pytest.mark.parametrize(("level", "seen"), [("debug", "DIWE"), ("info", "IWE"), ("warning", "WE"), ("error", "E"),
                                            ("none", "")])
def test_native_log_level_is_the_least_severe_llama_cpp_line_passed_on(
        tiny_model: Path, tmp_path: Path, level: str, seen: str) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[:3000])  # llama.cpp logs an error reading it
    with worker_log_records() as records, Pool(1, native_log_level=level) as pool:
        model = pool[0].load_model(tiny_model)  # info and debug lines
        model.new_context(n_ctx=2048).generate("Hi", n_predict=2)  # a warning: past its training length
        with pytest.raises(ModelLoadError):
            pool[0].load_model(truncated)
    levels = {m[len("[llama.cpp ")] for m in (r.getMessage() for r in records) if m.startswith("[llama.cpp ")}
    assert "".join(sorted(levels, key="DIWE".index)) == seen
    # Each at the Python level of its llama.cpp level (info and debug lines are DEBUG records).
    python_level = {"D": logging.DEBUG, "I": logging.DEBUG, "W": logging.WARNING, "E": logging.ERROR}
    for r in records:
        m = r.getMessage()
        if m.startswith("[llama.cpp "):
            assert r.levelno == python_level[m[len("[llama.cpp ")]], (m, r.levelname)


def test_a_crash_message_has_a_stderr_section_only_when_there_is_stderr(fresh_pool: Pool,
                                                                         tiny_model: Path) -> None:
    from lloyal_pool import WorkerCrashedError

    inst = fresh_pool[0]
    ctx = inst.load_model(tiny_model).new_context(n_ctx=512)  # its training length: no warning
    running = ctx.generate_async("Hi", n_predict=0, ignore_eos=True)  # until the context is full
    inst.kill()
    with pytest.raises(WorkerCrashedError) as info:
        running.result(timeout=60)
    err = info.value
    assert err.stderr_tail.strip() == ""  # a quiet worker, killed: it wrote nothing
    assert "stderr" not in str(err), str(err)


def test_a_stop_reason_prints_as_its_value() -> None:
    from lloyal_pool import StopReason

    assert str(StopReason.EOS) == "eos" and f"{StopReason.LENGTH}" == "length"
    assert f"{StopReason.STOP:>5}" == " stop" and StopReason.INTERRUPTED == "interrupted"


def test_eval_parses_special_tokens_in_text_unless_told_not_to(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        assert ctx.eval("<start_of_turn>", add_special=False).n_tokens == 1  # the default: parsed
        ctx.reset()
        assert ctx.eval_async("<start_of_turn>", add_special=False).result().n_tokens == 1
        ctx.reset()
        assert ctx.eval("<start_of_turn>", add_special=False, parse_special=False).n_tokens > 1
    finally:
        ctx.close()
