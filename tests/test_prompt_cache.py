"""What a generate starts from, and what of the cache it reuses: the prompt is the whole input; cache_prompt
(the default) keeps the longest common prefix, cache_bit_exact only what keeps the logits bit-identical,
append continues; sliding-window caches fall back to a full decode when they no longer hold the prefix;
long prompt evaluations report progress."""

from __future__ import annotations

import pytest

from lloyal_pool import Model

pytestmark = pytest.mark.gemma

LONG = " ".join(f"item{i}" for i in range(90))  # 261 tokens


def test_a_prompt_is_the_whole_input(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=512)
    fresh = gemma.new_context(n_ctx=512)
    try:
        ctx.generate("The capital of France is", n_predict=8)
        story = ctx.generate("Once upon a time", n_predict=12, cache_prompt=False)
        alone = fresh.generate("Once upon a time", n_predict=12, cache_prompt=False)
        assert story.tokens == alone.tokens  # nothing of the France answer leaks into the story
        assert ctx.tokens() == gemma.tokenize("Once upon a time") + story.tokens
        # With the default cache_prompt, only BOS is shared with the last input.
        again = ctx.generate("The capital of France is", n_predict=4)
        assert again.n_cached == 1
        assert ctx.tokens() == gemma.tokenize("The capital of France is") + again.tokens
    finally:
        ctx.close()
        fresh.close()


def test_append_continues_from_what_the_context_holds(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=256)
    try:
        first = ctx.generate("One, two, three,", n_predict=6, ignore_eos=True)
        held = len(ctx.tokens())
        more = ctx.generate(" and then", n_predict=4, append=True, ignore_eos=True)
        # The history it continues is reused, not decoded again: all of it counts as cached.
        assert more.n_cached == held and more.n_prompt == len(gemma.tokenize(" and then", add_special=False))
        held = len(ctx.tokens())
        cont = ctx.generate("", n_predict=3, append=True, ignore_eos=True)
        assert cont.n_cached == held and cont.n_prompt == 0
        expected = (gemma.tokenize("One, two, three,") + first.tokens
                    + gemma.tokenize(" and then", add_special=False) + more.tokens + cont.tokens)
        assert ctx.tokens() == expected
        with pytest.raises(ValueError, match="append=True"):
            ctx.generate("")
        assert ctx.generate("Hi", n_predict=1).n_decoded == 1  # still serving
    finally:
        ctx.close()


def test_a_repeated_prompt_reuses_all_of_it(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024)
    try:
        cold = ctx.generate(LONG, n_predict=8)
        assert cold.n_cached == 0 and cold.n_prompt > 250
        warm = ctx.generate(LONG, n_predict=8)
        # Everything but the last prompt token, which is decoded again for its logits.
        assert warm.n_cached == warm.n_prompt - 1
        longer = ctx.generate(LONG + " and the rest", n_predict=4)
        assert longer.n_cached == cold.n_prompt
        # The history is exactly the prompt (eval), with its logits: nothing to decode at all.
        ctx.reset()
        ctx.eval(LONG)
        z = ctx.logits(copy=True)
        exact = ctx.generate(LONG, n_predict=1)
        assert exact.n_cached == exact.n_prompt
        assert exact.tokens[0] == int(z.argmax())
    finally:
        ctx.close()


def test_cache_bit_exact_matches_a_fresh_decode(gemma: Model) -> None:
    # Small ubatches: the bit-exact reuse point is the start of the ubatch the shared prefix ends in.
    ctx = gemma.new_context(n_ctx=1024, n_batch=64, n_ubatch=16)
    try:
        fresh = ctx.generate(LONG + " and so on", n_predict=16, cache_prompt=False)
        ctx.generate(LONG + " but then", n_predict=4, cache_prompt=False)
        exact = ctx.generate(LONG + " and so on", n_predict=16, cache_bit_exact=True)
        assert exact.tokens == fresh.tokens
        assert exact.n_cached > 0 and exact.n_cached % 16 == 0
        assert exact.n_cached > exact.n_prompt - 16 - 8  # at most one ubatch (+ the diverging words) redone
    finally:
        ctx.close()


def test_sliding_window_cache_falls_back_to_a_full_decode(gemma: Model) -> None:
    # Gemma 3 attends over a 512-token window in most layers. Without swa_full, those layers keep only
    # the window (plus a ubatch): once the history is past it, a prefix that ends early can no longer be
    # continued, and cache_prompt decodes the whole prompt again. swa_full (the default) keeps it all.
    assert gemma.info.n_swa == 512
    head = " ".join(f"w{i}" for i in range(30))
    tail = " ".join(f"item{i}" for i in range(260))  # with head: about 900 tokens
    for swa_full in (False, True):
        ctx = gemma.new_context(n_ctx=1536, n_ubatch=64, swa_full=swa_full)
        try:
            ctx.generate(head + " " + tail, n_predict=4, cache_prompt=False)
            again = ctx.generate(head + " is what I said", n_predict=8)
            if swa_full:
                assert again.n_cached > 20
            else:
                assert again.n_cached == 0
            alone = gemma.new_context(n_ctx=1536, n_ubatch=64, swa_full=swa_full)
            try:
                ref = alone.generate(head + " is what I said", n_predict=8, cache_prompt=False)
            finally:
                alone.close()
            if not swa_full:
                assert again.tokens == ref.tokens  # a full decode: exactly what a fresh context does
            assert ctx.tokens() == gemma.tokenize(head + " is what I said") + again.tokens
        finally:
            ctx.close()


def test_long_prompts_report_progress(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024, n_batch=256, n_ubatch=64)
    try:
        seen: list[tuple[int, int]] = []
        r = ctx.generate(LONG, n_predict=2, progress=lambda done, total: seen.append((done, total)))
        total = r.n_prompt
        assert seen[-1] == (total, total)
        assert [d for d, _ in seen] == sorted({d for d, _ in seen}) and len(seen) == -(-total // 64)
        assert all(t == total for _, t in seen)

        # A cached prefix is not counted: the total is what this call decodes.
        seen.clear()
        r = ctx.generate(LONG + " and more", n_predict=2, progress=lambda d, t: seen.append((d, t)))
        assert seen[-1][1] == r.n_prompt - r.n_cached

        seen.clear()
        ctx.reset()
        ev = ctx.eval(LONG, progress=lambda d, t: seen.append((d, t)))
        assert seen[-1] == (ev.n_tokens, ev.n_tokens) and len(seen) > 1

        branches = gemma.new_context(n_ctx=1024, n_batch=128, n_ubatch=64)
        try:
            seen.clear()
            root = branches.branch(LONG, progress=lambda d, t: seen.append((d, t)))
            assert seen[-1] == (root.position, root.position) and len(seen) > 1
            seen.clear()
            root.prefill(" and more of the same" * 20, progress=lambda d, t: seen.append((d, t)))
            assert seen and seen[-1][0] == seen[-1][1]
        finally:
            branches.close()
    finally:
        ctx.close()


def test_a_progress_callback_that_raises_fails_the_call_not_the_context(gemma: Model) -> None:
    ctx = gemma.new_context(n_ctx=1024, n_ubatch=64)
    try:
        def boom(done: int, total: int) -> None:
            raise RuntimeError("stop right there")

        # The callback runs in this process; its error stops the request and is raised to the caller,
        # and neither the context nor the worker is broken by it.
        with pytest.raises(RuntimeError, match="stop right there"):
            ctx.generate(LONG, n_predict=2, progress=boom)
        assert ctx.generate("Hi", n_predict=1).n_decoded == 1
    finally:
        ctx.close()
