"""Which contexts page out (Pool(max_resident_contexts=N)): a pure question the worker's machine asks after
each transition, as the batcher asks its Scheduler which job goes next."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class Pageable(Protocol):
    """A context as the policy sees it."""

    @property
    def counted(self) -> bool:
        """Whether it takes room in the worker that the budget counts (made with new_context, in the worker)."""

    def idle(self) -> bool:
        """Whether it may page out now: nothing under way on it, nothing of it only the worker holds."""


P = TypeVar("P", bound=Pageable)


def victims(contexts: Iterable[P], budget: int, keep: object = None) -> list[P]:
    """The contexts to page out, least recently used first (``contexts`` is in use order): idle ones but
    ``keep`` (the one just made), as many as are resident beyond ``budget``. Fewer (none) when only busy
    contexts exceed it: paging out never waits for a context."""
    counted = [c for c in contexts if c.counted]
    excess = len(counted) - budget
    if excess <= 0:
        return []
    return [c for c in counted if c is not keep and c.idle()][:excess]


__all__ = ["Pageable", "victims"]
