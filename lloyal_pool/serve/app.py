"""The OpenAI-compatible HTTP endpoint: a Starlette app over a Pool (or a RayPool) whose workers hold
one model, reached through a Backend (backend.py).

    POST /v1/completions, /v1/chat/completions ─▶ backend.submit (continuous batching, routed per request)
    POST /v1/embeddings                         ─▶ an embedding context per worker
    GET  /v1/models, /health, /metrics, /        (the last: a chat page, no build step, no external assets)

Every request that generates is a batched request (batching.py): many clients share each worker's slots.
A client that goes away interrupts its generation (a stream at its next piece; a plain request within a
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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from importlib import resources
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .._aio import AsyncStream, settle
from ..batching import BatchRequest
from ..params import GenerateParams, Result
from ..pool import Pool
from ..session import formatted_params
from . import schemas
from .backend import backend_of
from .schemas import APIError, api_error

DISCONNECT_POLL = 0.25  # seconds between checks that the client of a plain (not streamed) request is there


class _Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors: dict[int, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0

    def count(self, endpoint: str) -> None:
        with self.lock:
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def result(self, result: Result) -> None:
        with self.lock:
            self.prompt_tokens += result.n_prompt
            self.completion_tokens += result.n_decoded

    def error(self, status: int) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1


class Server:
    """The app's state: the backend (a Pool or a RayPool), the model's name and chat template, the API key,
    the metrics."""

    def __init__(self, pool: Pool | Any, *, model_name: str | None = None, chat_template: str | None = None,
                 chat_logit_bias: Mapping[int, float] | None = None, api_key: str | None = None) -> None:
        self.pool = pool
        self.backend = backend_of(pool)
        self.model_name = model_name or self.backend.model_path().rsplit("/", 1)[-1].removesuffix(".gguf")
        self.chat_template = chat_template
        self.chat_logit_bias = dict(chat_logit_bias or {})
        self.api_key = api_key
        self.metrics = _Metrics()

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


async def _submit(server: Server, prompt: str | list[int], gen: GenerateParams,
                  stream: AsyncStream | None) -> BatchRequest:
    on_piece = None if stream is None else stream._q.put
    handle = await asyncio.to_thread(server.backend.submit, prompt, gen, on_piece)
    if stream is not None:
        stream._interrupt = lambda _id: handle.interrupt()
        stream._attach(handle.future)
    return handle


async def _unless_gone(request: Request, handle: BatchRequest, server: Server) -> Result:
    """The request's Result; if the client disconnects first, the generation is interrupted."""
    waiting = asyncio.ensure_future(settle(handle.future, handle.interrupt))
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            handle.interrupt()
            with server.metrics.lock:
                server.metrics.disconnects += 1
            return await waiting


def _prompt_of(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise APIError(400, "prompt is a non-empty string or token list (one prompt per request)", param="prompt")


def _event_stream(server: Server, stream: AsyncStream, events: AsyncGenerator[bytes, None]) -> StreamingResponse:
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
            if not stream.done:
                stream.interrupt()  # the client left: free the slot
        yield schemas.sse("[DONE]")

    # No caching, and no buffering by a proxy in front (nginx's X-Accel-Buffering): each piece as it comes.
    return StreamingResponse(framed(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- routes ----------------------------------------------------------------------------------------------------
async def completions(request: Request, server: Server) -> Response:
    body = await _body(request)
    gen = schemas.generate_params(body, chat=False)
    wants_usage = schemas.include_usage(body)
    prompt = _prompt_of(body)
    reply = schemas.Reply("cmpl", server.model_name)
    if not body.get("stream"):
        result = await _unless_gone(request, await _submit(server, prompt, gen, None), server)
        server.metrics.result(result)
        return JSONResponse(schemas.completion(result, reply))
    stream = AsyncStream(lambda _id: None, asyncio.get_running_loop())
    await _submit(server, prompt, gen, stream)

    async def events() -> AsyncGenerator[bytes, None]:
        async for piece in stream:
            yield schemas.sse(schemas.completion_chunk(piece, reply))
        result = await stream.result()
        server.metrics.result(result)
        yield schemas.sse(schemas.completion_chunk("", reply, schemas.finish_reason(result)))
        if wants_usage:
            yield schemas.sse(reply.usage_chunk("text_completion", result))

    return _event_stream(server, stream, events())


async def chat_completions(request: Request, server: Server) -> Response:
    body = await _body(request)
    gen = schemas.generate_params(body, chat=True)
    wants_usage = schemas.include_usage(body)
    messages = schemas.messages_of(body)
    tools, tool_choice = schemas.tools_of(body)
    fmt = await asyncio.to_thread(server.backend.format_chat, messages, template=server.chat_template, tools=tools,
                                  tool_choice=tool_choice)
    gen = formatted_params(fmt, gen)
    if server.chat_logit_bias:  # the request's own bias on a token wins
        gen = dataclasses.replace(gen, logit_bias={**server.chat_logit_bias, **gen.logit_bias})
    reply = schemas.Reply("chatcmpl", server.model_name)

    async def parse(result: Result) -> Any:
        partial = result.stop_reason in ("length", "interrupted")
        return await asyncio.to_thread(server.backend.parse_chat, result.text, template=server.chat_template,
                                       tools=tools, messages=messages, tool_choice=tool_choice, partial=partial)

    if not body.get("stream"):
        result = await _unless_gone(request, await _submit(server, fmt.prompt, gen, None), server)
        server.metrics.result(result)
        return JSONResponse(schemas.chat_completion(await parse(result), result, reply))
    stream = AsyncStream(lambda _id: None, asyncio.get_running_loop())
    await _submit(server, fmt.prompt, gen, stream)
    whole = bool(tools) and tool_choice != "none"  # the text may be a call: it is parsed once whole

    async def events() -> AsyncGenerator[bytes, None]:
        yield schemas.sse(schemas.chat_chunk({"role": "assistant", "content": ""}, reply))
        async for piece in stream:
            if not whole:
                yield schemas.sse(schemas.chat_chunk({"content": piece}, reply))
        result = await stream.result()
        server.metrics.result(result)
        message = await parse(result)
        if whole:
            yield schemas.sse(schemas.chat_chunk(schemas.chat_delta(message), reply))
        yield schemas.sse(schemas.chat_chunk({}, reply, schemas.finish_reason(result, bool(message.tool_calls))))
        if wants_usage:
            yield schemas.sse(reply.usage_chunk("chat.completion.chunk", result))

    return _event_stream(server, stream, events())


async def embeddings(request: Request, server: Server) -> Response:
    body = await _body(request)
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


def _model_card(server: Server) -> dict[str, Any]:
    return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "lloyal_pool"}


async def models(request: Request, server: Server) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(server)]})


async def model(request: Request, server: Server) -> Response:
    """GET /v1/models/{model}: the served model under the name /v1/models lists (any name maps to it for
    generation, but only that one is a model to look up)."""
    if request.path_params["model"] != server.model_name:
        raise APIError(404, f"the model {request.path_params['model']!r} does not exist; this server serves "
                            f"{server.model_name!r}", param="model", code="model_not_found")
    return JSONResponse(_model_card(server))


async def health(request: Request, server: Server) -> Response:
    gauges = await asyncio.to_thread(server.backend.gauges)
    alive = sum(1 for g in gauges if g.alive)
    status = 200 if alive else 503
    return JSONResponse({"status": "ok" if alive else "unavailable", "workers": len(gauges),
                         "workers_alive": alive}, status_code=status)


async def metrics(request: Request, server: Server) -> Response:
    m = server.metrics
    lines = ["# TYPE lloyal_requests_total counter"]
    with m.lock:
        lines += [f'lloyal_requests_total{{endpoint="{k}"}} {v}' for k, v in sorted(m.requests.items())]
        lines += ["# TYPE lloyal_errors_total counter"]
        lines += [f'lloyal_errors_total{{status="{k}"}} {v}' for k, v in sorted(m.errors.items())]
        lines += ["# TYPE lloyal_prompt_tokens_total counter", f"lloyal_prompt_tokens_total {m.prompt_tokens}",
                  "# TYPE lloyal_completion_tokens_total counter",
                  f"lloyal_completion_tokens_total {m.completion_tokens}",
                  "# TYPE lloyal_client_disconnects_total counter", f"lloyal_client_disconnects_total {m.disconnects}"]
    lines += ["# TYPE lloyal_worker_alive gauge", "# TYPE lloyal_slots_active gauge",
              "# TYPE lloyal_requests_queued gauge"]
    for g in await asyncio.to_thread(server.backend.gauges):
        lines.append(f'lloyal_worker_alive{{worker="{g.worker}"}} {int(g.alive)}')
        if g.alive:
            lines.append(f'lloyal_slots_active{{worker="{g.worker}"}} {g.active}')
            lines.append(f'lloyal_requests_queued{{worker="{g.worker}"}} {g.queued}')
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def chat_page(request: Request, server: Server) -> Response:
    return HTMLResponse(resources.files(__package__).joinpath("chat.html").read_text(encoding="utf-8"))


def _route(path: str, fn: Callable[[Request, Server], Awaitable[Response]], server: Server, methods: list[str],
           name: str, auth: bool = True) -> Route:
    async def endpoint(request: Request) -> Response:
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
               chat_logit_bias: Mapping[int, float] | None = None, api_key: str | None = None) -> Starlette:
    """The ASGI app serving ``pool`` (a Pool, or a lloyal_pool.ray.RayPool), whose workers each hold the
    one model it serves (any ``model`` a
    request names maps to it; ``model_name`` is the id /v1/models shows, default the file's stem).
    ``chat_template``: a chat format name or Jinja source for models without one. ``chat_logit_bias``:
    added to every chat completion's logit bias, the request's own bias on a token winning (what
    ``lloyal-pool serve`` passes for a model without a template: session.chat_fallback). ``api_key``: every
    /v1 route then needs ``Authorization: Bearer <api_key>``."""
    server = Server(pool, model_name=model_name, chat_template=chat_template, chat_logit_bias=chat_logit_bias,
                    api_key=api_key)
    routes = [
        _route("/v1/completions", completions, server, ["POST"], "completions"),
        _route("/v1/chat/completions", chat_completions, server, ["POST"], "chat_completions"),
        _route("/v1/embeddings", embeddings, server, ["POST"], "embeddings"),
        _route("/v1/models", models, server, ["GET"], "models"),
        _route("/v1/models/{model:path}", model, server, ["GET"], "model"),
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
