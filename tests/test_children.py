"""The benches' child-process harness (acespec/bench/children.py), on real processes."""

from __future__ import annotations

import os
import sys
import time

import pytest

from acespec.bench.children import ChildProcesses, ChildStartError, spawn, stop_process, wait_for_line

PY = sys.executable


def _alive(pid: int) -> bool:
    """Running, not gone and not a zombie waiting for whoever adopted it to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_wait_for_line_returns_the_match_and_keeps_draining_the_childs_output():
    # the child writes far more than a pipe holds after its ready line: it finishes only if someone reads
    code = "import sys; print('listening on 127.0.0.1:4321', flush=True); sys.stdout.write('x' * 1_000_000); print()"
    with ChildProcesses() as kids:
        p = kids.start([PY, "-c", code])
        m = wait_for_line(p, r"listening on [\d.]+:(\d+)", 30, "the child")
        assert m.group(1) == "4321"
        assert p.wait(30) == 0


def test_a_child_that_exits_without_its_line_is_a_typed_error_with_its_last_words():
    with ChildProcesses() as kids:
        p = kids.start([PY, "-c", "print('bad flag --nope'); raise SystemExit(2)"])
        with pytest.raises(ChildStartError, match="bad flag --nope") as e:
            wait_for_line(p, r"listening on", 30, "the server")
        assert isinstance(e.value, OSError)  # the CLI reports OSErrors as one line


def test_a_silent_child_times_out():
    with ChildProcesses() as kids:
        p = kids.start([PY, "-c", "import time; time.sleep(30)"])
        t0 = time.monotonic()
        with pytest.raises(ChildStartError, match="did not start within 1 s"):
            wait_for_line(p, r"ready", 1, "the sleeper")
        assert time.monotonic() - t0 < 10


def test_stopping_reaches_the_whole_process_group_and_kills_a_child_that_ignores_sigterm(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # the child ignores SIGTERM and starts a grandchild (in its group) that ignores it too
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(g.pid)); print('up', flush=True); time.sleep(60)")
    kids = ChildProcesses(grace_s=0.5)
    p = kids.start([PY, "-c", code])
    wait_for_line(p, r"^up", 30, "the child")
    grandchild = int(pidfile.read_text())
    t0 = time.monotonic()
    kids.stop_all()
    assert p.returncode is not None and p.returncode < 0  # killed by a signal, not exited
    assert time.monotonic() - t0 < 20
    for _ in range(100):  # the grandchild was killed with the group; its parent is gone, so init reaps it
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_child_writing_to_a_log_file_is_stopped_and_its_exit_status_returned(tmp_path):
    log = tmp_path / "server.log"
    p = spawn([PY, "-c", "import time; print('started', flush=True); time.sleep(60)"], log=log)
    for _ in range(200):
        if log.exists() and "started" in log.read_text():
            break
        time.sleep(0.05)
    assert "started" in log.read_text()
    with pytest.raises(ValueError, match="not a pipe"):
        wait_for_line(p, "started", 1, "the logger")
    assert stop_process(p, grace_s=10) == -15  # SIGTERM was enough
