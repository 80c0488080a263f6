"""An app of lloyal_pool.serve on uvicorn, on a free localhost port, in a thread of the test process."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai
import uvicorn

from lloyal_pool.serve import create_app

PATIENCE = 120.0  # a guard against hanging forever, never a timing assertion
TEMPLATE = "gemma"  # Gemma 3 270M's file has no chat template


class Served:
    def __init__(self, pool: Any, chat_template: str = TEMPLATE, **options: Any) -> None:  # a Pool or a RayPool
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(pool, chat_template=chat_template, **options)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + PATIENCE
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=PATIENCE)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(PATIENCE)




def chat_with_the_serve_command(args: list[str]) -> str:
    """Starts ``lloyal-pool serve`` with ``args`` (and a free port, an API key), waits for /health, has
    a short greedy chat with it, stops it; returns what it printed on stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lloyal_pool", "serve", *args, "--port", str(port),
                             "--api-key", "k"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + PATIENCE
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the server never answered"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=PATIENCE)
        reply = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].message.role == "assistant" and reply.usage and reply.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=PATIENCE)
    assert f"127.0.0.1:{port}" in err
    return err
