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
goes on handing the stream's tokens over and leaves the drafter alone until the job is done
(`loop/handoff.py`). Only the short draft calls (`chunk` tokens) run in the loop.

The loop's state comes in parts, each a small class below: the stream (`_Stream`), the chain
(`_Chain`), its branches (`_Branches`), the uploads (`_Uploads`, with the uplink's backoff,
`loop/backoff.py`), and the drafter's hand-off (`DrafterHandoff`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from acespec.draft.chain import ChainDrafter
from acespec.loop.backoff import BackoffMemory, UplinkBackoff
from acespec.loop.contention import ContentionGuard
from acespec.loop.handoff import DrafterHandoff, DrafterJob, Spawn
from acespec.loop.loop import ORIGIN_DRAFT, ORIGIN_TARGET, LoopResult, Round
from acespec.loop.records import Disconnected
from acespec.loop.stats import RunStats
from acespec.loop.transport import Clock, LeadLink, StepChunk, StreamError


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
    idle_after: int = 16  # steps in a row that could have verified a draft of ours and did not, before the
    #                       uplink backs off ...
    idle_gap_max: int = 64  # ... to one short draft per this many steps at most (the gap doubles from idle_after)
    catch_up_after: int = 16  # stream tokens the drafter may lag by before it catches up beside the loop (a job)
    #                           rather than inside its next draft call, which would hold the stream's tokens back
    poll_s: float = 0.005  # how often the loop looks for a finished job while the stream is quiet
    prefill_share: float = 0.5  # a late drafter joins only if it can read the context in this share of the
    #                             stream's expected time left (with the edge's measured prefill speed)


@dataclass
class LeadDepth:
    """How far ahead of the stream to keep the chain: the tokens the cloud commits while a draft travels
    up (rate x half an RTT, plus a step), plus the depth worth verifying at the measured acceptance."""

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
class _Branch:
    """One pre-drafted miss: an alternative to a chain token and what the drafter wrote after it."""

    alt: int  # the token it assumes the stream takes instead of the chain's
    tokens: list[int]  # what the drafter wrote after it
    alts: list[tuple[int, float, float]]  # their alternatives (as `_Chain.alt`), should it become the chain
    slot: int  # the drafter KV sequence holding it


def _alternatives(blk) -> list[tuple[int, float, float]]:
    """Per drafted token: (the drafter's best other token, its q, q of the drafted token); -1 if none."""
    out = []
    for tok, conf, (ids, qs) in zip(blk.tokens, blk.conf, blk.top or [((), ())] * len(blk.tokens)):
        alt = next(((int(i), float(p)) for i, p in zip(ids, qs) if int(i) != tok), (-1, 0.0))
        out.append((alt[0], alt[1], float(conf)))
    return out


# -- the loop's state, in parts -------------------------------------------------------------------------
# Each part groups the fields that change together; the loop's steps say which part they touch. Only the
# loop's thread reads or writes any of them (a job beside the loop touches the drafter alone: `handoff`).


@dataclass
class _Stream:
    """What the cloud has committed, as the edge received it."""

    prompt: list[int]  # the prompt's tokens
    committed: list[int]  # the prompt, then every token streamed since
    t0: float = 0.0  # when the run started (the loop's clock): the user's token times count from here
    last_arrival: float | None = None  # when the previous step arrived: the gaps give the stream's rate
    before_last: float | None = None  # when the step before it arrived (the contention guard's window)

    def generated(self) -> int:
        """Tokens streamed so far."""
        return len(self.committed) - len(self.prompt)


@dataclass
class _Chain:
    """The drafter's guess of the tokens after the committed ones."""

    tokens: list[int] = field(default_factory=list)  # the guess; tokens[0] follows the last committed token
    q: list[np.ndarray] = field(default_factory=list)  # [V] per token, for rules that need q
    alt: list[tuple[int, float, float]] = field(default_factory=list)  # per token, while branching:
    #                                                    (the drafter's second choice, its q, q of the token)
    gen: int = 0  # the chain's generation: a break starts a new one (uploads are keyed by it)
    breaks: int = 0  # breaks so far (stats)

    def pop(self) -> None:
        """The stream took the head: the drafter's KV already holds it, the rest stays good."""
        del self.tokens[0]
        if self.q:
            del self.q[0]
        if self.alt:
            del self.alt[0]

    def restart(self) -> None:
        """The stream took another token: the guess is void, and drafting starts over after it."""
        self.breaks += 1
        self.gen += 1
        self.tokens.clear()
        self.q.clear()
        self.alt.clear()

    def adopt(self, b: _Branch) -> None:
        """The stream took branch `b`'s alternative: its continuation is the guess now (same generation:
        the cloud holds the tree it came in)."""
        self.tokens, self.alt, self.q = list(b.tokens), list(b.alts), []


@dataclass
class _Branches:
    """Pre-drafted misses: at chain positions where one is likely, the drafter's second choice and a
    continuation after it, each in a drafter KV slot of its own."""

    enabled: bool = False  # whether this run drafts branches (branch_len > 0, spare KV slots, no q rows)
    main: int = 0  # the drafter KV slot that holds the chain
    free: list[int] = field(default_factory=list)  # KV slots no branch holds, for the next branch
    at: dict[int, _Branch] = field(default_factory=dict)  # absolute position of its alternative -> branch
    nomore: int = -1  # chain end (absolute) at which no position was left worth a branch
    drafted: int = 0  # branches drafted (stats)
    taken: int = 0  # branches the stream took (stats)

    def void(self, pos: int) -> None:
        """The stream went the chain's way at `pos`: the branch there can never be taken."""
        self.free.append(self.at.pop(pos).slot)

    def drop(self, keep: int | None = None) -> None:
        """Free every branch's slot but the one at `keep`'s."""
        for pos in [p for p in self.at if p != keep]:
            self.free.append(self.at.pop(pos).slot)

    def adopt(self, pos: int) -> _Branch:
        """The stream took the branch at `pos`: its slot holds the chain now, every other slot is free."""
        b = self.at[pos]
        self.drop(keep=pos)
        del self.at[pos]
        self.free.append(self.main)
        self.main = b.slot
        self.taken += 1
        return b


@dataclass
class _Uploads:
    """What went up to the cloud, and whether more may go."""

    backoff: UplinkBackoff  # rests the drafter and the uplink while the cloud verifies none of our drafts
    sent_gen: int = -1  # the chain generation of the last upload (-1: upload again at the next chance)
    sent_end: int = 0  # where the last upload's chain ended (base + length); a branch taken moves it
    up_gen: int = -1  # the chain generation the cloud holds (the last upload's; -1: none, as after a resume)
    up_at: float = 0.0  # when that upload went up (the loop's clock)
    sent: int = 0  # drafts sent (stats)

    def due(self, gen: int, end: int, resend: int) -> bool:
        """Whether to upload a chain of generation `gen` ending at `end`: a new one, or one grown by `resend`."""
        return self.backoff.may_send() and (self.sent_gen != gen or end >= self.sent_end + resend)

    def record(self, gen: int, end: int, at: float) -> None:
        """A chain of generation `gen`, ending at `end`, went up at `at`."""
        self.sent_gen, self.sent_end = gen, end
        self.up_gen, self.up_at = gen, at
        self.sent += 1
        self.backoff.sent()

    def held(self, gen: int, start: int, arrived: float, rtt: float) -> bool:
        """Whether the cloud held our chain (generation `gen`) for a step from `start` that arrived at
        `arrived`: it went up a round trip before the step came back, and reached past `start`."""
        return self.up_gen == gen and start < self.sent_end and self.up_at <= arrived - rtt

    def forget(self) -> None:
        """A new session's board is empty: upload again."""
        self.sent_gen = self.up_gen = -1


class FollowLoop:
    """The edge's cloud-led loop. Its state: the `stream` (committed tokens), the `chain` and its
    `branches`, the `uploads`, and the drafter's `handoff` (which job, if any, holds it); `depth` prices
    the chain's length; `stats` is the run's record."""

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
        spawn: Spawn | None = None,
        source: Callable[[], ChainDrafter | None] | None = None,
        after_first: bool = False,
        guard: ContentionGuard | None = None,
        backoff: BackoffMemory | None = None,
    ) -> None:
        """`job`: drafter work already running (the prompt's prefill, started while the handshake was in
        flight); `spawn`: how to run a catch-up beside the loop (`ThreadJob`; the simulator's on virtual
        time); None catches up inside the next draft call.

        A drafter may also join late: with `drafter` None, `source` is asked (without blocking) for one
        at each turn of the loop, and the first it gives is prefilled beside the loop (a `spawn` job) on
        everything committed so far. `after_first`: ask only once the stream's first token is here, so
        the drafter's prefill never competes with the cloud's for a first token (an edge and a cloud
        sharing one box's cores). Until then, and with neither, the loop just follows the stream.
        `guard`: rests the drafter while its work slows the cloud's steps (`loop/contention.py`);
        `backoff`: the edge's memory of whether the cloud verifies its drafts (`loop/backoff.py`)."""
        # fixed for the run: what the caller gave
        self.link = link  # steps down, drafts up
        self.cfg = config  # depths, chunk sizes, the backoff's and the branches' settings
        self.clock = clock  # the loop's time (virtual in the simulator)
        self.on_tokens = on_tokens  # each step's new tokens, as the user gets them
        self.on_round = on_round  # each step, as a `Round`
        self.should_stop = should_stop  # polled once a turn: the caller may end the run early
        # the state, in parts
        self.stream = _Stream(prompt=[int(t) for t in prompt], committed=[int(t) for t in prompt])
        self.chain = _Chain()
        self.branches = _Branches()
        self.uploads = _Uploads(UplinkBackoff(config.idle_after, config.idle_gap_max, memory=backoff))
        self.handoff = DrafterHandoff(None, job, spawn, source, after_first)
        self.too_late = False  # the late drafter could not have read the context before the stream ends
        self.depth = LeadDepth(config)  # the stream's rate and the cloud's acceptance: how long a chain to keep
        self.guard = guard  # whether the drafter's work slows the cloud (shared cores): it rests while it does
        self.worked_at = -math.inf  # when the drafter last worked (the loop's clock), for the guard
        self.stats = RunStats()  # the run's record, as every loop reports it
        if drafter is not None:
            self._bind(drafter)

    @property
    def memory(self) -> BackoffMemory | None:
        """The edge's memory (the backoff's): where the drafter's prefill speed is kept, and read."""
        return self.uploads.backoff.memory

    # the figures other code reads off a loop
    @property
    def drafts_sent(self) -> int:
        return self.uploads.sent

    @property
    def drafter_joined_at(self) -> int | None:
        return self.handoff.joined_at

    @property
    def needs_q(self) -> bool:
        return self.handoff.needs_q

    @needs_q.setter
    def needs_q(self, value: bool) -> None:  # a test sends token-only drafts with a drafter that keeps q
        self.handoff.needs_q = value

    def _bind(self, drafter: ChainDrafter) -> None:
        """Take `drafter` for the rest of the run: its rule's needs and the KV slots its branches may use."""
        self.handoff.bind(drafter)
        model = drafter.model
        self.branches.main = model.slot
        self.branches.free = [s for s in range(model.n_slots) if s != model.slot][: self.cfg.max_branches]
        self.branches.enabled = self.cfg.branch_len > 0 and bool(self.branches.free) and not self.handoff.needs_q

    def _join(self) -> bool:
        """A late drafter, if the source has one now: bound, and its prefill started beside the loop;
        unless, at the drafter's measured prefill speed, reading the context would take more than
        `prefill_share` of the stream's time left: then it stays idle for the run (`too_late`). A
        probe's prefill of a 2,000-token ShareGPT prompt ran the whole 64-token response beside the
        cloud's steps for no draft, and that request read 0.91x cloud-only."""
        if not self._may_join():
            return False
        tps = self.memory.prefill_tps if self.memory is not None else 0.0
        drafter = self.handoff.late(self.stats.emitted)
        if drafter is None:
            return False
        self._bind(drafter)
        left_s = (self.cfg.max_tokens - self.stream.generated()) / self.depth.rate if tps else math.inf
        if tps and drafter.missing(self.stream.committed) / tps > self.cfg.prefill_share * left_s:
            self.too_late = True
            return False
        read = self.memory.read if self.memory is not None else None
        self.handoff.prefill_late(self.stream.committed, self.stats.emitted, on_read=read)
        self.worked_at = self.clock()
        return True

    def _may_join(self) -> bool:
        """Whether a late drafter may be asked for now: while the backoff lets a draft go up, and, where
        the drafter's prefill speed is known, once the stream's pace is (from its second step: until
        then the loop waits on the stream rather than polling)."""
        known = self.memory is None or not self.memory.prefill_tps or self.depth.rate > 0
        return known and self.uploads.backoff.may_send()

    def _rtt(self) -> float:
        """The link's round trip, or the configured prior until the link has measured one."""
        rtt = self.link.rtt_s()
        return self.cfg.prior_rtt_s if rtt is None else rtt

    def run(self, t0: float | None = None) -> LoopResult:
        t0 = self.clock() if t0 is None else t0
        self.stream.t0, self.stream.last_arrival = t0, None
        try:
            return self._follow(t0)
        finally:
            self.handoff.settle()

    def _follow(self, t0: float) -> LoopResult:
        """Turn after turn: take what the stream sent (stream, chain, branches), then one piece of drafter
        work (handoff, chain or branches), then upload the chain if it is new or has grown (uploads)."""
        stream, chain, cfg = self.stream, self.chain, self.cfg
        finished = False
        rests = self.guard.rests if self.guard is not None else 0
        while not finished:
            if self.should_stop is not None and self.should_stop():
                break
            busy = self._want() > 0 or self._can_branch()
            resting = self.guard is not None and not self.guard.may_draft()  # it changes only at a step
            # a late drafter is looked for only while the backoff would let it draft (`_want`)
            waiting = not resting and self.handoff.waiting(self.stats.emitted, self._may_join())
            got = self.link.recv(0 if busy else cfg.poll_s if waiting else None)
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
                and not chain.tokens
                and not self.branches.at
                and self.handoff.should_catch_up(stream.committed, cfg.catch_up_after)
            ):
                self.handoff.catch_up(stream.committed)
                self.worked_at = self.clock()
            elif want > 0:  # a few tokens between looks at the stream; what costs nothing (a prediction) at once
                ahead = self.handoff.bound().free_ahead(stream.committed + chain.tokens)
                self._draft(max(min(want, cfg.chunk), min(want, ahead)))
            elif self._can_branch():
                self._draft_branch()
            if chain.tokens and self.uploads.due(chain.gen, len(stream.committed) + len(chain.tokens), cfg.resend):
                self._upload()
        self.stats.wall_s = self.clock() - t0
        self.stats.lead.update(
            {
                "drafts_sent": self.uploads.sent,
                "chain_breaks": chain.breaks,
                "branches_drafted": self.branches.drafted,
                "branches_taken": self.branches.taken,
                "catch_ups": self.handoff.catch_ups,
                "drafter_joined_at": self.handoff.joined_at,
                "drafter_too_late": self.too_late,
                "contention_rests": None if self.guard is None else self.guard.rests - rests,
            }
        )
        return LoopResult(stream.committed[len(stream.prompt) :], self.stats, finished)

    # -- drafting ------------------------------------------------------------------------------------
    def _want(self) -> int:
        """Tokens to draft now: up to the lead depth, never past the generation budget (a chain that
        long is of no use, and polling for it would spin)."""
        if self.too_late:
            return 0  # the drafter could not read the context before the stream ends (`_join`)
        if self.guard is not None and not self.guard.may_draft():
            return 0  # drafting slows the cloud's steps (shared cores), or the guard has no baseline yet
        if not self.uploads.backoff.may_send():
            return 0  # the cloud has been verifying none of our drafts: the drafter rests (UplinkBackoff)
        if self.handoff.drafter is None:
            self._join()  # not while the backoff rests the drafter: its prefill would be work for nothing
            return 0
        if not self.handoff.free():
            return 0
        left = self.cfg.max_tokens - self.stream.generated()
        return min(self.depth.target(self.link.rtt_s()), left) - len(self.chain.tokens)

    def _draft(self, n: int) -> None:
        """Extend the chain by `n` tokens (chain)."""
        chain, needs_q, branching = self.chain, self.handoff.needs_q, self.branches.enabled
        blk = self.handoff.bound().draft(
            self.stream.committed + chain.tokens, n, keep_q=needs_q, keep_top=2 if branching else 0
        )
        chain.tokens.extend(blk.tokens)
        if needs_q and blk.q is not None:
            chain.q.extend(blk.q)
        if branching:
            chain.alt.extend(_alternatives(blk))
        self.stats.draft_s += blk.seconds
        self.stats.draft_tokens += len(blk.tokens)
        self.worked_at = self.clock()

    def _can_branch(self) -> bool:
        br = self.branches
        return (
            br.enabled
            and bool(br.free)
            and bool(self.chain.tokens)
            and br.nomore < len(self.stream.committed) + len(self.chain.tokens)
            and self.uploads.backoff.may_send()
            and self.handoff.idle()
            and (self.guard is None or self.guard.may_draft())
        )

    def _draft_branch(self) -> None:
        """Pre-draft the likeliest nameable miss (branches): at chain position j, weight = reach(j) x
        q(second choice at j); the branch is that token and `branch_len` more after it, in a spare KV
        slot. Positions the cloud will have passed when the tree reaches it (a round trip of the
        stream's tokens) are skipped: a branch there could never be taken."""
        chain, br, committed = self.chain, self.branches, self.stream.committed
        skip = min(len(chain.alt) - 1, math.ceil(self.depth.rate * self._rtt()))
        base = len(committed)
        reach, best, bw = 1.0, None, 0.0
        for j, (alt, q_alt, q_tok) in enumerate(chain.alt):
            w = reach * q_alt
            if j >= skip and alt >= 0 and w > bw and base + j not in br.at:
                best, bw = j, w
            if j >= skip:
                reach *= q_tok
        if best is None:
            br.nomore = base + len(chain.tokens)  # nothing left worth a branch until the chain grows or moves
            return
        alt = chain.alt[best][0]
        drafter = self.handoff.bound()
        model, slot = drafter.model, br.free.pop()
        model.fork(slot, min(base + best, model.held(br.main)))
        model.activate(slot)
        try:
            blk = drafter.draft(committed + chain.tokens[:best] + [alt], self.cfg.branch_len, keep_top=2)
        finally:
            model.activate(br.main)
        br.at[base + best] = _Branch(alt, list(blk.tokens), _alternatives(blk), slot)
        br.drafted += 1
        self.worked_at = self.clock()
        self.stats.draft_s += blk.seconds
        self.stats.draft_tokens += len(blk.tokens)
        self.uploads.sent_gen = -1  # the tree goes up with the next upload

    def _upload(self) -> None:
        """Send the chain (up to `max_lead` tokens) and the branches off it as one DRAFT (uploads)."""
        chain, base = self.chain, len(self.stream.committed)
        n = min(len(chain.tokens), self.cfg.max_lead)
        q = np.stack(chain.q[:n]) if self.handoff.needs_q and chain.q else None
        tokens, parents = chain.tokens[:n], None
        for pos, b in sorted(self.branches.at.items()):
            j = pos - base  # the alternative extends chain token j - 1 (the base when j = 0)
            if j >= n:
                continue
            if parents is None:
                parents = list(range(n))
            parents += [j] + list(range(len(tokens) + 1, len(tokens) + 1 + len(b.tokens)))
            tokens = tokens + [b.alt] + b.tokens
        self.link.send_draft(base, tokens, q, parents)
        self.uploads.record(chain.gen, base + n, self.clock())

    # -- the stream --------------------------------------------------------------------------------
    def _apply(self, c: StepChunk) -> bool:
        """One step of the stream: its new tokens go to the chain (`_take`) and to the user; what the
        step says about our drafts goes to the backoff, the depth and the stats."""
        stream = self.stream
        have = len(stream.committed)
        if c.start > have:
            raise StreamError(f"the cloud streamed from {c.start}, the edge holds {have}")
        new = list(c.tokens[have - c.start :])
        now = self.clock() - stream.t0  # when the user gets them: a drafter call may have held them past arrival
        gap = None if stream.last_arrival is None else c.arrived - stream.last_arrival
        before_last, stream.last_arrival = stream.last_arrival, c.arrived
        if not new:
            return c.finished
        # the cloud held our chain for this step if it went up a round trip before the step came back
        held = self.uploads.held(self.chain.gen, c.start, c.arrived, self._rtt())
        slow = self.stats.draft_s > 0 and self.stats.draft_tokens / self.stats.draft_s <= self.depth.rate
        breaks = self.chain.breaks
        for t in new:
            self._take(t)
        self.stats.observe_block(c.drafted, c.accepted)
        self.uploads.backoff.step(c.drafted, telling=held or slow or self.chain.breaks > breaks, kept=c.accepted)
        self.stats.k_chosen.append(c.drafted)
        self.stats.observe_tokens(len(new), now)
        self.stats.observe_pass(c.drafted, c.verify_s)
        self.depth.observe(c, gap)
        if self.guard is not None:  # computed ~half an RTT before it arrived: the drafter was at work if it worked
            # after the step before the previous one arrived (steps that came during one long call count too)
            self.worked_at = self.clock() if self.handoff.job is not None else self.worked_at
            busy = self.worked_at > (-math.inf if stream.before_last is None else stream.before_last)
            stream.before_last = before_last
            self.guard.step(c.verify_s, busy, plain=not c.drafted, first=c.start <= len(stream.prompt))
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
                    logprobs=None if c.logprobs is None else c.logprobs[have - c.start :],
                )
            )
        return c.finished

    def _take(self, t: int) -> None:
        """One committed token: pop it off the chain, or take the branch it names, or start over."""
        chain, br = self.chain, self.branches
        pos = len(self.stream.committed)
        b = br.at.get(pos)
        if chain.tokens and chain.tokens[0] == t:
            chain.pop()
            if b is not None:  # the stream went the chain's way: that branch is void
                br.void(pos)
        elif b is not None and b.alt == t:
            # the miss a branch pre-drafted: its KV sequence becomes the main one, the cloud holds the tree
            br.adopt(pos)
            self.handoff.bound().model.activate(b.slot)
            chain.adopt(b)
            self.uploads.sent_end = pos + 1 + len(chain.tokens)
        elif chain.tokens:
            chain.restart()
            br.drop()
        self.stream.committed.append(t)

    def _resume(self) -> None:
        committed = self.stream.committed
        agreed = self.link.resume(committed)
        if agreed != len(committed):
            raise StreamError(f"the cloud resumed at {agreed}, the edge holds {len(committed)}")
        self.uploads.forget()
