"""The depth controller (`--policy controller`; docs/concepts/modes.md): a cost-model controller for K and fan-out B.

Each round the controller picks the draft depth K (and the branch fan-out B, 1 = a plain chain) that
maximises the expected committed tokens per second, from estimates it keeps online. All estimates
start at the priors in `ControllerConfig`; an observation key that never arrives leaves its prior in
place. Before the first verdict `next_k()` returns `k_init`.

Estimates
---------
* Per-position acceptance a_i (i = 0-based position in the block): the probability that draft
  position i is accepted *given that every earlier position was*. After a verdict (drafted d,
  accepted n), position i was reached iff i < d and i <= n, and accepted iff i < n. (Counting every
  i < d as an observation would estimate P(n > i) = a_0 ... a_i instead, and the product below would
  count the earlier positions twice.) Each position keeps exponentially discounted counts, s_i of
  acceptances and m_i of observations; every round all counts are multiplied by (1 - accept_ema) before
  the new ones are added, so this is an EMA with weight accept_ema (bias-corrected: the first
  observation is not diluted by a zero start). A position seen rarely (e.g. deeper than any K drafted
  lately) shrinks towards the pooled acceptance over all positions, itself shrunk to the prior:

      a_pool = (S + w0 * prior_accept) / (M + w0)
      a_i    = (s_i + w * a_pool) / (m_i + w)              w = accept_shrink

  w0 is `accept_prior_weight` pseudo-observations made before the first verdict, discounted with the
  real ones (w0 = accept_prior_weight (1 - accept_ema)^rounds): a prior held at full weight kept a
  fixed share of an estimate whose counts only hold ~1 / accept_ema rounds, and at 98.7% per token
  the controller believed 96-97%. A verdict that judged no draft token (drafted = 0) changes nothing.

* Expected tokens per round (accepted draft tokens + the one recovered/bonus token):

      E[K] = 1 + sum_{j=1..K} prod_{i<j} a_i               (constant a: (1 - a^(K+1)) / (1 - a))

* Drafter time per token t_d, RTT, uplink rate (bits/s, 0 = unlimited, as in `acespec.net`), bytes
  per draft token and state-cache bytes per entry: bias-corrected EMAs (weight `timing_ema`) of the
  observation keys `draft_s_per_token`, `rtt_s`, `up_bps`, `bytes_per_token`, `cache_bytes_per_entry`.
  Non-finite or negative values are ignored.

* Verify time as a function of the tokens verified n: t_v(n) = c0 + c1 n, fitted by exponentially
  weighted least squares (forgetting factor `verify_forget` per round) on the (n, verify_s) pairs,
  n = `drafted` (or obs `verify_tokens` when the caller verified more, e.g. branches). The prior line
  enters as two pseudo-observations (at n = 0 and n = k_max, weight `verify_prior_weight`), which keeps
  the 2x2 normal equations solvable while every block has the same length; with plenty of spread in n
  the data dominate. Predictions use max(c0, 0) and max(c1, 0).

Cost model for a decision (K, B)
--------------------------------
Fan-out B sends B candidates per position (B*K draft tokens). Approximation: the first candidate is
accepted with a_i, each further one, given all before it were rejected, with `branch_accept`, so

      a_i(B) = 1 - (1 - a_i) (1 - branch_accept)^(B-1)

      draft time   T_d = (K + o) t_d (1 + branch_draft_cost (B - 1))
      uplink time  T_u = 8 (B (K + o) bytes_per_token + frame_overhead_bytes) / up_bps      (0 if unlimited)
      round trip   T_r = rtt + t_v(B K) + T_u
      sync cycle   C   = T_d + T_r                          (stop and wait: everything in series)
      pipelined    C   = max(T_d, T_r)                      (drafting the next block hides the round trip)

o = 1 when pipelined, else 0: a pipelined block starts with the drafter's guess of the previous
block's bonus token, so it drafts and sends K + 1 tokens (in sync mode the bonus is the target's).

With `pipelined_miss=True` (default) the pipelined cycle also pays for mis-speculation: the next block
was drafted assuming this one is accepted in full *and* that the drafter guessed the bonus token, which
happens with p_ok = prod_{i<=K} a_i(B); otherwise that block is doomed and the edge waits a full round
trip, so C = p_ok max(T_d, T_r) + (1 - p_ok)(T_d + T_r). With `pipelined_miss=False` it is the plain max.

With `auto_window=True` (pipelined, the loop keeps enough blocks in flight to cover the round trip,
up to `max_window`) the round trip no longer sits in every cycle. Blocks stream through two stages,
the edge drafting and the target verifying, and the slower one sets the pace, unless the window is
too small to cover a block's whole round (W blocks per T_d + T_r at most); a broken speculation
(probability 1 - p_ok) drains the pipeline: the target idles while the verdict travels back and the
next block travels out, plus the drafting of that block unless the state cache already holds it
(h = the cache's hit rate):

      windowed     C   = max(T_d, t_v(B K), T_u, (T_d + T_r) / W) + (1 - p_ok)(rtt + T_u + (1 - h) T_d)

In this regime the drain per token, (1 - p_ok) / E[K], hardly depends on K, so a long round trip no
longer calls for deep blocks; what deep blocks still buy is fewer target passes per token, which is
what the pass budget below prices.

      rate(K, B)   = E_B[K] / C                                             (tokens/s)
      bw_use(K, B) = (B K bytes_per_token + frame_overhead_bytes) / C       (uplink bytes/s for drafts)
      mem_use(K,B) = (K + 1) B cache_entries_per_position cache_bytes_per_entry   (state-cache bytes)
      passes(K, B) = 1 / E_B[K]                                             (target passes per token)

(passes counts the blocks the edge counts on; branch blocks the target verifies are not in it.)

Constraints and multipliers
---------------------------
maximise rate subject to bw_use <= bw_budget and mem_use <= mem_budget. Each constraint is written
relative to its budget, g(K,B) = use / budget - 1 <= 0 (an equivalent constraint), and the objective
is divided by r* = max_{K,B} rate (a positive constant within a round: it does not move the argmax,
and it makes the multipliers dimensionless, "fractions of the peak rate"). Every round:

      (K, B) = argmax_{K in [k_min, k_max], B in [1, b_max]}  L(K, B)
      L(K, B) = rate(K,B)/r* - mu_bw g_bw(K,B) - mu_mem g_mem(K,B) - pass_price max(0, g_pass(K,B))

by exhaustive search (a few dozen evaluations), and after each verdict the dual variables take a
projected subgradient step at the current decision, with the refreshed estimates:

      mu <- min(mu_max, max(0, mu + dual_step g(K, B)))

so a multiplier grows while its budget is violated and decays to 0 while it is not. The cap mu_max
bounds wind-up. Hysteresis: the controller moves off its current (K, B) only when the best candidate
beats it by more than `hysteresis` (in units of r*), so noise in the estimates does not flap K.

The pass budget
---------------
The cloud's verify work per token, passes(K, B) <= pass_budget: on a shared GPU a pass is what a
session costs, and on a CPU target, whose verify time grows with every token, the windowed model's
fastest choice is K ~ 1, which keeps the target busiest. This one is an exact penalty with a fixed
price, pass_price max(0, g_pass), not a multiplier: sessions are a few dozen verdicts long, too few
for a dual variable to settle, and one tried first (not kept) swung K from the shortest blocks to
deep ones and back within a prompt.
With the penalty the choice is, in effect, the shortest block that keeps to the budget while that
costs less than `pass_price` of the peak rate per unit of relative violation; when acceptance is low
no K keeps to it (E[K] <= 1 / (1 - a) whatever K is), and the bounded price stops K from running to
k_max for a sliver fewer passes.

Plain steps (k_min = 0)
-----------------------
Where a block costs more than it saves (a CPU target whose rows cost nearly a step each, or poor
drafts), K = 0 wins: the round is a plain target step, and the user is not slower than plain
decoding. Only a loop with the target at hand should allow it (`generate`); over a WAN a one-token
round trip loses to cloud streaming.

* The round after the first block is a plain step: blocks of one length cannot tell the verify fit a
  step's cost from a row's (a flat line through one 4-token block prices a 13-token block as
  cheap as a step).
* A plain step tests no draft position, so acceptance would freeze at its last estimate. After
  `probe_every` plain steps one block of `probe_k` is drafted anyway: `next_k` returns it, while the
  decision in force stays 0, so hysteresis does not hold the probe's depth. Each probe after which K
  stays at 0 doubles the gap, up to `probe_gap_max`; a decision to draft, or a probe kept whole,
  resets it.
* No probe is sent where even every draft token accepted could not make a block beat a plain step
  (`could_pay`: the cost model at acceptance 1, on the measured verify line and drafting cost): there
  is nothing for it to find.
* The verify fit ages plain steps and blocks apart (`VerifyTimeFit`), so a long run of plain steps
  keeps the row cost that its blocks measured.
* A controller kept across generations (`generate(policy=...)`, as a long-running process would keep
  it) starts the next one where the last left off: at K = 0 on such a machine, with no drafter prefill.
* A drafter that sat out plain steps must read the tokens committed meanwhile before it drafts;
  `ChainDrafter` reports that reading apart (`DraftBlock.catchup_s`), and it is not charged to
  drafting's per-token cost.

Early-stop threshold `min_conf`
-------------------------------
The drafter ends a block at a token with q(x) < min_conf. With `ControllerConfig.min_conf` set, that
constant is used. With None (default) it follows the pooled acceptance a:
min_conf = min_conf_max (1 - a): when most drafts are accepted, stopping early mostly throws away
tokens that would have been kept, so the threshold is low; when acceptance collapses, low-confidence
tokens are the likely rejections and the drafter stops sooner. The loop reads the attribute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from acespec.control.estimates import VerifyTimeFit, _Ema, expected_tokens
from acespec.control.policy import DepthPolicy

__all__ = ["ControllerConfig", "DepthController", "VerifyTimeFit", "expected_tokens"]


@dataclass
class ControllerConfig:
    # -- decision space
    k_init: int = 4  # depth before the first verdict (clamped into [k_min, k_max])
    k_min: int = 1  # never draft fewer tokens per block (0: a plain target step when no block pays)
    k_max: int = 16  # never draft more tokens per block
    b_max: int = 1  # largest branch fan-out considered; 1 = chains only
    pipelined: bool = False  # True: the round trip overlaps drafting the next block (cycle = max, not sum)
    pipelined_miss: bool = True  # pipelined: charge a stop-and-wait cycle when the next block is doomed
    auto_window: bool = False  # pipelined with a window covering the round trip: cycle = slowest stage + drains
    max_window: int = 8  # auto_window: most blocks the loop keeps in flight (LoopConfig.max_window)
    hysteresis: float = 0.02  # move off the current (K, B) only for a gain above this fraction of peak rate
    probe_every: int = 32  # k_min = 0: after this many plain steps, one block of probe_k anyway ...
    probe_gap_max: int = 1024  # ... each probe that leaves K at 0 doubles that gap, up to this
    probe_k: int = 2  # how long a probe is
    # -- estimators
    accept_ema: float = 0.1  # weight of a new verdict in the per-position acceptance EMAs
    accept_shrink: float = 2.0  # pseudo-observations pulling a rarely seen position to the pooled acceptance
    accept_prior_weight: float = 2.0  # pseudo-observations pulling the pooled acceptance to prior_accept
    timing_ema: float = 0.2  # weight of a new sample in the timing / network EMAs
    verify_forget: float = 0.98  # forgetting factor of the verify-time least squares, per sample
    verify_prior_weight: float = 1e-3  # weight of each of the two prior pseudo-observations in that fit
    # -- priors, used until (or unless) the matching observation arrives
    prior_accept: float = 0.7  # per-position acceptance
    prior_draft_s_per_token: float = 0.02  # drafter seconds per token (edge NPU: ~10-30 ms)
    prior_rtt_s: float = 0.1  # round-trip time, seconds (WAN: 80-250 ms)
    prior_up_bps: float = 0.0  # uplink rate in bits/s; 0 = unlimited
    prior_bytes_per_token: float = 3.0  # uplink bytes per draft token (varint ids, no q)
    prior_cache_bytes_per_entry: float = 0.0  # state-cache bytes per entry; 0 = no cache / free
    prior_cache_hit: float = 0.0  # share of broken speculations whose next block the state cache holds
    prior_verify_c0: float = 0.03  # cloud verify time at K = 0, seconds
    prior_verify_c1: float = 0.002  # extra cloud verify seconds per draft token (a GPU verifies k ~ 1)
    # -- branches, wire and cache model
    branch_accept: float = 0.3  # P(an extra candidate is accepted | all candidates before it were rejected)
    branch_draft_cost: float = 1.0  # drafter cost of each extra branch, in chains (< 1 when batched)
    frame_overhead_bytes: float = 16.0  # uplink bytes per DRAFT frame besides the tokens
    cache_entries_per_position: float = 2.0  # state-cache entries pre-drafted per position and branch
    # -- budgets and their multipliers
    bw_budget: float = math.inf  # uplink bytes/s the drafts may use
    mem_budget: float = 32e6  # state-cache bytes (DESIGN: 32 MB per session)
    pass_budget: float = math.inf  # target verify passes per committed token the cloud grants
    pass_price: float = 1.0  # penalty per unit of relative pass-budget violation, in fractions of the peak rate
    dual_step: float = 0.2  # step size of the multipliers' projected subgradient ascent
    mu_max: float = 10.0  # cap on each multiplier (bounds wind-up)
    # -- early stop
    min_conf: float | None = None  # fixed early-stop threshold; None = min_conf_max * (1 - acceptance)
    min_conf_max: float = 0.4  # adaptive threshold at zero acceptance

    def __post_init__(self) -> None:
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError(f"need 0 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        if self.max_window < 1:
            raise ValueError(f"max_window must be >= 1, got {self.max_window}")
        if self.b_max < 1:
            raise ValueError(f"b_max must be >= 1, got {self.b_max}")
        if self.probe_every < 1 or self.probe_gap_max < 1 or self.probe_k < 1:
            raise ValueError(
                f"probe_every, probe_gap_max and probe_k must be >= 1, got "
                f"{self.probe_every}, {self.probe_gap_max}, {self.probe_k}"
            )
        for name in ("accept_ema", "timing_ema"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0.0 < self.verify_forget <= 1.0:
            raise ValueError(f"verify_forget must be in (0, 1], got {self.verify_forget}")
        for name in ("prior_accept", "branch_accept", "min_conf_max", "prior_cache_hit"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.min_conf is not None and not 0.0 <= self.min_conf <= 1.0:
            raise ValueError(f"min_conf must be in [0, 1] or None, got {self.min_conf}")
        for name in (
            "accept_shrink",
            "accept_prior_weight",
            "verify_prior_weight",
            "prior_draft_s_per_token",
            "prior_rtt_s",
            "prior_up_bps",
            "prior_bytes_per_token",
            "prior_cache_bytes_per_entry",
            "prior_verify_c0",
            "prior_verify_c1",
            "branch_draft_cost",
            "frame_overhead_bytes",
            "cache_entries_per_position",
            "dual_step",
            "mu_max",
            "pass_price",
            "hysteresis",
        ):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        for name in ("bw_budget", "mem_budget", "pass_budget"):
            v = getattr(self, name)
            if math.isnan(v) or v <= 0.0:
                raise ValueError(f"{name} must be > 0 (inf = unconstrained), got {v}")


class DepthController(DepthPolicy):
    """Picks K (and fan-out B) each round to maximise expected tokens/s under bandwidth and memory budgets.

    `next_k()` / `next_fanout()` before drafting a block; `update(drafted, accepted, **obs)` after each
    verdict; `observe(**obs)` for timings that arrive without a verdict; `min_conf` is the current
    early-stop threshold; `snapshot()` the current estimates. Deterministic: no randomness."""

    name = "controller"

    def __init__(self, config: ControllerConfig | None = None, **overrides) -> None:
        if config is None:
            config = ControllerConfig(**overrides)
        elif overrides:
            config = ControllerConfig(**{**config.__dict__, **overrides})
        self.cfg = c = config
        self.k = int(min(max(c.k_init, c.k_min), c.k_max))
        self.b = 1
        self.rounds = 0
        n = c.k_max + 1  # positions 0..k_max-1, plus k_max for the bonus guess of a full block
        self._s = np.zeros(n)  # discounted acceptances per position
        self._m = np.zeros(n)  # discounted observations per position
        self._S = 0.0  # pooled discounted acceptances
        self._M = 0.0  # pooled discounted observations
        self._w0 = c.accept_prior_weight  # the prior's pseudo-observations, discounted like the real ones
        w = c.timing_ema
        self._td = _Ema(w, c.prior_draft_s_per_token)
        self._rtt = _Ema(w, c.prior_rtt_s)
        self._up = _Ema(w, c.prior_up_bps)
        self._bpt = _Ema(w, c.prior_bytes_per_token)
        self._cbe = _Ema(w, c.prior_cache_bytes_per_entry)
        self._hit = _Ema(w, c.prior_cache_hit)
        self.verify = VerifyTimeFit(
            c.prior_verify_c0,
            c.prior_verify_c1,
            forget=c.verify_forget,
            prior_weight=c.verify_prior_weight,
            n_ref=c.k_max,
        )
        self.mu_bw = 0.0
        self.mu_mem = 0.0
        self.min_conf = self._min_conf()
        self._last: dict[str, float] = {}
        self._probe = 0  # the probe's depth, for the next block only (0: none)
        self._plain = 0  # plain steps since the last block with drafts
        self._probe_gap = c.probe_every

    # -- the DepthPolicy interface ----------------------------------------------------------------
    def next_k(self) -> int:
        return self._probe or self.k

    def next_fanout(self) -> int:
        return self.b

    def update(self, drafted: int, accepted: int, **obs: float) -> None:
        drafted, accepted = int(drafted), int(accepted)
        if drafted < 0 or not 0 <= accepted <= max(drafted, 0):
            raise ValueError(f"need 0 <= accepted <= drafted, got drafted={drafted}, accepted={accepted}")
        self._observe_accept(drafted, accepted)
        vs = _num(obs.get("verify_s"))
        if vs is not None:
            n = _num(obs.get("verify_tokens"))
            self.verify.add(float(drafted if n is None else n), vs)
        self._observe_timings(obs)
        self.rounds += 1
        # dual step at the decision in force, with the refreshed estimates; then re-plan
        g_bw, g_mem, _ = self._violations(self.k, self.b)
        c = self.cfg
        self.mu_bw = min(c.mu_max, max(0.0, self.mu_bw + c.dual_step * g_bw))
        self.mu_mem = min(c.mu_max, max(0.0, self.mu_mem + c.dual_step * g_mem))
        self._plan()
        self._schedule_probe(drafted, accepted)
        self.min_conf = self._min_conf()

    def _schedule_probe(self, drafted: int, accepted: int) -> None:
        """With K at 0, a short block every so often keeps acceptance measured (see the module doc)."""
        c = self.cfg
        if drafted:
            if self._probe and accepted == drafted:  # a probe kept whole: drafts may be good again, probe promptly
                self._probe_gap = c.probe_every
            self._probe = 0
        if self.k > 0:
            self._plain, self._probe_gap = 0, c.probe_every
            return
        if drafted:
            return
        self._plain += 1
        if self._plain < self._probe_gap:
            return
        self._plain = 0
        if self.could_pay():  # else a probe would cost its block and the drafter's catching up, and win nothing
            self._probe = min(c.probe_k, c.k_max)
            self._probe_gap = min(2 * self._probe_gap, max(c.probe_every, c.probe_gap_max))

    def could_pay(self) -> bool:
        """Whether some block could beat a plain step if every draft token were accepted (E = K + 1):
        once the verify line is measured at both ends and it says no, no acceptance can change that,
        so probing for acceptance is pure loss (a CPU whose rows cost nearly a step each)."""
        c = self.cfg
        if not self.verify.has_slope or c.k_max < 1:
            return c.k_max >= 1
        rate = self.evaluate(accept=np.ones(c.k_max + 1))["rate"][0]
        return bool(np.max(rate[1:]) > rate[0] * (1.0 + c.hysteresis))

    def observe(self, **obs: float) -> None:
        """Timing / network observations that come without a verdict (e.g. a PING's RTT)."""
        self._observe_timings(obs)

    # -- estimates ----------------------------------------------------------------------------------
    def _observe_accept(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            # a plain target step (or a verdict the loop marks as not judging the drafter) tested no
            # position: decaying the counts anyway would pull every estimate back to the prior for nothing
            return
        decay = 1.0 - self.cfg.accept_ema
        self._s *= decay
        self._m *= decay
        self._S *= decay
        self._M *= decay
        self._w0 *= decay
        reached = min(drafted, accepted + 1, len(self._m))  # positions 0..reached-1 were tested
        if reached > 0:
            self._m[:reached] += 1.0
            self._s[: min(accepted, reached)] += 1.0
            self._M += reached
            self._S += min(accepted, reached)

    def _observe_timings(self, obs: dict) -> None:
        for key, ema in (
            ("draft_s_per_token", self._td),
            ("rtt_s", self._rtt),
            ("up_bps", self._up),
            ("bytes_per_token", self._bpt),
            ("cache_bytes_per_entry", self._cbe),
            ("cache_hit", self._hit),
        ):
            v = _num(obs.get(key))
            if v is not None:
                ema.add(v)
                self._last[key] = v

    @property
    def pooled_accept(self) -> float:
        c = self.cfg
        w0 = self._w0
        if self._M + w0 <= 0.0:
            return c.prior_accept
        return (self._S + w0 * c.prior_accept) / (self._M + w0)

    def accept_estimates(self) -> np.ndarray:
        """a_i for positions 0..k_max (the last one stands for guessing the bonus token)."""
        w, pool = self.cfg.accept_shrink, self.pooled_accept
        den = self._m + w
        with np.errstate(invalid="ignore", divide="ignore"):
            a = np.where(den > 0.0, (self._s + w * pool) / np.where(den > 0.0, den, 1.0), pool)
        return np.clip(a, 0.0, 1.0)

    # -- the cost model -------------------------------------------------------------------------------
    def evaluate(self, accept: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """rate, bw_use, mem_use, E[K], cycle over the grid [b-1, K] for K = 0..k_max, B = 1..b_max;
        `accept`: per-position acceptance to price with instead of the estimates."""
        c = self.cfg
        ks = np.arange(c.k_max + 1, dtype=float)
        a = self.accept_estimates() if accept is None else np.asarray(accept, dtype=float)
        td, rtt, bpt, cbe = self._td.value, self._rtt.value, self._bpt.value, self._cbe.value
        hit = min(1.0, self._hit.value)
        up = self._up.value
        names = ("rate", "bw_use", "mem_use", "passes", "tokens", "cycle")
        out = {name: np.zeros((c.b_max, c.k_max + 1)) for name in names}
        for bi in range(c.b_max):
            b = bi + 1
            a_b = 1.0 - (1.0 - a) * (1.0 - c.branch_accept) ** (b - 1)
            surv = np.concatenate(([1.0], np.cumprod(a_b)))  # surv[j] = prod_{i<j} a_i(B), j = 0..k_max+1
            tokens = np.cumsum(surv)[: c.k_max + 1]  # E[K] for K = 0..k_max
            p_ok = surv[1 : c.k_max + 2]  # prod_{i<=K} a_i(B)
            # Tokens drafted (and sent) per block: K, and in pipelined mode also the guess of the previous
            # block's bonus token, which each block starts with (the loop drafts K + 1 tokens per block
            # while the pipeline flows). Without it a drafter-bound pipeline looked (K + 1) / K times as
            # fast as it is: K = 1 twice, so the model leaned to the shortest blocks.
            n_draft = ks + (1.0 if c.pipelined else 0.0)
            sent = b * n_draft * bpt + c.frame_overhead_bytes
            t_draft = n_draft * td * (1.0 + c.branch_draft_cost * (b - 1))
            with np.errstate(over="ignore"):  # a link too slow to measure: inf, and that K's rate is 0
                t_up = 8.0 * sent / up if up > 0.0 and math.isfinite(up) else np.zeros_like(ks)
            t_verify = self.verify.predict(b * ks)
            t_rt = rtt + t_verify + t_up
            if c.pipelined and c.auto_window:
                stage = np.maximum(np.maximum(t_draft, t_verify), np.maximum(t_up, (t_draft + t_rt) / c.max_window))
                cycle = stage + (1.0 - p_ok) * (rtt + t_up + (1.0 - hit) * t_draft)
            elif c.pipelined:
                overlap = np.maximum(t_draft, t_rt)
                cycle = p_ok * overlap + (1.0 - p_ok) * (t_draft + t_rt) if c.pipelined_miss else overlap
            else:
                cycle = t_draft + t_rt
            cycle = np.maximum(cycle, 1e-9)
            out["rate"][bi] = tokens / cycle
            out["bw_use"][bi] = sent / cycle
            out["mem_use"][bi] = (ks + 1.0) * b * c.cache_entries_per_position * cbe
            out["passes"][bi] = 1.0 / tokens
            out["tokens"][bi] = tokens
            out["cycle"][bi] = cycle
        return out

    def _violations_from(self, ev: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.cfg
        g_bw = ev["bw_use"] / c.bw_budget - 1.0
        g_mem = ev["mem_use"] / c.mem_budget - 1.0
        g_pass = ev["passes"] / c.pass_budget - 1.0
        return g_bw, g_mem, g_pass

    def _violations(self, k: int, b: int) -> tuple[float, float, float]:
        g_bw, g_mem, g_pass = self._violations_from(self.evaluate())
        return float(g_bw[b - 1, k]), float(g_mem[b - 1, k]), float(g_pass[b - 1, k])

    def lagrangian(self) -> np.ndarray:
        """L(K, B) on the [b-1, K] grid (entries outside [k_min, k_max] are -inf)."""
        ev = self.evaluate()
        g_bw, g_mem, g_pass = self._violations_from(ev)
        r_star = float(np.max(ev["rate"][:, self.cfg.k_min :]))
        # an infinite pass budget gives g_pass = -1 everywhere, so the penalty vanishes by itself
        L = (
            ev["rate"] / max(r_star, 1e-12)
            - self.mu_bw * g_bw
            - self.mu_mem * g_mem
            - self.cfg.pass_price * np.maximum(g_pass, 0.0)
        )
        L[:, : self.cfg.k_min] = -np.inf
        return L

    def _plan(self) -> None:
        if self.cfg.k_min == 0 and not self.verify.sw0:
            self.k, self.b = 0, 1  # a plain step pins the verify line's intercept first (module doc)
            return
        L = self.lagrangian()
        bi, k = np.unravel_index(int(np.argmax(L)), L.shape)  # first maximum: smallest B, then smallest K
        if L[bi, k] > L[self.b - 1, self.k] + self.cfg.hysteresis:
            self.k, self.b = int(k), int(bi) + 1

    def _min_conf(self) -> float:
        c = self.cfg
        if c.min_conf is not None:
            return float(c.min_conf)
        return float(min(1.0, max(0.0, c.min_conf_max * (1.0 - self.pooled_accept))))

    # -- stats ----------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        ev = self.evaluate()
        k, bi = self.k, self.b - 1
        return {
            "k": self.k,
            "probe": self._probe,
            "fanout": self.b,
            "min_conf": self.min_conf,
            "rounds": self.rounds,
            "accept": [round(float(x), 6) for x in self.accept_estimates()],
            "accept_pooled": self.pooled_accept,
            "expected_tokens": float(ev["tokens"][bi, k]),
            "rate_tok_s": float(ev["rate"][bi, k]),
            "cycle_s": float(ev["cycle"][bi, k]),
            "bw_use_bytes_s": float(ev["bw_use"][bi, k]),
            "mem_use_bytes": float(ev["mem_use"][bi, k]),
            "passes_per_token": float(ev["passes"][bi, k]),
            "draft_s_per_token": self._td.value,
            "rtt_s": self._rtt.value,
            "up_bps": self._up.value,
            "bytes_per_token": self._bpt.value,
            "cache_bytes_per_entry": self._cbe.value,
            "verify_c0": self.verify.c0,
            "verify_c1": self.verify.c1,
            "mu_bw": self.mu_bw,
            "mu_mem": self.mu_mem,
            "cache_hit": self._hit.value,
            "pipelined": self.cfg.pipelined,
            "auto_window": self.cfg.auto_window,
        }


def _num(v) -> float | None:
    """A usable observation: a finite, non-negative number; anything else is ignored."""
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x >= 0.0 else None
