"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages ending in a NUL byte, ours on its fd 3, its on fd 4), so a test can use a page as a person
would without a WebDriver or a websocket library. The test command (scripts/test) installs Debian's
chromium-headless-shell where it may run apt-get."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

BINARIES = ("chromium-headless-shell", "chromium", "chromium-browser")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, BINARIES) if path), None)


class Browser:
    """One page in a fresh headless Chromium. ``evaluate`` runs JavaScript in it and returns the value."""

    def __init__(self, binary: str, width: int = 900, height: int = 640, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="lloyal-chromium-")
        self._log = open(os.path.join(self._profile.name, "stderr.log"), "w+b")  # noqa: SIM115 (closed in close())
        to_chrome, self._out = os.pipe()
        self._in, from_chrome = os.pipe()
        # bash puts the pipe ends on the fds Chromium reads and writes (dash takes single-digit fds only;
        # this needs no preexec_fn).
        script = f'exec "$@" 3<&{to_chrome} 4>&{from_chrome} {to_chrome}<&- {from_chrome}>&-'
        # --no-sandbox: the tests run as root in CI, where Chromium's own sandbox refuses to start.
        args = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}",
                "about:blank"]
        self._proc = subprocess.Popen(["bash", "-c", script, "bash", *args], pass_fds=(to_chrome, from_chrome),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer = b""
        self._next_id = 0
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:  # events arrive between the replies; only our reply matters here
            while b"\0" not in self._buffer:
                assert time.monotonic() < deadline, f"Chromium did not answer {method}"
                chunk = os.read(self._in, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium exited: {self._stderr_tail()}")
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(line)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def page(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return self._call(method, params, self._session)

    def navigate(self, url: str) -> None:
        self.page("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def evaluate(self, expression: str) -> Any:
        result = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"the page never made {expression!r} true"
            time.sleep(0.05)
        return value

    def screenshot(self) -> bytes:
        return base64.b64decode(self.page("Page.captureScreenshot", {"format": "png"})["data"])

    def _stderr_tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def close(self) -> None:
        try:
            self._call("Browser.close")
        except (OSError, RuntimeError, AssertionError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._out)
        os.close(self._in)
        self._log.close()
        self._profile.cleanup()
