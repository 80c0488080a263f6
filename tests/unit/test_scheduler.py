"""The batcher's engine logic (lloyal_pool/scheduler.py) in-process, driven by fake token streams: which
slot a request gets and what of its prompt is kept, what each decode holds, when a request ends. No model,
no worker, no thread; the loop that does the round trips is tested with Gemma in tests/test_batching.py."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from lloyal_pool.params import StopReason
from lloyal_pool.routing import AFFINITY_TOKENS
from lloyal_pool.scheduler import Decode, Job, Placement, Scheduler, Step

EOG = -1  # what a fake stream yields to end generation


def admit_all(sched: Scheduler, kept: Callable[[int], int] = lambda keep: keep) -> None:
    """What the batcher's loop does with each placement: the sequence keeps what was asked (or less)."""
    for placement in sched.admit():
        source = placement.source
        if source is not None:  # the copy is sound: the source holds those cells of this prompt
            keep = placement.keep
            assert source is not placement.slot and len(source.tokens) >= keep
            assert source.tokens[:keep] == placement.job.prompt[:keep] and source.group == placement.job.group
        elif placement.keep:  # cells are kept only in the group that computed them
            assert placement.slot.group == placement.job.group
        sched.placed(placement, kept(placement.keep))


def run(sched: Scheduler, streams: dict[int, list[int]], jobs: list[Job],
        arrivals: dict[int, list[Job]] | None = None, cancel_at: dict[int, list[Job]] | None = None,
        stop_on: Callable[[Job, int], bool] = lambda job, token: False) -> tuple[dict[int, StopReason], list[Decode]]:
    """The batcher's loop with a fake model: job i samples streams[i] in order (EOG ends it). Returns each
    job's end (by its index in ``jobs``) and every decode."""
    ends: dict[int, StopReason] = {}
    decodes: list[Decode] = []
    sampled: dict[int, int] = {}
    for job in jobs:
        sched.submit(job)
    last_arrival = max(arrivals or {0: []})
    for iteration in range(10_000):
        for job in (arrivals or {}).get(iteration, []):
            sched.submit(job)
        for job in (cancel_at or {}).get(iteration, []):
            job.cancelled = True
        for job in sched.withdraw_cancelled():
            ends[id(job)] = StopReason.INTERRUPTED
        admit_all(sched)
        step = sched.step()
        for job in step.interrupted:
            sched.release(job)
            ends[id(job)] = StopReason.INTERRUPTED
        if step.idle:
            if not sched.waiting and iteration >= last_arrival:
                break
            continue
        going = []
        for job in step.sample:
            token = streams[id(job)][sampled.get(id(job), 0)]
            sampled[id(job)] = sampled.get(id(job), 0) + 1
            reason = sched.sampled(job, token, eog=token == EOG, stop=token != EOG and stop_on(job, token))
            if reason is None:
                going.append((job, token))
            else:
                sched.release(job)
                ends[id(job)] = reason
        decode = sched.decode(step, going)
        if decode is not None:
            assert all(j.group == decode.group for j in decode.jobs)  # one configuration per decode
            sched.decoded(decode)
            decodes.append(decode)
        assert sum(not j.paused for j in sched.running()) <= sched.lanes  # invariants of every iteration
        assert all(not j.paused for j in (*step.sample, *step.prefill, *step.holding))
        for slot in sched.slots:
            assert slot.job is None or slot.job.slot is slot
            if slot.job is not None:  # the slot holds the job's prompt so far, then what it generated
                job = slot.job
                n_in = len(job.prompt) - len(job.todo)
                assert slot.tokens[:n_in] == job.prompt[:n_in] and (not job.todo or len(slot.tokens) == n_in)
            assert len(slot.tokens) <= sched.n_ctx_slot
    return ends, decodes


def admission_order(sched: Scheduler) -> list[Job]:
    """The jobs sched admits from now on, in order (its admit() watched)."""
    order: list[Job] = []
    original = sched.admit

    def admit() -> list[Placement]:
        placements = original()
        order.extend(p.job for p in placements)
        return placements

    sched.admit = admit  # type: ignore[method-assign]
    return order


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_a_job_prefills_then_generates_until_its_stream_ends() -> None:
    sched = Scheduler([0], n_ctx_slot=64, chunk=8)
    job = Job(prompt(5))
    streams = {id(job): [7, 8, 9, EOG]}
    ends, decodes = run(sched, streams, [job])
    assert ends == {id(job): StopReason.EOS}
    assert job.n_decoded == 3
    # The prompt goes in whole (nobody generates meanwhile), then one decode per kept token; the EOG is
    # not decoded.
    assert [(len(d.parts), [t for _, t in d.commits]) for d in decodes] == [(1, []), (0, [7]), (0, [8]), (0, [9])]
    assert sched.slots[0].tokens == prompt(5) + [7, 8, 9]
    assert sched.slots[0].job is None and job.slot is None


def test_n_predict_and_the_slot_room_end_a_job_with_length() -> None:
    sched = Scheduler([0, 1], n_ctx_slot=8, chunk=8)
    short, roomy = Job(prompt(2), n_predict=3), Job(prompt(4, 500))
    streams = {id(short): [1] * 10, id(roomy): [2] * 10}
    ends, _ = run(sched, streams, [short, roomy])
    assert ends == {id(short): StopReason.LENGTH, id(roomy): StopReason.LENGTH}
    assert short.n_decoded == 3
    # The slot holds 4 + 3 committed tokens when the 5th is sampled: 8 cells full then, without a commit.
    assert roomy.n_decoded == 5
    assert len(sched.slots[1].tokens) == 8


def test_a_stop_string_ends_a_job_on_the_token_that_completes_it() -> None:
    sched = Scheduler([0], n_ctx_slot=64, chunk=8)
    job = Job(prompt(3))
    ends, decodes = run(sched, {id(job): [5, 6, 42, 7, EOG]}, [job], stop_on=lambda j, t: t == 42)
    assert ends == {id(job): StopReason.STOP}
    assert job.n_decoded == 3  # the stop's token counts as decoded (it was sampled), and is not committed
    assert [t for d in decodes for _, t in d.commits] == [5, 6]


def test_new_prompts_go_in_a_chunk_at_a_time_while_more_jobs_generate() -> None:
    sched = Scheduler([0, 1, 2, 3], n_ctx_slot=256, chunk=10)
    a, b, c = Job(prompt(4, 100)), Job(prompt(4, 200)), Job(prompt(4, 300))
    late = Job(prompt(35, 400))
    streams = {id(a): [1] * 20 + [EOG], id(b): [2] * 20 + [EOG], id(c): [3] * 20 + [EOG], id(late): [4, EOG]}
    _, decodes = run(sched, streams, [a, b, c], arrivals={3: [late]})
    parts = [len(part) for d in decodes for job, part in d.parts if job is late]
    # Three jobs generate, one prefills: 10 tokens a decode, beside the three commits.
    assert parts == [10, 10, 10, 5]
    for d in decodes:
        if any(job is late for job, _ in d.parts):
            assert len(d.commits) == 3


def test_prompts_go_in_whole_while_as_many_prefill_as_generate() -> None:
    sched = Scheduler([0, 1], n_ctx_slot=256, chunk=10)
    a, b = Job(prompt(30, 100)), Job(prompt(50, 200))
    _, decodes = run(sched, {id(a): [1, EOG], id(b): [2, EOG]}, [a, b])
    assert [len(part) for job, part in decodes[0].parts] == [30, 50]
    # One generating, one prefilling: the prompt goes in whole, beside the running job's token.
    sched = Scheduler([0, 1], n_ctx_slot=256, chunk=10)
    running, late = Job(prompt(4, 100)), Job(prompt(40, 200))
    _, decodes = run(sched, {id(running): [1] * 5 + [EOG], id(late): [2, EOG]}, [running], arrivals={2: [late]})
    assert [(len(part), len(d.commits)) for d in decodes for job, part in d.parts if job is late] == [(40, 1)]


def test_a_job_takes_the_free_slot_that_holds_the_longest_prefix_of_its_prompt() -> None:
    sched = Scheduler([0, 1, 2], n_ctx_slot=256, chunk=64)
    base = prompt(40)
    sched.slots[0].tokens = prompt(40, 900)
    sched.slots[1].tokens = base[:30] + [1, 2]
    sched.slots[2].tokens = base[:20]
    job = Job(base)
    sched.submit(job)
    [placement] = sched.admit()
    assert placement.slot is sched.slots[1] and placement.keep == 30
    sched.placed(placement, placement.keep)
    assert job.n_cached == 30 and job.todo == base[30:]
    assert sched.slots[1].tokens == base[:30]


def test_a_short_prefix_is_not_kept_and_a_whole_prompt_keeps_all_but_its_last_token() -> None:
    sched = Scheduler([0, 1], n_ctx_slot=256, chunk=64)
    sched.slots[0].tokens = prompt(AFFINITY_TOKENS - 1) + [1]
    sched.slots[1].tokens = prompt(AFFINITY_TOKENS + 10)
    short, whole = Job(prompt(AFFINITY_TOKENS - 1) + [2]), Job(prompt(AFFINITY_TOKENS + 10))
    sched.submit(whole)
    sched.submit(short)
    placements = {id(p.job): p for p in sched.admit()}
    assert placements[id(whole)].keep == AFFINITY_TOKENS + 9  # the last token is decoded again for its logits
    assert placements[id(short)].keep == 0
    # A sequence that could not keep its cells (kv.remove refused) starts from nothing.
    sched.placed(placements[id(whole)], 0)
    assert whole.todo == whole.prompt and whole.n_cached == 0 and sched.slots[1].tokens == []


def test_jobs_wait_for_a_slot_first_come_first_served_and_a_cancelled_waiter_never_gets_one() -> None:
    sched = Scheduler([0], n_ctx_slot=64, chunk=8)
    first, second, third = Job(prompt(3)), Job(prompt(3, 300)), Job(prompt(3, 600))
    streams = {id(first): [1, EOG], id(second): [2, EOG], id(third): [3, EOG]}
    order = admission_order(sched)
    ends, _ = run(sched, streams, [first, second, third], cancel_at={0: [second]})
    assert order == [first, third]
    assert ends[id(second)] == StopReason.INTERRUPTED and second.n_decoded == 0


def test_a_job_cancelled_in_its_slot_ends_at_the_next_step_and_frees_it() -> None:
    sched = Scheduler([0], n_ctx_slot=64, chunk=8)
    job, next_job = Job(prompt(3)), Job(prompt(3, 300))
    streams = {id(job): [1] * 50, id(next_job): [2, EOG]}
    ends, _ = run(sched, streams, [job, next_job], cancel_at={4: [job]})
    assert ends == {id(job): StopReason.INTERRUPTED, id(next_job): StopReason.EOS}
    assert 0 < job.n_decoded < 50


def test_a_released_slot_keeps_its_cells_for_the_next_job_unless_they_were_lost() -> None:
    sched = Scheduler([0], n_ctx_slot=256, chunk=64)
    shared = prompt(AFFINITY_TOKENS + 4)
    first = Job(shared + [1, 2])
    run(sched, {id(first): [9, EOG]}, [first])
    again = Job(shared + [3])
    sched.submit(again)
    [placement] = sched.admit()
    assert placement.keep == len(shared)
    sched.placed(placement, placement.keep)
    sched.release(again, cells_kept=False)
    assert sched.slots[0].tokens == [] and sched.slots[0].job is None


def prefilled(decodes: list[Decode]) -> int:
    """Prompt tokens the decodes took."""
    return sum(len(part) for d in decodes for _, part in d.parts)


def test_a_job_copies_the_longest_prefix_another_slot_holds_running_or_free() -> None:
    sched = Scheduler([0, 1, 2], n_ctx_slot=256, chunk=64)
    base = prompt(40)
    running = Job(base[:35] + [7, 7])
    sched.submit(running)
    admit_all(sched)
    sched.decoded(Decode([], [(running, running.todo)]))
    sched.slots[2].tokens = base[:20]  # a free slot with less of it
    job = Job(base)
    sched.submit(job)
    [placement] = sched.admit()
    assert placement.source is running.slot and placement.keep == 35
    assert placement.slot is not running.slot
    sched.placed(placement, placement.keep)
    assert job.n_cached == 35 and job.todo == base[35:] and placement.slot.tokens == base[:35]
    assert sched.affinity(base + [1]) == 40  # what a next job would take from the slots


def test_a_burst_with_one_preamble_decodes_it_once() -> None:
    sched = Scheduler(list(range(4)), n_ctx_slot=256, chunk=512)
    preamble = prompt(60)
    jobs = [Job(preamble + prompt(5, 1000 * (i + 1))) for i in range(4)]
    streams = {id(j): [1, 2, EOG] for j in jobs}
    ends, decodes = run(sched, streams, jobs)
    assert all(reason == StopReason.EOS for reason in ends.values())
    # The first job prefills the preamble alone; the others wait a step, copy it and decode their own tails.
    assert [j for j, _ in decodes[0].parts] == [jobs[0]]
    assert prefilled(decodes) == len(preamble) + 4 * 5
    assert [j.n_cached for j in jobs] == [0, 60, 60, 60]


def test_n_choices_of_one_prompt_decode_it_once_and_jobs_behind_them_do_not_wait() -> None:
    sched = Scheduler(list(range(4)), n_ctx_slot=256, chunk=512)
    same = prompt(30)
    choices = [Job(list(same)) for _ in range(3)]
    other = Job(prompt(10, 5000))
    streams = {id(j): [1, EOG] for j in [*choices, other]}
    _, decodes = run(sched, streams, [*choices, other])
    assert {id(j) for j, _ in decodes[0].parts} == {id(choices[0]), id(other)}
    assert prefilled(decodes) == len(same) + 2 * 1 + 10  # every choice decodes the prompt's last token again
    assert [j.n_cached for j in choices] == [0, 29, 29]


def test_a_job_whose_prefix_is_short_does_not_wait_for_it() -> None:
    sched = Scheduler([0, 1], n_ctx_slot=256, chunk=512)
    a, b = Job(prompt(AFFINITY_TOKENS - 1) + [1]), Job(prompt(AFFINITY_TOKENS - 1) + [2])
    _, decodes = run(sched, {id(a): [1, EOG], id(b): [1, EOG]}, [a, b])
    assert {id(j) for j, _ in decodes[0].parts} == {id(a), id(b)}


def test_lower_priority_values_are_admitted_first_and_equal_ones_in_order_of_arrival() -> None:
    sched = Scheduler([0], n_ctx_slot=64, chunk=8)
    jobs = [Job(prompt(3, 100 * i), priority=p) for i, p in enumerate([0, 5, -1, 0])]
    order = admission_order(sched)
    streams = {id(j): [1, EOG] for j in jobs}
    for job in jobs[1:]:
        sched.submit(job)
    run(sched, streams, [], arrivals={0: [], 1: [jobs[0]]})
    # jobs[1..3] arrive first; jobs[0] arrives while jobs[2] (priority -1) runs and passes jobs[1] (5).
    assert order == [jobs[2], jobs[3], jobs[0], jobs[1]]


def test_a_higher_priority_job_pauses_the_lowest_ranked_one_which_goes_on_where_it_stopped() -> None:
    # Two slots, one lane: the second slot is for preemption.
    sched = Scheduler([0, 1], n_ctx_slot=64, chunk=8, lanes=1)
    low, high, later = Job(prompt(3, 100), priority=5), Job(prompt(3, 200), priority=0), Job(prompt(3, 300), priority=5)
    streams = {id(low): [1, 2, 3, 4, 5, 6, EOG], id(high): [7, 8, EOG], id(later): [9, EOG]}
    running: list[list[Job]] = []
    original = sched.step

    def step() -> Step:
        out = original()
        running.append([j for j in (*out.sample, *out.prefill, *out.holding)])
        assert len(running[-1]) <= sched.lanes and all(j.paused for j in sched.paused())
        return out

    sched.step = step  # type: ignore[method-assign]
    ends, decodes = run(sched, streams, [low], arrivals={3: [high], 4: [later]})
    assert ends == {id(low): StopReason.EOS, id(high): StopReason.EOS, id(later): StopReason.EOS}
    # low ran, paused while high ran (in the spare slot), then went on; later (low's rank, after it) waited.
    who = [tuple(j is low for j in r) for r in running]
    assert (True,) in who[:3] and who[3:6] == [(False,)] * 3
    first_high = next(i for i, r in enumerate(running) if high in r)
    last_high = max(i for i, r in enumerate(running) if high in r)
    assert all(low not in r for r in running[first_high:last_high + 1])
    assert all(later not in r for r in running[:max(i for i, r in enumerate(running) if low in r)])
    commits = [t for d in decodes for j, t in d.commits if j is low]
    assert commits == [1, 2, 3, 4, 5, 6]  # nothing of it recomputed or lost


def test_without_a_free_lane_an_equal_or_lower_rank_waits_in_the_queue() -> None:
    sched = Scheduler([0, 1, 2], n_ctx_slot=64, chunk=8, lanes=1)
    first, second = Job(prompt(3, 100), priority=1), Job(prompt(3, 200), priority=1)
    sched.submit(first)
    admit_all(sched)
    sched.submit(second)
    admit_all(sched)
    assert sched.waiting == [second] and not sched.paused()  # it would only pause in a slot
    sched.submit(urgent := Job(prompt(3, 300), priority=0))
    admit_all(sched)
    assert urgent.slot is not None and sched.paused() == [first] and sched.waiting == [second]
    sched.release(urgent)
    admit_all(sched)
    assert not first.paused and sched.waiting == [second]  # the paused one goes on before the queue


def test_groups_take_turns_and_never_share_cells() -> None:
    # Two LoRA configurations: one decode each in turn, every job's tokens in order, and a prompt held by
    # the other group's slot is decoded again, not kept or copied.
    sched = Scheduler(list(range(4)), n_ctx_slot=256, chunk=512)
    shared = prompt(40)
    jobs = [Job(shared + [i], group="a" if i % 2 else "b") for i in range(4)]
    streams = {id(j): [10 + i, 20 + i, 30 + i, EOG] for i, j in enumerate(jobs)}
    ends, decodes = run(sched, streams, jobs)
    assert all(reason == StopReason.EOS for reason in ends.values())
    groups = [d.group for d in decodes]
    assert all(a != b for a, b in pairwise(groups)), groups  # turns while both have work
    for i, job in enumerate(jobs):
        assert [t for d in decodes for j, t in d.commits if j is job] == [10 + i, 20 + i, 30 + i]
    assert sorted(j.n_cached for j in jobs) == [0, 0, 40, 40]  # one copy within each group, none across
    again = Job(shared + [9], group="c")
    sched.submit(again)
    [placement] = sched.admit()
    assert placement.keep == 0 and placement.source is None


def test_without_sharing_a_job_keeps_its_own_slot_s_cells_only_and_never_waits() -> None:
    sched = Scheduler(list(range(3)), n_ctx_slot=256, chunk=512, share=False)
    preamble = prompt(60)
    jobs = [Job(preamble + prompt(5, 1000 * (i + 1))) for i in range(3)]
    _, decodes = run(sched, {id(j): [1, EOG] for j in jobs}, jobs)
    assert len({id(j) for j, _ in decodes[0].parts}) == 3 and [j.n_cached for j in jobs] == [0, 0, 0]
    again = Job(preamble + [7])
    sched.submit(again)
    [placement] = sched.admit()
    assert placement.source is None and placement.keep == 60


def test_what_a_dead_worker_hands_over_is_every_job_that_produced_nothing() -> None:
    sched = Scheduler([0, 1], n_ctx_slot=64, chunk=8)
    started, placed, waiting = Job(prompt(3)), Job(prompt(5, 300)), Job(prompt(3, 600))
    for job in (started, placed, waiting):
        sched.submit(job)
    admit_all(sched)
    assert sched.sampled(started, 1, eog=False, stop=False) is None
    taken = sched.take_unstarted()
    assert taken == [waiting, placed]
    assert placed.slot is None and placed.todo == [] and placed.n_cached == 0
    assert sched.waiting == [] and sched.running() == [started]
    assert sched.take_all() == [started] and started.slot is None and sched.running() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 12), st.integers(0, 30), st.booleans(),
                          st.integers(0, 2)), min_size=1, max_size=12),
       st.integers(1, 4), st.integers(1, 48), st.integers(0, 2))
def test_every_job_ends_once_with_the_tokens_its_stream_gave(
        specs: list[tuple[int, int, int, bool, int]], n_slots: int, chunk: int, preempt: int) -> None:
    # Jobs of random prompts (some sharing a prefix) in up to three groups (LoRA configurations) and three
    # priorities, arriving over time, some cancelled, with up to two slots for preemption: each ends
    # exactly once, with its stream's tokens committed in order into the slot it held, no slot is
    # shared, and each decode is of one group (run() checks).
    sched = Scheduler(list(range(n_slots + preempt)), n_ctx_slot=96, chunk=chunk, lanes=n_slots)
    jobs, arrivals, cancels, streams = [], {}, {}, {}
    for i, (n_prompt, n_gen, arrive, cancel, group) in enumerate(specs):
        job = Job(prompt(n_prompt, 100 if i % 2 else 1000 * i), n_predict=-1, group=group, priority=(i * 7) % 3)
        streams[id(job)] = [1000 + i] * n_gen + [EOG]
        arrivals.setdefault(arrive, []).append(job)
        if cancel:
            cancels.setdefault(arrive + 2, []).append(job)
        jobs.append(job)
    committed: dict[int, list[int]] = {id(j): [] for j in jobs}
    ends, decodes = run(sched, streams, [], arrivals=arrivals, cancel_at=cancels)
    for d in decodes:
        assert len({id(j) for j in d.jobs}) == len(d.jobs)
        for job, token in d.commits:
            committed[id(job)].append(token)
    assert set(ends) == {id(j) for j in jobs}
    for i, job in enumerate(jobs):
        tokens = committed[id(job)]
        assert tokens == [1000 + i] * len(tokens)
        if ends[id(job)] == StopReason.EOS:
            assert job.n_decoded == specs[i][1] and tokens == streams[id(job)][:-1]
        else:  # no room runs out: 40 + 12 tokens at most in 96
            assert ends[id(job)] == StopReason.INTERRUPTED
    assert sched.running() == [] and sched.waiting == []
