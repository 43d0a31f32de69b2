"""The edge side of a cloud-led session: follow the cloud's token stream and draft ahead of it.

The cloud decodes without waiting (`cloud/streaming.py`, cloud-led mode) and streams each step's tokens.
The edge keeps a *chain*: its drafter's guess of the tokens after everything it has seen streamed. It
drafts the chain ahead, a few tokens at a time, and uploads it as a DRAFT keyed by the committed
length it follows (`base`). When a step's tokens arrive:

- each one that equals the chain's head is popped (the drafter's KV already holds it: drafting goes
  on from the chain's end, no rollback);
- the first one that differs breaks the chain: it is dropped, and drafting restarts after the new
  committed tokens (the drafter's KV is synced back to them on its next call).

The cloud checks any draft against what it committed since the draft's base, so a chain built before
the edge saw the cloud's latest tokens still counts as long as they agree: that is how the uplink's
half round trip is hidden. Nothing here waits for the cloud except when there is nothing to draft.

A miss costs about a round trip of plain steps (the edge learns the cloud's token half an RTT late,
and its new chain reaches the cloud half an RTT after that). So once the chain is as long as it is
worth, the idle drafter pre-drafts *branches*: at the chain positions where a miss is likeliest to
land on a token it can name (the drafter's reach times its second choice's probability), that
second choice and a continuation after it, each drafted in a forked KV sequence of its own. Chain
and branches go up as one tree DRAFT; when the stream takes a branch, the cloud follows it at once,
and the edge makes that branch its chain (its KV already in place) instead of starting over.

How far ahead to draft is priced by `LeadDepth`: enough tokens to cover what the cloud commits in a
round trip, plus the depth the measured acceptance makes worth verifying; a drafter with nothing to
add stays idle (and so does the uplink).

The user's tokens never wait on the drafter's long calls: the prompt's prefill (a laptop drafter
takes seconds over a long prompt, where a GPU cloud streams from its first 50 ms), and catching up
on what the stream committed while the drafter rested, run as a `DrafterJob` beside the loop, which
goes on handing the stream's tokens over and leaves the drafter alone until the job is done. Only
the short draft calls (`chunk` tokens) run in the loop.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from acespec.draft.chain import ChainDrafter
from acespec.engine.loop import ORIGIN_DRAFT, ORIGIN_TARGET, LoopResult, Round
from acespec.engine.records import Disconnected
from acespec.engine.stats import RunStats
from acespec.engine.transport import Clock


class StreamError(RuntimeError):
    """The cloud's stream does not fit what the edge holds (a gap, or a resume at another length)."""


@dataclass(frozen=True)
class StepChunk:
    """One cloud-led step as the edge receives it (a TOKENS frame with HAS_STEP)."""

    start: int  # position of tokens[0]
    tokens: tuple[int, ...]
    finished: bool
    drafted: int  # draft tokens the step verified (0: a plain step)
    accepted: int  # of which kept
    verify_s: float  # the step's target time
    arrived: float  # when the edge received it (the loop's clock)


class LeadLink(ABC):
    """The edge's view of a cloud-led session: steps down, drafts up."""

    @abstractmethod
    def recv(self, timeout: float | None) -> StepChunk | Disconnected | None:
        """The next step (None if none within `timeout`; 0 = poll)."""

    @abstractmethod
    def send_draft(
        self, base: int, tokens: Sequence[int], q: np.ndarray | None, parents: Sequence[int] | None = None
    ) -> None:
        """Upload a chain that follows committed length `base` (a tree with `parents`, the wire's
        convention); `q`: [n, V] for rules that need it."""

    def resume(self, committed: Sequence[int]) -> int:
        """Reconnect; the cloud goes on streaming after the agreed committed length (returned)."""
        raise StreamError("this link cannot reconnect")

    def rtt_s(self) -> float | None:
        """The link's round-trip time as measured so far, if it knows it."""
        return None


@dataclass
class FollowConfig:
    max_tokens: int = 128  # generation budget (the cloud enforces it too)
    max_lead: int = 24  # most tokens the chain runs ahead of the stream (<= the server's max_draft_tokens)
    chunk: int = 2  # tokens drafted between looks at the stream
    resend: int = 2  # upload the chain again once it has grown by this many tokens
    prior_rtt_s: float = 0.1  # round trip assumed until the link measures one
    branch_len: int = 0  # tokens drafted after a branch's alternative (0 = no branches; they need a drafter with forks,
    #                      and on the recorded HumanEval traces they do not pay yet: docs/design-notes.md)
    max_branches: int = 4  # branches held at once, at distinct chain positions (each takes a KV slot)
    idle_after: int = (
        16  # steps in a row that could have verified a draft of ours and did not, before the uplink backs off ...
    )
    idle_gap_max: int = 64  # ... to one short draft per this many steps at most (the gap doubles from idle_after)
    catch_up_after: int = 16  # stream tokens the drafter may lag by before it catches up beside the loop (a job)
    #                           rather than inside its next draft call, which would hold the stream's tokens back
    poll_s: float = 0.005  # how often the loop looks for a finished job while the stream is quiet


@dataclass
class LeadDepth:
    """How far ahead of the stream to keep the chain: the tokens the cloud commits while a draft
    travels up (stream rate x half an RTT, plus a step of slack), plus the depth worth verifying at
    the measured acceptance (the run length a draft survives with 90% probability... of its mass)."""

    cfg: FollowConfig
    accept: float = 0.7  # EWMA of the per-token acceptance the cloud reports
    rate: float = 0.0  # EWMA of committed tokens per second

    def observe(self, chunk: StepChunk, gap_s: float | None) -> None:
        if chunk.drafted:
            a = chunk.accepted / chunk.drafted
            self.accept = 0.8 * self.accept + 0.2 * a
        if gap_s and gap_s > 0:
            r = len(chunk.tokens) / gap_s
            self.rate = r if self.rate == 0 else 0.8 * self.rate + 0.2 * r

    def target(self, rtt_s: float | None) -> int:
        rtt = self.cfg.prior_rtt_s if rtt_s is None else rtt_s
        transit = math.ceil(self.rate * rtt) + 1
        a = min(max(self.accept, 1e-3), 0.999)
        worth = math.ceil(math.log(0.1) / math.log(a))  # a^worth <= 0.1: deeper tokens rarely survive
        return max(1, min(self.cfg.max_lead, transit + worth))


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

    def step(self, drafted: int, telling: bool = True) -> None:
        """One step of the stream; `drafted`: draft tokens of ours it verified; `telling`: whether the
        step broke our chain, passed over a draft of ours that had reached the cloud in time, or came
        while the drafter is slower than the stream."""
        self.since += 1
        if drafted:
            self.ignored, self.gap = 0, 0
        elif self.sent_any and telling:
            self.ignored += 1
            if self.ignored >= self.idle_after and not self.gap:
                self.gap, self.since = self.idle_after, 0

    def may_send(self) -> bool:
        return not self.gap or self.since >= self.gap

    def sent(self) -> None:
        if self.gap:  # an upload the backoff let through: the next one waits twice as long, unless it is used
            self.gap = min(2 * self.gap, self.gap_max)
        self.sent_any, self.since = True, 0


class DrafterJob(ABC):
    """Drafter work running beside the follow loop (the prompt's prefill, a catch-up)."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def wait(self) -> None:
        """Block until it is done; re-raise what it raised."""


class ThreadJob(DrafterJob):
    """A job on a thread of its own: llama.cpp releases the GIL while it computes."""

    def __init__(self, fn: Callable[[], None], name: str = "acespec-drafter-job") -> None:
        self._error: BaseException | None = None

        def body() -> None:
            try:
                fn()
            except BaseException as e:  # re-raised by wait(), in the loop's thread
                self._error = e

        self._thread = threading.Thread(target=body, name=name, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


@dataclass
class _Branch:
    alt: int  # the token it assumes the stream takes instead of the chain's
    tokens: list[int]  # what the drafter wrote after it
    alts: list[tuple[int, float, float]]  # their alternatives (as `chain_alt`), should it become the chain
    slot: int  # the drafter KV sequence holding it


def _alternatives(blk) -> list[tuple[int, float, float]]:
    """Per drafted token: (the drafter's best other token, its q, q of the drafted token); -1 if none."""
    out = []
    for tok, conf, (ids, qs) in zip(blk.tokens, blk.conf, blk.top or [((), ())] * len(blk.tokens)):
        alt = next(((int(i), float(p)) for i, p in zip(ids, qs) if int(i) != tok), (-1, 0.0))
        out.append((alt[0], alt[1], float(conf)))
    return out


class FollowLoop:
    def __init__(
        self,
        link: LeadLink,
        prompt: Sequence[int],
        *,
        drafter: ChainDrafter | None,
        config: FollowConfig,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_round: Callable[[Round], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        clock: Clock = time.perf_counter,
        job: DrafterJob | None = None,
        spawn: Callable[[Callable[[], None]], DrafterJob] | None = None,
        source: Callable[[], ChainDrafter | None] | None = None,
        after_first: bool = False,
    ) -> None:
        """`job`: drafter work already running (the prompt's prefill, started while the handshake was in
        flight); `spawn`: how to run a catch-up beside the loop (`ThreadJob`; the simulator's on virtual
        time); None catches up inside the next draft call.

        A drafter may also join late: with `drafter` None, `source` is asked (without blocking) for one
        at each turn of the loop, and the first it gives is prefilled beside the loop (a `spawn` job) on
        everything committed so far. `after_first`: ask only once the stream's first token is here, so
        the drafter's prefill never competes with the cloud's for a first token (an edge and a cloud
        sharing one box's cores). Until then, and with neither, the loop just follows the stream."""
        self.link = link
        self.prompt = [int(t) for t in prompt]
        self.cfg = config
        self.on_tokens = on_tokens
        self.on_round = on_round
        self.should_stop = should_stop
        self.clock = clock
        self.depth = LeadDepth(config)
        self.uplink = UplinkBackoff(config.idle_after, config.idle_gap_max)
        self.stats = RunStats()
        self.committed = list(self.prompt)
        self.chain: list[int] = []  # the drafter's guess after `committed`
        self.chain_q: list[np.ndarray] = []  # [V] per chain token, rules that need q
        self.chain_alt: list[tuple[int, float, float]] = []  # per chain token: (second choice, its q, q of the token)
        self.branches: dict[int, _Branch] = {}  # absolute position of its alternative -> branch
        self._nomore = -1  # chain end (absolute) at which no position was left worth a branch
        self.branches_drafted = 0
        self.branches_taken = 0
        self._gen = 0  # the chain's generation: a break starts a new one
        self._sent_gen = -1  # generation of the last upload
        self._sent_end = 0  # where the last upload's chain ended (base + length)
        self._up_gen = -1  # the chain generation the cloud holds (the last upload's)
        self._up_at = 0.0  # when it went up (the loop's clock)
        self.drafts_sent = 0
        self.chain_breaks = 0
        self._job = job  # while it runs, the loop leaves the drafter alone
        self._spawn = spawn
        self.catch_ups = 0
        self._source = source
        self._after_first = after_first
        self.drafter_joined_at: int | None = None  # tokens streamed when a late drafter joined
        self.drafter: ChainDrafter | None = None
        self.needs_q, self.branching, self._main = False, False, 0
        self._free: list[int] = []  # KV slots for branches
        if drafter is not None:
            self._bind(drafter)

    def _bind(self, drafter: ChainDrafter) -> None:
        """Take `drafter` for the rest of the run: its rule's needs and the KV slots its branches may use."""
        self.drafter = drafter
        self.needs_q = drafter.rule.info.needs_q
        model = drafter.model
        self._main = model.slot
        self._free = [s for s in range(model.n_slots) if s != model.slot][
            : self.cfg.max_branches
        ]  # KV slots for branches
        self.branching = self.cfg.branch_len > 0 and bool(self._free) and not self.needs_q

    def _bound(self) -> ChainDrafter:
        """The drafter: the loop drafts only once one is bound (`_want` is 0 until then)."""
        assert self.drafter is not None, "the loop drafts only with a bound drafter"
        return self.drafter

    def _join(self) -> bool:
        """A late drafter, if the source has one now: bound, and its prefill started beside the loop."""
        if self._source is None or (self._after_first and self.stats.emitted == 0):
            return False
        drafter = self._source()
        if drafter is None:
            return False
        self._source = None
        self._bind(drafter)
        self.drafter_joined_at = self.stats.emitted
        ctx = list(self.committed)
        if self._spawn is not None:
            self._job = self._spawn(lambda: drafter.prefill(ctx))
        return True

    def run(self, t0: float | None = None) -> LoopResult:
        t0 = self.clock() if t0 is None else t0
        self._t0 = t0
        self._last_arrival: float | None = None
        try:
            return self._follow(t0)
        finally:
            if self._job is not None:  # the drafter must be idle before its owner uses it again
                job, self._job = self._job, None
                job.wait()

    def _follow(self, t0: float) -> LoopResult:
        finished = False
        while not finished:
            if self.should_stop is not None and self.should_stop():
                break
            busy = self._want() > 0 or self._can_branch()
            waiting = self._job is not None or (self._source is not None and self.stats.emitted > 0)
            got = self.link.recv(0 if busy else self.cfg.poll_s if waiting else None)
            while got is not None:
                if isinstance(got, Disconnected):
                    self._resume()
                else:
                    finished = self._apply(got) or finished
                got = None if finished else self.link.recv(0)
            if finished:
                break
            want = self._want()
            if (
                want > 0
                and self._spawn is not None
                and not self.chain
                and not self.branches
                and self._bound().missing(self.committed) > self.cfg.catch_up_after
            ):
                drafter, ctx = self._bound(), list(self.committed)
                self._job = self._spawn(functools.partial(drafter.prefill, ctx))  # this catch-up's own context
                self.catch_ups += 1
            elif want > 0:  # a few tokens between looks at the stream; what costs nothing (a prediction) at once
                ahead = self._bound().free_ahead(self.committed + self.chain)
                self._draft(max(min(want, self.cfg.chunk), min(want, ahead)))
            elif self._can_branch():
                self._draft_branch()
            if (
                self.chain
                and self.uplink.may_send()
                and (
                    self._sent_gen != self._gen
                    or len(self.committed) + len(self.chain) >= self._sent_end + self.cfg.resend
                )
            ):
                self._upload()
        self.stats.wall_s = self.clock() - t0
        self.stats.cache.update(
            {
                "drafts_sent": self.drafts_sent,
                "chain_breaks": self.chain_breaks,
                "branches_drafted": self.branches_drafted,
                "branches_taken": self.branches_taken,
                "catch_ups": self.catch_ups,
                "drafter_joined_at": self.drafter_joined_at,
            }
        )
        return LoopResult(self.committed[len(self.prompt) :], self.stats, finished)

    # -- drafting ------------------------------------------------------------------------------------
    def _want(self) -> int:
        """Tokens to draft now: up to the lead depth, never past the generation budget (a chain that
        long is of no use, and polling for it would spin)."""
        if self.drafter is None:
            self._join()
            return 0
        if not self.uplink.may_send():
            return 0  # the cloud has been verifying none of our drafts: the drafter rests (UplinkBackoff)
        if not self._drafter_free():
            return 0
        left = self.cfg.max_tokens - (len(self.committed) - len(self.prompt))
        return min(self.depth.target(self.link.rtt_s()), left) - len(self.chain)

    def _drafter_free(self) -> bool:
        """Whether the loop may use the drafter: no job is running (a finished one's error surfaces here)."""
        if self._job is None:
            return True
        if not self._job.done():
            return False
        job, self._job = self._job, None
        job.wait()
        return True

    def _draft(self, n: int) -> None:
        blk = self._bound().draft(
            self.committed + self.chain, n, keep_q=self.needs_q, keep_top=2 if self.branching else 0
        )
        self.chain.extend(blk.tokens)
        if self.needs_q and blk.q is not None:
            self.chain_q.extend(blk.q)
        if self.branching:
            self.chain_alt.extend(_alternatives(blk))
        self.stats.draft_s += blk.seconds
        self.stats.draft_tokens += len(blk.tokens)

    def _can_branch(self) -> bool:
        return (
            self.branching
            and bool(self._free)
            and bool(self.chain)
            and self._nomore < len(self.committed) + len(self.chain)
            and self.uplink.may_send()
            and self._job is None
        )

    def _draft_branch(self) -> None:
        """Pre-draft the likeliest nameable miss: at chain position j, weight = reach(j) x q(second
        choice at j); the branch is that token and `branch_len` more after it, in the spare KV slot.
        Positions the cloud will have passed when the tree reaches it (a round trip of the stream's
        tokens) are skipped: a branch there could never be taken."""
        rtt = self.link.rtt_s()
        skip = min(len(self.chain_alt) - 1, math.ceil(self.depth.rate * (self.cfg.prior_rtt_s if rtt is None else rtt)))
        base = len(self.committed)
        reach, best, bw = 1.0, None, 0.0
        for j, (alt, q_alt, q_tok) in enumerate(self.chain_alt):
            w = reach * q_alt
            if j >= skip and alt >= 0 and w > bw and base + j not in self.branches:
                best, bw = j, w
            if j >= skip:
                reach *= q_tok
        if best is None:
            self._nomore = base + len(self.chain)  # nothing left worth a branch until the chain grows or moves
            return
        alt = self.chain_alt[best][0]
        drafter = self._bound()
        model, slot = drafter.model, self._free.pop()
        model.fork(slot, min(base + best, model.held(self._main)))
        model.activate(slot)
        try:
            blk = drafter.draft(self.committed + self.chain[:best] + [alt], self.cfg.branch_len, keep_top=2)
        finally:
            model.activate(self._main)
        self.branches[base + best] = _Branch(alt, list(blk.tokens), _alternatives(blk), slot)
        self.branches_drafted += 1
        self.stats.draft_s += blk.seconds
        self.stats.draft_tokens += len(blk.tokens)
        self._sent_gen = -1  # the tree goes up with the next upload

    def _drop_branches(self, keep: int | None = None) -> None:
        for pos in [p for p in self.branches if p != keep]:
            self._free.append(self.branches.pop(pos).slot)

    def _upload(self) -> None:
        n = min(len(self.chain), self.cfg.max_lead)
        q = np.stack(self.chain_q[:n]) if self.needs_q and self.chain_q else None
        tokens, parents = self.chain[:n], None
        for pos, b in sorted(self.branches.items()):
            j = pos - len(self.committed)  # the alternative extends chain token j - 1 (the base when j = 0)
            if j >= n:
                continue
            if parents is None:
                parents = list(range(n))
            parents += [j] + list(range(len(tokens) + 1, len(tokens) + 1 + len(b.tokens)))
            tokens = tokens + [b.alt] + b.tokens
        self.link.send_draft(len(self.committed), tokens, q, parents)
        self._sent_gen, self._sent_end = self._gen, len(self.committed) + n
        self._up_gen, self._up_at = self._gen, self.clock()
        self.drafts_sent += 1
        self.uplink.sent()

    # -- the stream --------------------------------------------------------------------------------
    def _apply(self, c: StepChunk) -> bool:
        have = len(self.committed)
        if c.start > have:
            raise StreamError(f"the cloud streamed from {c.start}, the edge holds {have}")
        new = list(c.tokens[have - c.start :])
        now = self.clock() - self._t0  # when the user gets them: a drafter call may have held them past arrival
        gap = None if self._last_arrival is None else c.arrived - self._last_arrival
        self._last_arrival = c.arrived
        if not new:
            return c.finished
        rtt = self.link.rtt_s()
        # the cloud held our chain for this step if it went up a round trip before the step came back
        held = (
            self._up_gen == self._gen
            and c.start < self._sent_end
            and self._up_at <= c.arrived - (self.cfg.prior_rtt_s if rtt is None else rtt)
        )
        slow = self.stats.draft_s > 0 and self.stats.draft_tokens / self.stats.draft_s <= self.depth.rate
        breaks = self.chain_breaks
        for t in new:
            self._take(t)
        self.stats.observe_block(c.drafted, c.accepted)
        self.uplink.step(c.drafted, telling=held or slow or self.chain_breaks > breaks)
        self.stats.k_chosen.append(c.drafted)
        self.stats.observe_tokens(len(new), now)
        self.stats.observe_pass(c.drafted, c.verify_s)
        self.depth.observe(c, gap)
        if self.on_tokens:
            self.on_tokens(new)
        if self.on_round:
            kept = min(c.accepted, len(new))
            origins = [ORIGIN_DRAFT] * kept + [ORIGIN_TARGET] * (len(new) - kept)
            self.on_round(
                Round(
                    tokens=new,
                    origins=origins,
                    drafted=c.drafted,
                    accepted=c.accepted,
                    latency_s=None,
                    verify_s=c.verify_s,
                    rtt_s=self.link.rtt_s(),
                )
            )
        return c.finished

    def _take(self, t: int) -> None:
        """One committed token: pop it off the chain, or take the branch it names, or start over."""
        pos = len(self.committed)
        b = self.branches.get(pos)
        if self.chain and self.chain[0] == t:
            del self.chain[0]
            if self.chain_q:
                del self.chain_q[0]
            if self.chain_alt:
                del self.chain_alt[0]
            if b is not None:  # the stream went the chain's way: that branch is void
                self._free.append(self.branches.pop(pos).slot)
        elif b is not None and b.alt == t:
            # the miss a branch pre-drafted: its KV sequence becomes the main one, the cloud holds the tree
            self._drop_branches(keep=pos)
            del self.branches[pos]
            self._free.append(self._main)
            self._main = b.slot
            self._bound().model.activate(b.slot)
            self.chain, self.chain_alt, self.chain_q = list(b.tokens), list(b.alts), []
            self.branches_taken += 1
            self._sent_end = pos + 1 + len(self.chain)
        elif self.chain:
            self.chain_breaks += 1
            self._gen += 1
            self.chain.clear()
            self.chain_q.clear()
            self.chain_alt.clear()
            self._drop_branches()
        self.committed.append(t)

    def _resume(self) -> None:
        agreed = self.link.resume(self.committed)
        if agreed != len(self.committed):
            raise StreamError(f"the cloud resumed at {agreed}, the edge holds {len(self.committed)}")
        self._sent_gen = self._up_gen = -1  # a new session's board is empty: upload again
