"""LoRA adapters on real models: random low-rank adapters written with the gguf package (tests/loras.py)
for the tiny model and for Gemma 3 270M, applied per context with set semantics."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from loras import attention_shapes, write_lora
from tinymodel import make_not_gguf

from lloyal_pool import Context, LloyalError, LoraAdapter, LoraError, Model, Pool, StaleHandleError
from lloyal_pool import protocol as p
from lloyal_pool.shm import Region
from lloyal_pool.worker import engine as engine_mod

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def tiny_lora_paths(tiny: Model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two different adapters for the tiny model (q and v of every layer)."""
    d = tmp_path_factory.mktemp("lora")
    shapes = attention_shapes(tiny.info, range(tiny.info.n_layer))
    return (write_lora(d / "tiny-a.gguf", "llama", shapes, rank=4, seed=1),
            write_lora(d / "tiny-b.gguf", "llama", shapes, rank=8, alpha=4.0, seed=2))


@pytest.fixture(scope="module")
def tiny_loras(tiny: Model, tiny_lora_paths: tuple[Path, Path]) -> Iterator[tuple[LoraAdapter, LoraAdapter]]:
    a, b = (tiny.load_lora(path) for path in tiny_lora_paths)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def gemma_lora_path(gemma: Model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rank 8 on q and v of Gemma's first six layers."""
    shapes = attention_shapes(gemma.info, range(6))
    return write_lora(tmp_path_factory.mktemp("lora") / "gemma.gguf", "gemma3", shapes, rank=8, seed=3, std=2.0)


def _logits(ctx: Context, tokens: list[int]) -> np.ndarray:
    ctx.reset()
    ctx.eval(tokens)
    return ctx.logits(copy=True)


def test_adapter_handle(tiny: Model, tiny_loras: tuple[LoraAdapter, LoraAdapter],
                        tiny_lora_paths: tuple[Path, Path]) -> None:
    a, b = tiny_loras
    assert a.path == str(tiny_lora_paths[0]) and a.model is tiny and not a.closed
    assert a.alpha == 4.0 and b.alpha == 4.0
    assert a.meta["general.type"] == "adapter" and a.meta["adapter.type"] == "lora"
    assert a.meta["general.architecture"] == "llama"


def test_scale_one_changes_output_scale_zero_and_clear_are_the_base(
        tiny: Model, tiny_loras: tuple[LoraAdapter, LoraAdapter]) -> None:
    a, _ = tiny_loras
    tokens = tiny.tokenize(PROMPT)
    with_ctx = tiny.new_context(n_ctx=128)
    try:
        base = _logits(with_ctx, tokens)
        with_ctx.reset()
        base_text = with_ctx.generate(tokens, n_predict=8, ignore_eos=True).tokens

        assert with_ctx.set_lora([(a, 1.0)]) is True
        assert with_ctx.lora == [(a, 1.0)]
        adapted = _logits(with_ctx, tokens)
        assert np.isfinite(adapted).all()
        assert np.abs(adapted - base).max() > 0.1
        with_ctx.reset()
        assert with_ctx.generate(tokens, n_predict=8, ignore_eos=True).tokens != base_text

        half = (with_ctx.set_lora([(a, 0.5)]), _logits(with_ctx, tokens))
        assert half[0] is True and not np.array_equal(half[1], adapted) and not np.array_equal(half[1], base)

        assert with_ctx.set_lora([(a, 0.0)]) is True  # scale 0 is no adapter at all
        assert np.array_equal(_logits(with_ctx, tokens), base)

        with_ctx.set_lora([(a, 1.0)])
        assert np.array_equal(_logits(with_ctx, tokens), adapted)  # the same adapter again: the same numbers
        assert with_ctx.set_lora([]) is True
        assert with_ctx.lora == []
        assert np.array_equal(_logits(with_ctx, tokens), base)
    finally:
        with_ctx.close()


def test_a_changed_configuration_empties_the_history_the_same_one_keeps_it(
        tiny: Model, tiny_loras: tuple[LoraAdapter, LoraAdapter]) -> None:
    a, b = tiny_loras
    tokens = tiny.tokenize(PROMPT)
    ctx = tiny.new_context(n_ctx=128)
    try:
        ctx.set_lora([(a, 1.0), (b, 0.5)])
        ctx.eval(tokens)
        kept = ctx.logits(copy=True)
        # Same adapters and scales, in another order, with a zero-scale extra: the same configuration.
        assert ctx.set_lora([(b, 0.5), (a, 1.0)]) is False
        assert ctx.n_past() == len(tokens) and np.array_equal(ctx.logits(), kept)
        assert ctx.tokens() == tokens

        assert ctx.set_lora([(a, 1.0), (b, 0.25)]) is True
        assert ctx.n_past() == 0 and ctx.tokens() == []
        with pytest.raises(LloyalError):
            ctx.logits()  # the old logits belonged to the old configuration
        ctx.eval(tokens)
        assert not np.array_equal(ctx.logits(), kept)
    finally:
        ctx.close()


def test_two_contexts_of_one_model_run_different_adapters_at_once(
        tiny: Model, tiny_loras: tuple[LoraAdapter, LoraAdapter]) -> None:
    a, b = tiny_loras
    tokens = tiny.tokenize(PROMPT)
    halves = (tokens[: len(tokens) // 2], tokens[len(tokens) // 2:])
    configs = {"a": [(a, 1.0)], "b": [(b, 1.0)], "none": []}
    ref = tiny.new_context(n_ctx=128)
    try:
        expected = {}
        for name, config in configs.items():  # one configuration at a time
            ref.set_lora(config)
            ref.reset()
            for half in halves:
                ref.eval(half)
            expected[name] = ref.logits(copy=True)
    finally:
        ref.close()
    assert not np.array_equal(expected["a"], expected["b"])
    assert not np.array_equal(expected["a"], expected["none"])

    ctxs = {name: tiny.new_context(n_ctx=128) for name in configs}
    try:
        for name, ctx in ctxs.items():
            ctx.set_lora(configs[name])
        # All three configured at once, their decodes interleaved in the worker.
        for half in halves:
            for f in [ctx.eval_async(half) for ctx in ctxs.values()]:
                f.result()
        for name, ctx in ctxs.items():
            assert np.array_equal(ctx.logits(), expected[name]), name
    finally:
        for ctx in ctxs.values():
            ctx.close()


def test_branches_refuse_a_change_of_configuration(
        tiny: Model, tiny_loras: tuple[LoraAdapter, LoraAdapter]) -> None:
    a, _ = tiny_loras
    tokens = tiny.tokenize(PROMPT)
    ctx = tiny.new_context(n_ctx=128, n_seq_max=2)
    try:
        ctx.set_lora([(a, 1.0)])
        adapted = _logits(ctx, tokens)
        ctx.reset()
        branch = ctx.branch(tokens)
        assert np.allclose(branch.logits, adapted, atol=1e-3)  # branches decode under the adapters too
        with pytest.raises(LoraError, match="branches"):
            ctx.set_lora([])
        assert ctx.lora == [(a, 1.0)] and branch.alive
        assert ctx.set_lora([(a, 1.0)]) is False  # not a change: allowed
        seq = branch.detach()
        with pytest.raises(LoraError, match="detached"):
            ctx.set_lora([(a, 2.0)])
        ctx.kv.free(seq)
        assert ctx.set_lora([]) is True
        assert not np.allclose(ctx.branch(tokens).logits, adapted, atol=1e-3)
    finally:
        ctx.close()


def test_bad_adapter_files_are_typed_errors(tiny: Model, gemma: Model, tiny_lora_paths: tuple[Path, Path],
                                            tmp_path: Path) -> None:
    with pytest.raises(LoraError, match="not found"):
        tiny.load_lora(tmp_path / "missing.gguf")
    with pytest.raises(LoraError, match="not a GGUF"):
        tiny.load_lora(make_not_gguf(tmp_path / "junk.gguf"))
    with pytest.raises(LoraError, match=r"general\.type"):
        tiny.load_lora(tiny.path)  # a model, not an adapter
    with pytest.raises(LoraError, match="arch"):
        gemma.load_lora(tiny_lora_paths[0])  # a llama adapter for a gemma3 model
    wider = {name: (n_in * 2, n_out) for name, (n_in, n_out) in attention_shapes(tiny.info, [0]).items()}
    with pytest.raises(LoraError, match="shape"):
        tiny.load_lora(write_lora(tmp_path / "wider.gguf", "llama", wider))
    with pytest.raises(LoraError, match="does not exist"):
        tiny.load_lora(write_lora(tmp_path / "extra.gguf", "llama", {"blk.9.attn_q.weight": (64, 64)}))
    # Files llama.cpp itself would abort the process on (a key of another type, a tensor that is no matrix).
    for name, build in (("int-type", lambda w: w.add_uint32("general.type", 7)),
                        ("f64-alpha", lambda w: (w.add_type("adapter"), w.add_string("adapter.type", "lora"),
                                                 w.add_float64("adapter.lora.alpha", 4.0))),
                        ("3d", lambda w: (w.add_type("adapter"), w.add_string("adapter.type", "lora"),
                                          w.add_tensor("blk.0.attn_q.weight.lora_a",
                                                       np.zeros((2, 4, 64), dtype=np.float32))))):
        writer = gguf.GGUFWriter(tmp_path / f"{name}.gguf", "llama")
        build(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(LoraError, match=r"must be a|dimensions"):
            tiny.load_lora(tmp_path / f"{name}.gguf")
    # The worker goes on serving.
    assert tiny.detokenize(tiny.tokenize("still here", add_special=False)) == "still here"
    ctx = tiny.new_context(n_ctx=64)
    try:
        assert ctx.generate("Hello", n_predict=4, ignore_eos=True).n_decoded == 4
    finally:
        ctx.close()


def test_bad_configurations_are_typed_errors_and_change_nothing(
        pool: Pool, tiny: Model, tiny_loras: tuple[LoraAdapter, LoraAdapter], tiny_model: Path,
        tiny_lora_paths: tuple[Path, Path]) -> None:
    a, b = tiny_loras
    tokens = tiny.tokenize(PROMPT)
    ctx = tiny.new_context(n_ctx=128)
    other = tiny.instance.load_model(tiny_model)  # the same file, another Model handle in the same worker
    elsewhere = pool[0].load_model(tiny_model)  # another worker
    try:
        ctx.set_lora([(a, 1.0)])
        ctx.eval(tokens)
        before = ctx.logits(copy=True)

        for scale in (math.nan, math.inf, -math.inf):
            with pytest.raises(LoraError, match="finite"):
                ctx.set_lora([(a, scale)])
        with pytest.raises(LoraError, match="twice"):
            ctx.set_lora([(b, 1.0), (b, 0.5)])
        with pytest.raises(LoraError, match="another model"):
            ctx.set_lora([(other.load_lora(tiny_lora_paths[1]), 1.0)])
        with pytest.raises(LoraError, match="another worker"):
            ctx.set_lora([(elsewhere.load_lora(tiny_lora_paths[1]), 1.0)])
        with pytest.raises(TypeError):
            ctx.set_lora([("adapter", 1.0)])  # type: ignore[list-item]

        closed = tiny.load_lora(tiny_lora_paths[1])
        closed.close()
        assert closed.closed
        with pytest.raises(StaleHandleError):
            ctx.set_lora([(closed, 1.0)])
        of_closed_model = other.load_lora(tiny_lora_paths[0])
        other.close()
        assert of_closed_model.closed
        with pytest.raises(StaleHandleError):
            ctx.set_lora([(of_closed_model, 1.0)])

        # Nothing changed: same configuration, same history, same logits.
        assert ctx.lora == [(a, 1.0)] and ctx.n_past() == len(tokens)
        assert np.array_equal(ctx.logits(), before)
    finally:
        ctx.close()
        other.close()
        elsewhere.close()


def test_an_adapter_in_use_cannot_be_closed(tiny: Model, tiny_lora_paths: tuple[Path, Path]) -> None:
    adapter = tiny.load_lora(tiny_lora_paths[0])
    ctx = tiny.new_context(n_ctx=64)
    try:
        ctx.set_lora([(adapter, 1.0)])
        with pytest.raises(LoraError, match="set_lora"):
            adapter.close()
        assert not adapter.closed
        ctx.set_lora([])
        adapter.close()
        assert adapter.closed
        adapter.close()  # idempotent
    finally:
        ctx.close()


def test_engine_refuses_unknown_and_freed_adapter_handles(tiny_model: Path,
                                                         tiny_lora_paths: tuple[Path, Path]) -> None:
    import lloyal_pool.worker._native as native

    eng = engine_mod.Engine(native, Region.anonymous(8 << 20))
    try:
        model = eng.handle(p.LoadModel(path=str(tiny_model))).model
        other = eng.handle(p.LoadModel(path=str(tiny_model))).model
        ctx = eng.handle(p.NewContext(model=model, params={"n_ctx": 64})).context
        lora = eng.handle(p.LoadLora(model=other, path=str(tiny_lora_paths[0]))).lora
        with pytest.raises(LoraError, match="another model"):  # the native check, not the client's
            eng.handle(p.SetLora(context=ctx, adapters=[(lora, 1.0)]))
        with pytest.raises(StaleHandleError):
            eng.handle(p.SetLora(context=ctx, adapters=[(12345, 1.0)]))
        eng.handle(p.FreeModel(model=other))  # frees its adapters with it
        with pytest.raises(StaleHandleError):
            eng.handle(p.SetLora(context=ctx, adapters=[(lora, 1.0)]))
        with pytest.raises(StaleHandleError):
            eng.handle(p.FreeLora(lora=lora))
        own = eng.handle(p.LoadLora(model=model, path=str(tiny_lora_paths[0]))).lora
        assert eng.handle(p.SetLora(context=ctx, adapters=[(own, 1.0)])) is True
        eng.handle(p.FreeModel(model=model))  # context and adapter go with it
    finally:
        eng.close()


def test_gemma_lora(gemma: Model, tiny: Model, gemma_lora_path: Path) -> None:
    adapter = gemma.load_lora(gemma_lora_path)
    assert adapter.meta["general.architecture"] == "gemma3"
    tokens = gemma.tokenize("The capital of France is")
    ctx = gemma.new_context(n_ctx=256)
    try:
        base = _logits(ctx, tokens)
        ctx.reset()
        base_tokens = ctx.generate(tokens, n_predict=8, ignore_eos=True).tokens

        assert ctx.set_lora([(adapter, 1.0)]) is True
        adapted = _logits(ctx, tokens)
        assert np.isfinite(adapted).all() and np.abs(adapted - base).max() > 0.1
        ctx.reset()
        assert ctx.generate(tokens, n_predict=8, ignore_eos=True).tokens != base_tokens

        ctx.set_lora([(adapter, 0.0)])
        assert np.array_equal(_logits(ctx, tokens), base)
        ctx.set_lora([(adapter, 1.0)])
        assert ctx.set_lora([]) is True
        assert np.array_equal(_logits(ctx, tokens), base)
    finally:
        ctx.close()
        adapter.close()
    with pytest.raises(LoraError, match="arch"):
        tiny.load_lora(gemma_lora_path)  # a gemma3 adapter for a llama model
