"""The command line: generate prints only the generated text; chat streams replies to turns read from
stdin; info prints JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from lloyal_pool import Model
from lloyal_pool.cli import BASE_MODEL_END_BIAS


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lloyal_pool", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_only_the_text(gemma: Model) -> None:
    out = _run("generate", "-n", "16", "The capital of France is")
    assert out.returncode == 0, out.stderr
    ctx = gemma.new_context(n_ctx=4096)
    try:
        expected = ctx.generate("The capital of France is", n_predict=16).text
    finally:
        ctx.close()
    assert out.stdout == expected + "\n"


def test_generate_with_a_model_path_and_sampling(tiny_model: Path) -> None:
    a = _run("generate", "-m", str(tiny_model), "-n", "8", "--temperature", "0.8", "--seed", "3", "-q", "Hi")
    b = _run("generate", "-m", str(tiny_model), "-n", "8", "--temperature", "0.8", "--seed", "3", "-q", "Hi")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_info_prints_json(gemma_path: Path) -> None:
    out = _run("info")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["n_vocab"] == 262144 and info["path"] == str(gemma_path)
    assert info["worker"]["variant"] == "cpu" and info["worker"]["build"]["llama_cpp"]


def test_a_gpu_variant_that_cannot_load_is_a_warning_and_the_cpu_generates(tiny_model: Path) -> None:
    # No Vulkan backend is ever built here: the worker falls back, and the user is told so.
    out = _run("--variant", "vulkan", "generate", "-m", str(tiny_model), "-n", "4", "-q", "Hi")
    assert out.returncode == 0, out.stderr
    assert "requested native variant 'vulkan' unavailable, running 'cpu'" in out.stderr, out.stderr
    assert out.stdout == _run("generate", "-m", str(tiny_model), "-n", "4", "-q", "Hi").stdout


def test_bad_model_is_a_clean_error(tmp_path: Path) -> None:
    out = _run("info", "-m", str(tmp_path / "missing.gguf"))
    assert out.returncode == 1
    assert "ModelLoadError" in out.stderr and "Traceback" not in out.stderr


def test_the_client_never_loads_llama_cpp(tiny_model: Path) -> None:
    code = (
        "import sys\n"
        "from lloyal_pool import Pool\n"
        "with Pool(1) as pool:\n"
        f"    ctx = pool[0].load_model({str(tiny_model)!r}).new_context(n_ctx=64)\n"
        "    ctx.generate('Hi', n_predict=2)\n"
        "    ctx.logits()\n"
        "bad = [m for m in sys.modules if '_native' in m]\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert not bad, bad\n"
        "assert 'libllama' not in maps and 'libggml' not in maps and '_native.' not in maps\n"
        "print('clean')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr


def test_generate_reads_a_prompt_file_and_shows_its_progress(tmp_path: Path, tiny_model: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time " * 100)
    out = _run("generate", "-m", str(tiny_model), "-n", "4", "-f", str(prompt))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "prompt: done" in out.stderr  # the bar, as it ends when stderr is not a terminal
    quiet = _run("generate", "-m", str(tiny_model), "-n", "4", "-q", "-f", str(prompt))
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == out.stdout


def test_chat_streams_each_reply_on_a_line_in_the_gemma_format(gemma: Model) -> None:
    turns = ["Hello, I am Ada.", "Do you remember my name?"]
    out = subprocess.run([sys.executable, "-m", "lloyal_pool", "chat", "-q", "-n", "16", "-c", "1024"],
                         input="".join(t + "\n" for t in turns), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # The default model's file has no template: the CLI says which format it uses instead.
    assert "has no chat template: using the gemma format" in out.stderr
    ctx = gemma.new_context(n_ctx=1024)
    try:
        (eot,) = gemma.tokenize("<end_of_turn>", add_special=False, parse_special=True)
        session = ctx.chat(template="gemma", n_predict=16, logit_bias={eot: BASE_MODEL_END_BIAS})
        expected = [session.send(t).text for t in turns]
    finally:
        ctx.close()
    assert out.stdout == "".join(r + "\n" for r in expected)
    assert "Ada" in expected[1]


def test_chat_ctrl_c_stops_the_reply_not_the_program(tiny_model: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "lloyal_pool", "chat", "-m", str(tiny_model), "--template",
                             "chatml", "-q", "-v", "-n", "3000", "-c", "4096"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b"Tell me a long story.\n")
        # The reply has started streaming. It is long (3000 tokens, seconds), so that the signal comes
        # before its end even on a busy machine (300 tokens took 0.3 s: a descheduled test missed them).
        first = os.read(proc.stdout.fileno(), 1)
        assert first
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends (the workers are in their own session)
        # A second turn, then the end of input: the program ends after that turn.
        _, err = proc.communicate(b"Hi\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    log = err.decode()
    assert log.count("[interrupted]") == 1, log[-4000:]
    stats = [line for line in log.splitlines() if line.endswith(("stop: interrupted]", "stop: length]",
                                                                  "stop: eos]"))]
    assert len(stats) == 2 and stats[0].endswith("stop: interrupted]")  # the second turn was served


def test_sampling_flags_change_the_output(tiny: Model, tiny_model: Path) -> None:
    """Each flag reaches the sampler: the command prints what the library generates with the same
    parameters, and those outputs differ where the parameters should make them differ."""
    prompt = "orders capabilities Once upon a time"  # its greedy continuation starts with a token it holds
    ctx = tiny.new_context(n_ctx=4096, n_threads=1)
    try:
        def library(**params: object) -> str:
            return ctx.generate(prompt, n_predict=12, ignore_eos=False, **params).text  # type: ignore[arg-type]

        greedy = library()
        hot = {"temperature": 1.5, "seed": 3}
        cases = [
            ([], {}),
            (["--temperature", "1.5", "--seed", "3"], hot),
            (["--temperature", "1.5", "--seed", "4"], {"temperature": 1.5, "seed": 4}),
            (["--temperature", "1.5", "--seed", "3", "--top-k", "1"], {**hot, "top_k": 1}),
            (["--temperature", "1.5", "--seed", "3", "--top-p", "0.0001"], {**hot, "top_p": 0.0001}),
            (["--temperature", "1.5", "--seed", "3", "--min-p", "0.9999"], {**hot, "min_p": 0.9999}),
            (["--repeat-penalty", "3", "--repeat-last-n", "64"], {"repeat_penalty": 3.0, "repeat_last_n": 64}),
        ]
        expected = [library(**params) for _, params in cases]
    finally:
        ctx.close()
    # The parameters matter here: sampling hot differs from greedy and by seed, a truncation to the top
    # token brings back the greedy text, and the repeat penalty (over the prompt too) changes it.
    assert expected[0] == greedy and len({greedy, expected[1], expected[2]}) == 3
    assert expected[3] == expected[4] == expected[5] == greedy
    assert expected[6] != greedy
    for (flags, _), want in zip(cases, expected, strict=True):
        out = _run("generate", "-m", str(tiny_model), "-n", "12", "-t", "1", "-q", *flags, prompt)
        assert out.returncode == 0, out.stderr
        assert out.stdout == want + "\n", flags
