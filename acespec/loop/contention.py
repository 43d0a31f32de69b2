"""Whether the edge's drafting slows the cloud: `ContentionGuard`.

An edge and a cloud that share cores (one laptop running both, an edge on the cloud's busy box)
compete for them. Two llama.cpp instances each run a thread per core; while the drafter computes, the
cloud's threads wait at their barriers for threads the drafter's displaced, and its steps take many
times as long: measured on 2 cores with both unpinned, plain steps of the 1.5B target went from 82 ms
to 250-400 ms while the 0.5B drafter worked, and to 3.2 s in the worst run (auto streamed at 0.05-0.23x
cloud-only). No draft the cloud verifies can win that back on a CPU, where a verified row costs most
of a step. The uplink's backoff (`loop/backoff.py`) cannot see it: there the cloud goes on
verifying drafts, only slowly.

The cloud reports each step's own time (`verify_s` in TOKENS). The guard compares the cloud's plain
steps (those that verified no draft: a verified row's own cost would blur the comparison) while this
edge's drafter worked with its plain steps while the drafter was idle, and rests the drafter while
they take more than `margin` times as long:

- a drafter first works only once `baseline_steps` plain steps came with it idle (their time is the
  baseline; the prompt's own step, which holds the prefill, is not one of them);
- every `window` plain steps with the drafter at work are judged together: slower than the baseline
  by `margin` or more, the drafter rests for `rest` steps (its idle steps refresh the baseline), and
  each rest after such a verdict is twice the one before, up to `rest_max`; a window within the margin
  brings `rest` back to `rest_first`;
- a cloud that reports no step times (a zero `verify_s`) turns the guard off: it can judge nothing.

Judging by the cloud's steps has a price: the probe itself (the drafter's prefill of the prompt, then a
window of drafting) slows those steps, and on shared CPU cores by seconds. Where the edge can see its
cores' load (`CoreLoad`, Linux), it looks before it leaps: whenever the drafter would start work after
idle steps, if other processes kept the cores it may run on busy during those steps, leaving fewer
free than the drafter has threads (by `slack`; the cloud's threads, computing the stream on the same
cores), the drafter rests at once, as after a window judged too dear, without the probe.

One guard may serve every session an edge runs against a cloud (`acespec edge serve` keeps one), so
what one request learned, the next starts from: on shared cores the drafter then rests from a
request's first token instead of paying the probe again, and a session the drafter would rest
through is opened as a cloud-only one (`edge/runtime.py`); its steps count towards the rest (`skip`).
Sessions call it from their own threads; its fields are plain numbers, so sessions that interleave at
worst blur a verdict.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


class CoreLoad:
    """How many cores' worth of other processes' work ran on the cores this process may use, between
    two calls: the cores' busy time (`/proc/stat`) less this process's own CPU time. Linux only:
    elsewhere `available` is False and every call answers None."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat = stat
        try:
            self.cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
            self.available = bool(self.cpus) and self._read() is not None
        except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows) or no /proc
            self.cpus, self.available = set(), False
        self.last = self._read() if self.available else None

    def _read(self) -> tuple[float, float, float] | None:
        """(busy jiffies, all jiffies, this process's CPU seconds) over our cores."""
        busy = total = 0
        with open(self.stat) as f:
            for line in f:
                name, *fields = line.split()
                if name in self.cpus:
                    v = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                    total += sum(v)
        return (busy, total, time.process_time()) if total else None

    def others(self) -> float | None:
        """Cores' worth of other processes' work on our cores since the last call (None: unknown, or
        too short an interval to tell: the counters tick at 100 Hz)."""
        if not self.available or self.last is None:
            return None
        now = self._read()
        if now is None:
            return None
        (b0, t0, p0), (b1, t1, p1) = self.last, now
        ticks = (t1 - t0) / len(self.cpus)  # wall time, in jiffies, per core
        if ticks < 5:
            return None  # keep the interval open until it is long enough to mean something
        self.last = now
        wall_s = ticks / os.sysconf("SC_CLK_TCK")
        return max(0.0, (b1 - b0) / ticks - (p1 - p0) / wall_s)

    def cores(self) -> int:
        return len(self.cpus)


@dataclass
class ContentionConfig:
    margin: float = 1.5  # plain steps while the drafter works may take up to this times as long as while it idles
    window: int = 3  # steps with the drafter at work judged together
    baseline_steps: int = 2  # steps with the drafter idle before it may first work (the baseline)
    rest_first: int = 16  # steps of the first rest after a verdict that drafting slows the cloud ...
    rest_max: int = 1024  # ... each next rest twice as long, up to this many steps
    slack: float = 0.5  # with a CoreLoad: the drafter starts work only if other processes leave its threads
    #                     a core each, less this much in all


@dataclass
class ContentionGuard:
    cfg: ContentionConfig = field(default_factory=ContentionConfig)
    load: CoreLoad | None = None  # our cores' load by other processes (None: judge by the cloud's steps alone)
    threads: int = 1  # the drafter's CPU threads: with a load, the cores it needs free
    idle_s: float = 0.0  # the cloud's plain step time while the drafter was idle (EWMA; 0: none yet)
    idle_steps: int = 0  # plain idle steps seen (the baseline is ready at cfg.baseline_steps)
    blind_steps: int = 0  # plain steps that carried no step time: after baseline_steps of them, the guard is off
    busy_s: float = 0.0  # the current window: seconds of ...
    busy_steps: int = 0  # ... plain steps with the drafter at work
    rest: int = 0  # the length of the next rest (0: rest_first)
    resting: int = 0  # steps left in the current rest
    rests: int = 0  # rests so far (stats)
    verdicts: list[float] = field(default_factory=list)  # each judged window's step time over the baseline (stats)
    others: float | None = None  # other processes' cores' worth of work on ours, over the last idle steps
    crowded: int = 0  # rests begun because the cores were busy (stats)

    @classmethod
    def watching_cores(cls, threads: int) -> ContentionGuard:
        """The guard an edge process keeps: it watches the load on the cores this process may use (where
        the OS lets it) for a drafter of `threads` CPU threads."""
        return cls(load=CoreLoad(), threads=threads)

    def off(self) -> bool:
        """Whether the guard cannot judge: the cloud reports no step times."""
        return self.idle_steps == 0 and self.blind_steps >= self.cfg.baseline_steps

    def may_draft(self) -> bool:
        """Whether the drafter may work now (draft, join, catch up)."""
        if self.off():
            return True
        return self.idle_steps >= self.cfg.baseline_steps and self.resting == 0

    def skip(self, steps: int) -> None:
        """`steps` went by in a session that streamed plainly because the drafter would rest through it."""
        self.resting = max(0, self.resting - steps)

    def step(self, verify_s: float, busy: bool, plain: bool = True, first: bool = False) -> None:
        """One step of the stream: the cloud's `verify_s` for it, whether the drafter worked while the
        cloud computed it, and whether it was `plain` (verified no draft: only such steps are
        compared, as a verified row's own cost would blur the drafter's). `first`: the stream's first
        step (it holds the prompt's prefill: its time says nothing of a plain step's)."""
        others = self.load.others() if self.load is not None else None
        if first:
            return
        was = self.resting
        self.resting = max(0, self.resting - 1)
        if not busy and others is not None:
            self.others = others
        if not plain:
            return
        if verify_s <= 0:
            self.blind_steps += 1
            return
        if not busy:
            self.idle_s = verify_s if self.idle_steps == 0 else 0.7 * self.idle_s + 0.3 * verify_s
            self.idle_steps += 1
            if was <= 1 and self.idle_steps >= self.cfg.baseline_steps and self._crowded():
                self._rest()  # the drafter would start now: on cores this busy it would only slow the cloud
                self.crowded += 1
            return
        if self.idle_steps < self.cfg.baseline_steps:
            return  # nothing to judge against yet (a drafter that was at work before the guard was asked)
        self.busy_s += verify_s
        self.busy_steps += 1
        if self.busy_steps >= self.cfg.window:
            self._judge()

    def _judge(self) -> None:
        ratio = self.busy_s / self.busy_steps / self.idle_s
        self.verdicts.append(round(ratio, 3))
        self.busy_s, self.busy_steps = 0.0, 0
        if ratio >= self.cfg.margin:
            self._rest()
        else:
            self.rest = 0

    def _crowded(self) -> bool:
        if self.load is None or self.others is None:
            return False
        need = min(self.threads, self.load.cores())
        return self.load.cores() - self.others < need - self.cfg.slack

    def _rest(self) -> None:
        self.resting = self.rest or self.cfg.rest_first
        self.rest = min(2 * self.resting, self.cfg.rest_max)
        self.rests += 1
