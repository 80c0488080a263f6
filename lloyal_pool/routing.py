"""Where an independent request goes: the one routing policy of a Pool (among its workers' batchers) and a
RayPool (among its actors). Pure: it reads each candidate's load, slots and cached prefix, and picks.

A candidate with a free slot comes before one without; among those, the one that already holds the longest
prefix of the prompt, when that prefix is long enough to matter (a conversation stays where its cache is);
then the least loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

#: A cached prefix shorter than this does not draw a request away from a less loaded candidate, and a
#: batcher's slot does not keep it (batching.Batcher): decoding that many tokens again costs less than
#: the queueing it would risk.
AFFINITY_TOKENS = 16
#: The same for a prompt given as text, where the prefix is counted in characters (about four a token).
AFFINITY_CHARS = 64


class Candidate(Protocol):
    """What the policy reads of a place a request may go (a batching.Batcher, a ray.RayWorker)."""

    @property
    def load(self) -> int:
        """Requests running or waiting there."""
        ...

    @property
    def slots(self) -> int:
        """Requests it runs at once."""
        ...

    def affinity(self, prompt: Any) -> int:
        """The longest prefix of ``prompt`` it holds ready (tokens, or characters for text)."""
        ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class Router:
    """The policy (module docstring), with the least cached prefix that counts, per kind of prompt."""

    affinity_tokens: int = AFFINITY_TOKENS
    affinity_chars: int = AFFINITY_CHARS

    def pick(self, candidates: Sequence[C], prompt: str | Sequence[int]) -> C:
        """The candidate the request goes to; ValueError when there is none."""
        if not candidates:
            raise ValueError("no candidate to route to")
        enough = self.affinity_chars if isinstance(prompt, str) else self.affinity_tokens

        def key(c: C) -> tuple[bool, int, int]:
            load = c.load
            reuse = c.affinity(prompt)
            return load >= c.slots, -(reuse if reuse >= enough else 0), load

        return min(candidates, key=key)


#: The policy as the library routes: a Pool's requests and a RayPool's.
ROUTER = Router()


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
