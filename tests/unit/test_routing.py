"""The routing policy (routing.Router), on stand-in candidates: the one rule a Pool and a RayPool route by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from lloyal_pool.routing import AFFINITY_CHARS, AFFINITY_TOKENS, Router, common_prefix


@dataclass
class Place:
    load: int
    reuse: int = 0
    slots: int = 2

    def affinity(self, prompt: str | Sequence[int]) -> int:
        return self.reuse


ROUTER = Router()


def test_a_free_slot_comes_first_then_the_cache_then_the_lighter_load() -> None:
    idle, busy, cached, full = Place(0), Place(1), Place(1, reuse=40), Place(3, reuse=99)
    assert ROUTER.pick([busy, idle], [1]) is idle
    assert ROUTER.pick([idle, cached], [1]) is cached
    assert ROUTER.pick([full, busy], [1]) is busy  # the longest cache, but no free slot
    assert ROUTER.pick([Place(1, reuse=AFFINITY_TOKENS - 1), idle], [1]) is idle  # too short a prefix to count
    assert ROUTER.pick([Place(1, reuse=AFFINITY_TOKENS), idle], [1]).reuse == AFFINITY_TOKENS


def test_with_no_free_slot_anywhere_the_cache_then_the_load_decide() -> None:
    a, b, c = Place(4, reuse=20), Place(2), Place(3, reuse=30)
    assert ROUTER.pick([a, b, c], [1]) is c
    assert ROUTER.pick([a, b], "x") is b  # 20 characters of text is under AFFINITY_CHARS


def test_equal_caches_go_to_the_lighter_load() -> None:
    first, lighter = Place(1, reuse=50), Place(0, reuse=50)
    assert ROUTER.pick([first, lighter], [1]) is lighter


def test_text_prompts_count_their_prefix_in_characters() -> None:
    near = Place(1, reuse=AFFINITY_CHARS)
    assert ROUTER.pick([Place(0), near], "some text") is near
    assert ROUTER.pick([Place(0), Place(1, reuse=AFFINITY_CHARS - 1)], "some text").load == 0
    assert Router(affinity_chars=8).pick([Place(0), Place(1, reuse=8)], "text").reuse == 8


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        ROUTER.pick([], [1])


@pytest.mark.parametrize(("a", "b", "n"), [([1, 2, 3], [1, 2, 4], 2), ([], [1], 0), ("abc", "abcd", 3),
                                           ((5, 6), [5, 6], 2)])
def test_common_prefix(a: Sequence[object], b: Sequence[object], n: int) -> None:
    assert common_prefix(a, b) == n
