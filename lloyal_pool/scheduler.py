"""The batcher's engine logic: which request gets which slot, what the next decode holds, when a request
ends. No threads, no handles, no round trips: the Batcher's loop (batching.py) asks it for a plan, does
the calls the plan names, and tells it what came back. tests/unit/test_scheduler.py drives it with fake
token streams.

One iteration of the loop:

    admit()          waiting jobs into free slots, highest priority first, each with the longest prefix of
                     its prompt any slot holds (its own cells, or another slot's cells to copy)
    placed(...)      the loop has set up the slot's sequence: the job's prompt minus what it kept is to do
    step()           the jobs in slots: interrupted ones end; the others sample or prefill
    sampled(...)     each sampled token's verdict: the job ends (StopReason) or goes on with it
    decode(...)      ONE decode: the going jobs' tokens, beside a budget of the prompts still to prefill
    decoded(...)     what that decode put in each slot

With ``lanes`` fewer than the slots, at most ``lanes`` jobs run; the others in slots are *paused*: they
keep their slot, its cells and their branch (sampler, text, logits), and are neither sampled nor decoded.
Which jobs run is decided by rank, (priority, arrival): a waiting job takes a free slot when a lane is
free or it outranks a running job, which then pauses, and a paused job runs again when a lane frees (or
it outranks one). Nothing of a paused job is lost or recomputed: it goes on exactly where it stopped.

Jobs belong to groups (``Job.group``: the LoRA configuration a request runs under). One decode runs under
one configuration, so it takes the jobs of one group; when several groups have work, they take turns,
the group served longest ago first, and a job whose sampled token waits for its group's turn holds it
(``pending``) and samples nothing until it is in. Cells are reused and copied within a group only: they
were computed under its configuration.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .params import StopReason
from .routing import AFFINITY_TOKENS, common_prefix


@dataclass(eq=False)
class Job:
    """One request as the scheduler sees it. ``cancelled`` may be set from any thread."""

    prompt: list[int]
    n_predict: int = -1  # 0 or less: no limit but the slot's room
    slot: Slot | None = None
    todo: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    n_cached: int = 0
    n_decoded: int = 0
    cancelled: bool = False
    priority: int = 0  # lower goes first; equal priorities in order of arrival
    group: Hashable = ()  # jobs of one group may share a decode and each other's cells
    pending: int | None = None  # a sampled token waiting for its group's decode
    paused: bool = False  # in a slot, outranked by the jobs that have the lanes (Scheduler's lanes)
    arrival: int = 0  # set by submit(): the order among equal priorities

    @property
    def rank(self) -> tuple[int, int]:
        return self.priority, self.arrival


@dataclass(eq=False)
class Slot:
    """One of the context's KV sequences, held between jobs so that the next may reuse its prefix."""

    seq: int
    tokens: list[int] = field(default_factory=list)  # what its KV sequence holds
    job: Job | None = None
    group: Hashable = ()  # the group its cells were computed in


@dataclass(frozen=True)
class Placement:
    """A job admitted into a slot: the slot's sequence keeps its first ``keep`` cells (drop the rest),
    or, when ``source`` is another slot, holds nothing of its own but a copy of the source's first
    ``keep`` cells (llama_memory_seq_cp: the cells are shared, not decoded or duplicated)."""

    job: Job
    slot: Slot
    keep: int
    source: Slot | None = None


@dataclass
class Step:
    """The jobs in slots, as one iteration sees them: those that were interrupted (they end), those that
    sample a token, those whose prompt is still going in, and those whose token waits for its group's
    decode."""

    interrupted: list[Job]
    sample: list[Job]
    prefill: list[Job]
    holding: list[Job] = field(default_factory=list)
    paused: list[Job] = field(default_factory=list)  # they go on at a next iteration (a lane frees)

    @property
    def idle(self) -> bool:
        return not self.sample and not self.prefill and not self.holding and not self.paused


@dataclass
class Decode:
    """One decode, of one group's jobs: ``commits`` (a generating job and its sampled token) and ``parts``
    (a prefilling job and the next tokens of its prompt)."""

    commits: list[tuple[Job, int]]
    parts: list[tuple[Job, list[int]]]
    group: Hashable = ()

    @property
    def jobs(self) -> list[Job]:
        return [j for j, _ in self.commits] + [j for j, _ in self.parts]


class Scheduler:
    """Slots, waiting jobs and the rules between them, for a context of ``len(seqs)`` sequences with
    ``n_ctx_slot`` cells of room each; ``chunk``: the most prompt tokens a decode takes while more jobs
    generate than prefill. ``share`` False: cells are never copied between slots (a context whose
    sequences live in streams of their own), only kept in a slot for its next job."""

    def __init__(self, seqs: Sequence[int], n_ctx_slot: int, chunk: int, *, share: bool = True,
                 lanes: int | None = None) -> None:
        self.slots = [Slot(seq) for seq in seqs]
        self.n_ctx_slot = n_ctx_slot
        self.chunk = chunk
        self.share = share
        self.lanes = len(self.slots) if lanes is None else lanes  # the most jobs that run at once
        self.waiting: list[Job] = []
        self._arrivals = 0
        self._served: dict[Hashable, int] = {}  # the decode count when each group was last decoded
        self._n_decodes = 0

    # -- what it holds -------------------------------------------------------------------------------------
    def running(self) -> list[Job]:
        """The jobs in slots, paused ones included."""
        return [s.job for s in self.slots if s.job is not None]

    def paused(self) -> list[Job]:
        return [j for j in self.running() if j.paused]

    def affinity(self, prompt: Sequence[int]) -> int:
        """The longest prefix of prompt a job without adapters admitted now would not decode (0 when no
        slot is free): what any slot holds, or a running job's prompt will hold once it is in (without
        ``share``: what a free slot holds)."""
        if all(s.job is not None for s in self.slots):
            return 0
        if not self.share:
            return max((common_prefix(s.tokens, prompt) for s in self.slots if s.job is None and s.group == ()),
                       default=0)
        return max(max((common_prefix(s.tokens, prompt) for s in self.slots if s.group == ()), default=0),
                   self._coming(prompt, ()))

    def _coming(self, prompt: Sequence[int], group: Hashable) -> int:
        # What the group's running jobs' prompts share with prompt: held already, or being prefilled now
        # (not by a paused job: nothing says when it goes on).
        return max((common_prefix(j.prompt, prompt) for j in self.running() if j.group == group and not j.paused),
                   default=0)

    # -- admission -----------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        job.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(job)

    def _outranks_a_lane(self, job: Job) -> bool:
        """Whether job would run if it had a slot: a lane is free, or it outranks a job that runs."""
        running = [j for j in self.running() if not j.paused]
        return len(running) < self.lanes or job.rank < max(j.rank for j in running)

    def _assign_lanes(self) -> None:
        """The best-ranked jobs in slots run, the others pause."""
        ranked = sorted(self.running(), key=lambda j: j.rank)
        for i, job in enumerate(ranked):
            job.paused = i >= self.lanes

    def withdraw_cancelled(self) -> list[Job]:
        """Takes the jobs cancelled before they had a slot off the queue: they end with no token."""
        gone = [j for j in self.waiting if j.cancelled]
        self.waiting = [j for j in self.waiting if not j.cancelled]
        return gone

    def admit(self) -> list[Placement]:
        """Waiting jobs into free slots, by priority and then first come first served. A job's prefix is
        taken from wherever it is longest: the free slot it goes to (its own cells, kept), or any other
        slot, free or running (its cells copied, which costs no decode). A job whose prefix a running job
        is prefilling right now (a burst with one preamble, n choices of one prompt) waits for that
        prefill and copies it, rather than decoding the same tokens beside it; jobs behind it go first.

        A prefix shorter than AFFINITY_TOKENS is not kept: every text prompt shares its BOS, and a cell or
        two kept wherever the slot's last job put it makes every decode attend further (a 1024-token
        prefill took 2.5% longer, measured). The whole prompt is never kept: its last token is decoded
        again, for the logits of the job's first choice."""
        free = [s for s in self.slots if s.job is None]
        out: list[Placement] = []
        self._assign_lanes()  # a job that ended freed a lane: a paused one goes on first
        # A slot placed in this call holds what it will keep only once the loop has placed it: it is no
        # source yet (its job's prompt counts as coming).
        taken: list[Slot] = []
        for job in sorted(self.waiting, key=lambda j: j.priority):  # stable: arrival order within one
            if not free:
                break
            if not self._outranks_a_lane(job):
                continue  # it would only pause in the slot: a better-ranked job may come for it
            limit = len(job.prompt) - 1

            def held(s: Slot, job: Job = job) -> int:  # what of the job's prompt a slot's cells hold for it
                return common_prefix(s.tokens, job.prompt) if s.group == job.group else 0

            # Among free slots that hold as much of it, the one holding least: what the others cached stays.
            slot = max(free, key=lambda s: (held(s), -len(s.tokens)))
            own = min(held(slot), limit)
            sources = [s for s in self.slots if self.share and s is not slot and s not in taken]
            source = max(sources, default=None, key=held)
            shared = 0 if source is None else min(held(source), limit)
            if self.share and min(self._coming(job.prompt, job.group), limit) - max(own, shared) >= AFFINITY_TOKENS:
                continue  # a running job is decoding this prefix: copy it once it is in
            self.waiting.remove(job)
            free.remove(slot)
            taken.append(slot)
            slot.job, job.slot = job, slot
            self._assign_lanes()
            if shared > own and shared >= AFFINITY_TOKENS:
                out.append(Placement(job, slot, shared, source))
            else:
                out.append(Placement(job, slot, own if own >= AFFINITY_TOKENS else 0))
        return out

    def placed(self, placement: Placement, kept: int) -> None:
        """The slot's sequence now holds the first ``kept`` cells of the job's prompt (``placement.keep``,
        or 0 when they could not be kept or copied): the rest of the prompt is to prefill."""
        job, slot = placement.job, placement.slot
        slot.tokens = job.prompt[:kept]
        slot.group = job.group
        job.n_cached = kept
        job.todo = job.prompt[kept:]

    # -- one iteration -------------------------------------------------------------------------------------
    def step(self) -> Step:
        """What this iteration does with the jobs in slots (a snapshot: ``cancelled`` may change meanwhile)."""
        running = self.running()
        going = [j for j in running if not j.cancelled and not j.paused]
        return Step(interrupted=[j for j in running if j.cancelled],
                    sample=[j for j in going if not j.todo and j.pending is None],
                    prefill=[j for j in going if j.todo],
                    holding=[j for j in going if j.pending is not None],
                    paused=[j for j in running if j.paused and not j.cancelled])

    def sampled(self, job: Job, token: int, *, eog: bool, stop: bool) -> StopReason | None:
        """A sampled token's verdict: EOS when it ends generation (it is not kept), STOP when a stop
        string completed with it (``stop``, the text's verdict), LENGTH when the job reached n_predict
        or its slot is full; None: it goes into the next decode."""
        if eog:
            return StopReason.EOS
        job.n_decoded += 1
        if stop:
            return StopReason.STOP
        assert job.slot is not None
        if (job.n_predict > 0 and job.n_decoded >= job.n_predict) or len(job.slot.tokens) >= self.n_ctx_slot:
            return StopReason.LENGTH
        return None

    def decode(self, step: Step, going: Sequence[tuple[Job, int]]) -> Decode | None:
        """The step's decode, of one group's jobs (the group decoded longest ago, of those with work; the
        others' going tokens are held for their turn): their tokens, and the next part of their prompts
        still to prefill, a chunk of them while more jobs generate (and wait for it) than prefill, all
        at once otherwise: the fewer jobs kept waiting, the better. None when there is nothing to decode."""
        commits = [*going, *((j, j.pending) for j in step.holding if j.slot is not None and j.pending is not None)]
        prefilling = [j for j in step.prefill if j.slot is not None]  # not failed meanwhile
        groups = list(dict.fromkeys([j.group for j, _ in commits] + [j.group for j in prefilling]))
        if not groups:
            return None
        group = min(groups, key=lambda g: self._served.get(g, -1))
        for job, token in commits:
            job.pending = token if job.group != group else None
        commits = [(j, t) for j, t in commits if j.group == group]
        prefilling = [j for j in prefilling if j.group == group]
        generating = sum(1 for j in [*step.sample, *step.holding] if j.group == group)
        budget = self.chunk if generating > len(prefilling) else sum(len(j.todo) for j in prefilling)
        parts: list[tuple[Job, list[int]]] = []
        for job in prefilling:
            if budget <= 0:
                break
            part = job.todo[:budget]
            budget -= len(part)
            parts.append((job, part))
        return Decode(commits, parts, group)

    def decoded(self, decode: Decode) -> None:
        """The decode went in: each slot's sequence holds its job's new cells."""
        self._served[decode.group] = self._n_decodes
        self._n_decodes += 1
        for job, part in decode.parts:
            assert job.slot is not None
            job.todo = job.todo[len(part):]
            job.slot.tokens.extend(part)
        for job, token in decode.commits:
            assert job.slot is not None
            job.slot.tokens.append(token)

    # -- ending ----------------------------------------------------------------------------------------
    def release(self, job: Job, *, cells_kept: bool = True) -> None:
        """Frees the job's slot, if it has one. ``cells_kept``: its sequence still holds what the job put
        there, for the next job to reuse; False forgets it."""
        slot, job.slot = job.slot, None
        job.pending, job.paused = None, False
        if slot is not None:
            slot.job = None
            if not cells_kept:
                slot.tokens = []
            self._assign_lanes()  # its lane goes to the best-ranked paused job

    def take_unstarted(self) -> list[Job]:
        """Takes every job that has produced no token yet (waiting, or in a slot) off the scheduler, for
        another to run from the start: its slot is freed and forgotten."""
        gone = [j for j in self.waiting if j.n_decoded == 0]
        self.waiting = [j for j in self.waiting if j.n_decoded > 0]
        for slot in self.slots:
            job = slot.job
            if job is not None and job.n_decoded == 0:
                slot.job, job.slot, slot.tokens, job.paused = None, None, [], False
                gone.append(job)
        for job in gone:
            job.todo, job.n_cached = [], 0
        return gone

    def take_all(self) -> list[Job]:
        """Takes every job off (waiting ones first): the batcher stops."""
        gone = self.waiting + self.running()
        self.waiting = []
        for slot in self.slots:
            if slot.job is not None:
                slot.job.slot = None
                slot.job = None
        return gone


__all__ = ["Decode", "Job", "Placement", "Scheduler", "Slot", "Step"]
