"""The contention guard (`loop/contention.py`): an auto edge rests its drafter while its work slows
the cloud's steps, as it does where the two share cores.

- The guard's rules, step by step: a baseline of idle steps first; a window of dearer steps rests the
  drafter, each rest twice the last; a window within the margin ends the doubling; a cloud with no step
  times turns it off; busy cores rest the drafter before it starts work.
- `CoreLoad` reads the cores' load from a real `/proc/stat` and sees a process spinning on our cores.
- Over real sockets, a session the drafter would rest through streams as a cloud-only one.
- In a follow loop against a cloud whose steps cost five times as much while the drafter works, the
  guard cuts the drafter's work to a fraction, and the text is the cloud's either way; against a cloud
  the drafter does not slow, it never rests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.control.lead import LeadConfig
from acespec.draft.chain import ChainDrafter
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop.contention import ContentionConfig, ContentionGuard, CoreLoad
from acespec.loop.follow import FollowConfig, FollowLoop
from acespec.loop.transport import StepChunk
from acespec.loop.lead import LocalLeadLink
from acespec.loop.records import Disconnected
from acespec.loop.verifier import TargetVerifier
from acespec.models.toy import ToyModel
from acespec.verify import RuleSpec, SamplingParams

from paced_toy import PassCostToy
from test_lossless import GOOD_DRAFT, PROMPT, TARGET

STEP = 0.08  # a plain step's time, as the cloud reports it


def idle(g: ContentionGuard, n: int, s: float = STEP) -> None:
    for _ in range(n):
        g.step(s, busy=False)


def busy(g: ContentionGuard, n: int, s: float) -> None:
    for _ in range(n):
        g.step(s, busy=True)


# ------------------------------------------------------------------------------------------ the rules
def test_the_drafter_first_works_after_a_baseline_of_idle_steps_and_the_prompts_step_is_not_one():
    g = ContentionGuard(ContentionConfig(baseline_steps=2))
    assert not g.may_draft()
    g.step(5.0, busy=False, first=True)  # the prompt's prefill: no baseline
    assert not g.may_draft() and g.idle_steps == 0
    idle(g, 1)
    assert not g.may_draft()
    idle(g, 1)
    g.step(STEP / 2, busy=False, plain=False)  # a step that verified a draft: not a plain step's time
    assert g.may_draft() and g.idle_s == pytest.approx(STEP) and g.idle_steps == 2


def test_a_window_of_dearer_steps_rests_the_drafter_and_each_rest_is_twice_the_last():
    g = ContentionGuard(ContentionConfig(baseline_steps=2, window=3, margin=1.5, rest_first=4, rest_max=16))
    idle(g, 2)
    busy(g, 3, 4 * STEP)  # drafting made the cloud's steps 4x as dear
    assert not g.may_draft() and g.resting == 4 and g.rests == 1 and g.verdicts == [4.0]
    idle(g, 4)  # the rest: idle steps, which also refresh the baseline
    assert g.may_draft()
    busy(g, 3, 4 * STEP)
    assert g.resting == 8
    idle(g, 8)
    busy(g, 3, 4 * STEP)
    assert g.resting == 16
    idle(g, 16)
    busy(g, 3, 4 * STEP)
    assert g.resting == 16  # rest_max


def test_a_window_within_the_margin_keeps_the_drafter_at_work_and_ends_the_doubling():
    g = ContentionGuard(ContentionConfig(baseline_steps=2, window=3, rest_first=4))
    idle(g, 2)
    busy(g, 3, 4 * STEP)
    idle(g, 4)
    busy(g, 3, 1.2 * STEP)  # a little slower, within the margin (the machine's own noise)
    assert g.may_draft() and g.rest == 0 and g.rests == 1
    # steps that verified drafts take longer for their rows, not for the drafter: never judged
    for _ in range(10):
        g.step(4 * STEP, busy=True, plain=False)
    assert g.may_draft() and g.verdicts == [4.0, 1.2]


def test_a_cloud_that_reports_no_step_times_turns_the_guard_off():
    g = ContentionGuard(ContentionConfig(baseline_steps=2))
    assert not g.may_draft()
    for _ in range(2):
        g.step(0.0, busy=False)
    assert g.off() and g.may_draft()


class FakeStat:
    """A `/proc/stat` of our cores whose busy and idle jiffies the test sets."""

    def __init__(self, path: Path, cpus: set[int]) -> None:
        self.path, self.cpus = path, sorted(cpus)
        self.busy, self.idle = 0, 1000
        self.write()

    def advance(self, busy_cores: float, wall_s: float) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        ticks = wall_s * hz
        self.busy += round(busy_cores * ticks / len(self.cpus))
        self.idle += round((len(self.cpus) - busy_cores) * ticks / len(self.cpus))
        self.write()

    def write(self) -> None:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{c} {self.busy} 0 0 {self.idle} 0 0 0 0 0 0" for c in self.cpus]
        self.path.write_text("\n".join(lines) + "\nintr 0\n")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CoreLoad reads Linux's /proc/stat")
def test_cores_other_processes_keep_busy_rest_the_drafter_before_it_starts_work(tmp_path):
    cpus = os.sched_getaffinity(0)
    stat = FakeStat(tmp_path / "stat", cpus)
    load = CoreLoad(str(stat.path))
    assert load.available and load.cores() == len(cpus)
    n = len(cpus)
    g = ContentionGuard(ContentionConfig(baseline_steps=2, rest_first=4), load=load, threads=n)
    for _ in range(2):
        stat.advance(n - 0.1, 1.0)  # the cloud's threads, on every core the drafter would use
        g.step(STEP, busy=False)
    assert not g.may_draft() and g.crowded == 1 and g.resting == 4 and g.others == pytest.approx(n - 0.1, abs=0.05)
    for _ in range(4):  # still crowded when the rest ends: rest again, twice as long, without a probe
        stat.advance(n - 0.1, 1.0)
        g.step(STEP, busy=False)
    assert g.crowded == 2 and g.resting == 8 and g.verdicts == []
    for _ in range(8):  # the cores went quiet: the drafter starts
        stat.advance(0.05, 1.0)
        g.step(STEP, busy=False)
    assert g.may_draft() and g.crowded == 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CoreLoad reads Linux's /proc/stat")
def test_core_load_sees_a_process_spinning_on_our_cores():
    load = CoreLoad()
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)
        load.others()  # start the interval once the spinner runs
        time.sleep(1.0)
        others = load.others()
    finally:
        spin.kill()
        spin.wait()
    assert others is not None and others >= 0.7  # one core's worth, less what the scheduler gave elsewhere


# ------------------------------------------------------------------------------------------ in a follow loop
class ContendedLink(LocalLeadLink):
    """A cloud whose steps take `slowdown` times as long when the edge's drafter worked since the last
    step, as on cores the two share. It verifies no draft (its steps are all plain, as a pricer's often
    are), so the drafter's work is all cost; its text is the in-process cloud's."""

    def __init__(self, verifier: TargetVerifier, slowdown: float) -> None:
        super().__init__(verifier, config=LeadConfig(k_max=4, prior_row_cost=0.0))
        self.slowdown = slowdown
        self.loop: FollowLoop | None = None
        self.seen = 0

    def recv(self, timeout):
        if self.v.finished:
            return Disconnected("the session has finished")
        if timeout is not None and not self._sent:
            return None
        self._sent = False
        start = self.v.committed
        self.state.steps += 1
        verdict = self.v.verify(self.state.steps, start, [], None)
        assert self.loop is not None
        worked = self.loop.stats.draft_tokens != self.seen
        self.seen = self.loop.stats.draft_tokens
        verify_s = STEP * (self.slowdown if worked else 1.0)
        tokens = tuple(self.v.tokens[start : verdict.committed])
        return StepChunk(start, tokens, verdict.finished, verdict.drafted, verdict.accepted, verify_s, time.perf_counter())


def follow(slowdown: float, guard: ContentionGuard | None, n: int = 160):
    sp, rs = SamplingParams(0.0), RuleSpec.parse("greedy")
    v = TargetVerifier(TARGET, PROMPT, sampling=sp, rule=rs, max_tokens=n)
    link = ContendedLink(v, slowdown)
    drafter = ChainDrafter(GOOD_DRAFT, sampling=sp, rule=rs)
    drafter.model.reset()
    # the uplink's backoff would rest the drafter too, as the cloud verifies none of its drafts: it is off
    cfg = FollowConfig(max_tokens=n, max_lead=6, idle_after=10**6)
    loop = FollowLoop(link, PROMPT, drafter=drafter, config=cfg, guard=guard)
    link.loop = loop
    return loop.run()


def test_a_drafter_that_slows_the_cloud_rests_and_the_text_stays_the_clouds():
    free = follow(5.0, None)
    guarded = follow(5.0, ContentionGuard(ContentionConfig(rest_first=8, rest_max=64)))
    assert guarded.tokens == free.tokens and len(free.tokens) == 160
    assert guarded.stats.lead["contention_rests"] >= 2
    assert guarded.stats.draft_tokens < free.stats.draft_tokens / 3


def test_a_drafter_that_does_not_slow_the_cloud_never_rests():
    free = follow(1.0, None)
    guarded = follow(1.0, ContentionGuard())
    assert guarded.tokens == free.tokens
    assert guarded.stats.lead["contention_rests"] == 0
    assert guarded.stats.draft_tokens >= free.stats.draft_tokens / 2  # only the baseline's steps went undrafted


# ------------------------------------------------------------------------------------------ over sockets
def test_a_session_the_drafter_would_rest_through_streams_as_cloud_only_and_counts_towards_the_rest():
    """An edge that learned that its drafting slows the cloud (a long rest ahead) opens its next auto
    session as a cloud-only one: the same text, no drafter ever asked for, and the session's steps
    shorten the rest; once the rest is shorter than a session, auto is cloud-led again."""
    V, prompt = 64, (3, 1, 4, 1, 5, 9, 2, 6)
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.001), ServerConfig(port=0)) as srv:
        fp = ToyModel(vocab=V, seed=1).tokenizer.fingerprint
        asked: list[int] = []

        def source():
            asked.append(1)
            return None

        def run(mode: str, guard: ContentionGuard | None = None):
            cfg = EdgeConfig(mode=mode, connect=ConnectConfig(port=srv.port), max_tokens=40)
            return run_edge(None, prompt, cfg, model_id=fp, drafter_source=source, guard=guard)

        ref = run("cloud-only")
        g = ContentionGuard(resting=100, rest=200)
        res = run("auto", g)
        assert res.tokens == ref.tokens and res.stats.lead["streamed_plain"] is True
        assert g.resting == 60 and not asked
        res = run("auto", g)
        assert res.tokens == ref.tokens and g.resting == 20
        res = run("auto", g)  # a rest shorter than the session: cloud-led, and the drafter is asked for
        assert res.tokens == ref.tokens and "streamed_plain" not in res.stats.lead
        assert asked  # once its rest was over, the drafter was asked for
