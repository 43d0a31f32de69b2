"""When the edge does what: the loop's scheduler owns every timing estimate.

The protocol core (`loop.py`) asks it four questions, all answered from the transport's declared link
timing (`Transport.rtt_samples`, `last_arrival`, `link_samples`), the run's statistics and the loop's
clock, never from the wall clock directly, so a simulator can drive the same loop on virtual time:

- how many blocks to keep in flight (`window`);
- when each live block's verdict is due (`dues`, `until_verdict`);
- how long the next block can wait before the target runs dry (`slack`);
- whether to pre-draft cache outcomes now instead of drafting the next block (`predraft_plan`).

It also turns the link samples into what the depth controller prices (`link_observations`): the round
trip, the uplink's rate and the uplink bytes a draft token costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from acespec.loop.records import InFlight, LinkSample, LoopConfig
from acespec.loop.stats import RunStats
from acespec.loop.transport import Clock, Transport

RTT_WINDOW = 8  # recent round trips the path estimate takes its minimum over
RATE_WINDOW = 16  # recent blocks the uplink fit uses: a few seconds of verdicts, so it follows a link that changes
MIN_BYTE_SPREAD = 64.0  # blocks whose sizes vary less than this (std, bytes) cannot show a per-byte cost through jitter


class Scheduler:
    def __init__(
        self, cfg: LoopConfig, transport: Transport, stats: RunStats, inflight: InFlight, clock: Clock
    ) -> None:
        self.cfg = cfg
        self.transport = transport
        self.stats = stats
        self.inflight = inflight
        self.clock = clock
        self.main_drafted = 0  # tokens drafted on the critical path (cache pre-drafts are timed by the cache)
        self.catchup_s = 0.0  # of stats.draft_s: the drafter reading tokens committed by plain steps

    # -- what the edge measured -----------------------------------------------------------------
    def drafted(self, tokens: int, seconds: float, catchup_s: float = 0.0) -> None:
        """A block (or the rest of a partly pre-drafted one) was drafted on the critical path;
        `catchup_s` of `seconds` went to reading tokens committed while it sat out (`DraftBlock`)."""
        self.stats.draft_s += seconds
        self.stats.draft_tokens += tokens
        self.main_drafted += tokens
        self.catchup_s += catchup_s

    def draft_s_per_token(self) -> float | None:
        """What drafting one more token costs: catching up after plain steps is paid once per return
        to drafting, not per token, so it is left out."""
        return (self.stats.draft_s - self.catchup_s) / self.main_drafted if self.main_drafted else None

    def rtt(self) -> float | None:
        """The path's round trip: a verdict's delay minus verify time also holds queueing behind
        earlier blocks at the target, so take the minimum of recent samples."""
        samples = self.transport.rtt_samples
        return min(list(samples)[-RTT_WINDOW:]) if samples else None

    # -- the window -----------------------------------------------------------------------------
    def window(self) -> int:
        """Blocks to keep in flight. With auto_window, enough to keep drafting busy for one round trip:
        while a block travels and is verified (rtt + verify time), the edge drafts the next ones, so
        the pipeline needs ceil((rtt + t_verify) / t_draft_block) + 1 blocks before the first verdict
        is back. Deeper windows only pay when guesses hold, which high acceptance makes likely."""
        if self.cfg.mode == "sync":
            return 1
        w = self.cfg.window
        rtt = self.rtt()
        st = self.stats
        if self.cfg.auto_window and rtt is not None and st.k_chosen and st.draft_s > 0 and st.rounds:
            t_block = st.draft_s / max(1, len(st.k_chosen))
            t_cycle = rtt + st.verify_s / st.rounds
            w = max(w, min(self.cfg.max_window, int(np.ceil(t_cycle / max(t_block, 1e-4))) + 1))
        return w

    # -- verdict due times ----------------------------------------------------------------------
    def dues(self) -> list[float] | None:
        """When each live block's verdict is expected (on the loop's clock); None before there is an
        estimate. Two lower bounds, the later one wins: the network's (sent + fastest recent round
        trip + verify time) and the target's (the previous verdict + verify time: with blocks queued at
        a busy target, verdicts come one verify apart). Without the second, a deep pipeline against a
        slow target looked overdue at once, and the edge idled instead of pre-drafting."""
        rtt = self.rtt()
        live = self.inflight.live()
        if rtt is None or not live or not self.stats.rounds:
            return None
        verify = self.stats.verify_s / self.stats.rounds
        prev = self.transport.last_arrival
        dues = []
        for b in live:
            due = b.sent_at + rtt + verify
            if prev is not None:
                due = max(due, prev + verify)
            dues.append(due)
            prev = due
        return dues

    def until_verdict(self) -> float | None:
        """Seconds until the oldest live block's verdict is expected; None before there is an estimate."""
        dues = self.dues()
        return None if dues is None else dues[0] - self.clock()

    def slack(self, next_k: int, dues: list[float] | None = None) -> float | None:
        """Seconds the edge can spend before it must start drafting the next block (`next_k` tokens),
        for that block to reach the target by the time the target has verified every live block
        queued before it. The target finishes the last one half a round trip before its verdict is
        due here; the next block takes its drafting time (its K tokens and the guessed bonus it starts
        with) plus half a round trip to get there. None before there is an estimate. `dues`: `dues()`,
        if already at hand."""
        dues = self.dues() if dues is None else dues
        per_token = self.draft_s_per_token()
        rtt = self.rtt()
        if dues is None or per_token is None or rtt is None:
            return None
        t_block = per_token * (max(1, next_k) + 1)
        return dues[-1] - rtt - t_block - self.clock()

    # -- pre-drafting ---------------------------------------------------------------------------
    def predraft_plan(
        self, blocking: bool, cache, next_k: int, outcomes_first: Callable[[], bool]
    ) -> tuple[float | None, int | None] | None:
        """Pre-draft now instead of drafting the next block? (time budget, max_level) for the step, or None.
        - The window is full: the edge would idle; pre-draft up to the next verdict, at any depth.
        - The target has enough queued to stay busy while the edge takes a step and still drafts the
          next block in time (`slack`): the block ahead gains nothing from being drafted early, so the
          step is free; any depth, within the slack. (With a target that verifies slower than the edge
          drafts, drafting ahead to the window's edge only queued blocks at the target, and left the
          likeliest rejections undrafted when their verdicts came.)
        - Otherwise, first tokens only, when they are worth more than the block ahead (`outcomes_first`,
          the planner's call)."""
        dues = self.dues()  # once per pass of the wait loop: both estimates below read it
        until = None if dues is None else dues[0] - self.clock()
        if blocking:
            return until, None
        slack = self.slack(next_k, dues)
        if slack is not None:
            # keep one single-outcome step in hand: estimates err, and an idle target costs more
            slack -= cache.step_estimate(1)
            if slack > cache.step_estimate(cache.cfg.batch):
                return (slack if until is None else min(until, slack)), None
        if outcomes_first():
            return until, 1
        return None

    # -- what the controller prices -------------------------------------------------------------
    def link_observations(self) -> dict[str, float]:
        """The link estimates for the depth controller, as `DepthPolicy.update` keywords: `rtt_s`, and,
        where the recent blocks can tell, `up_bps` and `bytes_per_token` (see `uplink_rate` and
        `uplink_bytes_per_token`). A key the link cannot estimate is left out, so the controller keeps
        its previous estimate (or its prior) rather than taking a guess."""
        obs: dict[str, float] = {}
        rtt = self.rtt()
        if rtt is not None:
            obs["rtt_s"] = rtt
        recent = list(self.transport.link_samples)[-RATE_WINDOW:]
        bpt = uplink_bytes_per_token(recent)
        if bpt is not None:
            obs["bytes_per_token"] = bpt
        up = uplink_rate(recent)
        if up is not None:
            obs["up_bps"] = up
        return obs


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares line y = a + b x: (a, b)."""
    xm, ym = x.mean(), y.mean()
    b = float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())
    return float(ym - b * xm), b


def uplink_rate(samples: Sequence[LinkSample]) -> float | None:
    """The uplink's rate in bits/s, from how a block's round trip grows with its size: on a link of
    rate R a block of b bytes spends 8 b / R serialising (and queueing behind the blocks before it),
    so rtt_i = a + 8 b_i / R, fitted by least squares over the recent blocks. (Bytes over elapsed time
    would measure what the edge chose to send, not what the link can carry.) None when the recent
    blocks do not tell: their sizes vary too little for a per-byte cost to show through jitter (e.g.
    token ids only, a few bytes each), or the fit finds no positive cost per byte. Either way the
    uplink is then not what limits a block, and the controller keeps its last estimate."""
    pts = [(s.bytes_up, s.rtt_s) for s in samples if s.bytes_up > 0]
    if len(pts) < 4:
        return None
    b, rtt = np.asarray(pts, dtype=float).T
    if b.std() < MIN_BYTE_SPREAD:
        return None
    _, s_per_byte = _fit(b, rtt)
    return 8.0 / s_per_byte if s_per_byte > 0 else None


def uplink_bytes_per_token(samples: Sequence[LinkSample]) -> float | None:
    """Uplink bytes each draft token adds to a block: the slope of frame bytes over tokens, so the
    frame's fixed header (which the controller counts on its own) is not spread over the tokens. With
    every recent block the same length the slope cannot be fitted; then the pooled ratio, which counts
    the header in, errs on the side of a costlier token."""
    pts = [(s.tokens, s.bytes_up) for s in samples if s.bytes_up > 0 and s.tokens > 0]
    if not pts:
        return None
    n, b = np.asarray(pts, dtype=float).T
    if len(pts) >= 4 and n.std() >= 1.0:
        _, per_token = _fit(n, b)
        if per_token > 0:
            return per_token
    return float(b.sum() / n.sum())
