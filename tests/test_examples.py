"""Every example runs, on the default model, with small settings: the examples are documentation, and
documentation that does not run is wrong."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

CASES = {
    "best_of_n": (["-n", "3", "-t", "12"], "best (ppl"),
    "embed": ([], "nearest to 0: 1 ("),
    "speculative": (["-k", "3", "-t", "16"], "tokens per target step"),
    "entropy": (["-t", "20"], "explored"),
    "grammar": (["-n", "2"], "fork 1:"),
    "snapshot": (["-n", "2", "-t", "8"], "Q: Where is the cafe? ->"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name: str, gemma_path: Path) -> None:
    args, expect = CASES[name]
    script = EXAMPLES / name / f"{name}.py"
    assert (EXAMPLES / name / "README.md").exists()
    out = subprocess.run([sys.executable, str(script), "-m", str(gemma_path), *args], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout, out.stdout[-2000:]


STREAMING = ["-t", "160", "--n-ctx", "96", "--tail", "24", "--summary-tokens", "24"]


def test_streaming_example_summarizes_what_it_evicts(gemma_path: Path) -> None:
    # Only what holds on every CPU: reseeds happen, each one (with the sidecar) prints a non-empty
    # summary of bounded size that goes into the cache, and --no-summary prints none. Never the words.
    script = EXAMPLES / "streaming" / "streaming.py"
    assert (EXAMPLES / "streaming" / "README.md").exists()

    def run(*extra: str) -> tuple[str, list[re.Match[str]], list[re.Match[str]], re.Match[str]]:
        out = subprocess.run([sys.executable, str(script), "-m", str(gemma_path), *STREAMING, *extra],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        summaries = list(re.finditer(r"^\[summary (\d+): (\d+) tokens of (\d+) evicted, [\d.]+ s\] (.*)$",
                                     out.stdout, re.M))
        reseeds = list(re.finditer(r"^--- reseed (\d+): segment perplexity [\d.]+, cache 4\+(\d+)\+24 tokens",
                                   out.stdout, re.M))
        final = re.search(r"(\d+) reseeds, (\d+) summaries", out.stdout)
        assert final, out.stdout[-2000:]
        return out.stdout, summaries, reseeds, final

    stdout, summaries, reseeds, final = run()
    assert len(reseeds) >= 1 and int(final[1]) == len(reseeds), stdout[-2000:]
    assert len(summaries) == len(reseeds) == int(final[2]), stdout[-2000:]
    for s, r in zip(summaries, reseeds, strict=True):
        assert s[4].strip(), s[0]  # non-empty text
        assert 1 <= int(s[2]) <= 24 and int(s[3]) > 0, s[0]
        assert 0 < int(r[2]) <= 24, r[0]  # the summary, markers included, within its cap, in the cache

    stdout, summaries, reseeds, final = run("--no-summary")
    assert len(reseeds) >= 1 and int(final[2]) == 0, stdout[-2000:]
    assert summaries == [] and "[summary" not in stdout
    assert all(r[2] == "0" for r in reseeds)


README = EXAMPLES.parent / "README.md"


def test_the_readme_tour_runs_as_written(gemma_path: Path) -> None:
    # The tour is the first thing a new user runs; run as written, it must work and do what it says.
    text = README.read_text()
    tour = text[text.index("## A short tour"):]
    code = tour[tour.index("```python\n") + len("```python\n"):tour.index("```\n", tour.index("```python\n") + 10)]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == ""  # quiet: no native warnings on stderr
    # Each report on a line of its own (progress and streamed pieces are ended), and what it reports true.
    lines = out.stdout.splitlines()  # the progress's \r reads as a line break here (universal newlines)
    progress = [x for x in lines if "loading" in x]
    assert progress[-1] == "loading 100%" and all(re.fullmatch(r"loading \d+%", x) for x in progress)
    reused = next(re.fullmatch(r"(\d+) of (\d+) prompt tokens reused", x) for x in lines if "reused" in x)
    assert reused and 0 < int(reused[1]) < int(reused[2])
    appended = next(re.fullmatch(r"(\d+) tokens appended to the (\d+) the context held", x)
                    for x in lines if "appended" in x)
    assert appended and int(appended[2]) > int(reused[2])
    turn = next(re.fullmatch(r"second turn: (\d+) of (\d+) tokens of the conversation reused", x)
                for x in lines if "second turn" in x)
    assert turn and 0 < int(turn[1]) < int(turn[2])


def test_chat_example_runs_from_stdin(gemma_path: Path) -> None:
    script = EXAMPLES / "chat" / "chat.py"
    assert (EXAMPLES / "chat" / "README.md").exists()
    out = subprocess.run([sys.executable, str(script), "-m", str(gemma_path), "-n", "16"],
                         input="Hello, I am Ada.\nDo you remember my name?\n", capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    replies = [line for line in out.stdout.splitlines() if line.startswith("model> ")]
    stats = [line for line in out.stdout.splitlines() if line.startswith("  [")]
    assert len(replies) == 2 and "Ada" in replies[1]
    assert ", 0 reused" in stats[0]
    assert " 0 reused" not in stats[1]  # the second turn reuses the first from the cache
    assert out.stdout.rstrip().endswith("4 messages")
