"""Session paging (Pool(max_resident_contexts=N)): the least recently used idle contexts beyond N are
paged out to files this process holds and paged in by their next call, transparently: the same history
(n_past, the prompt cache's n_cached), the same next tokens and scores as a context that never left,
through concurrent use, moves, a kill of the worker (recover=True) and the pool's close.

Every comparison is with a reference run on this machine, in a context that was never paged out."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lloyal_pool import InvalidArgumentError, Pool, PoolClosedError, StaleHandleError
from lloyal_pool.context import Context
from lloyal_pool.model import Model

GREEDY: dict[str, Any] = dict(temperature=0.0, n_predict=12, ignore_eos=True)
N_CTX = 512
PROMPTS = [f"Note {i}: the {animal} crossed the river at dawn because" for i, animal in
           enumerate(["fox", "heron", "otter", "badger", "lynx", "stag"])]


@pytest.fixture(scope="module")
def paged(gemma_path: Path) -> Iterator[tuple[Pool, Model]]:
    """One worker that keeps two contexts resident."""
    with Pool(1, max_resident_contexts=2) as pool:
        yield pool, pool[0].load_model(gemma_path)


def _two_turns(ctx: Context, prompt: str) -> tuple[str, str, int]:
    """A first turn, then a second that extends it: its text and its n_cached."""
    first = ctx.generate(prompt, **GREEDY).text
    second = ctx.generate(prompt + first + " Then", **GREEDY)
    return first, second.text, second.n_cached


def _reference(model: Model, prompt: str) -> tuple[str, str, int]:
    ctx = model.new_context(n_ctx=N_CTX)
    try:
        return _two_turns(ctx, prompt)
    finally:
        ctx.close()


def _settled(*contexts: Context) -> list[bool]:
    """Whether each context is paged out, once the page-outs its workers run in the background ended."""
    for ctx in contexts:
        assert ctx.instance._core.machine.budget is not None and ctx.instance._core.settle(30)
    return [c.paged for c in contexts]


def _closing(contexts: list[Context]) -> None:
    for c in contexts:
        c.close()


def test_contexts_beyond_the_budget_page_out_and_come_back_whole(paged: tuple[Pool, Model]) -> None:
    pool, model = paged
    references = [_reference(model, pr) for pr in PROMPTS[:4]]
    contexts = [model.new_context(n_ctx=N_CTX) for _ in range(4)]
    try:
        firsts = [c.generate(pr, **GREEDY).text for c, pr in zip(contexts, PROMPTS[:4], strict=True)]
        n_past = [c.n_past() for c in contexts]
        # The two used last stay; the two before them went out, least recently used first.
        assert _settled(*contexts) == [True, True, False, False]
        stats = pool[0].stats()["paging"]
        assert stats["budget"] == 2 and stats["resident"] == 2 and stats["paged"] == 2
        assert stats["page_bytes"] > 0 and stats["page_disk_bytes"] > 0
        for i, c in enumerate(contexts):
            assert c.n_past() == n_past[i]  # paged in: the same history
            second = c.generate(PROMPTS[i] + firsts[i] + " Then", **GREEDY)
            assert (firsts[i], second.text, second.n_cached) == references[i]
            assert second.n_cached > 0  # the restored cache is reused, not decoded again
        _settled(*contexts)
        assert pool[0].stats()["paging"]["resident"] == 2
    finally:
        _closing(contexts)


def test_a_paged_context_scores_and_reads_logits_as_one_that_never_left(paged: tuple[Pool, Model]) -> None:
    _, model = paged
    text = "The lighthouse keeper climbed the stairs every evening."
    reference = model.new_context(n_ctx=N_CTX)
    ctx = model.new_context(n_ctx=N_CTX)
    others = [model.new_context(n_ctx=N_CTX) for _ in range(2)]
    try:
        reference.eval(PROMPTS[0])
        ref_logits = reference.logits(copy=True)
        ref_score = reference.score(text, logprobs=3)
        ctx.eval(PROMPTS[0])
        view = ctx.logits()
        for o in others:
            o.eval("something else")  # ctx is the least recently used now: it goes out
        assert _settled(ctx) == [True]
        with pytest.raises(StaleHandleError, match="paged out"):
            float(view[0])  # the row it showed was freed with the worker's copy
        np.testing.assert_array_equal(ctx.logits(copy=True), ref_logits)
        for o in others:
            o.eval("and another thing")
        assert _settled(ctx) == [True]
        score = ctx.score(text, logprobs=3)
        assert score == ref_score
    finally:
        _closing([reference, ctx, *others])


def test_busy_contexts_stay_resident_and_page_out_once_idle(paged: tuple[Pool, Model]) -> None:
    pool, model = paged
    streaming, branching, idle = (model.new_context(n_ctx=N_CTX) for _ in range(3))
    try:
        idle.eval(PROMPTS[1])
        stream = streaming.stream(PROMPTS[0], temperature=0.0, n_predict=64, ignore_eos=True)
        next(stream)
        stream.pause()  # a paused stream holds its generation in the worker
        branch = branching.branch(PROMPTS[2])
        for i in range(3):  # three more contexts used: only the idle one may make room
            extra = model.new_context(n_ctx=N_CTX)
            extra.eval(PROMPTS[3 + i])
            _settled(extra)
            # Over budget while nothing else is idle: the busy two stay; the new one, idle once its eval
            # has ended, may go out too (the page-out runs when the machine lets it: after the eval or not).
            assert [idle.paged, streaming.paged, branching.paged] == [True, False, False]
            assert pool[0].stats()["paging"]["resident"] == 2 + (not extra.paged)
            extra.close()
        assert _settled(idle, streaming, branching) == [True, False, False]
        stream.resume()
        text = "".join(stream)
        assert len(text) > 0 and stream.result.n_decoded == 64
        branch.prune()
        for c in (idle, model.new_context(n_ctx=N_CTX)):
            c.eval("one more")
        assert _settled(streaming, branching) == [True, True]  # idle now: the least recently used went out
        assert pool[0].stats()["paging"]["resident"] == 2
    finally:
        _closing([streaming, branching, idle])


def test_paged_contexts_used_from_many_threads_give_their_sequential_text(paged: tuple[Pool, Model]) -> None:
    _, model = paged
    references = [_reference(model, pr) for pr in PROMPTS]
    contexts = [model.new_context(n_ctx=N_CTX) for _ in PROMPTS]
    results: dict[int, tuple[str, str, int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _two_turns(contexts[i], PROMPTS[i])
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert [results[i] for i in range(len(PROMPTS))] == references
    finally:
        _closing(contexts)


def test_closing_a_paged_context_frees_its_file(paged: tuple[Pool, Model]) -> None:
    pool, model = paged
    contexts = [model.new_context(n_ctx=N_CTX) for _ in range(3)]
    for c in contexts:
        c.eval(PROMPTS[0])
    assert _settled(contexts[0]) == [True]
    before = pool[0].stats()["paging"]
    contexts[0].close()
    after = pool[0].stats()["paging"]
    assert after["paged"] == before["paged"] - 1 and after["page_bytes"] < before["page_bytes"]
    with pytest.raises(StaleHandleError):
        contexts[0].n_past()
    assert contexts[1].n_past() > 0  # the worker freed nothing of the others
    _closing(contexts[1:])


def test_a_paged_context_moves_as_its_file(gemma_path: Path) -> None:
    with Pool(2, max_resident_contexts=1) as pool:
        model = pool[0].load_model(gemma_path)
        pool[1].load_model(gemma_path)
        reference = _reference(model, PROMPTS[0])
        ctx, other = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
        first = ctx.generate(PROMPTS[0], **GREEDY).text
        n_past = ctx.n_past()
        other.eval(PROMPTS[1])
        assert _settled(ctx) == [True]
        ctx.move_to(pool[1])
        assert ctx.paged and ctx.instance is pool[1]  # nothing was loaded to move it
        assert pool[1].stats()["paging"]["paged"] == 1 and pool[0].stats()["paging"]["paged"] == 0
        assert ctx.n_past() == n_past and not ctx.paged
        second = ctx.generate(PROMPTS[0] + first + " Then", **GREEDY)
        assert (first, second.text, second.n_cached) == reference
        fresh = pool.drain(pool[0])  # the resident one moves too
        assert other.instance is fresh and other.n_past() > 0


def test_a_paged_context_moves_to_a_worker_without_paging_while_another_thread_reads_its_logits(
        gemma_path: Path) -> None:
    """A move and a logits() call made meanwhile each wait for what the context's core lets them do (the
    move takes it, then the read runs in the target; or the read pages it in first, then it moves).
    Before, the move and the read could each wait for the other, for ever."""
    with Pool(1, max_resident_contexts=1) as pool, Pool(1) as plain:
        model = pool[0].load_model(gemma_path)
        plain[0].load_model(gemma_path)
        for _ in range(3):
            ctx, other = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
            ctx.generate(PROMPTS[0], **GREEDY)
            expected = ctx.logits(copy=True)
            other.eval(PROMPTS[1])
            assert _settled(ctx) == [True]
            read: list[np.ndarray] = []
            mover = threading.Thread(target=ctx.move_to, args=(plain[0],), daemon=True)
            reader = threading.Thread(target=lambda c=ctx, out=read: out.append(c.logits(copy=True)), daemon=True)
            mover.start()
            reader.start()
            mover.join(60)
            reader.join(60)
            assert not mover.is_alive() and not reader.is_alive(), "the move and the read wait for each other"
            assert ctx.instance is plain[0] and not ctx.paged
            np.testing.assert_array_equal(read[0], expected)
            ctx.close()
            other.close()


def test_paged_and_resident_contexts_survive_a_kill_of_their_worker(gemma_path: Path) -> None:
    with Pool(1, recover=True, max_resident_contexts=1) as pool:
        model = pool[0].load_model(gemma_path)
        references = [_reference(model, pr) for pr in PROMPTS[:2]]
        a, b = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
        firsts = [a.generate(PROMPTS[0], **GREEDY).text, b.generate(PROMPTS[1], **GREEDY).text]
        assert _settled(a) == [True]
        a.n_past()  # in again (from its file, which is now its checkpoint too); b goes out
        a.generate("", append=True, n_predict=16, ignore_eos=True)  # a replayed entry on top of its file
        assert _settled(a, b) == [False, True]
        pid = pool[0].pid
        pool[0].kill()
        for ctx, prompt, first, reference in zip((a, b), PROMPTS[:2], firsts, references, strict=True):
            second = ctx.generate(prompt + first + " Then", **GREEDY)
            assert (first, second.text, second.n_cached) == reference
        assert pool[0].pid != pid


def test_a_paged_context_of_a_closed_pool_raises_pool_closed(gemma_path: Path) -> None:
    pool = Pool(1, max_resident_contexts=1)
    model = pool[0].load_model(gemma_path)
    a, b = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
    a.eval(PROMPTS[0])
    b.eval(PROMPTS[1])
    assert _settled(a) == [True]
    pool.close()
    for ctx in (a, b):
        with pytest.raises(PoolClosedError):
            ctx.n_past()


@pytest.mark.parametrize("options", [dict(max_resident_contexts=0), dict(max_resident_contexts=True),
                                     dict(max_resident_contexts="4"), dict(page_dir="/nonexistent/dir"),
                                     dict(page_dir=3)])
def test_bad_paging_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        Pool(0, **options)


def test_page_files_live_in_page_dir_and_leave_nothing_behind(gemma_path: Path, tmp_path: Path) -> None:
    with Pool(1, max_resident_contexts=1, page_dir=tmp_path) as pool:
        model = pool[0].load_model(gemma_path)
        a, b = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
        a.eval(PROMPTS[0])
        b.eval(PROMPTS[1])
        assert _settled(a) == [True]
        stats = pool[0].stats()["paging"]
        assert stats["page_dir"] == os.path.realpath(tmp_path) and stats["page_disk_bytes"] > 0
        assert os.listdir(tmp_path) == []  # unnamed files: nothing to clean up whoever crashes


def test_page_files_go_to_the_temporary_directory_by_default(gemma_path: Path) -> None:
    """On disk where the system keeps temporary files, not in memory: paging is there to free memory."""
    with Pool(1, max_resident_contexts=1) as pool:
        model = pool[0].load_model(gemma_path)
        a, b = model.new_context(n_ctx=N_CTX), model.new_context(n_ctx=N_CTX)
        a.eval(PROMPTS[0])
        b.eval(PROMPTS[1])
        assert _settled(a) == [True]
        page = a._link.state.page
        assert page is not None
        assert os.readlink(f"/proc/self/fd/{page.fd}").startswith(os.path.realpath(tempfile.gettempdir()) + "/")
        assert pool[0].stats()["paging"]["page_dir"] == os.path.realpath(tempfile.gettempdir())


def _within(seconds: float, fn: Any) -> Any:
    """fn() on a thread, failing the test (instead of hanging it) if it has not returned in time."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"did not return within {seconds:g} s"
    return out[0]


def test_state_calls_and_a_draft_page_a_context_in_first(paged: tuple[Pool, Model]) -> None:
    # save_state/load_state take the worker's transfer file before their request, and a page-in takes it
    # too; a draft context is used by another context's call: each is paged in (and kept) first.
    _, model = paged
    a, b, c = (model.new_context(n_ctx=N_CTX) for _ in range(3))
    try:
        a.eval(PROMPTS[0])
        held = a.n_past()
        b.eval(PROMPTS[1])
        c.eval(PROMPTS[2])
        assert _settled(a) == [True]
        state = _within(60, a.save_state)
        assert len(state) > 0 and not a.paged
        b.eval(PROMPTS[3])
        c.eval(PROMPTS[4])
        assert _settled(a) == [True]
        assert _within(60, lambda: a.load_state(state)) == held
        want = b.generate(PROMPTS[5], **GREEDY).text
        c.eval(PROMPTS[0])
        b.eval(PROMPTS[1])
        assert _settled(a) == [True]
        got = _within(120, lambda: b.generate_with_draft(PROMPTS[5], draft=a, **GREEDY))
        assert got.text == want  # greedy: every token is the target's own choice
    finally:
        _closing([a, b, c])
