"""Command line: ``lloyal-pool generate PROMPT``, ``lloyal-pool chat``, ``lloyal-pool serve`` and
``lloyal-pool info`` (also ``python -m lloyal_pool``).

generate prints only the generated text on stdout, streamed as it is decoded; the load progress bar and
diagnostics go to stderr, so the output can be piped. chat reads one user turn per line from stdin and
streams each reply to stdout, one line per reply; Ctrl-C stops a reply, Ctrl-D (end of input) ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import __version__, variants
from .errors import LloyalError
from .model import Model
from .models import default_model_path
from .params import ContextParams, GenerateParams
from .pool import Pool
from .session import BASE_MODEL_END_BIAS, chat_fallback
from .stream import Stream


class _ProgressBar:
    """A bar on stderr (a tty; elsewhere just a line when done): fed a fraction (model loading) or
    (done, total) tokens (prompt evaluation, via .tokens)."""

    def __init__(self, label: str, width: int = 30) -> None:
        self.label = label
        self.width = width
        self.tty = sys.stderr.isatty()
        self.done = False

    def tokens(self, done: int, total: int) -> None:
        self(done / total if total else 1.0, f" {done}/{total} tokens")

    def __call__(self, fraction: float, detail: str = "") -> None:
        if self.done:
            return
        if self.tty:
            filled = int(self.width * fraction)
            bar = "#" * filled + "-" * (self.width - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {fraction * 100:5.1f}%{detail}")
            sys.stderr.flush()
        if fraction >= 1.0:
            self.done = True
            sys.stderr.write("\r\033[K" if self.tty else f"{self.label}: done\n")
            sys.stderr.flush()


def _model_path(arg: str | None) -> Path:
    return Path(arg) if arg else default_model_path()


def _cmd_generate(args: argparse.Namespace) -> int:
    path = _model_path(args.model)
    params = GenerateParams(n_predict=args.n_predict, temperature=args.temperature, seed=args.seed,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                            stop=tuple(args.stop or ()))
    with Pool(1, variant=args.variant, cpu=args.cpu) as pool:
        model = pool[0].load_model(path, progress=_ProgressBar(f"loading {path.name}") if not args.quiet else None)
        ctx = model.new_context(ContextParams(n_ctx=args.n_ctx, n_threads=args.threads))
        prompt = Path(args.file).read_text() if args.file else args.prompt
        if prompt is None:
            raise SystemExit("lloyal-pool generate: give a PROMPT or --file")
        bar = None if args.quiet else _ProgressBar("prompt").tokens
        stream = ctx.stream(prompt, params, progress=bar)
        with _ctrl_c_interrupts(stream):
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        result = stream.result
        sys.stdout.write("\n")
        if args.verbose:
            print(f"[{result.n_prompt} prompt tokens in {result.prompt_ms:.0f} ms, {result.n_decoded} tokens in "
                  f"{result.decode_ms:.0f} ms ({result.decode_tokens_per_second:.1f} tok/s), "
                  f"stop: {result.stop_reason.value}]", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    path = _model_path(args.model)
    with Pool(1, variant=args.variant, cpu=args.cpu) as pool:
        model = pool[0].load_model(path, progress=_ProgressBar(f"loading {path.name}") if not args.quiet else None)
        ctx = model.new_context(ContextParams(n_ctx=args.n_ctx, n_threads=args.threads))
        template = args.template
        end_bias = args.end_bias
        tokenize = _special_tokenizer(model)
        bias: dict[int, float] = {}
        if template is None and model.info.chat_template is None:
            fallback = chat_fallback(tokenize, BASE_MODEL_END_BIAS if end_bias is None else end_bias)
            template, bias = fallback.template, fallback.logit_bias
            print(f"lloyal-pool chat: {path.name} has no chat template: using {fallback} (--template to choose "
                  "another, --end-bias)", file=sys.stderr)
        elif end_bias:
            end = tokenize("<end_of_turn>")
            if len(end) != 1:
                raise SystemExit("lloyal-pool chat: --end-bias needs a vocabulary with an <end_of_turn> token")
            bias[end[0]] = end_bias
        session = ctx.chat(args.system, template=template, n_predict=args.n_predict,
                           temperature=args.temperature, seed=args.seed, top_k=args.top_k, top_p=args.top_p,
                           min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                           repeat_last_n=args.repeat_last_n, stop=tuple(args.stop or ()), logit_bias=bias)
        interactive = sys.stdin.isatty()
        while True:
            try:
                line = input("> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            except KeyboardInterrupt:
                sys.stdout.write("\n")  # Ctrl-C at the prompt drops the line; Ctrl-D ends
                continue
            if not interactive and not line:
                break
            text = line.strip()
            if not text:
                continue
            stream = session.stream(text)
            with _ctrl_c_interrupts(stream):  # the reply stops where it is and stays in the conversation
                for piece in stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            result = stream.reply.result
            sys.stdout.write("\n")
            sys.stdout.flush()
            if result.interrupted:
                print("[interrupted]", file=sys.stderr)
            if args.verbose:
                print(f"[{result.n_prompt} prompt tokens, {result.n_cached} reused; {result.n_decoded} tokens in "
                      f"{result.decode_ms:.0f} ms; stop: {result.stop_reason.value}]", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _ctrl_c_interrupts(stream: Stream) -> Iterator[None]:
    """While the block runs, Ctrl-C (SIGINT) interrupts ``stream`` and the program goes on. A handler
    rather than catching KeyboardInterrupt: that exception is raised wherever the main thread happens to
    be, which may be a __del__ or a callback where Python swallows it, and the Ctrl-C is then lost. The
    handler itself runs at such a place too, perhaps inside a lock that interrupt() takes: it hands the
    interrupt to a thread."""
    def handler(signum: int, frame: object) -> None:
        threading.Thread(target=stream.interrupt, name="lloyal-ctrl-c", daemon=True).start()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _cmd_info(args: argparse.Namespace) -> int:
    path = _model_path(args.model)
    with Pool(1, variant=args.variant, cpu=args.cpu) as pool:
        inst = pool[0]
        model = inst.load_model(path, vocab_only=args.vocab_only)
        info = model.info.to_dict()
        if not args.meta:
            info.pop("meta", None)
        out = {"path": str(path), **info, "worker": {"variant": inst.variant, "cpu_kernels": inst.cpu_kernels,
                                                     "cpu_levels": variants.installed_cpu_levels(),
                                                     "build": inst.build_info}}
    print(json.dumps(out, indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .serve import create_app
    except ImportError as exc:
        raise SystemExit(f"lloyal-pool serve needs the serve extra: pip install 'lloyal_pool[serve]' ({exc})") from None
    if args.ray is not None:
        if args.lora:
            raise SystemExit("lloyal-pool serve: --lora serves adapters from workers on this machine, not --ray")
        if args.deterministic:
            raise SystemExit("lloyal-pool serve: --deterministic runs workers on this machine, not --ray")
        if args.preempt_slots:
            raise SystemExit("lloyal-pool serve: --preempt-slots runs workers on this machine, not --ray")
        return _serve_on_ray(args, uvicorn.run, create_app)
    path = _model_path(args.model)
    loras = _serve_loras(args, path)
    with Pool(args.workers, variant=args.variant, cpu=args.cpu, threads_per_worker=args.threads) as pool:
        for inst in pool:
            # Batch invariance needs the weights as the file has them (no repacking): Batcher's docstring.
            model = inst.load_model(path, repack=not args.deterministic)
            model.batcher(slots=args.slots, n_ctx_slot=args.n_ctx_slot, deterministic=args.deterministic,
                          preempt_slots=args.preempt_slots)
        template, bias = _serve_template(args, path.name, model.info.chat_template is not None,
                                         _special_tokenizer(model))
        # Every worker's model loads the adapters here (LoraError, naming the adapter, for a bad one).
        app = create_app(pool, model_name=args.name, chat_template=template, chat_logit_bias=bias,
                         api_key=args.api_key, lora=loras, **_max_tokens(args))
        with_loras = f" with LoRA adapters {', '.join(name for name, _ in loras)}" if loras else ""
        mode = (", deterministic" if args.deterministic else "") + (
            f", {args.preempt_slots} slot(s) for preemption" if args.preempt_slots else "")
        print(f"lloyal-pool serve: {path.name} on {args.workers} worker(s){with_loras}{mode}, "
              f"http://{args.host}:{args.port}/", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _serve_on_ray(args: argparse.Namespace, run: Any, create_app: Any) -> int:
    """serve --ray: the workers are actors of a Ray cluster (lloyal_pool.ray); -m is found on each node."""
    try:
        import ray

        from .ray import RayPool
    except ImportError as exc:
        raise SystemExit(f"lloyal-pool serve --ray needs the ray extra: pip install 'lloyal_pool[ray]' ({exc})") \
            from None
    ray.init(address=args.ray or None, log_to_driver=False)
    threads = args.threads or 1
    options = {name: value for name, value in (("variant", args.variant), ("cpu", args.cpu)) if value}
    with RayPool(args.workers, args.model, num_cpus=threads, threads_per_worker=threads, slots=args.slots,
                 n_ctx_slot=args.n_ctx_slot, pool_options=options or None) as pool:
        first = pool[0]
        name = first.model_path.rsplit("/", 1)[-1]
        template, bias = _serve_template(args, name, first.has_chat_template,
                                         lambda text: ray.get(first.actor.tokenize.remote(text, False, True)))
        app = create_app(pool, model_name=args.name, chat_template=template, chat_logit_bias=bias,
                         api_key=args.api_key, **_max_tokens(args))
        nodes = len({w.node_id for w in pool})
        print(f"lloyal-pool serve: {name} on {args.workers} Ray actor(s) on {nodes} node(s), "
              f"http://{args.host}:{args.port}/", file=sys.stderr)
        run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _lora_arg(text: str) -> tuple[str, str]:
    """--lora's value: NAME=PATH, or PATH (named by the file's stem; a path that exists is a path, even
    with an = in it)."""
    name, sep, path = text.partition("=")
    if not sep or os.path.exists(text):
        name, path = Path(text).stem, text
    return name, path


def _serve_loras(args: argparse.Namespace, model: Path) -> list[tuple[str, str]]:
    """--lora's adapters as (name, path), checked before any worker starts: the names unique and not the
    model's, each file there (llama.cpp checks the rest when every worker loads them)."""
    from .serve.backend import served_loras

    pairs = [_lora_arg(text) for text in args.lora or ()]
    try:
        adapters = served_loras(pairs)
    except ValueError as exc:
        raise SystemExit(f"lloyal-pool serve: --lora: {exc}") from None
    model_name = args.name or model.name.removesuffix(".gguf")
    for a in adapters:
        if a.name == model_name:
            raise SystemExit(f"lloyal-pool serve: --lora: the adapter {a.path} is named {a.name!r}, as the model is: "
                             f"name it apart (--lora NAME=PATH) or the model (--name)")
        if not os.path.isfile(a.path):
            raise SystemExit(f"lloyal-pool serve: --lora {a.name}={a.path}: no such file")
    return pairs


def _max_tokens(args: argparse.Namespace) -> dict[str, int]:
    """create_app's max_tokens, where --max-tokens gave one (else its default)."""
    if args.max_tokens is not None and args.max_tokens < 0:
        raise SystemExit(f"lloyal-pool serve: --max-tokens is 0 (no cap) or more, got {args.max_tokens}")
    return {} if args.max_tokens is None else {"max_tokens": args.max_tokens}


def _serve_template(args: argparse.Namespace, name: str, has_template: bool,
                    tokenize: Callable[[str], list[int]]) -> tuple[str | None, dict[int, float]]:
    """--template, or for a model without a chat template of its own the fallback (session.chat_fallback):
    the format its tokens suggest, and the bias that makes a base model end its turns."""
    if args.template is not None:
        return str(args.template), {}
    if has_template:
        return None, {}
    fallback = chat_fallback(tokenize)
    print(f"lloyal-pool serve: {name} has no chat template: chats use {fallback} (--template to choose another)",
          file=sys.stderr)
    return fallback.template, fallback.logit_bias


def _special_tokenizer(model: Model) -> Callable[[str], list[int]]:
    return lambda text: model.tokenize(text, add_special=False, parse_special=True)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """What generate and chat both take: sampling, stop strings, context size, threads."""
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=0.0)
    p.add_argument("--repeat-last-n", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("-c", "--n-ctx", type=int, default=4096)
    p.add_argument("-t", "--threads", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lloyal-pool", description="crash-isolated llama.cpp inference")
    ap.add_argument("--version", action="version", version=f"lloyal_pool {__version__}")
    ap.add_argument("--variant", default=None, help="GPU backend: cuda, vulkan, auto, or cpu (the default)")
    ap.add_argument("--cpu", default=None, metavar="LEVEL",
                    help="the level of CPU kernels, e.g. haswell (default: LLOYAL_POOL_CPU, else auto: the best "
                    "this CPU runs; `lloyal-pool info` shows the one chosen and the levels installed)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text; only the text goes to stdout")
    g.add_argument("prompt", nargs="?", help="the prompt (or --file)")
    g.add_argument("-f", "--file", help="read the prompt from this file")
    g.add_argument("-m", "--model", help="GGUF file (default: Gemma 3 270M Q4_K_M)")
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (<= 0: until full)")
    _sampling_args(g)
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars (model load, prompt)")
    g.add_argument("-v", "--verbose", action="store_true", help="timings on stderr")
    g.set_defaults(fn=_cmd_generate)

    c = sub.add_parser("chat", help="chat: a user turn per line on stdin, each reply streamed to stdout")
    c.add_argument("-m", "--model", help="GGUF file (default: Gemma 3 270M Q4_K_M)")
    c.add_argument("--template", help="a chat format (gemma, chatml, llama3) or Jinja source; default: the "
                   "model's own, or gemma for a model without one")
    c.add_argument("--system", help="a system message to start the conversation with")
    c.add_argument("--end-bias", type=float, default=None,
                   help=f"logit bias on <end_of_turn> (default {BASE_MODEL_END_BIAS:g} when falling back to the "
                   "Gemma format, else 0)")
    c.add_argument("-n", "--n-predict", type=int, default=256, help="most tokens per reply (<= 0: no limit)")
    _sampling_args(c)
    c.add_argument("-q", "--quiet", action="store_true", help="no model loading bar")
    c.add_argument("-v", "--verbose", action="store_true", help="tokens and timings of each reply on stderr")
    c.set_defaults(fn=_cmd_chat)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP endpoint (needs lloyal_pool[serve])")
    s.add_argument("-m", "--model", help="GGUF file (default: Gemma 3 270M Q4_K_M)")
    s.add_argument("--workers", type=int, default=1, help="worker processes, each serving the model")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: localhost only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer <key> on every route but /health, /metrics and /")
    s.add_argument("--name", default=None, help="the model id /v1/models shows (default: the file's stem)")
    s.add_argument("--template", help="chat format or Jinja source for a model without a chat template")
    s.add_argument("--slots", type=int, default=8, help="requests each worker runs at once")
    s.add_argument("--n-ctx-slot", type=int, default=2048, help="tokens of room per request")
    s.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="most tokens of a chat reply whose request sets no max_tokens (default 1024; 0: until the "
                        "slot is full); a completion's default stays OpenAI's 16, or N if smaller")
    s.add_argument("-t", "--threads", type=int, default=None, help="threads per worker")
    s.add_argument("--deterministic", action="store_true",
                   help="a request's tokens do not depend on the other requests batched with it (bit for bit what "
                   "it gives alone; slower, CPU workers only, no prefix copies between slots)")
    s.add_argument("--preempt-slots", type=int, default=0, metavar="N",
                   help="N slots more per worker, for preemption: a request of a lower priority value that finds "
                   "every slot busy pauses the lowest-ranked running one, which goes on once a request ends")
    s.add_argument("--lora", action="append", metavar="[NAME=]PATH",
                   help="a LoRA adapter GGUF every worker's model loads (repeatable; ids 0, 1, ... in this order). "
                   "A request runs it when its model is NAME (default: the file's stem) or its lora field "
                   "lists the id; others get the base model")
    s.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the workers as actors of a Ray cluster (needs lloyal_pool[ray]): its address, or none "
                   "for Ray's default (RAY_ADDRESS, a cluster running here, else a new local one); -m is then "
                   "a path on each node")
    s.set_defaults(fn=_cmd_serve)

    i = sub.add_parser("info", help="model info as JSON")
    i.add_argument("-m", "--model", help="GGUF file (default: Gemma 3 270M Q4_K_M)")
    i.add_argument("--vocab-only", action="store_true")
    i.add_argument("--meta", action="store_true", help="include every GGUF metadata key")
    i.set_defaults(fn=_cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Worker logs (llama.cpp's warnings among them) are for -v; errors always show, and so do the pool's
    # warnings (a GPU variant asked for that fell back to the CPU).
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not verbose:
        logging.getLogger("lloyal_pool.worker").setLevel(logging.ERROR)
    try:
        return int(args.fn(args))
    except LloyalError as exc:
        print(f"lloyal-pool: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
