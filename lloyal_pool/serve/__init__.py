"""An OpenAI-compatible HTTP endpoint over a Pool (``pip install lloyal_pool[serve]``): ``create_app`` for
an ASGI server of your own, or ``lloyal-pool serve`` (``run``) with uvicorn.

Starlette and uvicorn, because the endpoint needs routing, streaming responses and disconnect detection,
and nothing more: Starlette is the small ASGI toolkit FastAPI itself is built on (its one dependency is
anyio), uvicorn the ASGI server most deployments use. Request bodies are checked by the library's own
parameter checks (schemas.py), so no model-validation layer (pydantic) is needed on top.
"""

from __future__ import annotations

from .app import Server, create_app

__all__ = ["Server", "create_app"]
