"""Every operation is declared once (protocol.py) and has a handler (worker/*_handlers.py) whose types match
the declaration, and a golden frame: the exact bytes a request of it puts on the wire."""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import pytest

from lloyal_pool import errors
from lloyal_pool import protocol as p
from lloyal_pool.protocol import Kind, Op
from lloyal_pool.worker import loop  # noqa: F401 (registers the crash kit's handler, and the zygote's)
from lloyal_pool.worker.engine import HANDLERS

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_frames.txt"
REGEN_ENV = "LLOYAL_POOL_REGEN_GOLDEN"

# One request of every operation, with every field set (so a renamed or retyped field changes the bytes).
EXAMPLES: dict[Op, p.Request[Any]] = {r.op: r for r in [
    p.Ping(),
    p.Freeze(),
    p.Fork(worker_id=3, cwd="/tmp/lloyal-worker0-x/fork3-y"),
    p.Reap(pid=4242, timeout=0.5),
    p.LoadModel(path="/m.gguf", n_gpu_layers=-1, use_mmap=False, vocab_only=True, repack=False),
    p.FreeModel(model=1),
    p.Tokenize(model=1, text="héllo", add_special=False, parse_special=True),
    p.Detokenize(model=1, tokens=[1, 2], remove_special=True, unparse_special=True),
    p.TokenToPiece(model=1, token=7, special=False),
    p.ApplyChatTemplate(model=1, messages=[("user", "hi")], template="chatml",
                        add_generation_prompt=False, tools="[]"),
    p.JsonSchemaToGrammar(schema='{"type": "string"}'),
    p.NewContext(model=1, params={"n_ctx": 64}),
    p.FreeContext(context=2),
    p.Eval(context=2, tokens=[1, 2, 3], text=None, add_special=None, parse_special=False),
    p.Resume(context=2, stream=True, origin=41),
    p.AdoptGeneration(context=2, params={"n_predict": 3, "seed": 7},
                      suspension={"tokens": [5, 6], "n_sampled": 2, "emitted": 4, "draws": [[0, 2]], "n_prompt": 3,
                                  "n_cached": 0, "prompt_ms": 1.5}, origin=41),
    p.Generate(context=2, prompt="Hi", params={"n_predict": 3, "logit_bias": {5: -1.5}}, stream=True,
               append=True, progress=True),
    p.GenerateWithDraft(context=2, prompt=[1, 2], params={"n_predict": 8}, draft=3, n_draft=4, ngram_min=1,
                        ngram_max=3, stream=True, append=False, progress=True),
    p.Logits(context=2),
    p.Reset(context=2),
    p.Tokens(context=2),
    p.NPast(context=2),
    p.LoadLora(model=1, path="/a.gguf"),
    p.FreeLora(lora=3),
    p.SetLora(context=2, adapters=[(3, 0.5), (4, 1.0)]),
    p.Embed(context=2, inputs=["héllo", [1, 2]], normalize=False),
    p.Rerank(context=2, query="q", documents=["a", "b"], prompt="{document} {query}"),
    p.SaveState(context=2, path="/c.state", in_place=True),
    p.LoadState(context=2, path="/c.state"),
    p.RenewTransfer(fd=5),
    p.ScoreText(context=2, text="The capital", logprobs=2),
    p.ScoreChoices(context=2, choices=[" Paris", [3, 4]]),
    p.BranchCreate(context=2, params={"temperature": 0.5}, grammar={"gbnf": 'root ::= "a"'}, prompt=[1, 2]),
    p.BranchFork(context=2, branch=65537),
    p.BranchAdopt(context=2, seq=3, params={}, grammar=None),
    p.BranchPrune(context=2, branch=65537, subtree=True),
    p.BranchRetainOnly(context=2, branch=65537),
    p.BranchDetach(context=2, branch=65537),
    p.BranchInfoRequest(context=2, branch=65537),
    p.BranchSetParams(context=2, branch=65537, params={"seed": 4}),
    p.BranchSetGrammar(context=2, branch=65537, grammar=None),
    p.BranchSetLogitBias(context=2, branch=65537, bias=[(5, -2.0)]),
    p.BranchReseed(context=2, branch=65537, seed=9),
    p.BranchSetLogits(context=2, branch=65537, logits=b"\x00\x00\x80\x3f"),
    p.BranchMergeLogits(context=2, branch=65537, experts=[131073], alpha=0.5),
    p.Produce(context=2, branches=[65537]),
    p.BranchSetText(context=2, branch=65537, stop=["\n\n"], render_special=False),
    p.ProduceText(context=2, branches=[65537]),
    p.BranchSetLogprobs(context=2, branch=65537, logprobs=3),
    p.Commit(context=2, pairs=[(65537, 11)]),
    p.Prefill(context=2, items=[(65537, [1, 2]), (131073, "text")], commits=[(196609, 5)], loras=[(3, 0.5)]),
    p.Step(context=2, branches=[65537, 131073]),
    p.ClearAndReseed(context=2, sinks=[1], tail=[2, 3]),
    p.KvCopy(context=2, src=0, dst=1, p0=2, p1=5),
    p.KvKeep(context=2, seq=1),
    p.KvRemove(context=2, seq=1, p0=3, p1=-1),
    p.KvPosMin(context=2, seq=1),
    p.KvPosMax(context=2, seq=1),
    p.KvFree(context=2, seq=1),
    p.KvPressureRequest(context=2),
    p.RawDecode(context=2, tokens=[1, 2, 3], pos=4, seq=1),
    p.Sample(context=2, params={"temperature": 0.5, "seed": 3}, grammar=2),
    p.GrammarNew(context=2, grammar={"gbnf": 'root ::= "a"', "root": "root"}),
    p.GrammarClone(context=2, handle=1),
    p.GrammarMask(context=2, handle=1),
    p.GrammarAccept(context=2, handle=1, token=5),
    p.GrammarFree(context=2, handle=1),
    p.StateSeqSize(context=2, seq=1),
    p.StateSeqGet(context=2, seq=1),
    p.StateSeqSet(context=2, seq=1, data=b"\x01\x02"),
    p.StateSeqSaveFile(context=2, seq=1, path="/s.bin", tokens=[1, 2]),
    p.StateSeqLoadFile(context=2, seq=1, path="/s.bin"),
    p.ChatFormat(model=1, messages='[{"role": "user", "content": "hi"}]', template="gemma",
                 add_generation_prompt=False, tools="[]", tool_choice="required"),
    p.ParseChatOutput(model=1, text="Hello", messages='[{"role": "user", "content": "hi"}]', template="chatml",
                      tools="[]", tool_choice="none", partial=True),
    p.Devices(),
    p.MemoryBreakdown(context=2),
    p.Fault(kind="exit", code=4, seconds=1.5),
]}


def _frames() -> dict[str, str]:
    return {op.value: p.pack(Kind.REQUEST, 7, p.request_payload(req)).hex() for op, req in EXAMPLES.items()}


def test_every_op_has_one_request_type_and_an_example() -> None:
    assert set(p.REQUESTS) == set(Op)
    assert set(EXAMPLES) == set(Op)
    for op, cls in p.REQUESTS.items():
        assert cls.op is op and type(EXAMPLES[op]) is cls


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.value)
def test_every_op_has_a_handler_typed_as_declared(op: Op) -> None:
    cls = p.REQUESTS[op]
    handler = HANDLERS[cls]
    hints = typing.get_type_hints(handler)
    assert hints["req"] is cls, f"{handler.__qualname__} takes {hints['req']}, not {cls.__name__}"
    declared = p.REPLIES[cls]
    returned = hints["return"]
    assert returned == declared or (declared is type(None) and returned is type(None)), (
        f"{handler.__qualname__} returns {returned}, {cls.__name__} declares {declared}")


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.value)
def test_golden_frames_round_trip(op: Op) -> None:
    frames = _frames()
    if os.environ.get(REGEN_ENV) == "1":
        GOLDEN.write_text("".join(f"{name} {frame}\n" for name, frame in sorted(frames.items())))
    golden = dict(line.split(" ", 1) for line in GOLDEN.read_text().splitlines())
    assert golden.get(op.value) == frames[op.value], (
        f"the wire bytes of {op.value} changed: if that is meant, bump PROTOCOL_VERSION and run the tests "
        f"once with {REGEN_ENV}=1")
    kind, req_id, payload = p.unpack(bytes.fromhex(golden[op.value])[4:])
    assert (kind, req_id) == (Kind.REQUEST, 7)
    assert p.parse_request(payload) == EXAMPLES[op]


def test_reply_types_convert_from_the_wire() -> None:
    state = {"branch": 65537, "position": 3, "n_accepted": 1, "perplexity": 2.5, "sampling_perplexity": 1.5}
    stepped = p.parse_reply(p.Step, {"decode_ms": 1.0, "states": [state], "produced": [[5, b"a", False, None]]})
    assert stepped.produced == [(5, b"a", False, None)] and stepped.states[0].position == 3
    assert p.parse_reply(p.Tokenize, [1, 2]) == [1, 2]
    assert p.parse_reply(p.FreeModel, None) is None
    with pytest.raises(errors.ProtocolError, match="does not match"):
        p.parse_reply(p.Tokenize, ["a"])
