"""The lifecycle machine (lloyal_pool._machine) against a fake worker and driver (fakecore.py): random
interleavings of calls, streams paused and resumed, checkpoints, page-outs and -ins, moves, deaths and
replies, with the invariants checked after each step: a call is answered exactly once, a hold is released
in every path, and the journal replays what the worker holds."""

from __future__ import annotations

import random
from concurrent.futures import Future
from typing import Any

import pytest
from fakecore import DROPPED, FakeCore, replay
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lloyal_pool import protocol as p
from lloyal_pool._generation import Generation, Phase, Why
from lloyal_pool._journal import GENERATED_TOKEN_COST
from lloyal_pool._machine import ContextState, CoreMachine, Kind, Status
from lloyal_pool.errors import ContextError, ContextLostError, LloyalError
from lloyal_pool.params import MAX_SEED

GREEDY = {"temperature": 0.0}
RANDOM = {"temperature": 0.9, "seed": MAX_SEED}


def _generate(ctx: ContextState, prompt: list[int], n: int, append: bool = False, random_seed: bool = False,
              stream: bool = False) -> p.Generate:
    params = {**(RANDOM if random_seed else GREEDY), "n_predict": n}
    return p.Generate(context=ctx.handle, prompt=prompt, params=params, append=append, stream=stream)


def _settle(core: FakeCore, rounds: int = 2000) -> None:
    """Runs the worker and the jobs until nothing is left to do."""
    for _ in range(rounds):
        if core.quiet():
            return
        if not core.run_job():
            core.step_worker()
    raise AssertionError("the machine and its worker never came to rest")


def _worker_tokens(core: FakeCore, ctx: ContextState) -> list[int]:
    return list(core.worker.contexts[ctx.handle].tokens)


def _journal_holds_the_worker_s_history(core: FakeCore, ctx: ContextState) -> None:
    journal = ctx.journal
    assert journal is not None
    if journal.lost is None and not ctx.gens and ctx.status is Status.RESIDENT:
        assert replay(journal.checkpoint, list(journal.entries)) == _worker_tokens(core, ctx), journal.entries


# -- directed cases ---------------------------------------------------------------------------------------
def test_a_checkpoint_s_journal_restarts_at_its_reply_with_what_came_after_on_top() -> None:
    core = FakeCore(CoreMachine(recover=True), random.Random(1))
    ctx = core.new_context()
    core.call(ctx, p.Eval(context=ctx.handle, tokens=[1, 2, 3]))
    done: Future[int] = Future()
    done.set_running_or_notify_cancel()
    core.do(core.machine.checkpoint(ctx, done))
    core.run_job()  # the SaveState goes out behind the eval
    core.call(ctx, p.Eval(context=ctx.handle, tokens=[4]))  # and this one behind it
    _settle(core)
    assert done.result() == 3
    assert ctx.journal is not None and len(ctx.journal.entries) == 1  # the eval answered after the SaveState
    _journal_holds_the_worker_s_history(core, ctx)


def test_a_stop_then_a_crash_loses_nothing() -> None:
    """An interrupted generation cannot be replayed: the machine saves the state instead, so that the
    next crash restores it; every later call, and a new stream, works."""
    core = FakeCore(CoreMachine(recover=True), random.Random(2))
    ctx = core.new_context()
    gen = core.generation(ctx, _generate(ctx, [5, 6], 50, stream=True), None)
    for _ in range(3):
        core.step_worker()
    core.on(core.machine.stop, ctx, gen)
    _settle(core)
    assert gen.future.result().interrupted
    held = _worker_tokens(core, ctx)
    assert ctx.journal is not None and ctx.journal.lost is None  # checkpointed
    core.kill()
    _settle(core)
    assert _worker_tokens(core, ctx) == held and ctx.notice is None
    fut = core.call(ctx, p.Tokens(context=ctx.handle))
    _settle(core)
    assert fut.result() == held


def test_a_stream_resumed_while_its_worker_is_recovering_is_taken_over_by_the_replacement() -> None:
    """The caller resumes a paused stream after its worker died, before the replacement serves: the
    Resume waits, and goes out behind the hand-over of the generation (the dead worker held it)."""
    core = FakeCore(CoreMachine(recover=True), random.Random(6))
    ctx = core.new_context()
    gen = core.generation(ctx, _generate(ctx, [3, 4], 8, stream=True), None)
    core.step_worker()
    core.on(core.machine.pause, ctx, gen)
    _settle(core)
    assert gen.phase is Phase.PAUSED
    core.kill()
    core.on(core.machine.resume, ctx, gen)  # the recovery has not run yet
    _settle(core)
    assert gen.future.result().n_decoded == 8


def test_a_stream_resumed_while_it_moves_goes_on_in_the_target() -> None:
    """Resumed while a move holds its context, after the target took it over paused: the Resume waits
    for the commit and goes to the target, which holds the generation now."""
    source = FakeCore(CoreMachine(recover=True), random.Random(7))
    target = FakeCore(CoreMachine(recover=True), random.Random(8))
    ctx = source.new_context()
    gen = source.generation(ctx, _generate(ctx, [3, 4], 8, stream=True), None)
    source.step_worker()
    source.on(source.machine.pause, ctx, gen)
    _settle(source)
    began: Future[Any] = Future()
    began.set_running_or_notify_cancel()
    source.on(source.machine.begin_move, ctx, object(), began)
    _settle(source)
    _kind, image = began.result()
    source.on(source.machine.resume, ctx, gen)  # the move holds it: nothing goes to the source
    desc = target.worker.new_context(tuple(image.state if hasattr(image, "state") else image))
    if gen.phase is Phase.PAUSED and gen.suspension is not None:  # what the target adopts (migration.py)
        target.worker.contexts[desc.context].suspended = {**gen.suspension, "origin": gen.origin}
    queued, out_source = source.machine.release_moved(ctx)
    out_target = target.machine.take_moved(ctx, desc, queued, image)
    source.do(out_source)
    target.do(out_target)
    _settle(source)
    _settle(target)
    assert gen.future.result().n_decoded == 8


def test_a_move_does_not_pause_a_stream_that_a_call_behind_it_would_drop() -> None:
    """A generate waits behind a stream when a move begins: paused for the move, the stream would be
    dropped by that generate (a call after a pause drops the paused generation), so it ends first."""
    core = FakeCore(CoreMachine(recover=True), random.Random(9))
    ctx = core.new_context()
    gen = core.generation(ctx, _generate(ctx, [1], 2, stream=True), None)
    after = core.call(ctx, _generate(ctx, [1], 0))
    began: Future[Any] = Future()
    began.set_running_or_notify_cancel()
    core.on(core.machine.begin_move, ctx, object(), began)
    _settle(core)
    core.on(core.machine.abort_move, ctx)
    _settle(core)
    assert gen.future.result().n_decoded == 2 and after.result() is not None


class _Branches:
    """State of the context that lives only in the worker (a BranchStore holding branches)."""

    def holds(self) -> bool:
        return True


def test_a_context_whose_history_cannot_be_rebuilt_comes_back_empty_and_says_so_once() -> None:
    core = FakeCore(CoreMachine(recover=True), random.Random(5))
    ctx = core.new_context()
    branches = _Branches()
    ctx.holders.add(branches)  # no checkpoint: its state would not save
    core.call(ctx, _generate(ctx, [1, 2], 3, random_seed=True))  # and no replay reproduces it
    _settle(core)
    assert ctx.journal is not None and ctx.journal.lost is not None
    core.kill()
    _settle(core)
    first = core.call(ctx, p.Tokens(context=ctx.handle))
    second = core.call(ctx, p.Tokens(context=ctx.handle))
    _settle(core)
    with pytest.raises(ContextLostError, match="random seed"):
        first.result()
    assert second.result() == []  # made again empty, and it serves
    del branches


def test_a_stream_held_for_its_checkpoint_keeps_other_calls_out_until_it_resumes() -> None:
    core = FakeCore(CoreMachine(recover=True, checkpoint_tokens=2 * GENERATED_TOKEN_COST), random.Random(3))
    ctx = core.new_context()
    gen = core.generation(ctx, _generate(ctx, [7], 12, stream=True), 2 * GENERATED_TOKEN_COST)
    while ctx.hold is None:
        core.step_worker()  # its second piece asks for the checkpoint's pause
    other = core.call(ctx, p.Eval(context=ctx.handle, tokens=[9]))
    assert ctx.queued and not other.done()  # it waits: at the pause it would end the generation
    _settle(core)
    assert gen.future.result().n_decoded == 12 and other.result().n_tokens == 1
    assert ctx.hold is None and ctx.journal is not None and ctx.journal.checkpoint is not None
    _journal_holds_the_worker_s_history(core, ctx)


def test_a_page_out_during_which_the_worker_dies_leaves_the_context_to_recovery() -> None:
    core = FakeCore(CoreMachine(recover=True, budget=1), random.Random(4))
    a = core.new_context()
    core.call(a, p.Eval(context=a.handle, tokens=[1, 2]))
    _settle(core)
    b = core.new_context()  # a goes out
    assert a.status is Status.PAGING_OUT
    core.run_job()
    core.kill()
    _settle(core)
    assert a.status in (Status.RESIDENT, Status.PAGED) and b.status in (Status.RESIDENT, Status.PAGED)
    fut = core.call(a, p.Tokens(context=a.handle))
    _settle(core)
    assert fut.result() == [1, 2]


# -- random interleavings ---------------------------------------------------------------------------------
class Lifecycle(RuleBasedStateMachine):
    """Two workers under recovery, each keeping two contexts resident at most, checkpoints every few
    tokens: callers, moves between the workers, the workers, the jobs and SIGKILLs in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)
        self.cores = [FakeCore(CoreMachine(recover=True, checkpoint_tokens=6 * GENERATED_TOKEN_COST, budget=2),
                               self.rng) for _ in range(2)]
        self.owner: dict[ContextState, FakeCore] = {}  # the core that holds each context now
        self.contexts: list[ContextState] = []
        self.futures: list[Future[Any]] = []
        self.gens: list[Generation] = []
        self.moves: list[tuple[ContextState, FakeCore, FakeCore, Future[Any]]] = []
        self.kills = 0

    @initialize()
    def start(self) -> None:
        self._new(self.cores[0])

    def _new(self, core: FakeCore) -> None:
        ctx = core.new_context()
        self.owner[ctx] = core
        self.contexts.append(ctx)

    def _ctx(self, i: int) -> tuple[ContextState, FakeCore]:
        ctx = self.contexts[i % len(self.contexts)]
        return ctx, self.owner[ctx]

    @precondition(lambda self: len(self.contexts) < 5)
    @rule(w=st.integers(0, 1))
    def new_context(self, w: int) -> None:  # a NewContext answered (made during a recovery, it waits for it)
        if self.cores[w].machine.phase == "alive":
            self._new(self.cores[w])

    @rule(i=st.integers(0, 9), n=st.integers(0, 6), append=st.booleans(), random_seed=st.booleans(),
          prompt=st.lists(st.integers(1, 90), min_size=1, max_size=4))
    def generate(self, i: int, n: int, append: bool, random_seed: bool, prompt: list[int]) -> None:
        ctx, core = self._ctx(i)
        self.futures.append(core.call(ctx, _generate(ctx, prompt, n, append, random_seed)))

    @rule(i=st.integers(0, 9), tokens=st.lists(st.integers(1, 90), min_size=1, max_size=4))
    def eval(self, i: int, tokens: list[int]) -> None:
        ctx, core = self._ctx(i)
        self.futures.append(core.call(ctx, p.Eval(context=ctx.handle, tokens=tokens)))

    @rule(i=st.integers(0, 9))
    def read(self, i: int) -> None:
        ctx, core = self._ctx(i)
        self.futures.append(core.call(ctx, p.Tokens(context=ctx.handle)))

    @rule(i=st.integers(0, 9))
    def reset(self, i: int) -> None:
        ctx, core = self._ctx(i)
        self.futures.append(core.call(ctx, p.Reset(context=ctx.handle)))

    @rule(i=st.integers(0, 9), n=st.integers(1, 10), prompt=st.lists(st.integers(1, 90), min_size=1, max_size=3))
    def stream(self, i: int, n: int, prompt: list[int]) -> None:
        ctx, core = self._ctx(i)
        if ctx.status is Status.CLOSED:
            return
        self.gens.append(core.generation(ctx, _generate(ctx, prompt, n, stream=True),
                                         core.machine.checkpoint_tokens))

    def _gen(self, i: int) -> tuple[FakeCore, ContextState, Generation] | None:
        live = [(self.owner[c], c, g) for c in self.contexts for g in c.gens]
        return live[i % len(live)] if live else None

    @rule(i=st.integers(0, 9), what=st.sampled_from(["pause", "resume", "stop"]))
    def steer(self, i: int, what: str) -> None:
        found = self._gen(i)
        if found is not None:
            core, ctx, gen = found
            core.on(getattr(core.machine, what), ctx, gen)

    @rule(i=st.integers(0, 9))
    def interrupt(self, i: int) -> None:
        ctx, core = self._ctx(i)
        core.on(core.machine.interrupt, ctx)

    @rule(i=st.integers(0, 9))
    def checkpoint(self, i: int) -> None:
        ctx, core = self._ctx(i)
        fut: Future[int] = Future()
        fut.set_running_or_notify_cancel()
        self.futures.append(fut)
        core.on(core.machine.checkpoint, ctx, fut)

    @rule(i=st.integers(0, 9))
    def save_and_load(self, i: int) -> None:
        ctx, core = self._ctx(i)
        self.futures.append(core.call(ctx, p.SaveState(context=ctx.handle, path="", in_place=True), kind=Kind.SAVE))
        self.futures.append(core.call(ctx, p.LoadState(context=ctx.handle, path=""), kind=Kind.LOAD,
                                      data=bytes([3, 4, 5])))

    @precondition(lambda self: len(self.contexts) > 1)
    @rule(i=st.integers(0, 9))
    def close(self, i: int) -> None:
        ctx, core = self._ctx(i)
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        self.futures.append(fut)
        core.on(core.machine.close, ctx, fut)

    @rule(i=st.integers(0, 9))
    def move(self, i: int) -> None:
        """Context.move_to's first step: the source holds it and saves it (migration.py)."""
        ctx, source = self._ctx(i)
        if any(m[0] is ctx for m in self.moves):
            return
        target = self.cores[1 - self.cores.index(source)]
        began: Future[Any] = Future()
        began.set_running_or_notify_cancel()
        source.on(source.machine.begin_move, ctx, object(), began)
        self.moves.append((ctx, source, target, began))

    @rule(commit=st.booleans())
    def finish_move(self, commit: bool) -> None:
        """The move's state came out: it is made in the target (or the target fails) and committed."""
        ready = [m for m in self.moves if m[3].done()]
        if not ready:
            return
        ctx, source, target, began = ready[0]
        self.moves.remove(ready[0])
        if began.exception() is not None:
            return  # the source died first: the move failed with its crash
        kind, image = began.result()
        if not commit or not target.worker.alive or target.machine.phase != "alive":
            source.on(source.machine.abort_move, ctx)
            return
        if kind == "paged":
            desc = None
        else:
            tokens: tuple[int, ...] = () if image == b"" else (image.state if hasattr(image, "state") else tuple(image))
            desc = target.worker.new_context(tokens)
            fake = target.worker.contexts[desc.context]
            for gen in ctx.gens:
                if gen.phase is Phase.PAUSED and not gen.in_prompt and gen.suspension is not None:
                    fake.suspended = {**gen.suspension, "origin": gen.origin}
        queued, out_source = source.machine.release_moved(ctx)
        out_target = target.machine.take_moved(ctx, desc, queued, image)
        self.owner[ctx] = target
        source.do(out_source)
        target.do(out_target)

    @rule(w=st.integers(0, 1), k=st.integers(1, 12))
    def work(self, w: int, k: int) -> None:
        for _ in range(k):
            self.cores[w].step_worker()

    @rule(w=st.integers(0, 1))
    def job(self, w: int) -> None:
        self.cores[w].run_job()

    @precondition(lambda self: self.kills < 5)
    @rule(w=st.integers(0, 1))
    def kill(self, w: int) -> None:
        self.kills += 1
        self.cores[w].kill()

    @invariant()
    def each_call_is_answered_at_most_once(self) -> None:
        for core in self.cores:
            assert all(n <= 1 for n in core.settled.values()), core.settled

    @invariant()
    def at_rest_nothing_is_held_and_every_journal_replays_its_worker(self) -> None:
        if self.moves or not all(c.quiet() and c.machine.phase == "alive" for c in self.cores):
            return
        for ctx in self.contexts:
            if ctx.status is Status.CLOSED:
                continue
            core = self.owner[ctx]
            paused = [g for g in ctx.gens if g.phase is Phase.PAUSED]
            assert ctx.hold is None, (ctx.hold, [(g.phase, g.why) for g in ctx.gens])
            assert all(g.why is Why.CALLER for g in paused), [(g.phase, g.why) for g in ctx.gens]
            assert ctx.status in (Status.RESIDENT, Status.PAGED), ctx.status
            assert not ctx.queued and not ctx.inflight and not ctx.deferred
            if ctx.status is Status.RESIDENT and not paused:
                _journal_holds_the_worker_s_history(core, ctx)

    def teardown(self) -> None:
        for _ in range(50):
            for _ctx, _source, _target, began in list(self.moves):
                if began.done():
                    self.finish_move(commit=False)
            for ctx in self.contexts:
                core = self.owner[ctx]
                for gen in list(ctx.gens):
                    core.on(core.machine.stop, ctx, gen)
            for core in self.cores:
                _settle(core)
            if all(f.done() for f in self.futures) and all(g.done for g in self.gens) and not self.moves:
                break
        assert not self.moves, "a move never got its state"
        assert all(f.done() for f in self.futures), "a call was never answered"
        assert all(g.done for g in self.gens), "a generation never ended"
        for fut in self.futures:
            exc = fut.exception()
            assert exc is None or isinstance(exc, LloyalError), repr(exc)  # typed, always
        for gen in self.gens:  # a resume reaches the generation wherever it lives now (taken over there),
            exc = gen.future.exception()  # unless a call of the caller's on its context dropped it
            if isinstance(exc, ContextError) and "nothing is paused" in str(exc):
                assert gen.origin in DROPPED, repr(exc)
        for ctx in self.contexts:
            assert ctx.hold is None


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(max_examples=800, stateful_step_count=60, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_the_lost_error_is_typed() -> None:
    assert issubclass(ContextLostError, LloyalError)


@pytest.mark.parametrize("seed", range(3))
def test_a_stream_survives_kills_with_its_text_whole(seed: int) -> None:
    """A greedy stream killed under at any token: its pieces join to what an undisturbed run writes."""
    rng = random.Random(seed)
    alone = FakeCore(CoreMachine(), random.Random(0))
    ctx0 = alone.new_context()
    ref = alone.generation(ctx0, _generate(ctx0, [1, 2, 3], 20, stream=True), None)
    _settle(alone)
    core = FakeCore(CoreMachine(recover=True, checkpoint_tokens=4 * GENERATED_TOKEN_COST), rng)
    ctx = core.new_context()
    gen = core.generation(ctx, _generate(ctx, [1, 2, 3], 20, stream=True), 4 * GENERATED_TOKEN_COST)
    for _ in range(200):
        if gen.done:
            break
        if rng.random() < 0.05:
            core.kill()
        elif not core.run_job():
            core.step_worker()
    _settle(core)
    assert gen.future.result().text == ref.future.result().text
    assert "".join(core.delivered[gen]) == ref.future.result().text
