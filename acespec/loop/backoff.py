"""When a cloud-led edge rests its drafter and its uplink: `UplinkBackoff`.

In a cloud-led session (`loop/follow.py`) the cloud verifies an edge's draft only when its pricer
finds it worth a pass; a draft nobody verifies still costs the cloud a frame to decode and the edge
its drafter. The backoff counts the steps that judged our drafts and found none worth it, and spaces
the uploads out while that lasts. The live edge's `FollowLoop` and the benchmarks' replay edges
(`bench/replay_edge.py`) share it, so the two rest alike.

An edge that serves many requests (`acespec edge serve`) keeps a `BackoffMemory` for them all, so a
request opens as the last one left off: resting, when the cloud was passing our drafts over. Without
it every request drafted afresh for `idle_after` steps, and drafts nobody verifies are not free even
on the edge's own core: a drafter working on one core of a 2-core VM slowed the target's steps on the
other by 5% (shared memory bandwidth; `scripts/drafter_contention.py`), which on ShareGPT at 0 ms put
auto at 0.97x cloud-only with 0.99 target passes per token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BackoffMemory:
    """What the edge's sessions learned of the cloud's use of their drafts, for the sessions after them:
    whether the last one to learn anything ended resting. One per edge; sessions that interleave at
    worst blur it (a plain flag)."""

    resting: bool = False


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
    memory: BackoffMemory | None = None  # the edge's, shared by its sessions: a session opens as the last left off

    def __post_init__(self) -> None:
        if self.memory is not None and self.memory.resting:  # open resting: one draft after idle_after steps
            self.gap, self.since, self.sent_any = self.idle_after, 0, True

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
                self.memory.resting = False
        elif self.sent_any and telling:
            self.ignored += 1
            if self.ignored >= self.idle_after and not self.gap:
                self.gap, self.since = self.idle_after, 0
                if self.memory is not None:
                    self.memory.resting = True

    def may_send(self) -> bool:
        return not self.gap or self.since >= self.gap

    def sent(self) -> None:
        if self.gap:  # an upload the backoff let through: the next one waits twice as long, unless it is used
            self.gap = min(2 * self.gap, self.gap_max)
        self.sent_any, self.since = True, 0
