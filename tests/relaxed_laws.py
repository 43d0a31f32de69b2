"""Oracles for the relaxed rules' output laws, re-derived from the formulas in docs/research/rules.md independently of the
code in acespec/verify/relaxed.py: the first emitted token's exact distribution for a draft x ~ q, and
the hand-built (q, p) cases that take every rule's relaxed branch. Shared by tests/test_verify_relaxed.py
(the numpy rules) and tests/test_vllm.py (the same rules inside vLLM's rejection sampler); no scipy, so
the vLLM profile can import it."""

from __future__ import annotations

import numpy as np

from acespec.verify.relaxed import entropy, jsd

RELAXED = ["typical", "cactus", "mentored", "fuzzy", "r_fuzzy", "casc_opt", "casc_tok"]


def rand_dist(rng: np.random.Generator, V: int, *, sparse: bool = False, conc: float = 1.0) -> np.ndarray:
    """A random distribution over V tokens; `sparse` zeroes about a third of them (top-k/top-p style)."""
    d = rng.dirichlet(np.full(V, conc))
    if sparse:
        d[rng.random(V) < 0.33] = 0.0
        if d.sum() == 0:
            d[rng.integers(V)] = 1.0
        d /= d.sum()
    return d


def analytic_targets(rule: str, x: int, q: np.ndarray, p: np.ndarray, prm: dict) -> tuple[np.ndarray, np.ndarray]:
    """pi_rej and pi_res of the template rules, straight from the formulas in docs/research/rules.md."""
    if rule == "cactus":
        px, d = p[x], prm["delta"]
        h = np.clip(px + np.sqrt(2 * d * px * (1 - px)), 0, 1)
        H = p * (1 - h) / (1 - px) if px < 1 else np.zeros_like(p)
        H[x] = h
        return H, H
    if rule == "mentored":
        return np.minimum(p / (1 - prm["alpha"]), 1), p
    if rule == "r_fuzzy":
        pi = q if jsd(p, q) < prm["alpha"] else p
        return pi, pi
    if rule == "casc_opt":
        r = 1.0 if q.max() < p.max() - prm["alpha"] * np.maximum(p - q, 0).sum() else 0.0
        pi = (1 - r) * q + r * p
        return pi, pi
    if rule == "casc_tok":
        A = p >= (1 - prm["alpha"]) * p.max()
        eta = 1 - q[A].sum()
        pi = q * A + eta * p
        return pi, pi
    raise AssertionError(rule)


def analytic_first_token(rule: str, q: np.ndarray, p: np.ndarray, prm: dict) -> np.ndarray:
    """P(emitted first token = y) for a draft x ~ q (k >= 1; position 0 only)."""
    V = len(p)
    out = np.zeros(V)
    if rule == "typical":
        # accepted x is emitted as is; every rejected x emits argmax p
        thr = min(prm["eps"], prm["delta"] * np.exp(-entropy(p)))
        ok = p > thr
        out += np.where(ok, q, 0.0)
        out[np.argmax(p)] += q[~ok].sum()
        return out
    if rule == "fuzzy":
        # below the JSD threshold every draft is accepted (out = q); otherwise strict, whose output is p
        return q.copy() if jsd(p, q) < prm["T"] else p.copy()
    # template: P(y) = sum_x q(x) [a(x) 1{y = x} + (1 - a(x)) r_x(y)],
    #   a(x) = min(1, pi_rej(x)/q(x)),  r_x = norm(max(0, pi_res - q))
    for x in np.flatnonzero(q > 0):
        pi_rej, pi_res = analytic_targets(rule, x, q, p, prm)
        a = min(1.0, pi_rej[x] / q[x])
        r = np.maximum(pi_res - q, 0)
        r = r / r.sum() if r.sum() > 1e-12 else pi_res
        out[x] += q[x] * a
        out += q[x] * (1 - a) * r
    return out


def relaxed_cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Hand-built (q, p) pairs chosen so every rule's relaxed branch is taken in at least one of them."""
    rng = np.random.default_rng(7)
    p_peak = np.array([0.40, 0.25, 0.15, 0.08, 0.05, 0.04, 0.02, 0.01])
    q_overconfident = np.array([0.55, 0.10, 0.10, 0.05, 0.05, 0.05, 0.05, 0.05])  # max q > max p
    p_rand = rand_dist(rng, 12)
    q_close = 0.7 * p_rand + 0.3 * rand_dist(rng, 12)  # small JSD: the fuzzy rules' relaxed branch
    p_flat = rand_dist(rng, 16, conc=5.0)
    q_far = rand_dist(rng, 16, conc=0.3)
    return [("peaked", q_overconfident, p_peak), ("close", q_close, p_rand), ("far", q_far, p_flat)]


CASES = relaxed_cases()


# a milder setting per rule, next to the registered default, so partial acceptance and the residual
# path are exercised too (the default accepts everything on some cases)
MILD = {
    "typical": {"eps": 0.2, "delta": 0.5},
    "cactus": {"delta": 0.05},
    "mentored": {"alpha": 0.1},
    "fuzzy": {"T": 0.05},
    "r_fuzzy": {"alpha": 0.05},
    "casc_opt": {"alpha": 0.0},
    "casc_tok": {"alpha": 0.1},
}
