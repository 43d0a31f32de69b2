"""The relaxed (lossy) verification rules of DESIGN.md, one small pure function each.

Every rule has the signature of `acespec.verify.rules` and the vLLM rejection-sampler vocabulary:

    rule(draft, q, p, rng, **params) -> (accepted, next_token)

    draft  int[k]        drafted token ids
    q      [k, V]        drafter probabilities at each draft position (unused by `typical`)
    p      [k+1, V]      target probabilities at each draft position plus the bonus position

A rejected position emits a *recovered* token; a fully accepted block emits a *bonus* token.

Most rules are instances of the general template (`template_verify`): accept draft x with probability
min(1, pi_rej(x)/q(x)); after a rejection emit a sample of norm(max(0, pi_res - q)); after a full
accept emit a sample of pi_bonus. Each template rule below is written as a *targets* function

    targets(x, q_row, p_row, **params) -> (pi_rej [V], pi_res [V])

for one position (x = the draft token there), so that the rule itself, and the exact acceptance
probability `acceptance_probability` used by tests and sweeps, share one definition.

The bonus position has a target row p[k] but no drafter row (q is [k, V]), so every rule here
draws its bonus token from p[k]: with no draft token there is nothing to relax.

Each rule is registered with one *relaxed* default setting (see `register(..., defaults=...)`);
`LOSSLESS_POINTS` gives the parameters at which a rule reduces to `strict`, and `RELAX_PARAM` /
`RELAX_DIRECTION` say which parameter relaxes it and which way.
"""

from __future__ import annotations

import math

from typing import Callable

import numpy as np

from acespec.verify.rules import RuleSpec, register, residual_sample, template_verify
from acespec.verify.sampling import sample

# ------------------------------------------------------------------------------------------ divergences


def entropy(p: np.ndarray) -> np.ndarray:  # p: [..., V] -> [...]
    """Shannon entropy in nats, with 0 log 0 = 0."""
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    return terms.sum(axis=-1)


def jsd(p: np.ndarray, q: np.ndarray) -> np.ndarray:  # p, q: [..., V] -> [...]
    """Jensen-Shannon divergence in nats: KL(p||m)/2 + KL(q||m)/2, m = (p+q)/2; in [0, ln 2]."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    m = 0.5 * (p + q)
    with np.errstate(divide="ignore", invalid="ignore"):
        kp = np.where(p > 0, p * np.log(p / m), 0.0)
        kq = np.where(q > 0, q * np.log(q / m), 0.0)
    # rounding can leave a tiny negative value for p == q; a divergence is never negative
    return np.maximum(0.5 * (kp.sum(axis=-1) + kq.sum(axis=-1)), 0.0)


def total_variation(p: np.ndarray, q: np.ndarray) -> np.ndarray:  # p, q: [..., V] -> [...]
    """TV(p, q) = sum max(0, p - q) (equal to half the L1 distance for normalised rows)."""
    return np.maximum(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64), 0.0).sum(axis=-1)


# ------------------------------------------------------------------------------------------ template plumbing

Targets = Callable[..., tuple[np.ndarray, np.ndarray]]  # (x, q_row [V], p_row [V], **params) -> (pi_rej, pi_res)


def _template(targets: Targets, draft, q, p, rng, **params) -> tuple[int, int]:
    """Build the per-position pi_rej / pi_res rows with `targets` and run the shared template."""
    # draft: int[k]; q: [k, V]; p: [k+1, V]
    k = len(draft)
    pi_rej = np.empty((k, p.shape[1]))  # [k, V]
    pi_res = np.empty((k, p.shape[1]))  # [k, V]
    for i in range(k):
        pi_rej[i], pi_res[i] = targets(int(draft[i]), q[i], p[i], **params)
    return template_verify(draft, q, pi_rej, pi_res, p[k], rng)


def _template_accept(targets: Targets) -> Callable[..., float]:
    """Acceptance probability of draft x at one position, exactly as `template_verify` decides it."""

    def accept(x: int, q_row: np.ndarray, p_row: np.ndarray, **params: float) -> float:
        pi_rej, _ = targets(x, q_row, p_row, **params)
        if pi_rej[x] <= 0.0:
            return 0.0
        return 1.0 if q_row[x] <= 0.0 else min(1.0, pi_rej[x] / q_row[x])

    return accept


# name -> accept(x, q_row, p_row, **params): probability that draft token x is accepted at one position
_ACCEPT: dict[str, Callable[..., float]] = {}


# ------------------------------------------------------------------------------------------ typical (Medusa)


def typical_threshold(p_row: np.ndarray, *, eps: float, delta: float) -> float:  # p_row: [V]
    """min(eps, delta * exp(-H(p))): a hard floor eps, lowered for high-entropy (uncertain) rows."""
    return float(min(eps, delta * np.exp(-entropy(p_row))))


def _typical_accept(x: int, q_row, p_row, *, eps: float, delta: float, **_) -> float:
    return 1.0 if p_row[x] > typical_threshold(p_row, eps=eps, delta=delta) else 0.0


# Defaults are what Medusa's `medusa_generate` runs with: posterior_threshold (eps) = 0.09 and
# posterior_alpha (delta) = 0.3 = sqrt(eps). (Medusa's helper `evaluate_posterior` has the two swapped
# as its own keyword defaults, 0.3 / 0.09, but the generation loop always passes 0.09 / 0.3.)
@register("typical", needs_q=False, defaults={"eps": 0.09, "delta": 0.3}, bounds={"eps": (0.0, 1.0), "delta": (0.0, math.inf)})
def typical(draft, q, p, rng, *, eps: float, delta: float, **_):
    """Typical acceptance (Cai et al. 2024, Medusa).

    accept x    iff  p(x) > min(eps, delta * exp(-H(p)))       (H in nats; deterministic, no u drawn)
    recovered   =    argmax p                                   (Medusa's choice; ties -> lowest id)
    bonus       ~    p[k]                                       (no draft there, so nothing to relax:
                                                                 plain sampling at the user's temperature)

    Relaxes as eps or delta decrease (RELAX_PARAM: eps, downwards). It has no lossless point: a
    threshold >= 1 rejects everything and emits argmax p, which is greedy decoding, not sampling from p.
    Under greedy sampling (one-hot p) it accepts exactly the argmax, i.e. it equals `greedy`.
    """
    # draft: int[k]; p: [k+1, V]; q is not read
    for i, x in enumerate(draft):
        if not _typical_accept(int(x), None, p[i], eps=eps, delta=delta):
            return i, int(np.argmax(p[i]))
    k = len(draft)
    return k, sample(p[k], rng)


_ACCEPT["typical"] = _typical_accept


# ------------------------------------------------------------------------------------------ cactus


def cactus_targets(x: int, q_row, p_row, *, delta: float, **_) -> tuple[np.ndarray, np.ndarray]:
    """H: move mass onto the draft token x, as far as a chi-square budget allows.

    h    = clip(p(x) + sqrt(2 delta p(x) (1 - p(x))), 0, 1)
    H(x) = h;   H(y) = p(y) (1 - h) / (1 - p(x))  for y != x      (the other tokens scaled down evenly)

    Within this family chi^2(H || p) = (h - p(x))^2 / (p(x)(1 - p(x))), so h is the largest mass on x
    with chi^2(H || p) <= 2 delta (i.e. KL(H || p) <~ delta). pi_rej = pi_res = H.
    """
    if delta < 0:
        raise ValueError(f"cactus: delta must be >= 0, got {delta}")
    px = float(p_row[x])
    h = min(max(px + np.sqrt(2.0 * delta * px * (1.0 - px)), 0.0), 1.0)
    rest = 1.0 - px
    # p(x) = 1 leaves no other mass to scale (0/0): H is then one-hot on x, which is p itself
    H = p_row * ((1.0 - h) / rest) if rest > 1e-12 else np.zeros_like(p_row, dtype=np.float64)
    H[x] = h
    return H, H


@register("cactus", needs_q=True, defaults={"delta": 0.35}, bounds={"delta": (0.0, math.inf)})  # default: the brief's relaxed setting
def cactus(draft, q, p, rng, *, delta: float, **_):
    """CACTUS: accept iff u < min(1, h/q(x)); residual norm(max(0, H - q)); bonus p.

    See `cactus_targets` for h and H. delta = 0 gives H = p, i.e. `strict`; acceptance rises with delta.
    """
    return _template(cactus_targets, draft, q, p, rng, delta=delta)


_ACCEPT["cactus"] = _template_accept(cactus_targets)


# ------------------------------------------------------------------------------------------ mentored


def mentored_targets(x: int, q_row, p_row, *, alpha: float, **_) -> tuple[np.ndarray, np.ndarray]:
    """pi_rej(v) = min(p(v) / (1 - alpha), 1) (alpha >= 1: its limit, 1 wherever p > 0); pi_res = p.

    pi_rej is an acceptance target only (it does not sum to 1); the residual stays p's, so a rejected
    position still emits from norm(max(0, p - q)).
    """
    p_row = np.asarray(p_row, dtype=np.float64)
    if alpha >= 1.0:
        pi_rej = (p_row > 0).astype(np.float64)
    else:
        pi_rej = np.minimum(p_row / (1.0 - alpha), 1.0)
    return pi_rej, p_row


@register("mentored", needs_q=True, defaults={"alpha": 0.3}, bounds={"alpha": (0.0, math.inf)})  # default: p(x) counts as p(x)/0.7
def mentored(draft, q, p, rng, *, alpha: float, **_):
    """Mentored acceptance: accept x w.p. min(1, min(p(x)/(1-alpha), 1)/q(x)); residual norm(max(0,
    p - q)); bonus p. alpha = 0 is `strict`; acceptance rises with alpha (for alpha < 1)."""
    return _template(mentored_targets, draft, q, p, rng, alpha=alpha)


_ACCEPT["mentored"] = _template_accept(mentored_targets)


# ------------------------------------------------------------------------------------------ fuzzy / r_fuzzy


def _strict_accept(x: int, q_row, p_row) -> float:
    """min(1, p(x)/q(x)), with template_verify's conventions for zero entries."""
    if p_row[x] <= 0.0:
        return 0.0
    return 1.0 if q_row[x] <= 0.0 else min(1.0, p_row[x] / q_row[x])


def _fuzzy_accept(x: int, q_row, p_row, *, T: float, **_) -> float:
    return 1.0 if jsd(p_row, q_row) < T else _strict_accept(x, q_row, p_row)


# Default T = 0.3 nats: JSD is at most ln 2 = 0.693, so rows less than ~43% of the way to disjoint
# take the drafter's token as is.
@register("fuzzy", needs_q=True, defaults={"T": 0.3})
def fuzzy(draft, q, p, rng, *, T: float, **_):
    """Fuzzy speculative decoding (Holsman et al. 2025).

    At each position: if JSD(p, q) < T accept the draft token outright (no u drawn); otherwise the
    strict test u < min(1, p(x)/q(x)), residual norm(max(0, p - q)). Bonus from p.
    T <= 0 is `strict` (JSD >= 0); acceptance rises with T. Same output distribution as `r_fuzzy` with
    alpha = T, which is this rule written in the template form.
    """
    # draft: int[k]; q: [k, V]; p: [k+1, V]
    k = len(draft)
    d = jsd(p[:k], q)  # [k]
    for i in range(k):
        if d[i] < T:
            continue
        x = int(draft[i])
        u = rng.random()
        if u < _strict_accept(x, q[i], p[i]):
            continue
        return i, residual_sample(p[i], q[i], rng)
    return k, sample(p[k], rng)


_ACCEPT["fuzzy"] = _fuzzy_accept


def r_fuzzy_targets(x: int, q_row, p_row, *, alpha: float, **_) -> tuple[np.ndarray, np.ndarray]:
    """pi_rej = pi_res = q if JSD(p, q) < alpha else p."""
    pi = q_row if jsd(p_row, q_row) < alpha else p_row
    pi = np.asarray(pi, dtype=np.float64)
    return pi, pi


@register("r_fuzzy", needs_q=True, defaults={"alpha": 0.3})  # default: same threshold as fuzzy's T
def r_fuzzy(draft, q, p, rng, *, alpha: float, **_):
    """Fuzzy in the template form: pi_rej = pi_res = q where JSD(p, q) < alpha, else p; bonus p.

    With pi_rej = q the sampled draft is always accepted (ratio q(x)/q(x) = 1), so this equals `fuzzy`
    in distribution. alpha <= 0 is `strict`; acceptance rises with alpha.
    """
    return _template(r_fuzzy_targets, draft, q, p, rng, alpha=alpha)


_ACCEPT["r_fuzzy"] = _template_accept(r_fuzzy_targets)


# ------------------------------------------------------------------------------------------ cascades


def casc_opt_targets(x: int, q_row, p_row, *, alpha: float, **_) -> tuple[np.ndarray, np.ndarray]:
    """Defer to the target (r = 1) iff max q < max p - alpha * TV(p, q); pi = (1 - r) q + r p.

    r is 0 or 1, so pi is q (keep the drafter's choice: always accepted) or p (the strict test).
    Since max q - max p <= TV(p, q), every alpha < -1 defers whenever p != q: lossless.
    """
    q_row = np.asarray(q_row, dtype=np.float64)
    p_row = np.asarray(p_row, dtype=np.float64)
    defer = q_row.max() < p_row.max() - alpha * float(total_variation(p_row, q_row))
    pi = p_row if defer else q_row
    return pi, pi


@register("casc_opt", needs_q=True, defaults={"alpha": 0.5})  # default: drafter may trail by TV/2
def casc_opt(draft, q, p, rng, *, alpha: float, **_):
    """Speculative cascade, optimal-deferral form (Narasimhan et al. 2024): pi from
    `casc_opt_targets` is used for acceptance and residual; bonus from p (no q at the bonus position).
    alpha -> -inf (any alpha < -1) is `strict`; acceptance rises with alpha."""
    return _template(casc_opt_targets, draft, q, p, rng, alpha=alpha)


_ACCEPT["casc_opt"] = _template_accept(casc_opt_targets)


def casc_tok_targets(x: int, q_row, p_row, *, alpha: float, **_) -> tuple[np.ndarray, np.ndarray]:
    """Token-level cascade: keep the drafter on the tokens the target also rates highly.

    A   = {v : p(v) >= (1 - alpha) max p}          (alpha < 0: A is empty)
    eta = 1 - sum_{v in A} q(v)                     (drafter mass outside A, handed to the target)
    pi  = q * 1[v in A] + eta * p                   (sums to 1)
    """
    q_row = np.asarray(q_row, dtype=np.float64)
    p_row = np.asarray(p_row, dtype=np.float64)
    in_a = p_row >= (1.0 - alpha) * p_row.max()
    eta = max(1.0 - float(q_row[in_a].sum()), 0.0)  # rounding must not make the p share negative
    pi = np.where(in_a, q_row, 0.0) + eta * p_row
    return pi, pi


@register("casc_tok", needs_q=True, defaults={"alpha": 0.3})  # default: A = tokens within 70% of max p
def casc_tok(draft, q, p, rng, *, alpha: float, **_):
    """Speculative cascade, token-specific form (Narasimhan et al. 2024): pi from `casc_tok_targets`
    is used for acceptance and residual; bonus from p (no q at the bonus position).

    alpha -> -inf (any alpha < 0: A empty, eta = 1, pi = p) is `strict`. A grows with alpha, but the
    acceptance probability sum_x min(q(x), pi(x)) is NOT monotone in alpha in general, and can fall
    below strict's: adding a token to A shrinks eta, and so pi, on every token outside A.
    """
    return _template(casc_tok_targets, draft, q, p, rng, alpha=alpha)


_ACCEPT["casc_tok"] = _template_accept(casc_tok_targets)

# The lossless rules, so that sweeps can compare against them with the same function.
_ACCEPT["strict"] = lambda x, q_row, p_row, **_: _strict_accept(x, q_row, p_row)
_ACCEPT["greedy"] = lambda x, q_row, p_row, **_: 1.0 if x == int(np.argmax(p_row)) else 0.0


# ------------------------------------------------------------------------------------------ tables and helpers

# Each rule's parameters at its lossless point (where it equals `strict`). `typical` has none.
LOSSLESS_POINTS: dict[str, dict[str, float]] = {
    "cactus": {"delta": 0.0},
    "mentored": {"alpha": 0.0},
    "fuzzy": {"T": 0.0},
    "r_fuzzy": {"alpha": 0.0},
    "casc_opt": {"alpha": -1e9},  # any alpha < -1 is lossless; -1e9 stands for -inf
    "casc_tok": {"alpha": -1e9},  # any alpha < 0 is lossless; -1e9 stands for -inf
}

# The parameter that relaxes each rule ...
RELAX_PARAM: dict[str, str] = {
    "typical": "eps",
    "cactus": "delta",
    "mentored": "alpha",
    "fuzzy": "T",
    "r_fuzzy": "alpha",
    "casc_opt": "alpha",
    "casc_tok": "alpha",
}
# ... and the direction in which it relaxes: +1 = increasing it relaxes, -1 = decreasing it relaxes.
# Acceptance is monotone in that direction for every rule except casc_tok (see its docstring).
RELAX_DIRECTION: dict[str, int] = {name: (-1 if name == "typical" else +1) for name in RELAX_PARAM}


def acceptance_probability(rule: str | RuleSpec, q_row: np.ndarray, p_row: np.ndarray, **params: float) -> float:
    """Exact probability that one draft token x ~ q_row is accepted at a position with target p_row.

    sum_x q(x) * P(accept x), using the rule's own acceptance definition (for template rules
    sum_x min(q(x), pi_rej_x(x))). Parameters: the rule's defaults, overridden by the spec, then `params`.
    """
    spec = rule if isinstance(rule, RuleSpec) else RuleSpec.parse(rule)
    if spec.name not in _ACCEPT:
        raise ValueError(f"no exact acceptance probability for rule {spec.name!r}")
    kwargs = spec.kwargs()
    kwargs.update(params)
    q_row = np.asarray(q_row, dtype=np.float64)  # [V]
    p_row = np.asarray(p_row, dtype=np.float64)  # [V]
    accept = _ACCEPT[spec.name]
    return float(sum(q_row[x] * accept(x, q_row, p_row, **kwargs) for x in np.flatnonzero(q_row > 0)))

