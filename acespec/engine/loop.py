"""The draft -> verify loop, written once.

The loop talks to the target through a `Transport`: `send(block)` and `recv(timeout) -> Verdict`.
In one process the transport calls a `TargetVerifier` directly (`LocalTransport`); across the
network the edge runtime plugs in a TCP transport. Two schedules:

- `sync`: stop-and-wait, one block in flight.
- `pipelined`: after sending a block the edge keeps drafting as if it will be accepted in full, with
  the drafter's own guess of the bonus token, and sends the next block (whose first token is that
  guess) without waiting, up to `window` blocks in flight. Every verdict is applied to the committed
  prefix; if the speculative context no longer extends it, the edge drops back to the committed
  prefix (the target drops the stale blocks by itself, see `verifier.py`).

A block with no draft tokens is a plain target step, so `k = 0` without a drafter is ordinary
autoregressive decoding with the target: the baseline, through the very same loop.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from acespec.control.depth import DepthPolicy, FixedDepth
from acespec.draft.chain import ChainDrafter
from acespec.engine.stats import RunStats
from acespec.engine.verifier import TargetVerifier, Verdict


@dataclass
class Block:
    seq: int  # sequence number, increasing per session
    base: int  # committed length the block builds on
    tokens: list[int]  # overlap (guessed bonus of the previous block, if pipelined) + draft tokens
    q: np.ndarray | None = None  # [len(tokens), V] drafter rows, for rules that need q
    overlap: int = 0  # how many leading tokens are assumptions about the previous block
    doomed: bool = False  # a verdict already showed the assumptions it builds on were wrong
    alt_key: tuple[int, int, int] | None = None  # a branch: the outcome (seq, accepted, next) it continues
    top: list = field(default_factory=list)  # the drafter's candidates per token (for the state cache)
    sent_at: float = 0.0  # perf_counter() when it was sent
    cached: int = 0  # leading draft tokens (after the overlap) that the state cache had pre-drafted


# Where a committed token came from, as `Round.origins` reports it
ORIGIN_DRAFT = "draft"  # a draft token the target accepted
ORIGIN_CACHE = "cache"  # an accepted draft token the state cache had pre-drafted while a verdict was in flight
ORIGIN_TARGET = "target"  # the target's own token: the correction after a rejection, or the bonus


@dataclass
class Round:
    """One applied verdict, as `on_round` observers see it (the edge API streams and counts these)."""

    tokens: list[int]  # the tokens it committed
    origins: list[str]  # per token, one of the ORIGIN_* values
    drafted: int  # draft tokens it judged (the block's K)
    accepted: int  # ... of which the target kept
    latency_s: float | None  # block sent -> verdict applied: round trip, queueing and verify time (None: cloud-only streaming)
    verify_s: float  # the target's verify time, as it reported it
    rtt_s: float | None  # the path's round trip estimate (None before the first sample)


@dataclass
class Disconnected:
    """What `recv` returns when the link to the target broke; the loop then calls `resume`."""

    reason: str = ""


class Transport(ABC):
    @abstractmethod
    def send(self, block: Block) -> None: ...

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Verdict | Disconnected | None:
        """The next verdict, in block order; None if none arrived within `timeout` (None = wait)."""

    def resume(self, committed: Sequence[int]) -> int:
        """Re-establish the link, continuing from the `committed` tokens (prompt included); returns the
        agreed committed length."""
        raise RuntimeError("this transport cannot reconnect")

    def close(self) -> None:
        pass


class LocalTransport(Transport):
    """Direct calls into a `TargetVerifier` in the same process: the single-process engine."""

    def __init__(self, verifier: TargetVerifier) -> None:
        self.verifier = verifier
        self._out: deque[Verdict] = deque()

    def send(self, block: Block) -> None:
        self._out.append(self.verifier.verify(block.seq, block.base, block.tokens, block.q))

    def recv(self, timeout: float | None = None) -> Verdict | None:
        return self._out.popleft() if self._out else None


@dataclass
class LoopConfig:
    mode: str = "sync"  # "sync" (stop-and-wait) or "pipelined"
    window: int = 2  # pipelined: most blocks in flight (the least, with auto_window)
    auto_window: bool = False  # pipelined: grow the window to cover the round trip (see _window)
    max_window: int = 8  # auto_window's ceiling
    min_conf: float = 0.0  # stop a block early when q(x) drops below this
    max_tokens: int = 128  # generation budget (the target enforces it too)
    branches: bool = False  # send pre-drafted outcomes as branch blocks, so the target can continue past a rejection

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "pipelined"):
            raise ValueError(f"mode must be sync or pipelined, got {self.mode!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


@dataclass
class LoopResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    stats: RunStats
    finished: bool = True


class SpecLoop:
    def __init__(
        self,
        transport: Transport,
        prompt: Sequence[int],
        *,
        drafter: ChainDrafter | None,
        policy: DepthPolicy | None = None,
        config: LoopConfig | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        cache=None,  # a draft.cache.StateCache: pre-draft likely outcomes while waiting for verdicts
        on_round: Callable[[Round], None] | None = None,
        should_stop: Callable[[], bool] | None = None,  # polled between verdicts: True ends the run early (finished=False)
    ) -> None:
        self.transport = transport
        self.prompt = [int(t) for t in prompt]
        self.drafter = drafter
        self.policy = policy or FixedDepth(0 if drafter is None else 4)
        self.cfg = config or LoopConfig()
        self.on_tokens = on_tokens
        self.on_round = on_round
        self.should_stop = should_stop
        self.committed: list[int] = list(self.prompt)
        self.spec: list[int] = list(self.prompt)  # committed + tokens assumed by blocks in flight
        self.inflight: deque[Block] = deque()
        self.seq = 0
        self.stats = RunStats()
        self.finished = False
        self.cache = cache
        self._ready = None  # a cache hit: the next block, already drafted
        self._planned: set[int] = set()  # blocks whose outcomes the cache has planned
        self._extra: dict[int, tuple] = {}  # sync + cache: (bonus guess, its candidates) per block
        self._alts: dict[tuple[int, int, int], Block] = {}  # branches in flight, by the outcome they continue
        self._main_drafted = 0  # tokens drafted on the critical path (not cache pre-drafts)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, t0: float | None = None) -> LoopResult:
        """Generate to the end. `t0`: when the request started (perf_counter), if before this call,
        so time to first token and wall time include the handshake and prefill done before it."""
        t_start = time.perf_counter() if t0 is None else t0
        self._t0 = t_start
        while not self.finished and not self._stopping():
            window = self._window()
            # take every verdict that is already here; block only when the window is full
            while self.inflight:
                # doomed blocks and branches do not hold the window: the target drops or skips them itself
                blocking = len(self._live()) >= window
                self._plan_cache()
                v = None
                plan = self._predraft_plan(blocking) if self.cache is not None and self.cache.has_work else None
                if plan is not None:
                    # the edge would idle here, or the next block can wait, or the outcomes are likelier
                    # than it: pre-draft likely outcomes a batched drafter step at a time, checking for
                    # the verdict in between, and only as much as fits before the verdict is due (a step
                    # that overruns it delays the edge's answer) and, ahead of the next block, within
                    # the slack that leaves it in time for the target
                    v = self.transport.recv(0.0)
                    if v is None:
                        budget, max_level = plan
                        steps = self.cache.metrics.steps
                        for entry in self.cache.predraft_step(budget, max_level=max_level):
                            if self.cfg.branches:
                                self._send_branch(entry)
                        if self.cache.metrics.steps > steps:
                            continue
                if v is None:
                    t_wait = time.perf_counter()
                    v = self.transport.recv(None if blocking else 0.0)
                    if blocking:
                        self.stats.wait_s += time.perf_counter() - t_wait
                if v is None:
                    break
                if isinstance(v, Disconnected):
                    self._resync()
                    break
                if self.cache is not None:
                    self.cache.finish_partial()  # a partial pre-draft can still be the hit
                self._apply(v)
                if self.finished or self._stopping():
                    break
            if self.finished or self._stopping():
                break
            self._send_next_block()
        self.stats.wall_s = time.perf_counter() - t_start
        if self.cache is not None:
            self.stats.cache.update(self.cache.metrics.as_dict())
            self.cache.clear()
        return LoopResult(self.committed[len(self.prompt) :], self.stats, self.finished)

    def _stopping(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def _window(self) -> int:
        """Blocks to keep in flight. With auto_window, enough to keep drafting busy for one round trip:
        while a block travels and is verified (rtt + verify time), the edge drafts the next ones, so
        the pipeline needs ceil((rtt + t_verify) / t_draft_block) + 1 blocks before the first verdict
        is back. Deeper windows only pay when guesses hold, which high acceptance makes likely."""
        if self.cfg.mode == "sync":
            return 1
        w = self.cfg.window
        rtt = self._rtt()
        if self.cfg.auto_window and rtt is not None and self.stats.k_chosen and self.stats.draft_s > 0 and self.stats.rounds:
            t_block = self.stats.draft_s / max(1, len(self.stats.k_chosen))
            t_cycle = rtt + self.stats.verify_s / self.stats.rounds
            w = max(w, min(self.cfg.max_window, int(np.ceil(t_cycle / max(t_block, 1e-4))) + 1))
        return w

    def _live(self) -> list[Block]:
        """The blocks in flight the edge still counts on: not doomed, not branches."""
        return [b for b in self.inflight if not b.doomed and b.alt_key is None]

    def _predraft_plan(self, blocking: bool) -> tuple[float | None, int | None] | None:
        """Pre-draft now instead of drafting the next block? (time budget, max_level) for the step, or None.
        - The window is full: the edge would idle; pre-draft up to the next verdict, at any depth.
        - The target has enough queued to stay busy while the edge takes a step and still drafts the
          next block in time (`_slack`): the block ahead gains nothing from being drafted early, so the
          step is free; any depth, within the slack. (With a target that verifies slower than the edge
          drafts, drafting ahead to the window's edge only queued blocks at the target, and left the
          likeliest rejections undrafted when their verdicts came.)
        - Otherwise, first tokens only, when they are worth more than the block ahead (`_outcomes_first`)."""
        dues = self._dues()  # once per pass of the wait loop: both estimates below read it
        until = None if dues is None else dues[0] - time.perf_counter()
        if blocking:
            return until, None
        slack = self._slack(dues)
        if slack is not None:
            # keep one single-outcome step in hand: estimates err, and an idle target costs more
            slack -= self.cache.step_estimate(1)
            if slack > self.cache.step_estimate(self.cache.cfg.batch):
                return (slack if until is None else min(until, slack)), None
        if self._outcomes_first():
            return until, 1
        return None

    def _dues(self) -> list[float] | None:
        """When each live block's verdict is expected (perf_counter); None before there is an estimate.
        Two lower bounds, the later one wins: the network's (sent + fastest recent round trip + verify
        time) and the target's (the previous verdict + verify time: with blocks queued at a busy target,
        verdicts come one verify apart). Without the second, a deep pipeline against a slow target
        looked overdue at once, and the edge idled instead of pre-drafting."""
        rtt = self._rtt()
        live = self._live()
        if rtt is None or not live or not self.stats.rounds:
            return None
        verify = self.stats.verify_s / self.stats.rounds
        prev = getattr(self.transport, "last_arrival", None)
        dues = []
        for b in live:
            due = b.sent_at + rtt + verify
            if prev is not None:
                due = max(due, prev + verify)
            dues.append(due)
            prev = due
        return dues

    def _until_verdict(self) -> float | None:
        """Seconds until the oldest live block's verdict is expected; None before there is an estimate."""
        dues = self._dues()
        return None if dues is None else dues[0] - time.perf_counter()

    def _slack(self, dues: list[float] | None = None) -> float | None:
        """Seconds the edge can spend before it must start drafting the next block, for that block to
        reach the target by the time the target has verified every live block queued before it. The
        target finishes the last one half a round trip before its verdict is due here; the next block
        takes its drafting time (its K tokens and the guessed bonus it starts with) plus half a round
        trip to get there. None before there is an estimate. `dues`: `_dues()`, if already at hand."""
        dues = self._dues() if dues is None else dues
        if dues is None or not self._main_drafted or self.drafter is None:
            return None
        t_block = self.stats.draft_s / self._main_drafted * (max(1, self.policy.next_k()) + 1)
        return dues[-1] - self._rtt() - t_block - time.perf_counter()

    def _rtt(self) -> float | None:
        """The path's round trip: a verdict's delay minus verify time also holds queueing behind
        earlier blocks at the target, so take the minimum of recent samples."""
        samples = getattr(self.transport, "rtt_samples", None)
        return min(list(samples)[-8:]) if samples else None

    def _resync(self) -> None:
        """After a dropped link: every block in flight is void; continue from what both sides agree on."""
        agreed = self.transport.resume(self.committed)
        if agreed != len(self.committed):
            raise RuntimeError(f"the target resumed at {agreed}, the edge holds {len(self.committed)} committed tokens")
        self.inflight.clear()
        self._planned.clear()
        self._extra.clear()
        self._alts.clear()
        self.spec = list(self.committed)
        self._ready = None
        if self.cache is not None:
            self.cache.clear()

    def _send_branch(self, e) -> None:
        """A pre-drafted outcome as its own block: `lead` (the outcome's tokens) is the overlap the
        target checks, so it is verified only if that outcome really happened, and dropped otherwise."""
        if self.transport_needs_q:
            return  # rules that need q would need rows for the lead tokens too; keep branches to q-free rules
        block = Block(
            self.seq, e.base, list(e.lead) + list(e.tokens), None, len(e.lead), alt_key=e.key,
            top=[None] * len(e.lead) + list(e.top), cached=len(e.tokens),
        )
        self.seq += 1
        self.inflight.append(block)
        self._alts[e.key] = block
        block.sent_at = time.perf_counter()
        self.transport.send(block)
        self.stats.cache["branches_sent"] = self.stats.cache.get("branches_sent", 0) + 1

    @property
    def transport_needs_q(self) -> bool:
        return bool(self.drafter is not None and self.drafter.rule.info.needs_q)

    def _send_next_block(self) -> None:
        k = self.policy.next_k() if self.drafter is not None else 0
        live = self._live()
        # build on the committed length the target will have when it reaches this block if every live
        # block in flight is accepted in full; the first token is then our guess of the last bonus
        overlap = 1 if live else 0
        base = live[-1].base + len(live[-1].tokens) if live else len(self.spec)
        block_tokens: list[int] = []
        q = None
        top: list = []
        cached = 0
        ready, self._ready = self._ready, None
        if ready is not None and (live or self.committed[ready.base :] != ready.lead):
            ready = None  # it continued an outcome the committed prefix has since moved past
        if ready is not None:
            block_tokens, q, top = list(ready.tokens), ready.q, list(ready.top)
            cached = len(block_tokens)
            if len(block_tokens) < k and self.drafter is not None:
                # a partial pre-draft: its drafter state is in place, so finish the block from there
                d = self.drafter.draft(self.spec + block_tokens, k - len(block_tokens), min_conf=self.cfg.min_conf,
                                       keep_top=self.cache.cfg.alternatives + 1)
                self.stats.draft_s += d.seconds
                self._main_drafted += len(d.tokens)
                block_tokens += d.tokens
                top += d.top
                q = None if q is None or d.q is None else np.concatenate([q, d.q])
        elif k + overlap > 0 and self.drafter is not None:
            # sync mode with a cache: draft one token more than we send; it is the likely bonus,
            # and its q row lets the cache plan the full-accept outcomes
            extra = 1 if (self.cache is not None and self.cfg.mode == "sync") else 0
            keep_top = self.cache.cfg.alternatives + 1 if self.cache is not None else 0
            d = self.drafter.draft(
                self.spec, k + overlap + extra, min_conf=self.cfg.min_conf, min_tokens=overlap + 1, keep_top=keep_top
            )
            self.stats.draft_s += d.seconds
            self._main_drafted += len(d.tokens)
            block_tokens, q, top = d.tokens, d.q, d.top
            if extra and len(block_tokens) == k + overlap + extra:
                self._extra[self.seq] = (block_tokens[-1], top[-1] if top else None)
                block_tokens, top = block_tokens[:-1], top[:-1]
                q = None if q is None else q[:-1]
        self.stats.k_chosen.append(len(block_tokens) - overlap)
        block = Block(self.seq, base, block_tokens, q, overlap, top=top, cached=cached)
        self.seq += 1
        self.spec.extend(block_tokens)
        self.inflight.append(block)
        block.sent_at = time.perf_counter()
        self.transport.send(block)

    def _plan_cache(self) -> None:
        """Queue the likely outcomes of the live blocks in flight, oldest first, one block per call.
        A later block's outcomes can only happen if every block before it is accepted in full with the
        bonus the edge guessed, so they are weighted by that probability in the cache's one queue:
        idle time goes to the most probable outcomes, whichever block they belong to. (Planning only
        the oldest block left nothing drafted for the next one, whose verdict comes right after.)"""
        if self.cache is None:
            return
        live = self._live()
        if all(b.seq in self._planned for b in live):
            return  # the common case on every pass of the wait loop: nothing new to plan
        accept = self._accept_estimates()
        for b, nxt, guess, prior in self._chain(live, accept):
            if prior < self.cache.cfg.min_prob:
                return
            if b is not None and b.seq not in self._planned:
                if b.top:
                    self._plan_block(b, guess, nxt, accept, prior)
                return

    def _accept_estimates(self) -> list[float]:
        """Conditional acceptance per block position, P(accept i | accepted 0..i-1), Laplace-smoothed."""
        pa, pd = self.stats.pos_accepted, self.stats.pos_drafted
        return [(pa[i] + 1) / ((pa[i - 1] if i else pd[0]) + 2) for i in range(len(pa))] or [0.7]

    def _chain(self, live: list[Block], accept: list[float]):
        """(block, next block, the next block's bonus guess candidates, prior) along the live blocks,
        where prior = P(every earlier block accepted in full with the bonus the edge guessed); then
        (None, None, None, prior) for a block not drafted yet, whose prior is what drafting it now is worth."""
        prior = 1.0
        for j, b in enumerate(live):
            nxt = live[j + 1] if j + 1 < len(live) else None
            guess = nxt.top[0] if nxt is not None and nxt.overlap and nxt.top and nxt.top[0] is not None else None
            yield b, nxt, guess, prior
            for i in range(len(b.tokens) - b.overlap):
                prior *= accept[min(i, len(accept) - 1)]
            if guess is not None:
                ids, probs = guess
                hit = probs[ids == nxt.tokens[0]]
                prior *= float(hit[0]) if len(hit) else 0.0
        yield None, None, None, prior

    def _outcomes_first(self) -> bool:
        """Should the edge pre-draft before drafting the next block? Each is worth the probability that
        its work gets used: the next batched pre-draft step, the total probability of the outcomes it
        advances; the next block, the probability that every block in flight is accepted in full.
        With deep blocks the block ahead is often the long shot (a 16-token block at 0.95 per token
        is accepted whole about 44% of the time, two in a row 19%), and drafting it anyway left the
        likeliest rejection outcomes undrafted when their verdicts came."""
        live = self._live()
        if len(live) < 2:
            return False  # keep the target fed first: one block verifying, one queued behind it
        *_, (_, _, _, ahead) = self._chain(live, self._accept_estimates())
        return self.cache.next_step_value(max_level=1) >= ahead

    def _plan_block(self, b: Block, guess, nxt: Block | None, accept: list[float], prior: float) -> None:
        self._planned.add(b.seq)
        rows = list(b.top[b.overlap :])
        draft = b.tokens[b.overlap :]
        bonus_guess = None
        if guess is not None:
            bonus_guess = nxt.tokens[0]  # already in flight: not worth a cache entry
            rows.append(guess)
        elif b.seq in self._extra and self._extra[b.seq][1] is not None:
            rows.append(self._extra[b.seq][1])
        self.cache.cfg.depth = max(1, self.policy.next_k())
        committed_then = self.spec[: b.base + b.overlap] if b.base + b.overlap <= len(self.spec) else self.committed
        self.cache.plan_block(b.seq, committed_then, draft, rows, accept, bonus_guess=bonus_guess, prior=prior)

    def _apply(self, v: Verdict) -> None:
        block = self.inflight.popleft()
        self._extra.pop(block.seq, None)
        self._planned.discard(block.seq)  # bounded: only blocks in flight stay planned
        if block.alt_key is not None:
            self._alts.pop(block.alt_key, None)
        if v.seq != block.seq:
            raise RuntimeError(f"verdict for block {v.seq} arrived while block {block.seq} was expected")
        if v.dropped:
            self.stats.dropped += 1
            if v.finished:
                self.finished = True
            if not block.doomed and block.alt_key is None:
                # a block we still counted on was dropped: whatever it assumed did not happen, so
                # nothing built on it can be verified either; start again from the committed prefix
                self.spec = list(self.committed)
                for b in self.inflight:
                    b.doomed = True
            if self.cache is not None:
                self.cache.discard_block(v.seq)
            return
        o = len(self.committed) - block.base
        new = block.tokens[o:]
        drafted = len(new)
        emitted = new[: v.accepted] + [v.next_token]
        self.committed.extend(emitted)
        if len(self.committed) != v.committed:
            raise RuntimeError(f"edge and target disagree on the committed length ({len(self.committed)} vs {v.committed})")
        self.stats.observe_block(drafted, v.accepted)
        self.stats.verify_s += v.verify_us / 1e6
        obs = {"verify_s": v.verify_us / 1e6}
        if self._main_drafted:  # blocks drafted on the critical path only, not cache pre-drafts
            obs["draft_s_per_token"] = self.stats.draft_s / self._main_drafted
        rtt = self._rtt()
        if rtt is not None:
            obs["rtt_s"] = rtt
        self.policy.update(drafted, v.accepted, **obs)
        if getattr(self.policy, "min_conf", None) is not None:
            self.cfg.min_conf = float(self.policy.min_conf)
        now = time.perf_counter() - self._t0
        if self.stats.emitted == 0:
            self.stats.ttft_s = now
        self.stats.emitted += len(emitted)
        self.stats.token_times.extend([now] * len(emitted))
        if self.on_tokens:
            self.on_tokens(emitted)
        if self.on_round:
            self._report(block, o, v, emitted, drafted, rtt)
        if v.finished:
            self.finished = True
        # keep speculating only while the assumptions still extend what was committed
        n = len(self.committed)
        if block.alt_key is None:
            # the other outcomes' branches of this block can no longer be verified
            for key in [k for k in self._alts if k[0] == block.seq]:
                if key != (v.seq, v.accepted, v.next_token):
                    self._alts.pop(key).doomed = True
        # After a rejection the rest of the block is gone even when the recovered token equals the
        # rejected draft token (a prefix match alone would keep that stale tail in `spec`, every later
        # block would build past the committed length, and the target would drop them forever).
        if v.accepted < drafted or len(self.spec) < n or self.spec[:n] != self.committed:
            self.spec = list(self.committed)
            branch = self._alts.pop((v.seq, v.accepted, v.next_token), None)
            for b in self.inflight:
                if b is not branch:
                    b.doomed = True
            # cache keys count accepted tokens from the block's own overlap; a doomed block that the
            # target verified from elsewhere (o != overlap) has no valid key
            if self.cache is not None and not v.finished and o == block.overlap and not block.doomed:
                hit = self.cache.lookup(v.seq, v.accepted, v.next_token, rejected=v.accepted < drafted)
                observe = getattr(self.policy, "observe", None)  # duck-typed policies may have none
                if observe is not None:
                    observe(cache_hit=float(hit is not None))
                if branch is not None and hit is not None:
                    # the target will verify that branch next: speculate on past it at once
                    branch.alt_key = None
                    self.spec = list(self.committed) + list(hit.tokens)
                    self.stats.cache["branch_hits"] = self.stats.cache.get("branch_hits", 0) + 1
                elif hit is not None:
                    self._ready = hit
        if self.cache is not None:
            self.cache.discard_block(v.seq)

    def _report(self, block: Block, o: int, v: Verdict, emitted: list[int], drafted: int, rtt: float | None) -> None:
        """Hand the applied verdict to `on_round`. Accepted token i sits at block.tokens[o + i]; the
        cache's part of the block is the `cached` tokens right after the overlap."""
        lo, hi = block.overlap, block.overlap + block.cached
        origins = [ORIGIN_CACHE if lo <= o + i < hi else ORIGIN_DRAFT for i in range(v.accepted)] + [ORIGIN_TARGET]
        self.on_round(Round(
            tokens=list(emitted), origins=origins, drafted=drafted, accepted=v.accepted,
            latency_s=time.perf_counter() - block.sent_at, verify_s=v.verify_us / 1e6, rtt_s=rtt,
        ))
