"""Pool(recover=True): a worker that dies is replaced in place, its models and contexts rebuilt from their
checkpoints and journals, and the calls in flight sent again where the caller gets the same answer."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lloyal_pool import (
    ContextError,
    ContextLostError,
    DeadWorkerError,
    Pool,
    StaleHandleError,
    WorkerCrashedError,
    WorkerEvent,
)
from lloyal_pool.params import MAX_SEED, StopReason


def _kill(pool: Pool) -> None:
    os.kill(pool[0].pid, signal.SIGKILL)


def _kill_and_wait(pool: Pool) -> None:
    """SIGKILL, then wait until the recovery is done (a call sent before the death is noticed would be
    in flight on the dying worker)."""
    done = threading.Event()
    dying = pool[0].pid  # an earlier recovery's event may still be on its way: wait for this one's
    unsubscribe = pool.subscribe(lambda e: done.set() if e.kind == "recovered" and e.pid != dying else None)
    _kill(pool)
    assert done.wait(60)
    unsubscribe()


def test_a_greedy_stream_killed_midway_completes_with_the_same_text(gemma_path: Path) -> None:
    with Pool(1, recover=True) as pool:
        events: list[WorkerEvent] = []
        pool.subscribe(events.append)
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        prompt = "Tell me a story about a dragon who learns to paint."
        reference = ctx.generate(prompt, n_predict=128, ignore_eos=True).text
        first_pid = pool[0].pid
        pieces: list[str] = []
        with ctx.stream(prompt, n_predict=128, ignore_eos=True) as stream:
            for piece in stream:
                pieces.append(piece)
                if len(pieces) == 48:
                    _kill(pool)
            result = stream.result
        assert "".join(pieces) == reference and result.text == reference
        assert result.n_decoded == 128
        assert pool[0].pid != first_pid and pool[0].alive
        assert [e.kind for e in events] == ["died", "recovered"] and events[1].instance is pool[0]


def test_a_new_stream_after_a_stop_completes_when_the_worker_dies(gemma_path: Path) -> None:
    # A desktop app's everyday path: Stop a seeded stream (an interrupted generation cannot be replayed,
    # so the context's history is lost to recovery), then start a new whole-prompt stream, which a crash
    # cuts short. That stream replaces the whole history: the replacement worker makes the context again,
    # empty, and sends it again, and it completes with the text an uninterrupted run writes.
    seeded: dict[str, Any] = dict(temperature=0.7, seed=3, n_predict=60, ignore_eos=True, cache_prompt=False)
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(gemma_path).new_context(n_ctx=1024)
        prompt = "Tell me a story about a lighthouse keeper."
        reference = ctx.generate(prompt, **seeded).text
        with ctx.stream("Write a poem about the sea.", **seeded) as first:
            for i, _ in enumerate(first):
                if i == 9:
                    break  # the Stop button: leaving the block interrupts it
        assert first.result.stop_reason == StopReason.INTERRUPTED
        pieces: list[str] = []
        with ctx.stream(prompt, **seeded) as second:
            for piece in second:
                pieces.append(piece)
                if len(pieces) == 10:
                    _kill(pool)
            result = second.result
        assert "".join(pieces) == result.text == reference and result.n_decoded == 60
        # The context holds the replayed conversation: it goes on from there.
        assert ctx.tokens()[-60:] == result.tokens and ctx.generate("", append=True, n_predict=4).n_decoded == 4


def test_the_journal_rebuilds_appended_history(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512)

        def build() -> None:
            ctx.generate("Once upon a time", n_predict=8)
            ctx.eval(" and then")
            ctx.generate("", append=True, n_predict=8, temperature=0.9, seed=7)

        build()
        expected = ctx.tokens()
        want_next = ctx.generate(" more", append=True, n_predict=8).tokens
        build()
        _kill(pool)
        # A call made while the recovery runs waits for it, on the rebuilt context.
        assert ctx.tokens() == expected
        assert ctx.generate(" more", append=True, n_predict=8).tokens == want_next


def test_a_checkpoint_and_a_loaded_state_restore_without_replay(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512)
        ctx.generate("The garden", n_predict=12, temperature=0.8, seed=MAX_SEED)  # random: not replayable
        assert ctx.checkpoint() > 0  # recoverable from the saved state (the pool takes one of its own too)
        ctx.eval(" grew")
        expected = ctx.tokens()
        _kill(pool)
        assert ctx.tokens() == expected
        saved = ctx.save_state()
        ctx.generate("Something else entirely", n_predict=4)
        ctx.load_state(saved)  # a state loaded from bytes is a checkpoint too
        _kill(pool)
        assert ctx.tokens() == expected


def _checkpointed(ctx: Any) -> None:
    """Waits until the checkpoint the pool takes of its own (after a call replay cannot reach past) has
    landed."""
    core = ctx._link.core
    assert core.wait_for(lambda: not ctx._link.state.checkpointing and ctx._link.journal.lost is None, 30)


def test_calls_answered_while_a_checkpoint_is_read_replay_on_top_of_it(tiny_model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal restarts at the SaveState's reply: calls the worker answered after it (read-only ones
    too) are replayed on top of the checkpoint, none from before it again."""
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512)
        ctx.eval("Once upon a time")
        ctx.eval(" and then")
        replied, go_on = threading.Event(), threading.Event()
        transfer = type(ctx._proc.transfer())  # its bytes are read once the SaveState has replied
        read = transfer.read

        def slow_read(self: Any) -> bytes:
            replied.set()
            assert go_on.wait(30)
            return read(self)

        monkeypatch.setattr(transfer, "read", slow_read)
        saving = threading.Thread(target=ctx.checkpoint)
        saving.start()
        assert replied.wait(30)
        monkeypatch.undo()
        ctx.tokens()  # read-only: recorded after the SaveState, adds nothing
        ctx.eval(" the end")
        expected = ctx.tokens()
        go_on.set()
        saving.join()
        _kill(pool)
        assert ctx.tokens() == expected


def test_a_reply_that_wins_the_race_with_its_sender_is_journaled_in_reply_order(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's SaveState is written, and its sender is descheduled before it goes on (a loaded
    machine, the GIL): meanwhile the worker answers it and an eval another thread sends. What the journal
    keeps is the worker's order: the checkpoint, then the eval on top, so that a crash then restores both.
    (The journal's hooks used to be attached after the write: a reply that won the race ran them on the
    sending thread, late, and the checkpoint's restart wiped the eval.)"""
    from lloyal_pool import protocol as p
    from lloyal_pool._process import WorkerProcess

    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512)
        ctx.eval("Once upon a time")
        call = WorkerProcess.call
        written = threading.Event()

        def descheduled_after_a_save_state(self: WorkerProcess, req: Any, *args: Any, **kwargs: Any) -> Any:
            fut = call(self, req, *args, **kwargs)
            if isinstance(req, p.SaveState):
                written.set()
                time.sleep(1.0)
            return fut

        monkeypatch.setattr(WorkerProcess, "call", descheduled_after_a_save_state)
        saving = threading.Thread(target=ctx.checkpoint, daemon=True)
        saving.start()
        assert written.wait(30)
        ctx.eval(" and then")  # answered after the SaveState, while its sender sleeps
        expected = ctx.tokens()
        saving.join(30)
        monkeypatch.undo()
        _kill_and_wait(pool)
        assert ctx.tokens() == expected


def test_what_cannot_be_replayed_fails_as_a_crash_and_an_interrupted_history_survives(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=4096)
        # A sampled generation with a random seed in flight cannot give the same answer again.
        fut = ctx.generate_async("Hi", n_predict=0, ignore_eos=True, temperature=1.0, seed=MAX_SEED)
        time.sleep(0.2)
        _kill(pool)
        with pytest.raises(WorkerCrashedError):
            fut.result(timeout=30)
        # An interrupted generation leaves a history no replay reproduces: the pool saves the state
        # itself then (a Stop, then a crash, no longer loses the conversation).
        stream = ctx.stream("Hi", n_predict=0, ignore_eos=True)
        next(iter(stream))
        stream.close()
        assert stream.result.stop_reason == "interrupted"
        _checkpointed(ctx)
        held = ctx.tokens()
        _kill_and_wait(pool)
        assert ctx.tokens() == held
        assert ctx.generate("", append=True, n_predict=2).n_decoded == 2
        # The model survived the recovery: a new context works.
        other = ctx.model.new_context(n_ctx=256)
        assert other.generate("Hi", n_predict=2).n_decoded == 2


def test_branches_are_not_replayed_and_their_context_comes_back_empty(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512, n_seq_max=4)
        root = ctx.branch("Hello")
        root.fork()
        _kill_and_wait(pool)
        with pytest.raises(ContextLostError, match="not replayed") as info:
            ctx.tokens()  # said once: the first call that needs the history
        assert isinstance(info.value, DeadWorkerError)
        assert ctx.tokens() == [] and not root.alive  # made again empty: it serves from here
        with pytest.raises(StaleHandleError):
            root.fork()
        again = ctx.branch("Hello")
        assert again.alive and ctx.n_past() == 0


def test_calls_on_the_instance_wait_for_the_recovery(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        model = pool[0].load_model(tiny_model)
        recovered = threading.Event()
        pool.subscribe(lambda e: recovered.set() if e.kind == "recovered" else None)
        _kill(pool)
        assert model.tokenize("Hello world")  # waits, then runs in the replacement
        assert pool[0].ping(timeout=30) < 5
        assert recovered.wait(30)


def _recovering(pool: Pool, dying: Any) -> bool:
    """Whether pool[0]'s core knows dying is dead and has not yet put a replacement in its place."""
    core = pool[0]._core
    return bool(dying._dead_event.wait(30)) and core.wait_for(
        lambda: core.machine.phase != "alive" or core.proc is not dying, 30) and core.proc is dying


def test_a_call_made_while_the_recovery_runs_waits_for_it(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Pool(1, recover=True) as pool:
        model = pool[0].load_model(tiny_model)
        dying = pool[0]._proc
        _slow_replacement(monkeypatch)
        _kill(pool)
        assert _recovering(pool, dying)  # the death is known, the replacement is on its way
        assert pool[0].ping(timeout=30) < 5  # through the instance
        assert pool[0]._proc is not dying and pool[0].alive
        assert model.tokenize("Hello world")


def _slow_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replacement worker takes a moment longer to be handed over: calls made meanwhile are made while
    the recovery runs."""
    from lloyal_pool import pool as pool_module

    replacement = pool_module._Host.replacement

    def slow(self: Any) -> Any:
        time.sleep(0.5)
        return replacement(self)

    monkeypatch.setattr(pool_module._Host, "replacement", slow)


def test_model_calls_made_while_the_recovery_runs_go_to_their_new_handles(tiny_model: Path, gemma_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with Pool(1, recover=True) as pool:
        # One handle counter per worker, and the replacement loads the models first, then the contexts:
        # with handles 1 (closed), 2 and 3 before, a and b get 1 and 2, so that a's old handle names b
        # there. Two models whose tokens differ, so that a call sent to a stale handle is seen.
        gone, a, b = (pool[0].load_model(path) for path in (tiny_model, tiny_model, gemma_path))
        contexts = [a.new_context(n_ctx=64), a.new_context(n_ctx=64), b.new_context(n_ctx=64)]
        gone.close()
        before = (a._handle, b._handle)
        expected = [m.tokenize("Hello world") for m in (a, b)]
        assert expected[0] != expected[1]
        dying = pool[0]._proc
        _slow_replacement(monkeypatch)
        _kill(pool)
        assert _recovering(pool, dying)
        with ThreadPoolExecutor(2) as calls:  # both made before the recovery is done
            got = [f.result(timeout=60) for f in [calls.submit(m.tokenize, "Hello world") for m in (a, b)]]
        assert got == expected
        after = (a._handle, b._handle)
        assert before == (2, 3) and after == (1, 2), (before, after)  # a's old handle is b's now
        assert all(ctx.generate("Hi", n_predict=1).n_decoded == 1 for ctx in contexts)


def test_context_calls_made_while_the_recovery_runs_go_to_their_new_handles(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from loras import attention_shapes, write_lora

    with Pool(1, recover=True) as pool:
        model = pool[0].load_model(tiny_model)  # handle 1
        path = write_lora(tmp_path / "a.gguf", "llama", attention_shapes(model.info, range(model.info.n_layer)),
                          rank=4, seed=1)
        first = model.new_context(n_ctx=128)  # 2
        adapters = [model.load_lora(path), model.load_lora(path)]  # 3, 4 (loaded, applied nowhere)
        model.new_context(n_ctx=64).close()  # 5
        second = model.new_context(n_ctx=128)  # 6
        first.eval("one two three")
        second.eval("four five six seven")
        held = [ctx.tokens() for ctx in (first, second)]
        # The replacement loads the model, its adapters, then its contexts (in no set order): 1, 2, 3, then
        # 4 and 5, so `first` moves up from 2 and `second` down from 6.
        before = (first.handle, second.handle)
        dying = pool[0]._proc
        _slow_replacement(monkeypatch)
        _kill(pool)
        assert _recovering(pool, dying)
        with ThreadPoolExecutor(2) as calls:  # both made before the recovery is done
            got = [f.result(timeout=60) for f in [calls.submit(ctx.tokens) for ctx in (first, second)]]
        assert got == held and held[0] != held[1]
        assert before == (2, 6) and {first.handle, second.handle} == {4, 5}
        assert not any(adapter.closed for adapter in adapters)


def test_a_stream_interrupted_just_before_a_crash_stays_interrupted_when_sent_again(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=512)
        stream = ctx.stream("Once upon a time", n_predict=400, ignore_eos=True)
        next(stream)  # it runs
        os.kill(pool[0].pid, signal.SIGSTOP)
        stream.interrupt()  # written to the region, never read by the stopped worker
        _kill(pool)  # the replacement gets the stream again, under a new request id
        assert stream.future.result(timeout=60).interrupted
        assert len(stream.result.tokens) < 400


def test_checkpoint_needs_recover(tiny_model: Path) -> None:
    with Pool(1) as pool:
        ctx = pool[0].load_model(tiny_model).new_context(n_ctx=256)
        ctx.eval("Hi")
        with pytest.raises(ContextError, match="recover=True"):
            ctx.checkpoint()


def test_lora_adapters_come_back_and_a_lora_context_is_restored_under_them(tiny_model: Path, tmp_path: Path) -> None:
    from loras import attention_shapes, write_lora

    with Pool(1, recover=True) as pool:
        model = pool[0].load_model(tiny_model)
        path = write_lora(tmp_path / "a.gguf", "llama", attention_shapes(model.info, range(model.info.n_layer)),
                          rank=4, seed=1)
        adapter = model.load_lora(path)
        with_lora = model.new_context(n_ctx=256)
        with_lora.set_lora([(adapter, 1.0)])
        with_lora.generate("Hello", n_predict=4)
        held = with_lora.tokens()
        want_next = with_lora.generate(" more", append=True, n_predict=6).tokens
        with_lora.generate("Hello", n_predict=4)
        old_handle = adapter._handle
        _kill_and_wait(pool)
        # Made again with its adapter applied first, then its journal replayed under it.
        assert with_lora.tokens() == held and with_lora.lora == [(adapter, 1.0)]
        assert with_lora.generate(" more", append=True, n_predict=6).tokens == want_next
        fresh = model.new_context(n_ctx=256)
        assert fresh.set_lora([(adapter, 1.0)])  # the adapter was loaded again in the replacement
        assert fresh.generate("Hello", n_predict=4).n_decoded == 4
        assert not adapter.closed and isinstance(old_handle, int)


def test_a_worker_started_by_replace_is_recovered_too(tiny_model: Path) -> None:
    with Pool(1, recover=True) as pool:
        fresh = pool.replace(0)
        model = fresh.load_model(tiny_model)
        recovered = threading.Event()
        pool.subscribe(lambda e: recovered.set() if e.kind == "recovered" else None)
        _kill(pool)
        assert model.tokenize("Hello world")  # the replacement's replacement has it again
        assert recovered.wait(30)
