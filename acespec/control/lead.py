"""How much of an edge's draft a cloud-led step should verify: priced, so speculation never costs the user.

A cloud-led session's cloud steps without waiting; before each step it may verify k tokens of a draft
that agrees with the stream (`loop.board`). That step emits `E(k)` tokens on average and costs
`t(k) + other` seconds (`other`: what the step waits for besides its own pass, e.g. other sessions in
a CPU tick). The pricer picks the k that maximises tokens per second,

    E(k) = 1 + sum_{j=1..k} prod_{i<j} a_i          (a_i: acceptance at draft position i, given i reached)
    rate(k) = E(k) / (t(k) + other)

and k = 0 (a plain step, cloud-only's) whenever no draft beats it. On a GPU t(k) is nearly flat, so any
agreeing draft pays; on a CPU a (k+1)-row pass costs several steps, so only well-accepted drafts do.
Acceptance and costs are learned online from the session's own steps (exponentially weighted); a
small share of steps probes a short draft when drafting is off, so a session whose drafts become
good again is noticed. Each probe that leaves drafting priced out doubles the gap to the next (one
kept whole resets it), so on drafts that stay poor (sampling at T = 1 on a CPU, where a probe costs
most of a step more) probing costs a vanishing share of the session, not a fixed one.

Two things one session cannot see alone:

- *Its rows are paid for by everyone in its pass.* In a batched tick (or a vLLM step) a session's k
  draft rows lengthen the pass that `shared` sessions wait for, so a step is priced at
  `t(0) + shared * (t(k) - t(0))`: drafting pays only where its extra tokens outweigh the time it takes
  from every session in the pass, not just from its own. A session that priced only its own share drew
  other sessions below cloud-only (ShareGPT at T = 1, 4 and 8 sessions: 0.94x).
- *What the sessions before it learned.* A `LeadMemory` (one per server or vLLM worker) keeps the
  acceptance and the row costs (seconds k rows add to a pass) that every session observed. A new
  session takes its acceptance prior and unmeasured row costs from there, not from fixed guesses: on
  a fleet whose drafts are poor it no longer opens with a draft that a 0.7 prior priced in, and on one
  whose drafts are good it drafts at its second step with no probe. Its own observations outweigh the
  memory within a few steps, and it probes as before, so a session unlike the fleet is still noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from acespec.control.estimates import expected_tokens


@dataclass
class LeadConfig:
    k_max: int = 16  # most draft tokens one step verifies
    prior_accept: float = 0.7  # acceptance assumed at the first draft position before any is seen
    prior_weight: float = (
        2.0  # how many observations a prior is worth (a deeper position's prior is its predecessor's estimate)
    )
    decay: float = 0.97  # per-observation forgetting of acceptance
    prior_row_cost: float = 0.05  # extra cost of one draft row, as a fraction of a step, before one is measured
    probe_every: int = (
        32  # with drafting priced out, the step after this many plain ones verifies a short draft anyway ...
    )
    probe_gap_max: int = (
        1024  # ... each probe that leaves drafting priced out doubles that gap, up to this (one kept whole resets it)
    )
    probe_k: int = 2  # how long that probe is
    explore_every: int = 8  # one drafting step in this many tries a deeper k whose cost is not measured yet ...
    explore_within: float = 0.9  # ... if its estimated rate is at least this share of the best measured one


@dataclass
class LeadMemory:
    """What a server's cloud-led sessions observed, kept for the sessions after them (see above)."""

    cfg: LeadConfig = field(default_factory=LeadConfig)
    decay: float = 0.995  # per-observation forgetting (all sessions' steps together: a few hundred)
    _acc: list[list[float]] = field(default_factory=list)  # per draft position: (weighted accepted, weighted reached)
    _extra: dict[int, float] = field(default_factory=dict)  # k -> EWMA of t(k) - t(0), seconds, over sessions

    def __post_init__(self) -> None:
        self._acc = [[0.0, 0.0] for _ in range(self.cfg.k_max)]

    def observe(self, drafted: int, accepted: int) -> None:
        _count(self._acc, drafted, accepted, self.decay)

    def observe_cost(self, k: int, extra_s: float) -> None:
        """A pass with k draft rows took `extra_s` longer than the session's plain steps: what its rows
        cost, which (unlike the pass's whole time) does not grow with the sessions in a tick."""
        old = self._extra.get(k)
        self._extra[k] = extra_s if old is None else 0.9 * old + 0.1 * extra_s

    def accepts(self, n: int) -> list[float]:
        """Acceptance at draft positions 0..n-1 (each position's prior is its predecessor's estimate)."""
        return _accepts(self._acc, n, self.cfg.prior_accept, self.cfg.prior_weight)

    def extras(self) -> dict[int, float]:
        return dict(self._extra)


def _count(acc: list[list[float]], drafted: int, accepted: int, decay: float) -> None:
    for i in range(min(drafted, len(acc))):  # position i was reached; kept iff i < accepted
        a = acc[i]
        a[0] = a[0] * decay + (1.0 if i < accepted else 0.0)
        a[1] = a[1] * decay + 1.0
        if i >= accepted:
            break  # positions after a rejection were never judged


def _accepts(acc: list[list[float]], n: int, prior: float | list[float], weight: float) -> list[float]:
    """Smoothed acceptance per position: `prior` is position 0's (a list: one per position), and a
    deeper position's default prior is its predecessor's estimate."""
    out: list[float] = []
    for i in range(min(n, len(acc))):
        pr = prior[i] if isinstance(prior, list) else (prior if i == 0 else out[-1])
        a, m = acc[i]
        out.append((a + pr * weight) / (m + weight))
    return out


@dataclass
class LeadPricer:
    cfg: LeadConfig = field(default_factory=LeadConfig)
    memory: LeadMemory | None = None  # the server's: priors from earlier sessions, and where this one's steps go too
    # per draft position i: (weighted accepted, weighted reached)
    _acc: list[list[float]] = field(default_factory=list)
    _cost: dict[int, float] = field(default_factory=dict)  # k -> EWMA of a step's own time at that k (0: a plain step)
    _other: float = 0.0  # EWMA of time outside the session's own pass
    _since_draft: int = 0
    _since_explore: int = 0
    _probe_gap: int = 0  # plain steps before the next probe (backs off while probes change nothing)
    _probe: int = 0  # the depth of the probe in flight (0: none)
    _shared: float = 0.0  # EWMA of how many sessions' rows were in this session's passes (0: none seen)

    def __post_init__(self) -> None:
        self._acc = [[0.0, 0.0] for _ in range(self.cfg.k_max)]
        self._probe_gap = self.cfg.probe_every

    # -- what was seen -----------------------------------------------------------------------------
    def observe(
        self,
        drafted: int,
        accepted: int,
        own_s: float,
        wall_s: float | None = None,
        shared: int = 1,
        timed: bool = True,
    ) -> None:
        """One step: `drafted` tokens verified, `accepted` kept, `own_s` its pass, `wall_s` all it took,
        `shared`: sessions whose rows were in that pass (this one included). `timed` False: the pass also
        prefilled other sessions' prompts, so its time teaches nothing of what a step costs (a second of
        prompt rows in a plain step's estimate would make every draft look free beside it)."""
        c = self.cfg
        _count(self._acc, drafted, accepted, c.decay)
        if self.memory is not None:
            self.memory.observe(drafted, accepted)
        if self._probe and drafted == self._probe:
            if accepted == drafted:  # a probe kept whole: drafts may be good again, so probe promptly
                self._probe_gap = c.probe_every
            self._probe = 0
        if not timed:
            return
        self._shared = float(shared) if not self._shared else 0.8 * self._shared + 0.2 * shared
        if self.memory is not None and drafted and 0 in self._cost:
            self.memory.observe_cost(drafted, own_s - self._cost[0])
        old = self._cost.get(drafted)
        self._cost[drafted] = own_s if old is None else 0.8 * old + 0.2 * own_s
        if wall_s is not None:
            self._other = 0.8 * self._other + 0.2 * max(0.0, wall_s - own_s)

    def accepts(self, n: int) -> list[float]:
        """Acceptance at draft positions 0..n-1: this session's, its prior the memory's (else the config's)."""
        c = self.cfg
        prior = self.memory.accepts(n) if self.memory is not None else c.prior_accept
        return _accepts(self._acc, n, prior, c.prior_weight)

    def accept(self, i: int) -> float:
        return self.accepts(i + 1)[i]

    def _points(self) -> list[tuple[int, float]]:
        """Measured step costs by depth; depths this session has not measured: its plain step plus what
        the memory says k rows add."""
        pts = dict(self._cost)
        if self.memory is not None and 0 in pts:
            for k, extra in self.memory.extras().items():
                pts.setdefault(k, pts[0] + max(0.0, extra))
        return sorted(pts.items())

    def cost(self, k: int) -> float:
        """Expected own time of a step that verifies k draft tokens: measured where it was, else
        interpolated between measured depths, else extended from the deepest two (a pass's cost per
        row falls as it grows on a CPU, so a line through shallow passes would overprice deep ones)."""
        if k in self._cost:
            return self._cost[k]
        pts = self._points()
        if any(p == k for p, _ in pts):
            return dict(pts)[k]
        if not pts or pts[0][0] != 0:  # no plain step measured yet: a unit step
            step = pts[0][1] / (1 + self.cfg.prior_row_cost * pts[0][0]) if pts else 1.0
            pts = [(0, step)] + pts
        lo = max((p for p in pts if p[0] < k), default=None)
        hi = min((p for p in pts if p[0] > k), default=None)
        if lo is not None and hi is not None:
            return lo[1] + (hi[1] - lo[1]) * (k - lo[0]) / (hi[0] - lo[0])
        (k1, t1) = pts[-1]
        if len(pts) >= 2:
            (k0, t0) = pts[-2]
            slope = max(0.0, (t1 - t0) / (k1 - k0))
        else:
            slope = t1 * self.cfg.prior_row_cost
        return t1 + slope * (k - k1)

    def expected_tokens(self, k: int, accepts: list[float] | None = None) -> float:
        k = min(k, self.cfg.k_max)
        return expected_tokens(accepts if accepts is not None else self.accepts(k), k)

    def step_cost(self, k: int) -> float:
        """What a step at depth k costs this session, counting its rows against everyone in its pass."""
        c0 = self.cost(0)
        return c0 + max(1.0, self._shared) * max(0.0, self.cost(k) - c0) + self._other

    # -- the choice ----------------------------------------------------------------------------------
    def choose(self, available: int) -> int:
        """Draft tokens to verify this step, out of `available` that agree with the stream."""
        c = self.cfg
        n = min(available, c.k_max)
        if n <= 0 or 0 not in self._cost:  # a draft's rows are priced against a measured plain step (the first is one)
            return 0
        if not any(k > 0 for k, _ in self._points()):
            # a draft row's cost is still a guess (a GPU's 5% of a step, or nearly a whole step on one
            # CPU thread): the first draft is as short as a probe, so a wrong guess costs one probe
            n = min(n, c.probe_k)
        accepts = self.accepts(c.k_max)
        best_k, best_rate = 0, 1.0 / self.step_cost(0)
        for k in range(1, n + 1):
            rate = self.expected_tokens(k, accepts) / self.step_cost(k)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        if best_k == 0:
            self._since_draft += 1
            if self._since_draft >= self._probe_gap:
                best_k = self._probe = min(n, c.probe_k)
                self._probe_gap = min(2 * self._probe_gap, max(c.probe_every, c.probe_gap_max))
        else:
            self._probe_gap = c.probe_every  # drafting pays again: probe promptly the next time it stops
            self._since_explore += 1
            deeper = min(n, max(best_k + 2, 2 * best_k))
            # an unmeasured deeper depth is tried only if its estimate comes close to the best: on a CPU
            # whose rows cost as much as a step, probing ever deeper would itself cost the user
            close = self.expected_tokens(deeper, accepts) / self.step_cost(deeper) >= c.explore_within * best_rate
            if deeper > best_k and deeper not in self._cost and close and self._since_explore >= c.explore_every:
                best_k, self._since_explore = deeper, 0
        if best_k:
            self._since_draft = 0
        return best_k

    def describe(self) -> dict:
        return {
            "accept": [round(a, 3) for a in self.accepts(min(4, self.cfg.k_max))],
            "cost_ms": {k: round(1e3 * v, 2) for k, v in sorted(self._cost.items())},
            "other_ms": round(1e3 * self._other, 2),
            "shared": round(self._shared, 2),
        }
