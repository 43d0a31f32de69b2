"""The simulated cloud: one accelerator, real `TargetVerifier` sessions, passes that take virtual time.

Every session is a real `TargetVerifier` over a replay target (`acespec.sim.replay`), so which blocks are
dropped, what a verdict accepts and when a generation ends follow the shipped rule, not a copy of it.
Only time is modelled. Like the serving engines, the accelerator runs one pass at a time, and a pass
takes the head of every session's queue at once: a block to verify (a dropped block is answered at
once and the next one taken), a plain decode step for a cloud-only session, or the prompt prefill of a
new session; a cloud-led session's step verifies what its `LeadState` plans from the drafts that
reached it (as the live server does), or is a plain step. Its duration comes from a cost model, `pass_s(ks, prefill)`: the draft tokens verified
per session in the pass and the prompt tokens prefilled in it (`DeviceProfile.pass_s` for one
session; a batched curve for many, see `acespec.sim.capacity`).

A session gets WELCOME as soon as its HELLO arrives and its prefill joins the next pass, as the live
server warms a session while the edge drafts its first block.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from acespec.control.lead import LeadMemory
from acespec.loop.lead import LeadState
from acespec.loop.verifier import BlockVerdict, TargetVerifier, VerifyJob
from acespec.sim.kernel import Kernel, Mailbox
from acespec.sim.link import FrameSizer, SimLink

__all__ = ["CloudCost", "SimCloud", "SimCloudSession", "Streamed"]


class CloudCost(Protocol):
    def pass_s(self, ks: Sequence[int], prefill: int = 0) -> float:
        """Seconds of one pass verifying ks[i] draft tokens for session i (0: a plain step) and
        prefilling `prefill` prompt tokens."""


@dataclass(frozen=True)
class Streamed:
    """A cloud-only or cloud-led TOKENS frame, as the simulated edge receives it."""

    tokens: tuple[int, ...]
    finished: bool
    start: int = 0  # position of tokens[0]
    drafted: int = 0  # cloud-led: draft tokens the step verified
    accepted: int = 0
    verify_s: float = 0.0


@dataclass(frozen=True)
class SentBlock:
    """What crossed the uplink (the loop's `Block` keeps changing after it is sent)."""

    seq: int
    base: int
    tokens: tuple[int, ...]


@dataclass
class SimCloudSession:
    """One edge's session as the simulated cloud holds it: its verifier, the link down to that edge and
    the blocks waiting for the accelerator."""

    verifier: TargetVerifier
    down: SimLink
    inbox: Mailbox  # the edge's
    real_id: Callable[[int], int]  # compact id -> real id, for frame sizes
    cloud_only: bool = False
    lead: LeadState | None = None  # cloud-led: the drafts that arrived and the step pricing
    prefill: int = 0  # prompt tokens still to prefill (set when its HELLO arrives)
    ready: bool = False  # HELLO arrived
    queue: deque = field(default_factory=deque)  # blocks waiting for the accelerator
    passes: int = 0


class SimCloud:
    def __init__(self, kernel: Kernel, cost: CloudCost, sizer: FrameSizer, *, max_batch: int = 1 << 30) -> None:
        self.k = kernel
        self.cost = cost
        self.sizer = sizer
        self.lead_memory = LeadMemory()  # cloud-led pricing shared by the sessions, as the live server's
        self.max_batch = max_batch  # sessions one pass may hold
        self.sessions: list[SimCloudSession] = []
        self.busy = False
        self.passes = 0  # accelerator passes
        self.busy_s = 0.0  # accelerator seconds
        self.pass_sizes: list[int] = []  # sessions per pass
        self._rr = 0  # round-robin start, so a capped batch serves every session in turn

    # -- frames arriving from the edges -----------------------------------------------------------
    def hello(self, s: SimCloudSession) -> None:
        s.ready = True
        s.prefill = max(0, s.verifier.committed - 1)  # verify() always evaluates the last prompt token itself
        nbytes = self.sizer.welcome(s.verifier.committed)
        s.down.send(nbytes, lambda t: s.inbox.put((t, "welcome", nbytes)))
        self.sessions.append(s)
        self._kick()

    def draft(self, s: SimCloudSession, block: SentBlock) -> None:
        s.queue.append(block)
        self._kick()

    def lead_draft(
        self, s: SimCloudSession, base: int, tokens: tuple[int, ...], parents: tuple[int, ...] | None = None
    ) -> None:
        assert s.lead is not None, "only a cloud-led session gets drafts"
        s.lead.take(base, tokens, parents, None, s.verifier.committed)
        self._kick()

    # -- the accelerator --------------------------------------------------------------------------
    def _kick(self) -> None:
        if not self.busy:
            self._start_pass()

    def _start_pass(self) -> None:
        work: list[
            tuple[SimCloudSession, VerifyJob | BlockVerdict | None]
        ] = []  # None: the session's prompt prefill; a BlockVerdict: dropped
        prefill = 0
        n = len(self.sessions)
        for i in range(n):
            if len(work) >= self.max_batch:
                break
            s = self.sessions[(self._rr + i) % n]
            if s.prefill:
                work.append((s, None))
                prefill += s.prefill
            elif s.lead is not None:
                if not s.verifier.finished:
                    draft, _ = s.lead.plan(s.verifier)
                    work.append((s, s.verifier.prepare(s.lead.steps, s.verifier.committed, draft)))
            elif s.cloud_only:
                if not s.verifier.finished:
                    work.append((s, s.verifier.prepare(s.passes, s.verifier.committed, [])))
            else:
                job = self._next_job(s)
                if job is not None:
                    work.append((s, job))
        self._rr = (self._rr + 1) % max(1, n)
        if not work:
            self.busy = False
            return
        self.busy = True
        ks = [job.k for _, job in work if isinstance(job, VerifyJob)]  # prefills (None) have no k
        dt = self.cost.pass_s(ks, prefill)
        self.passes += 1
        self.busy_s += dt
        self.pass_sizes.append(len(work))
        self.k.at(self.k.t + dt, lambda: self._finish_pass(work, dt))

    def _next_job(self, s: SimCloudSession) -> VerifyJob | None:
        """The session's next block that is not stale; a stale one is answered at once (dropped)."""
        while s.queue:
            b = s.queue.popleft()
            job = s.verifier.prepare(b.seq, b.base, list(b.tokens))
            if isinstance(job, BlockVerdict):
                self._send_verdict(s, job)
                continue
            return job
        return None

    def _finish_pass(self, work: list, dt: float) -> None:
        for s, job in work:
            if job is None:
                s.verifier.warm()
                s.prefill = 0
                continue
            start = s.verifier.committed
            v = dataclasses.replace(
                self._verify(s, job, dt), shared=len(work), prefill_rows=sum(j is None for _, j in work)
            )
            s.passes += 1
            if s.lead is not None:
                s.lead.observe(v, dt)
                toks = tuple(s.verifier.tokens[start : v.committed])
                nbytes = self.sizer.tokens(
                    start, tuple(s.real_id(x) for x in toks), v.finished, (v.drafted, v.accepted, v.verify_us)
                )
                frame = Streamed(toks, v.finished, start, v.drafted, v.accepted, dt)
                s.down.send(nbytes, lambda t, f=frame, nb=nbytes, s=s: s.inbox.put((t, f, nb)))
            elif s.cloud_only:
                nbytes = self.sizer.tokens(s.verifier.committed - 1, (s.real_id(v.next_token),), v.finished)
                frame = Streamed((v.next_token,), v.finished)
                s.down.send(nbytes, lambda t, f=frame, nb=nbytes, s=s: s.inbox.put((t, f, nb)))
            else:
                self._send_verdict(s, v)
        self._start_pass()

    @staticmethod
    def _verify(s: SimCloudSession, job: VerifyJob, dt: float) -> BlockVerdict:
        """The verifier's own pass (`TargetVerifier.verify`), on the replay target, taking `dt` of virtual time."""
        ver = s.verifier
        n = ver.target.sync(ver.tokens[:-1])
        logits = ver.target.eval(ver.tokens[n:] + job.draft.tolist(), last=job.k + 1)
        v = ver.finish(job, logits, dt)
        return dataclasses.replace(v, verify_us=int(dt * 1e6))

    def _send_verdict(self, s: SimCloudSession, v: BlockVerdict) -> None:
        nbytes = self.sizer.verdict(
            v.seq,
            v.accepted,
            s.real_id(v.next_token) if v.next_token >= 0 else 0,
            v.verify_us,
            v.committed,
            v.dropped,
            v.finished,
        )
        s.down.send(nbytes, lambda t: s.inbox.put((t, v, nbytes)))
