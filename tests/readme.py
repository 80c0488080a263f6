"""The README's examples, run as written: documentation that does not run is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def run_section(title: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs the first ```python block after the heading ``title`` in a fresh interpreter."""
    text = README.read_text()
    section = text[text.index(title):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```\n", start)]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
