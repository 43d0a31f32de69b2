"""When a cloud-led edge rests its drafter and its uplink: `UplinkBackoff`.

In a cloud-led session (`loop/follow.py`) the cloud verifies an edge's draft only when its pricer
finds it worth a pass; a draft nobody verifies still costs the cloud a frame to decode and the edge
its drafter. The backoff counts the steps that judged our drafts and found none worth it, and spaces
the uploads out while that lasts. The live edge's `FollowLoop` and the benchmarks' replay edges
(`bench/replay_edge.py`) share it, so the two rest alike.

An edge that serves many requests (`acespec edge serve`) keeps a `BackoffMemory` for them all. While
the last request to learn anything ended resting, most requests do not draft at all: they stream as
cloud-only ones (`edge/runtime.py`'s auto), and one in `every` (2, 4, then 8 while those find nothing
kept) drafts from its first token, a probe of whether the cloud takes our drafts again. Drafts nobody
verifies are not free even on the edge's own core: a drafter working on one core of a 2-core VM slowed
the target's steps on the other by 5% (shared memory bandwidth; `scripts/drafter_contention.py`). An
earlier memory opened each request resting instead, with one draft after `idle_after` steps; that
draft's prefill of the whole prompt alone cost such a request 2-6% on HumanEval (1.4-1.7 s of drafter
time for a draft the cloud never verified, as its own probes come 32 steps apart;
`scripts/edge_cpu_per_request.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BackoffMemory:
    """What the edge's sessions learned of drafting, for the sessions after them: whether the last one
    to learn anything found the cloud passing its drafts over (and while it did, which new session
    probes), and how fast the drafter reads a context (whether a late drafter could read a long
    prompt before the stream ends: `FollowLoop._join`). One per edge; sessions that interleave at
    worst blur it (plain fields)."""

    probe_first: int = 2  # while resting, the first probe is this many sessions after the rest began ...
    probe_max: int = 8  # ... each probe that finds nothing kept doubles the spacing, up to this
    resting: bool = False
    every: int = 0  # sessions between probes now (0: probe_first)
    skipped: int = 0  # sessions since the last probe (or since the rest began)
    prefill_tps: float = 0.0  # the drafter's prefill speed, tokens/s, as measured beside a stream (0: not yet)

    def drafts(self) -> bool:
        """Whether a new session drafts: always while not resting; while resting, only a probe."""
        if not self.resting:
            return True
        self.skipped += 1
        every = self.every or self.probe_first
        if self.skipped < every:
            return False
        self.skipped, self.every = 0, min(2 * every, self.probe_max)
        return True

    def rest(self) -> None:
        """A session found the cloud passing its drafts over."""
        if not self.resting:
            self.resting, self.skipped, self.every = True, 0, 0

    def wake(self) -> None:
        """A session's draft was kept: the next sessions draft."""
        self.resting, self.skipped, self.every = False, 0, 0

    def read(self, tokens: int, seconds: float) -> None:
        """A late drafter's prefill read `tokens` in `seconds` (a short one says little: skipped)."""
        if tokens >= 64 and seconds > 0:
            r = tokens / seconds
            self.prefill_tps = r if not self.prefill_tps else 0.7 * self.prefill_tps + 0.3 * r


@dataclass
class UplinkBackoff:
    """Whether to draft and upload now. While the cloud verifies none of this edge's drafts, step after
    step (its pricer finds them not worth a pass, or they are wrong), every upload only costs the cloud
    a frame to decode and the edge its drafter: after `idle_after` such steps the edge sends one short
    draft per `gap` steps, the gap doubling up to `gap_max`, and goes back to drafting freely the first
    step the cloud verifies one (the cloud's occasional probe of a draft is what brings it back).

    Only a step that says something about the drafts counts: one that broke the chain, one our
    uploaded chain reached in time and the cloud passed over, or any step while the drafter is slower
    than the stream (a chain that falls behind never gets ahead again). Steps while a faster drafter's
    chain is still catching up after a miss, or its upload is on the way, say nothing: on a fast
    target (18 ms a step) at 100 ms RTT that catch-up alone is about 16 steps, and counting it rested a
    drafter whose drafts the cloud was taking (`acespec bench sim --profile edge-npu+h200`: 1.04x
    cloud-only instead of 1.27x).
    Shared by the edge (`FollowLoop`) and the benchmarks' replay edges."""

    idle_after: int = 16
    gap_max: int = 64
    ignored: int = 0  # steps in a row, since a draft went up, with none verified
    gap: int = 0  # steps between uploads while backing off (0: upload freely)
    since: int = 0  # steps since the last upload
    sent_any: bool = False
    memory: BackoffMemory | None = None  # the edge's, shared by its sessions: told when this one rests or wakes

    def step(self, drafted: int, telling: bool = True, kept: int | None = None) -> None:
        """One step of the stream; `drafted`: draft tokens of ours it verified, `kept` of which it kept
        (None: all); `telling`: whether the step broke our chain, passed over a draft of ours that had
        reached the cloud in time, or came while the drafter is slower than the stream. A verified draft
        wakes the edge only if the cloud kept some of it: a probe it rejected whole says the drafts are
        still poor (probes woke every request's drafter on ShareGPT at 0 ms, each rejected)."""
        self.since += 1
        if drafted and (kept is None or kept > 0):
            self.ignored, self.gap = 0, 0
            if self.memory is not None:
                self.memory.wake()
        elif self.sent_any and telling:
            self.ignored += 1
            if self.ignored >= self.idle_after and not self.gap:
                self.gap, self.since = self.idle_after, 0
                if self.memory is not None:
                    self.memory.rest()

    def may_send(self) -> bool:
        return not self.gap or self.since >= self.gap

    def sent(self) -> None:
        if self.gap:  # an upload the backoff let through: the next one waits twice as long, unless it is used
            self.gap = min(2 * self.gap, self.gap_max)
        self.sent_any, self.since = True, 0
