"""Whether a drafter on the other core slows the target's steps: the cost of drafts nobody verifies.

The target (the default pair's 1.5B, one thread) takes one-token steps on CPU 0 after a 300-token
prompt, with CPU 1 idle, then busy with the 0.5B drafter taking its own steps, then busy with a spin
loop (no memory traffic), then idle again. A slower step with the drafter than with the spin loop is
what the cores share besides themselves (memory bandwidth, caches): on 2 cores of an AMD EPYC (Zen 3)
under KVM it printed 57.6, 60.5, 58.6 and 56.2 ms (docs/design-notes.md, the uplink's remembered rest).

    .venv/bin/python scripts/drafter_contention.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

os.environ["ACESPEC_THREADS"] = "1"

from acespec.models import load_model  # noqa: E402 - after the thread count is set
from acespec.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402


def drafter_forever() -> None:
    """The drafter's work on CPU 1: a short prompt, then one-token steps, over and over."""
    os.sched_setaffinity(0, {1})
    m = load_model(DEFAULT_DRAFT, n_ctx=2048)
    while True:
        m.reset()
        m.eval(list(range(100, 120)))
        for i in range(200):
            m.eval([100 + i % 50])


def main() -> None:
    os.sched_setaffinity(0, {0})
    target = load_model(DEFAULT_TARGET, n_ctx=2048)

    def ms_per_step(n: int = 40) -> float:
        target.reset()
        target.eval(list(range(100, 400)))
        t = time.perf_counter()
        for i in range(n):
            target.eval([500 + i])
        return (time.perf_counter() - t) / n * 1e3

    ms_per_step(5)  # llama.cpp's first evaluation is slow
    print(f"CPU 1 idle       {ms_per_step():.1f} ms/step", flush=True)
    other = subprocess.Popen([sys.executable, __file__, "--drafter"])
    time.sleep(8)  # its model loads
    print(f"CPU 1 drafting   {ms_per_step():.1f} ms/step", flush=True)
    other.kill()
    other.wait()
    spin = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    time.sleep(1)
    print(f"CPU 1 spinning   {ms_per_step():.1f} ms/step", flush=True)
    spin.kill()
    spin.wait()
    time.sleep(1)
    print(f"CPU 1 idle again {ms_per_step():.1f} ms/step", flush=True)


if __name__ == "__main__":
    drafter_forever() if sys.argv[1:] == ["--drafter"] else main()
