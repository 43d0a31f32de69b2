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
small, bounded share of steps probes a short draft when drafting is off, so a session whose drafts
become good again is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LeadConfig:
    k_max: int = 16  # most draft tokens one step verifies
    prior_accept: float = 0.7  # acceptance assumed at a position before any is seen
    prior_weight: float = 2.0  # how many observations the prior is worth
    decay: float = 0.97  # per-observation forgetting of acceptance and costs
    prior_row_cost: float = 0.05  # extra cost of one draft row, as a fraction of a step, before one is measured
    probe_every: int = 32  # with drafting priced out, one step in this many verifies a short draft anyway
    probe_k: int = 2  # how long that probe is


@dataclass
class LeadPricer:
    cfg: LeadConfig = field(default_factory=LeadConfig)
    # per draft position i: (weighted accepted, weighted reached)
    _acc: list[list[float]] = field(default_factory=list)
    _step_t: float | None = None  # EWMA of a plain step's own time
    _row_t: float | None = None  # EWMA of what one draft row adds to it
    _other: float = 0.0  # EWMA of time outside the session's own pass
    _since_draft: int = 0

    def __post_init__(self) -> None:
        self._acc = [[0.0, 0.0] for _ in range(self.cfg.k_max)]

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
        ew = lambda old, new: new if old is None else 0.8 * old + 0.2 * new  # noqa: E731
        if drafted == 0:
            self._step_t = ew(self._step_t, own_s)
        elif self._step_t is not None:
            self._row_t = ew(self._row_t, max(0.0, own_s - self._step_t) / drafted)
        if wall_s is not None:
            self._other = 0.8 * self._other + 0.2 * max(0.0, wall_s - own_s)

    def accept(self, i: int) -> float:
        a, n = self._acc[i]
        c = self.cfg
        return (a + c.prior_accept * c.prior_weight) / (n + c.prior_weight)

    def cost(self, k: int) -> float:
        """Expected own time of a step that verifies k draft tokens: a step plus k rows."""
        step = 1.0 if self._step_t is None else self._step_t
        row = step * self.cfg.prior_row_cost if self._row_t is None else self._row_t
        return step + row * k

    def expected_tokens(self, k: int) -> float:
        e, reach = 1.0, 1.0
        for i in range(min(k, self.cfg.k_max)):
            reach *= self.accept(i)
            e += reach
        return e

    # -- the choice ----------------------------------------------------------------------------------
    def choose(self, available: int) -> int:
        """Draft tokens to verify this step, out of `available` that agree with the stream."""
        n = min(available, self.cfg.k_max)
        if self._row_t is None:  # a draft row's cost is still a guess: keep the first drafts short
            n = min(n, 2 * self.cfg.probe_k)
        if n <= 0:
            return 0
        best_k, best_rate = 0, 1.0 / (self.cost(0) + self._other)
        for k in range(1, n + 1):
            rate = self.expected_tokens(k) / (self.cost(k) + self._other)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        if best_k == 0:
            self._since_draft += 1
            if self._since_draft >= self.cfg.probe_every:
                best_k = min(n, self.cfg.probe_k)
        if best_k:
            self._since_draft = 0
        return best_k

    def describe(self) -> dict:
        return {"accept": [round(self.accept(i), 3) for i in range(min(4, self.cfg.k_max))],
                "step_ms": None if self._step_t is None else round(1e3 * self._step_t, 2),
                "row_ms": None if self._row_t is None else round(1e3 * self._row_t, 3), "other_ms": round(1e3 * self._other, 2)}
