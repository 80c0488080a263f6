"""The OpenAI-compatible HTTP endpoint: a Starlette app over a Pool (or a RayPool) whose workers hold
one model, reached through a Backend (backend.py).

    POST /v1/completions, /v1/chat/completions ─▶ backend.submit_many (continuous batching, routed per
                                                   request; its n choices on one worker, the prompt decoded once)
    POST /v1/embeddings                         ─▶ an embedding context per worker
    POST /tokenize, /detokenize, /apply-template, GET /props   ─▶ questions to any live worker (llama-server's)
    GET  /v1/models, /lora-adapters, /health, /metrics, /   (the last: a chat page, no build step, no external assets)

Every request that generates is a batched request (batching.py): many clients share each worker's slots.
A request may run LoRA adapters the server loaded for every worker's model (create_app's ``lora``): its
``model`` names one, or its ``lora`` field (llama-server's) lists them by id with scales (schemas.lora_of);
requests on different adapters share the batcher, decoded in turns.
A request for ``n`` choices (or a completion's ``best_of``) is that many batched requests of one prompt on
one worker, followed together (_Choices); one choice is a request of one. A client that goes away interrupts
its generation (a stream at its next piece; a plain request within a
quarter of a second), so its slot is free again. Calls that ask the worker a question (tokenize, format a
chat) run on a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from importlib import resources
from typing import Any

import msgspec
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from .._aio import _LoopQueue, settle
from ..batching import BatchRequest, best_choices, ranked_params
from ..chat import CHAT_FORMATS, template_source
from ..errors import InvalidTokenError
from ..params import GenerateParams, Result, StopReason, TokenLogprob
from ..pool import Pool
from ..session import call_opener, formatted_params
from . import schemas
from .backend import LoraSpec, PoolBackend, backend_of, served_loras
from .schemas import APIError, api_error
from .telemetry import ARRIVAL, Metrics, Timing

DISCONNECT_POLL = 0.25  # seconds between checks that the client of a plain (not streamed) request is there


class Server:
    """The app's state: the backend (a Pool or a RayPool), the model's name and chat template, the LoRA
    adapters served, the API key, the default cap on a reply (max_tokens), the metrics."""

    def __init__(self, pool: Pool | Any, *, model_name: str | None = None, chat_template: str | None = None,
                 chat_logit_bias: Mapping[int, float] | None = None, api_key: str | None = None,
                 max_tokens: int = schemas.DEFAULT_MAX_TOKENS, lora: LoraSpec | None = None) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens is a whole number of tokens (0: no cap), got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.pool = pool
        adapters = served_loras(lora)  # refused before anything is asked of a worker
        self.backend = backend_of(pool)
        self.model_name = model_name or self.backend.model_path().rsplit("/", 1)[-1].removesuffix(".gguf")
        #: The LoRA adapters served, in id order.
        self.loras: list[schemas.ServedLora] = adapters
        if adapters:
            if not isinstance(self.backend, PoolBackend):
                raise ValueError("LoRA adapters (lora=) are served from a Pool on this machine; a RayPool's "
                                 "actors load none")
            if any(a.name == self.model_name for a in adapters):
                raise ValueError(f"a LoRA adapter is named {self.model_name!r}, as the model is: name it apart "
                                 f"(NAME=PATH), or the model (model_name, --name)")
            self.backend.serve_loras(adapters)
        self.chat_template = chat_template
        self.chat_logit_bias = dict(chat_logit_bias or {})
        self.api_key = api_key
        self.metrics = Metrics()
        self._slots: int | None = None  # of one worker's batcher, asked at the first request for several choices

    async def worker_slots(self) -> int:
        """The slots of one worker's batcher: the most choices one request can have."""
        if self._slots is None:
            served, _ = await asyncio.to_thread(self.backend.served_model)
            self._slots = served.slots
        return self._slots

    def generate_params(self, body: Mapping[str, Any], *, chat: bool) -> tuple[GenerateParams, str]:
        """A generating request's GenerateParams, its adapters included (schemas.lora_of), and the model
        its reply names: the adapter its ``model`` named, else the served model."""
        gen = schemas.generate_params(body, chat=chat, server_max_tokens=self.max_tokens)
        lora, shown = schemas.lora_of(body, self.model_name, self.loras)
        return (dataclasses.replace(gen, lora=lora) if lora else gen), shown

    def check_key(self, request: Request) -> None:
        """APIError 401 unless the request carries the API key (when one is set)."""
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error",
                           code="invalid_api_key")


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body is a JSON object")
    return body


class _Progress:
    """What the choices of one generating request report as they run: their timings, their pieces (for a
    stream: in the order they come, each with its choice's index, then (i, None) once choice i ended) and
    their ends; the metrics count the request once its last choice has ended. The requests' callbacks hold
    this, not the _Choices: a running request must not keep its client's end alive."""

    def __init__(self, server: Server, n: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self.metrics = server.metrics
        self.timings = [Timing() for _ in range(n)]
        self.results: list[Result | None] = [None] * n
        self.left = n
        self.lock = threading.Lock()
        self.q = None if loop is None else _LoopQueue(loop)

    def on_piece(self, i: int, piece: str) -> None:
        self.timings[i].piece()
        if self.q is not None:
            self.q.put((i, piece))

    def ended(self, i: int) -> Callable[[Future[Result]], None]:
        return lambda fut: self._end(i, fut)

    def _end(self, i: int, fut: Future[Result]) -> None:
        self.timings[i].end = time.monotonic()
        with self.lock:
            if not fut.cancelled() and fut.exception() is None:
                self.results[i] = fut.result()
            self.left -= 1
            last = self.left == 0
        if self.q is not None:
            self.q.put((i, None))
        if last:
            self.metrics.ended(self.timings, self.results)


class _Choices:
    """The n choices of one generating request (n = 1: a request of one), as the app follows them. Dropped
    while they run (a response that never began), it interrupts them, as an AsyncStream does."""

    def __init__(self, progress: _Progress, handles: Sequence[BatchRequest]) -> None:
        self._progress = progress
        self.handles = list(handles)
        self._sent = [0] * len(self.handles)  # per choice, the token log-probabilities streamed so far
        for i, handle in enumerate(self.handles):
            handle.future.add_done_callback(progress.ended(i))

    def __del__(self) -> None:
        if not self.done:
            self.interrupt()

    @property
    def done(self) -> bool:
        """Whether every choice has ended."""
        return all(h.future.done() for h in self.handles)

    def interrupt(self) -> None:
        """Ends every choice that is still running (from any thread)."""
        for handle in self.handles:
            handle.interrupt()

    def fresh_logprobs(self, i: int, result: Result | None = None) -> list[TokenLogprob]:
        """Choice i's token log-probabilities not streamed yet: of the tokens handed out so far (each is
        there before its piece), or, given its Result, all the rest."""
        seen = (result.logprobs or []) if result is not None else self.handles[i].logprobs_so_far()
        fresh = seen[self._sent[i]:]
        self._sent[i] = max(self._sent[i], len(seen))
        return fresh

    async def result(self, i: int) -> Result:
        """Choice i's Result (its error raised); a cancelled wait interrupts every choice."""
        return await settle(self.handles[i].future, self.interrupt)

    async def results(self) -> list[Result]:
        """Every choice's Result; the first error is raised, and the other choices are interrupted."""
        try:
            return [await self.result(i) for i in range(len(self.handles))]
        except BaseException:
            self.interrupt()
            raise

    async def pieces(self) -> AsyncIterator[tuple[int, str | None]]:
        """A stream's pieces as they come: (i, piece) of choice i, then (i, None) once it has ended (its
        result() is ready), until every choice has. Cancelling the iterating task interrupts them."""
        q = self._progress.q
        assert q is not None, "a stream's choices"
        left = len(self.handles)
        while left:
            try:
                item: object = await q.items.get()
            except asyncio.CancelledError:
                self.interrupt()
                raise
            assert isinstance(item, tuple)
            i, piece = item
            if piece is None:
                left -= 1
            yield i, piece


async def _submit(server: Server, prompt: str | list[int], gen: GenerateParams, n: int, *,
                  stream: bool) -> _Choices:
    """Submits ``n`` choices of a generation (a stream's pieces to their queue); the metrics count it when
    it ends."""
    progress = _Progress(server, n, asyncio.get_running_loop() if stream else None)
    handles = await asyncio.to_thread(server.backend.submit_many, prompt, gen, n, progress.on_piece)
    return _Choices(progress, handles)


async def _unless_gone(request: Request, choices: _Choices) -> list[Result]:
    """The choices' Results; if the client disconnects first, every choice is interrupted."""
    waiting = asyncio.ensure_future(choices.results())
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            choices.interrupt()  # the metrics count the interrupted request as a client that left
            return await waiting


async def _generate(request: Request, server: Server, prompt: str | list[int], gen: GenerateParams, n: int,
                    best_of: int) -> tuple[list[Result], list[Result]]:
    """A plain (not streamed) request's n choices, and all it generated: best_of's candidates, ranked by
    the mean log-probability of their tokens (batching.best_choices; their logprobs kept only if asked)."""
    if best_of == n:
        results = await _unless_gone(request, await _submit(server, prompt, gen, n, stream=False))
        return results, results
    generated = await _unless_gone(request, await _submit(server, prompt, ranked_params(gen), best_of, stream=False))
    return best_choices(generated, n, keep_logprobs=gen.logprobs is not None), generated


async def _fit(server: Server, n: int, best_of: int) -> None:
    """APIError unless the choices fit one worker's slots (one choice always does: no question asked)."""
    if best_of > 1:
        schemas.check_slots(n, best_of, await server.worker_slots())


def _prompt_of(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise APIError(400, "prompt is a non-empty string or token list (one prompt per request)", param="prompt")


def _event_stream(server: Server, choices: _Choices, events: AsyncGenerator[bytes, None]) -> StreamingResponse:
    """The server-sent events of a streamed reply. An error after the first event is one more event in
    OpenAI's error shape, and the stream still ends with [DONE]; a client that leaves frees its slot."""

    async def framed() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except Exception as exc:  # the worker's errors, and a backend gone (503) while parsing the reply
            err = api_error(exc)
            server.metrics.error(err.status)
            yield schemas.sse(err.body())
        finally:
            await events.aclose()
            if not choices.done:
                choices.interrupt()  # the client left: free the slots
        yield schemas.sse("[DONE]")

    # No caching, and no buffering by a proxy in front (nginx's X-Accel-Buffering): each piece as it comes.
    return StreamingResponse(framed(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- routes ----------------------------------------------------------------------------------------------------
async def completions(request: Request, server: Server) -> Response:
    body = await _body(request)
    gen, shown = server.generate_params(body, chat=False)
    n, best_of = schemas.choices_of(body, chat=False)
    wants_usage = schemas.include_usage(body)
    prompt = _prompt_of(body)
    await _fit(server, n, best_of)
    reply = schemas.Reply("cmpl", shown)
    # echo: the reply starts with the prompt (and its tokens' log-probabilities, with logprobs)
    echo = await asyncio.to_thread(server.backend.echo, prompt, gen.logprobs) if _flag(body, "echo", False) else None
    if echo is not None and body.get("max_tokens") == 0:
        # The prompt alone, scored: how evaluation harnesses ask for a text's log-likelihood (max_tokens 0
        # elsewhere means no cap but the slot's room).
        nothing = Result(text="", tokens=[], n_prompt=echo.n_prompt, n_decoded=0, n_cached=0,
                         stop_reason=StopReason.LENGTH, prompt_ms=0.0, decode_ms=0.0,
                         logprobs=None if gen.logprobs is None else [])
        return JSONResponse(schemas.completion([nothing] * n, reply, echo=echo, logprobs=gen.logprobs is not None))
    if not body.get("stream"):
        results, generated = await _generate(request, server, prompt, gen, n, best_of)
        return JSONResponse(schemas.completion(results, reply, generated, echo=echo,
                                               logprobs=gen.logprobs is not None))
    choices = await _submit(server, prompt, gen, n, stream=True)

    offsets = [0 if echo is None else len(echo.text)] * n  # per choice, where its next token's text starts

    def logprobs(i: int, result: Result | None = None) -> dict[str, Any] | None:
        # The tokens each chunk carries; a piece held back (a stop string that may complete, a split UTF-8
        # character) comes with a later chunk's tokens, and the last chunk carries whatever is left.
        if gen.logprobs is None:
            return None
        fresh = choices.fresh_logprobs(i, result)
        if not fresh and result is None:
            return None
        shown = schemas.completion_logprobs(fresh, offsets[i])
        assert shown is not None
        offsets[i] += sum(len(t) for t in shown["tokens"])
        return shown

    async def events() -> AsyncGenerator[bytes, None]:
        if echo is not None:  # each choice starts with the prompt
            for i in range(n):
                yield schemas.sse(schemas.completion_chunk(echo.text, reply, index=i, logprobs=None if gen.logprobs
                                                           is None else schemas.echo_logprobs(echo)))
        async for i, piece in choices.pieces():
            if piece is not None:
                yield schemas.sse(schemas.completion_chunk(piece, reply, logprobs=logprobs(i), index=i))
                continue
            result = await choices.result(i)
            yield schemas.sse(schemas.completion_chunk("", reply, schemas.finish_reason(result),
                                                       logprobs(i, result), index=i))
        if wants_usage:
            yield schemas.sse(reply.usage_chunk("text_completion", await choices.results()))

    return _event_stream(server, choices, events())


async def chat_completions(request: Request, server: Server) -> Response:
    body = await _body(request)
    gen, shown = server.generate_params(body, chat=True)
    n, _ = schemas.choices_of(body, chat=True)
    wants_usage = schemas.include_usage(body)
    messages = schemas.messages_of(body)
    tools, tool_choice = schemas.tools_of(body)
    parallel = schemas.parallel_tool_calls(body)

    def format_chat(choice: str) -> Any:
        return server.backend.format_chat(messages, template=server.chat_template, tools=tools, tool_choice=choice)

    fmt = await asyncio.to_thread(format_chat, tool_choice)
    opener = ""
    if tool_choice == "required":
        if not fmt.grammar:
            raise APIError(400, f"tool_choice {body.get('tool_choice')!r} needs a chat format with tool calls, and "
                                "this server's has none (--template to choose one)", param="tool_choice")
        # The reply must be a call: the prompt ends with the format's call marker (session.call_opener).
        opener = await asyncio.to_thread(call_opener, fmt, lambda: format_chat("auto"))
    gen = formatted_params(fmt, gen, opener, parallel)
    if server.chat_logit_bias:  # the request's own bias on a token wins
        gen = dataclasses.replace(gen, logit_bias={**server.chat_logit_bias, **gen.logit_bias})
    await _fit(server, n, n)
    reply = schemas.Reply("chatcmpl", shown)

    async def parse(result: Result) -> Any:
        partial = result.stop_reason in ("length", "interrupted")
        message = await asyncio.to_thread(server.backend.parse_chat, opener + result.text,
                                          template=server.chat_template, tools=tools, messages=messages,
                                          tool_choice=tool_choice, partial=partial)
        if not parallel and len(message.tool_calls) > 1:  # parallel_tool_calls false: the first call only
            message = msgspec.structs.replace(message, tool_calls=message.tool_calls[:1])
        return message

    if not body.get("stream"):
        results, _ = await _generate(request, server, fmt.prompt + opener, gen, n, n)
        parsed = [await parse(result) for result in results]
        return JSONResponse(schemas.chat_completion(parsed, results, reply))
    choices = await _submit(server, fmt.prompt + opener, gen, n, stream=True)
    whole = bool(tools) and tool_choice != "none"  # the text may be a call: it is parsed once whole

    async def events() -> AsyncGenerator[bytes, None]:
        for i in range(n):
            yield schemas.sse(schemas.chat_chunk({"role": "assistant", "content": ""}, reply, index=i))
        async for i, piece in choices.pieces():
            if piece is not None:
                if not whole:  # with the log-probabilities of the tokens handed out so far (completions')
                    fresh = choices.fresh_logprobs(i) if gen.logprobs is not None else []
                    yield schemas.sse(schemas.chat_chunk({"content": piece}, reply, index=i,
                                                         logprobs=schemas.chat_logprobs(fresh) if fresh else None))
                continue
            result = await choices.result(i)
            message = await parse(result)
            if whole:
                yield schemas.sse(schemas.chat_chunk(schemas.chat_delta(message), reply, index=i))
            rest = choices.fresh_logprobs(i, result) if gen.logprobs is not None else None
            yield schemas.sse(schemas.chat_chunk({}, reply, schemas.finish_reason(result, bool(message.tool_calls)),
                                                 schemas.chat_logprobs(rest), index=i))
        if wants_usage:
            yield schemas.sse(reply.usage_chunk("chat.completion.chunk", await choices.results()))

    return _event_stream(server, choices, events())


async def embeddings(request: Request, server: Server) -> Response:
    body = await _body(request)
    if schemas.lora_of({"model": body.get("model")}, server.model_name, server.loras)[0]:
        raise APIError(400, f"LoRA adapters run in completions and chats; embeddings are the model's own: name "
                            f"{server.model_name!r}", param="model")
    inputs = body.get("input")
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(isinstance(i, int) for i in inputs)):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, (str, list)) for i in inputs):
        raise APIError(400, "input is a string, a token list, or a non-empty list of them", param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):  # the openai package asks for base64 (float32, little-endian)
        raise APIError(400, 'encoding_format is "float" or "base64"', param="encoding_format")
    vectors, n_tokens = await asyncio.to_thread(server.backend.embed, inputs)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if encoding == "base64"
             else [float(x) for x in v]} for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": server.model_name,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


def _model_cards(server: Server) -> list[dict[str, Any]]:
    """The served model's card, then one per LoRA adapter, whose ``parent`` is the model (as vLLM lists
    its LoRA modules)."""
    return ([{"id": server.model_name, "object": "model", "created": 0, "owned_by": "lloyal_pool"}]
            + [{"id": a.name, "object": "model", "created": 0, "owned_by": "lloyal_pool", "parent": server.model_name}
               for a in server.loras])


async def models(request: Request, server: Server) -> Response:
    return JSONResponse({"object": "list", "data": _model_cards(server)})


async def model(request: Request, server: Server) -> Response:
    """GET /v1/models/{model}: the served model, or one of its LoRA adapters, under the name /v1/models
    lists (on a server without adapters any name maps to the model for generation, but only its own is a
    model to look up)."""
    card = next((c for c in _model_cards(server) if c["id"] == request.path_params["model"]), None)
    if card is None:
        adapters = f" and its LoRA adapters {', '.join(repr(a.name) for a in server.loras)}" if server.loras else ""
        raise APIError(404, f"the model {request.path_params['model']!r} does not exist; this server serves "
                            f"{server.model_name!r}{adapters}", param="model", code="model_not_found")
    return JSONResponse(card)


async def lora_adapters(request: Request, server: Server) -> Response:
    """GET /lora-adapters, as llama-server's: the adapters loaded, ``[{"id", "path", "scale"}, ...]`` (and
    the ``name`` a request's ``model`` selects one by). ``scale`` is 0: none applies to a request that
    does not ask for it (llama-server's --lora-init-without-apply); there is no POST to change that."""
    return JSONResponse([{"id": a.id, "path": a.path, "name": a.name, "scale": 0.0} for a in server.loras])


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:  # unset, or null as clients send what they leave unset
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} is true or false, got {value!r}", param=name)
    return value


def _piece(data: bytes) -> str | list[int]:
    """A token's piece as llama-server's /tokenize shows it: its text, or its bytes where they are not
    UTF-8 on their own (part of a character)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def tokenize(request: Request, server: Server) -> Response:
    """POST /tokenize, as llama-server's: ``content`` (text), ``add_special`` (BOS where the model adds
    it; default false), ``parse_special`` (control-token text as those tokens; default true),
    ``with_pieces`` (default false) -> ``{"tokens": [id, ...]}``, or with pieces ``[{"id", "piece"}, ...]``."""
    body = await _body(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise APIError(400, "content is the text to tokenize (a string)", param="content")
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    tokens = await asyncio.to_thread(server.backend.tokenize, content, add_special, parse_special)
    if not with_pieces:
        return JSONResponse({"tokens": tokens})
    pieces = await asyncio.to_thread(server.backend.token_pieces, tokens)
    return JSONResponse({"tokens": [{"id": t, "piece": _piece(b)} for t, b in zip(tokens, pieces, strict=True)]})


async def detokenize(request: Request, server: Server) -> Response:
    """POST /detokenize, as llama-server's: ``tokens`` (ids) -> ``{"content": text}``, control tokens
    written out."""
    body = await _body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "tokens is a list of token ids", param="tokens")
    try:
        content = await asyncio.to_thread(server.backend.detokenize, tokens)
    except InvalidTokenError as exc:
        raise APIError(400, str(exc), param="tokens") from None
    return JSONResponse({"content": content})


async def apply_template(request: Request, server: Server) -> Response:
    """POST /apply-template, as llama-server's: a chat request's ``messages`` (and ``tools``,
    ``tool_choice``) -> ``{"prompt": text}``, the prompt a chat completion of them generates from (the
    server's chat format: the model's template, --template, or the fallback; for a forced tool call, the
    format's call marker after it, as chat_completions adds it)."""
    body = await _body(request)
    messages = schemas.messages_of(body)
    tools, tool_choice = schemas.tools_of(body)

    def format_chat(choice: str) -> Any:
        return server.backend.format_chat(messages, template=server.chat_template, tools=tools, tool_choice=choice)

    fmt = await asyncio.to_thread(format_chat, tool_choice)
    opener = ""
    if tool_choice == "required" and fmt.grammar:
        opener = await asyncio.to_thread(call_opener, fmt, lambda: format_chat("auto"))
    return JSONResponse({"prompt": fmt.prompt + opener})


async def props(request: Request, server: Server) -> Response:
    """GET /props, in llama-server's shape where it has the field: the model, its slots and their room,
    the chat template in use, what a request that sets nothing gets, the build."""
    served, slots = await asyncio.to_thread(server.backend.served_model)
    own = server.chat_template is None  # else --template, or the fallback for a model without one
    template = served.chat_template if own else template_source(server.chat_template)
    chat_max = schemas.default_max_tokens(server.max_tokens, chat=True)
    params: dict[str, Any] = {
        "n_predict": chat_max or -1, "max_tokens": chat_max or -1,
        "completion_max_tokens": schemas.default_max_tokens(server.max_tokens, chat=False),
        "temperature": schemas.DEFAULT_TEMPERATURE, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "seed": None, "stop": [], "ignore_eos": False, "stream": False}
    return JSONResponse({
        "default_generation_settings": {"n_ctx": served.n_ctx_slot, "params": params},
        "total_slots": slots,
        "model_alias": server.model_name,
        "model_path": served.path,
        "modalities": {"vision": False, "audio": False},
        "chat_template": template or "",
        "chat_template_origin": "model" if own else "server",
        "chat_format": server.chat_template if server.chat_template in CHAT_FORMATS else None,
        "chat_logit_bias": {str(t): b for t, b in server.chat_logit_bias.items()},
        "bos_token": served.bos_token,
        "eos_token": served.eos_token,
        "build_info": str(served.build.get("build_info", "")),
        "llama_cpp": served.build.get("llama_cpp"),
        "lloyal_pool_version": __version__,
        "is_sleeping": False,
    })


async def health(request: Request, server: Server) -> Response:
    gauges = await asyncio.to_thread(server.backend.gauges)
    alive = sum(1 for g in gauges if g.alive)
    status = 200 if alive else 503
    return JSONResponse({"status": "ok" if alive else "unavailable", "workers": len(gauges),
                         "workers_alive": alive}, status_code=status)


async def metrics(request: Request, server: Server) -> Response:
    gauges = await asyncio.to_thread(server.backend.gauges)
    return PlainTextResponse(server.metrics.text(gauges), media_type="text/plain; version=0.0.4")


async def chat_page(request: Request, server: Server) -> Response:
    return HTMLResponse(resources.files(__package__).joinpath("chat.html").read_text(encoding="utf-8"))


def _route(path: str, fn: Callable[[Request, Server], Awaitable[Response]], server: Server, methods: list[str],
           name: str, auth: bool = True) -> Route:
    async def endpoint(request: Request) -> Response:
        ARRIVAL.set(time.monotonic())
        server.metrics.count(name)
        try:
            if auth:
                server.check_key(request)
            return await fn(request, server)
        except Exception as exc:  # every failure in OpenAI's error shape, the worker's included
            err = api_error(exc)
            server.metrics.error(err.status)
            return JSONResponse(err.body(), status_code=err.status)

    return Route(path, endpoint, methods=methods, name=name)


def create_app(pool: Pool | Any, *, model_name: str | None = None, chat_template: str | None = None,
               chat_logit_bias: Mapping[int, float] | None = None, api_key: str | None = None,
               max_tokens: int = schemas.DEFAULT_MAX_TOKENS, lora: LoraSpec | None = None) -> Starlette:
    """The ASGI app serving ``pool`` (a Pool, or a lloyal_pool.ray.RayPool), whose workers each hold the
    one model it serves (``model_name`` is the id /v1/models shows, default the file's stem; without
    adapters any ``model`` a request names maps to it).
    ``lora``: LoRA adapters to serve (a Pool only): paths (each named by its file's stem) or (name,
    path) pairs, or a mapping of names to paths. Every worker's model loads them now (LoraError for one
    that cannot be loaded; ValueError for two of one name, one file twice, a name that is the model's),
    and so does a model a worker holds later (after Pool.replace) before its next request. A request
    runs them through its ``model`` (an adapter's name: that adapter at scale 1) or llama-server's
    ``lora`` field (``[{"id": i, "scale": s}]``, ids in this order); a ``model`` that is neither the
    model's name nor an adapter's is then a 400 (model_not_found).
    ``chat_template``: a chat format name or Jinja source for models without one. ``chat_logit_bias``:
    added to every chat completion's logit bias, the request's own bias on a token winning (what
    ``lloyal-pool serve`` passes for a model without a template: session.chat_fallback). ``api_key``: every
    route but /health, /metrics and / then needs ``Authorization: Bearer <api_key>``. ``max_tokens``: a
    chat's max_tokens when the request gives none (0: until the slot is full or the reply ends); a
    completion's is OpenAI's 16, or this where it is smaller."""
    server = Server(pool, model_name=model_name, chat_template=chat_template, chat_logit_bias=chat_logit_bias,
                    api_key=api_key, max_tokens=max_tokens, lora=lora)
    routes = [
        _route("/v1/completions", completions, server, ["POST"], "completions"),
        _route("/v1/chat/completions", chat_completions, server, ["POST"], "chat_completions"),
        _route("/v1/embeddings", embeddings, server, ["POST"], "embeddings"),
        _route("/v1/models", models, server, ["GET"], "models"),
        _route("/v1/models/{model:path}", model, server, ["GET"], "model"),
        _route("/tokenize", tokenize, server, ["POST"], "tokenize"),
        _route("/detokenize", detokenize, server, ["POST"], "detokenize"),
        _route("/apply-template", apply_template, server, ["POST"], "apply_template"),
        _route("/props", props, server, ["GET"], "props"),
        _route("/lora-adapters", lora_adapters, server, ["GET"], "lora_adapters"),
        _route("/health", health, server, ["GET"], "health", auth=False),
        _route("/metrics", metrics, server, ["GET"], "metrics", auth=False),
        _route("/", chat_page, server, ["GET"], "chat_page", auth=False),
    ]

    async def not_served(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        what = "no such route" if status == 404 else f"{request.method} is not allowed here"
        err = APIError(status, f"{what}: {request.method} {request.url.path}")
        server.metrics.error(status)
        return JSONResponse(err.body(), status_code=status)

    # An unknown path or method answers in OpenAI's error shape too, not Starlette's plain text.
    app = Starlette(routes=routes, exception_handlers={404: not_served, 405: not_served})
    app.state.server = server
    return app
