"""How much of an edge's draft a cloud-led step should verify: priced, so speculation never costs the user.

A cloud-led session's cloud steps without waiting; before each step it may verify k tokens of a draft
that agrees with the stream (`engine.board`). That step emits `E(k)` tokens on average and costs
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
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LeadConfig:
    k_max: int = 16  # most draft tokens one step verifies
    prior_accept: float = 0.7  # acceptance assumed at the first draft position before any is seen
    prior_weight: float = 2.0  # how many observations a prior is worth (a deeper position's prior is its predecessor's estimate)
    decay: float = 0.97  # per-observation forgetting of acceptance
    prior_row_cost: float = 0.05  # extra cost of one draft row, as a fraction of a step, before one is measured
    probe_every: int = 32  # with drafting priced out, the step after this many plain ones verifies a short draft anyway ...
    probe_gap_max: int = 1024  # ... each probe that leaves drafting priced out doubles that gap, up to this (one kept whole resets it)
    probe_k: int = 2  # how long that probe is
    explore_every: int = 8  # one drafting step in this many tries a deeper k whose cost is not measured yet ...
    explore_within: float = 0.9  # ... if its estimated rate is at least this share of the best measured one


@dataclass
class LeadPricer:
    cfg: LeadConfig = field(default_factory=LeadConfig)
    # per draft position i: (weighted accepted, weighted reached)
    _acc: list[list[float]] = field(default_factory=list)
    _cost: dict[int, float] = field(default_factory=dict)  # k -> EWMA of a step's own time at that k (0: a plain step)
    _other: float = 0.0  # EWMA of time outside the session's own pass
    _since_draft: int = 0
    _since_explore: int = 0
    _probe_gap: int = 0  # plain steps before the next probe (backs off while probes change nothing)
    _probe: int = 0  # the depth of the probe in flight (0: none)

    def __post_init__(self) -> None:
        self._acc = [[0.0, 0.0] for _ in range(self.cfg.k_max)]
        self._probe_gap = self.cfg.probe_every

    # -- what was seen -----------------------------------------------------------------------------
    def observe(self, drafted: int, accepted: int, own_s: float, wall_s: float | None = None) -> None:
        """One step: `drafted` tokens verified, `accepted` kept, `own_s` its pass, `wall_s` all it took."""
        c = self.cfg
        for i in range(min(drafted, c.k_max)):  # position i was reached; kept iff i < accepted
            a = self._acc[i]
            a[0] = a[0] * c.decay + (1.0 if i < accepted else 0.0)
            a[1] = a[1] * c.decay + 1.0
            if i >= accepted:
                break  # positions after a rejection were never judged
        if self._probe and drafted == self._probe:
            if accepted == drafted:  # a probe kept whole: drafts may be good again, so probe promptly
                self._probe_gap = c.probe_every
            self._probe = 0
        old = self._cost.get(drafted)
        self._cost[drafted] = own_s if old is None else 0.8 * old + 0.2 * own_s
        if wall_s is not None:
            self._other = 0.8 * self._other + 0.2 * max(0.0, wall_s - own_s)

    def accept(self, i: int) -> float:
        c = self.cfg
        prior = c.prior_accept if i == 0 else self.accept(i - 1)
        a, n = self._acc[i]
        return (a + prior * c.prior_weight) / (n + c.prior_weight)

    def cost(self, k: int) -> float:
        """Expected own time of a step that verifies k draft tokens: measured where it was, else
        interpolated between measured depths, else extended from the deepest two (a pass's cost per
        row falls as it grows on a CPU, so a line through shallow passes would overprice deep ones)."""
        if k in self._cost:
            return self._cost[k]
        pts = sorted(self._cost.items())
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

    def expected_tokens(self, k: int) -> float:
        e, reach = 1.0, 1.0
        for i in range(min(k, self.cfg.k_max)):
            reach *= self.accept(i)
            e += reach
        return e

    # -- the choice ----------------------------------------------------------------------------------
    def choose(self, available: int) -> int:
        """Draft tokens to verify this step, out of `available` that agree with the stream."""
        c = self.cfg
        n = min(available, c.k_max)
        if n <= 0 or 0 not in self._cost:  # a draft's rows are priced against a measured plain step (the first is one)
            return 0
        if not any(k > 0 for k in self._cost):
            # a draft row's cost is still a guess (a GPU's 5% of a step, or nearly a whole step on one
            # CPU thread): the first draft is as short as a probe, so a wrong guess costs one probe
            n = min(n, c.probe_k)
        best_k, best_rate = 0, 1.0 / (self.cost(0) + self._other)
        for k in range(1, n + 1):
            rate = self.expected_tokens(k) / (self.cost(k) + self._other)
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
            close = self.expected_tokens(deeper) / (self.cost(deeper) + self._other) >= c.explore_within * best_rate
            if deeper > best_k and deeper not in self._cost and close and self._since_explore >= c.explore_every:
                best_k, self._since_explore = deeper, 0
        if best_k:
            self._since_draft = 0
        return best_k

    def describe(self) -> dict:
        return {"accept": [round(self.accept(i), 3) for i in range(min(4, self.cfg.k_max))],
                "cost_ms": {k: round(1e3 * v, 2) for k, v in sorted(self._cost.items())}, "other_ms": round(1e3 * self._other, 2)}
