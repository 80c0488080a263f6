"""Session paging (Pool(max_resident_contexts=N)): a worker keeps at most N of its contexts resident;
beyond that, the least recently used idle one is paged out (its state saved into a file this process
holds, its KV cache freed in the worker) and its next call pages it in again, under the same handle.

    call on a paged-out context ─▶ use(): NewContext, SetLora, LoadState (the page file copied into
    the worker's transfer file in the kernel) ─▶ the call goes on ─▶ contexts beyond N, least recently
    used first: held as a move holds them, SaveState, copied into a new page file, FreeContext

Only an idle context pages out: none of its calls in flight or waiting at its link, no stream of it
running or paused, no branches and no grammar handles (their state lives in the worker and does not
travel). A budget that only busy contexts exceed is exceeded until one of them is idle again.

A page file is an unnamed file (O_TMPFILE) in the pool's ``page_dir``: nothing is left behind whoever
crashes, and it belongs to this process, not to the worker, so a paged-out context outlives its
worker. Under crash recovery the page file is also the context's checkpoint: a recovered worker pages
the context in on its next call, and a resident one restores from it and replays what came after.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import weakref
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from . import protocol as p
from .errors import LloyalError, PoolClosedError, WorkerCrashedError
from .lora import lora_wire

if TYPE_CHECKING:
    from .context import Context


class PageFile:
    """A context's saved state, in an unnamed file of ``directory`` that this process holds."""

    def __init__(self, directory: str) -> None:
        flag = getattr(os, "O_TMPFILE", 0)
        if flag:
            try:
                self._fd = os.open(directory, flag | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError:  # a file system without unnamed files
                flag = 0
        if not flag:
            self._fd, path = tempfile.mkstemp(prefix="lloyal_pool_page_", dir=directory)
            os.unlink(path)
        self.size = 0
        self._closer = weakref.finalize(self, os.close, self._fd)  # dropped unclosed (its context collected)

    @property
    def fd(self) -> int:
        """What a transfer's write() copies the state from."""
        return self._fd

    def fill(self, src: int) -> None:
        from .shm import _write_all

        _write_all(self._fd, src)
        self.size = os.fstat(self._fd).st_size

    @property
    def disk_bytes(self) -> int:
        try:
            return os.fstat(self._fd).st_blocks * 512
        except OSError:
            return 0

    def close(self) -> None:
        """Idempotent."""
        self._closer()
        self._fd = -1


class Pager:
    """One worker's residency: its pageable contexts, least recently used first, and the paged-out ones."""

    def __init__(self, budget: int, directory: str | None) -> None:
        self.budget = budget
        self.directory = directory or tempfile.gettempdir()
        self._lock = threading.Lock()
        # Insertion order is use order: a use moves a context to the end.
        self._resident: weakref.WeakKeyDictionary[Context, None] = weakref.WeakKeyDictionary()
        self._paged: weakref.WeakKeyDictionary[Context, None] = weakref.WeakKeyDictionary()
        self._pages: weakref.WeakKeyDictionary[Context, PageFile] = weakref.WeakKeyDictionary()
        self.page_outs = 0
        self.page_ins = 0
        self._page_in_s = 0.0
        self._enforcing = False  # a page-out thread runs
        self._progress = False
        self._settled = threading.Condition(self._lock)

    # -- membership --------------------------------------------------------------------------------
    def admit(self, ctx: Context) -> None:
        """A new context of this worker: resident, most recently used; others page out to make room."""
        ctx._pager = self
        ctx._link.on_use = _use_hook(ctx)
        with self._lock:
            self._resident[ctx] = None
            start = len(self._resident) > self.budget and not self._enforcing
            self._enforcing = self._enforcing or start
        if start:  # one pass here (else the page-out under way goes on until the budget holds)
            try:
                self._enforce(ctx)
            finally:
                with self._lock:
                    self._enforcing = False
                    self._settled.notify_all()

    def forget(self, ctx: Context) -> None:
        """The context closed, or moved to another worker: its page file goes."""
        with self._lock:
            self._resident.pop(ctx, None)
            self._paged.pop(ctx, None)
            page = self._pages.pop(ctx, None)
        if page is not None:
            page.close()
        ctx._pager = None
        ctx._link.on_use = None

    def hand_over(self, ctx: Context, target: Pager) -> None:
        """A paged-out context moved to ``target``'s worker (migration.py): its page file goes with it,
        untouched."""
        with self._lock:
            self._paged.pop(ctx, None)
            page = self._pages.pop(ctx, None)
        ctx._pager = target
        with target._lock:
            target._paged[ctx] = None
            if page is not None:
                target._pages[ctx] = page

    def close(self) -> None:
        """The pool closed: every page file goes (a paged-out context's calls raise PoolClosedError)."""
        with self._lock:
            pages = list(self._pages.values())
            self._pages.clear()
        for page in pages:
            page.close()

    # -- use ---------------------------------------------------------------------------------------
    def use(self, ctx: Context, holding_link: bool = False) -> None:
        """Before each call on ctx: pages it in if it is out, marks it most recently used, and pages out
        what goes beyond the budget. ``holding_link``: the caller holds the context's link (a move), so
        no other call can page it in or out meanwhile; the page lock is not taken then, as a thread that
        holds it (logits()) may be waiting at the link."""
        link = ctx._link
        if link.paged:
            with nullcontext() if holding_link else ctx._page_lock:
                if link.paged:
                    t0 = time.perf_counter()
                    page = self._pages.get(ctx)
                    _page_in(ctx, page)
                    with self._lock:
                        self._paged.pop(ctx, None)
                        self.page_ins += 1
                        self._page_in_s += time.perf_counter() - t0
                        if page is not None and link.journal is None:  # no checkpoint needs it any more
                            self._pages.pop(ctx, None)
                            page.close()
        with self._lock:
            if ctx in self._resident:
                del self._resident[ctx]
            self._resident[ctx] = None
            start = len(self._resident) > self.budget and not self._enforcing
            self._enforcing = self._enforcing or start
        if start:  # off the caller's thread: its call need not wait for another context's page-out
            threading.Thread(target=self._enforce_while_over, daemon=True, name="lloyal-page-out").start()

    def _enforce_while_over(self, keep: Context | None = None) -> None:
        """Pages out until the budget holds or nothing more can go; one at a time (``_enforcing``)."""
        try:
            while True:
                self._enforce(keep)
                with self._lock:
                    if len(self._resident) <= self.budget or not self._progress:
                        self._enforcing = False
                        self._settled.notify_all()
                        return
        except BaseException:
            with self._lock:
                self._enforcing = False
                self._settled.notify_all()
            raise

    def settle(self, timeout: float | None = None) -> bool:
        """Waits until no page-out is under way (tests; a benchmark's counts); False on timeout."""
        with self._lock:
            return self._settled.wait_for(lambda: not self._enforcing, timeout)

    # -- paging out --------------------------------------------------------------------------------
    def _enforce(self, keep: Context | None) -> None:
        """Pages out the least recently used idle contexts (but ``keep``) while more than the budget are
        resident; ``_progress`` says whether it paged any out."""
        with self._lock:
            excess = len(self._resident) - self.budget
            candidates = [c for c in list(self._resident) if c is not keep]
        self._progress = False
        for victim in candidates:
            if excess <= 0:
                return
            if self._page_out(victim):
                excess -= 1
                self._progress = True

    def _page_out(self, ctx: Context) -> bool:
        """Pages ctx out if it is idle now (module docstring); False when it is not."""
        link = ctx._link
        if (ctx.closed or ctx._pins or len(ctx.branches) or link.holds_handles()
                or ctx._runs.live()):
            return False
        proc = link.proc
        if not proc.alive:
            return False
        # Not while a logits() or embed() call reads its rows from shared memory (the page lock).
        if not ctx._page_lock.acquire(blocking=False):
            return False
        try:
            return self._page_out_held(ctx)
        finally:
            ctx._page_lock.release()

    def _page_out_held(self, ctx: Context) -> bool:
        link, proc = ctx._link, ctx._link.proc
        with link.held_if_idle() as held:
            if not held or ctx.closed or link.paged:
                return False
            page: PageFile | None = None
            try:
                with proc.transfer() as f:
                    if proc.call(p.NPast(context=link.handle)).result():
                        proc.call(p.SaveState(context=link.handle, path=f.path, in_place=True)).result()
                        page = PageFile(self.directory)
                        page.fill(f.fd)
                journal = link.journal
                if journal is not None:  # what crash recovery restores the context from, from now on
                    journal.restart(page if page is not None else b"")
                proc.call(p.FreeContext(context=link.handle)).result()
            except (LloyalError, WorkerCrashedError, OSError):
                if page is not None and link.journal is None:
                    page.close()
                return False  # it stays resident (or crash recovery rebuilds it from its journal)
            # Still holding the link: a call made meanwhile pages it in, never finds it freed.
            link.paged = True
            with self._lock:
                self._resident.pop(ctx, None)
                self._paged[ctx] = None
                old = self._pages.pop(ctx, None)
                if page is not None:
                    self._pages[ctx] = page
                self.page_outs += 1
        if old is not None:
            old.close()
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pages = list(self._pages.values())
            out: dict[str, Any] = {
                "budget": self.budget, "resident": len(self._resident), "paged": len(self._paged),
                "page_outs": self.page_outs, "page_ins": self.page_ins,
                "page_in_ms_mean": 1000 * self._page_in_s / self.page_ins if self.page_ins else 0.0}
        out["page_bytes"] = sum(pg.size for pg in pages)
        out["page_disk_bytes"] = sum(pg.disk_bytes for pg in pages)
        out["page_dir"] = self.directory
        return out


def _page_in(ctx: Context, page: PageFile | None) -> None:
    """Makes the context again in its instance's worker from its page file (None: it held nothing)."""
    proc = ctx.instance._live()  # a worker that crash recovery is replacing: its replacement
    if page is not None and page.fd < 0:
        raise PoolClosedError("the pool is closed: the paged-out context went with it")
    created = proc.call(p.NewContext(model=ctx.model._handle, params=ctx._params.to_wire())).result()
    try:
        if ctx._lora:  # first: a changed configuration empties the context
            proc.call(p.SetLora(context=created.context, adapters=lora_wire(ctx._lora))).result()
        if page is not None:
            with proc.transfer() as f:
                f.write(page.fd)
                proc.call(p.LoadState(context=created.context, path=f.path)).result()
    except BaseException:
        if proc.alive:
            try:
                proc.call(p.FreeContext(context=created.context)).result()
            except LloyalError:
                pass
        raise
    ctx._rebind(proc, created)
    ctx._link.paged = False


def _use_hook(ctx: Context) -> Any:
    ref = weakref.ref(ctx)

    def on_use() -> None:
        c = ref()
        if c is not None and c._pager is not None:
            c._pager.use(c)

    return on_use


__all__ = ["PageFile", "Pager"]
