"""Child processes of the benches (and of `acespec demo`): start them, read the line that says they are up,
and stop every one of them whatever happens.

Each child runs in its own process group (its own session), so stopping it also stops what it started
(vLLM's workers, a profiler's child) and a Ctrl-C at the terminal reaches only the parent, which then
stops its children in order. Stopping is SIGTERM to the group, a grace period for a clean exit (a server
finishes the verdicts it owes), then SIGKILL; the child is reaped either way.

    with ChildProcesses() as kids:
        cloud = kids.start([sys.executable, "-m", "acespec.cli", "serve", "--port", "0"])
        port = int(wait_for_line(cloud, r"listening on [\\d.]+:(\\d+)", 60, "the cloud").group(1))
        ...
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType


class ChildStartError(OSError):
    """A child process exited or stayed silent before printing the line that says it is up. An OSError, so
    the CLI reports it as a one-line error like any other failure to start a process."""


def spawn(argv: list[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start `argv` in its own process group. Its stdout and stderr go, merged, to a pipe (read it with
    `wait_for_line`, which keeps draining it) or, with `log`, appended to that file: a pipe that nobody
    reads fills up and blocks the child, so a child whose output is not read must write to a file."""
    if log is None:
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
    with open(log, "ab") as out:  # the child keeps its own descriptor; ours closes now
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """`sig` to the child's process group when it leads one (started by `spawn`), else to the child alone."""
    if p.poll() is not None:
        return
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
    except ProcessLookupError:  # exited between the poll and the signal
        pass


def stop_process(p: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    """SIGTERM to the child's group, SIGKILL if it has not exited within `grace_s`; reaped either way.
    Returns its exit status."""
    stop_all([p], grace_s)
    return p.returncode


def stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Stop several children at once: all are asked to exit first, so their grace periods overlap."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait(30)
        _kill_stragglers(p)


def _kill_stragglers(p: subprocess.Popen) -> None:
    """Once a group's leader (a `spawn`ed child) has exited, whatever it started in its group and left
    behind goes too: a leader that exits on SIGTERM does not wait for its own children, and on a loaded
    machine they can outlive the run that started them."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no such group left: nothing stayed behind
        pass


class ChildProcesses:
    """The children of one run: each started with `spawn`, all stopped by `stop_all` (or on leaving a
    `with` block, exception or not)."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.procs: list[subprocess.Popen] = []
        self.grace_s = grace_s

    def start(self, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
        p = spawn(argv, env=env, log=log)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        stop_all(self.procs, self.grace_s)

    def __enter__(self) -> ChildProcesses:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()


def wait_for_line(p: subprocess.Popen, pattern: str, timeout: float, what: str) -> re.Match:
    """Read the child's output until a line matches `pattern` and return the match; keep draining the
    output afterwards (in a daemon thread) so the child never blocks on a full pipe. ChildStartError,
    with the last lines it printed, if it exits or `timeout` seconds pass first."""
    if p.stdout is None:
        raise ValueError(f"{what}: its output is not a pipe (started with a log file?)")
    stdout = p.stdout
    rx = re.compile(pattern)
    found: list[re.Match] = []
    seen: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in stdout:
            if not ready.is_set():
                seen.append(line.rstrip())
                m = rx.search(line)
                if m:
                    found.append(m)
                    ready.set()
        ready.set()  # end of output: the child exited

    threading.Thread(target=pump, daemon=True, name=f"output of {what}").start()
    if not ready.wait(timeout) or not found:
        tail = "\n  ".join(seen[-10:]) or "(no output)"
        raise ChildStartError(f"{what} did not start within {timeout:.0f} s:\n  {tail}")
    return found[0]
