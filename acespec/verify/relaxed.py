"""The relaxed (lossy) verification rules (docs/research/rules.md), one small pure function each.

Every rule has the signature of `acespec.verify.rules` and the vLLM rejection-sampler vocabulary:

    rule(draft, q, p, rng, **params) -> (accepted, next_token)

    draft  int[k]        drafted token ids
    q      [k, V]        drafter probabilities at each draft position (unused by `typical`)
    p      [k+1, V]      target probabilities at each draft position plus the bonus position

A rejected position emits a *recovered* token; a fully accepted block emits a *bonus* token.

Most rules are instances of the general template (`template_verify`): accept draft x with probability
min(1, pi_rej(x)/q(x)); after a rejection emit a sample of norm(max(0, pi_res - q)); after a full
accept emit a sample of pi_bonus. Each template rule below is written as a *targets* function

    targets(x, q, p, **params) -> (pi_rej [n, V], pi_res [n, V])      x: int[n]; q, p: [n, V]

batched over positions (row i: draft token x[i], drafter row q[i], target row p[i]); the other rules
as their acceptance test and recovered law. Every one of these row functions is written against the
array API (`rules.namespace`), so the same definition runs on numpy (the rules below, one block at
a time, in float64) and on torch (AceSpec's vLLM plugin, all of a step's rows at once): `ROW_LAWS`
gathers, per rule, the probability of accepting each row's draft and the law of the token emitted
after a rejection there. The rule itself, the exact acceptance probability `acceptance_probability`
used by tests and sweeps, and the plugin share that one definition.

The bonus position has a target row p[k] but no drafter row (q is [k, V]), so every rule here
draws its bonus token from p[k]: with no draft token there is nothing to relax.

Each rule is registered with one *relaxed* default setting (see `register(..., defaults=...)`);
`LOSSLESS_POINTS` gives the parameters at which a rule reduces to `strict`, and `RELAX_PARAM` /
`RELAX_DIRECTION` say which parameter relaxes it and which way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from array_api_compat import device

from acespec.verify.rules import (
    RuleSpec,
    as_float,
    namespace,
    register,
    residual,
    residual_sample,
    rows_of,
    template_accept,
    template_verify,
)
from acespec.verify.sampling import sample

# ------------------------------------------------------------------------------------------ divergences


def entropy(p):  # p: [..., V] -> [...]
    """Shannon entropy in nats, with 0 log 0 = 0."""
    p = as_float(p)
    xp = namespace(p)
    # p = 0 takes log of the smallest normal number instead of -inf: a finite factor, so its term is 0
    return -xp.sum(p * xp.log(xp.clip(p, min=xp.finfo(p.dtype).tiny)), axis=-1)


def _kl_terms(a, m, tiny):  # a, m: [...] -> [...]
    """a log(a/m), element by element, with 0 log 0 = 0: KL(a||m)'s terms. Any shape: whole rows, or
    elements gathered from them."""
    xp = namespace(a, m)
    return a * xp.log(xp.clip(a, min=tiny) / m)


SPARSE_Q = 8  # `jsd` evaluates its terms only on q's support where at most one element of q in SPARSE_Q is nonzero


def jsd(p, q):  # p, q: [..., V] -> [...]
    """Jensen-Shannon divergence in nats: KL(p||m)/2 + KL(q||m)/2, m = (p+q)/2; in [0, ln 2].

    The row sums of `_kl_terms`. Where q is sparse (a token-only draft's row is one-hot; at most one
    element in SPARSE_Q nonzero here) they are evaluated on q's support only: everywhere else m = p/2,
    so p's term is p log 2 and q's is 0, filled in by that closed form. The rows are then read a few
    times, with no log or division over them. The two ways differ only in the order of the additions.
    """
    p, q = as_float(p), as_float(q)
    xp = namespace(p, q)
    tiny = xp.finfo(p.dtype).tiny
    if p.shape != q.shape:
        p, q = xp.broadcast_arrays(p, q)
    if SPARSE_Q * int(xp.count_nonzero(q)) <= math.prod(q.shape):
        on = xp.nonzero(q)  # q >= 0: its support
        pv, qv = p[on], q[on]
        m = xp.clip(0.5 * (pv + qv), min=tiny)
        terms = math.log(2.0) * p  # off q's support: p log(p / (p/2)) + 0
        terms[on] = _kl_terms(pv, m, tiny) + _kl_terms(qv, m, tiny)
        out = 0.5 * xp.sum(terms, axis=-1)
    else:
        m = xp.clip(0.5 * (p + q), min=tiny)  # where m is clipped, p = q = 0 and both terms are 0
        out = 0.5 * (xp.sum(_kl_terms(p, m, tiny), axis=-1) + xp.sum(_kl_terms(q, m, tiny), axis=-1))
    # rounding can leave a tiny negative value for p == q; a divergence is never negative
    return xp.clip(out, min=0.0)


def total_variation(p, q):  # p, q: [..., V] -> [...]
    """TV(p, q) = sum max(0, p - q) (equal to half the L1 distance for normalised rows)."""
    p, q = as_float(p), as_float(q)
    xp = namespace(p, q)
    return xp.sum(xp.clip(p - q, min=0.0), axis=-1)


def argmax_row(p):  # p: [n, V] -> [n, V]
    """One-hot on each row's argmax (ties -> lowest id): the law of a deterministic recovered token."""
    xp = namespace(p)
    out = xp.zeros_like(p)
    out[rows_of(xp, p), xp.argmax(p, axis=-1)] = 1.0
    return out


# ------------------------------------------------------------------------------------------ row laws


@dataclass(frozen=True)
class RowLaw:
    """One position of a rule, batched over rows and written against the array API (numpy or torch).

    accept(x, q, p, **params) -> [n]       probability that row i's draft x[i] is accepted
    recovered(x, q, p, **params) -> [n, V] unnormalised law of the token emitted after a rejection there

    x: int[n]; q: [n, V] (None for rules that need no drafter rows); p: [n, V].
    """

    accept: Callable
    recovered: Callable


ROW_LAWS: dict[str, RowLaw] = {}

Targets = Callable[..., tuple]  # (x int[n], q [n, V], p [n, V], **params) -> (pi_rej [n, V], pi_res [n, V])


def _template_law(targets: Targets) -> RowLaw:
    """A template rule's row law: accept w.p. min(1, pi_rej(x)/q(x)); recovered ~ norm(max(0, pi_res - q))."""

    def accept(x, q, p, **params):
        return template_accept(x, q, targets(x, q, p, **params)[0])

    def recovered(x, q, p, **params):
        return residual(targets(x, q, p, **params)[1], q)

    return RowLaw(accept, recovered)


def _template(targets: Targets, draft, q, p, rng, **params) -> tuple[int, int]:
    """Build the block's pi_rej / pi_res rows with `targets` and run the shared template."""
    # draft: int[k]; q: [k, V]; p: [k+1, V]
    k = len(draft)
    pi_rej, pi_res = targets(draft, q, p[:k], **params)  # [k, V], [k, V]
    return template_verify(draft, q, pi_rej, pi_res, p[k], rng)


# ------------------------------------------------------------------------------------------ typical (Medusa)


def typical_threshold(p, *, eps: float, delta: float):  # p: [..., V] -> [...]
    """min(eps, delta * exp(-H(p))): a hard floor eps, lowered for high-entropy (uncertain) rows."""
    xp = namespace(p)
    return xp.clip(delta * xp.exp(-entropy(p)), max=eps)


def typical_accept(x, q, p, *, eps: float, delta: float, **_):  # x: int[n]; p: [n, V] -> [n], 0 or 1; q unused
    """1 where p(x) > typical_threshold(p), else 0: deterministic, no u drawn."""
    p = as_float(p)
    xp = namespace(p)
    px = p[rows_of(xp, p), x]  # [n]
    return xp.astype(px > typical_threshold(p, eps=eps, delta=delta), p.dtype)


def typical_recovered(x, q, p, **_):  # p: [n, V] -> [n, V]
    """Medusa's recovered token: argmax p (one-hot), whatever was drafted."""
    return argmax_row(as_float(p))


# Defaults are what Medusa's `medusa_generate` runs with: posterior_threshold (eps) = 0.09 and
# posterior_alpha (delta) = 0.3 = sqrt(eps). (Medusa's helper `evaluate_posterior` has the two swapped
# as its own keyword defaults, 0.3 / 0.09, but the generation loop always passes 0.09 / 0.3.)
@register(
    "typical", needs_q=False, defaults={"eps": 0.09, "delta": 0.3}, bounds={"eps": (0.0, 1.0), "delta": (0.0, math.inf)}
)
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
    k = len(draft)
    ok = typical_accept(draft, None, p[:k], eps=eps, delta=delta)  # [k]
    for i in range(k):
        if not ok[i]:
            return i, int(np.argmax(typical_recovered(draft[i : i + 1], None, p[i : i + 1])[0]))
    return k, sample(p[k], rng)


ROW_LAWS["typical"] = RowLaw(typical_accept, typical_recovered)


# ------------------------------------------------------------------------------------------ cactus


def cactus_targets(x, q, p, *, delta: float, **_):  # x: int[n]; p: [n, V] -> ([n, V], [n, V]); q unused
    """H: move mass onto the draft token x, as far as a chi-square budget allows.

    h    = clip(p(x) + sqrt(2 delta p(x) (1 - p(x))), 0, 1)
    H(x) = h;   H(y) = p(y) (1 - h) / (1 - p(x))  for y != x      (the other tokens scaled down evenly)

    Within this family chi^2(H || p) = (h - p(x))^2 / (p(x)(1 - p(x))), so h is the largest mass on x
    with chi^2(H || p) <= 2 delta (i.e. KL(H || p) <~ delta). pi_rej = pi_res = H.
    """
    if delta < 0:
        raise ValueError(f"cactus: delta must be >= 0, got {delta}")
    p = as_float(p)
    xp = namespace(p)
    r = rows_of(xp, p)
    px = p[r, x]  # [n]
    rest = 1.0 - px  # [n]
    h = xp.clip(px + xp.sqrt(2.0 * delta * xp.clip(px * rest, min=0.0)), 0.0, 1.0)  # [n]
    # p(x) = 1 leaves no other mass to scale (0/0): H is then one-hot on x, which is p itself
    some = rest > 1e-12
    H = p * xp.where(some, (1.0 - h) / xp.where(some, rest, 1.0), 0.0)[:, None]  # [n, V]
    H[r, x] = h
    return H, H


@register(
    "cactus", needs_q=True, defaults={"delta": 0.35}, bounds={"delta": (0.0, math.inf)}
)  # default: the brief's relaxed setting
def cactus(draft, q, p, rng, *, delta: float, **_):
    """CACTUS: accept iff u < min(1, h/q(x)); residual norm(max(0, H - q)); bonus p.

    See `cactus_targets` for h and H. delta = 0 gives H = p, i.e. `strict`; acceptance rises with delta.
    """
    return _template(cactus_targets, draft, q, p, rng, delta=delta)


ROW_LAWS["cactus"] = _template_law(cactus_targets)


# ------------------------------------------------------------------------------------------ mentored


def mentored_targets(x, q, p, *, alpha: float, **_):  # p: [n, V] -> ([n, V], [n, V]); x, q unused
    """pi_rej(v) = min(p(v) / (1 - alpha), 1) (alpha >= 1: its limit, 1 wherever p > 0); pi_res = p.

    pi_rej is an acceptance target only (it does not sum to 1); the residual stays p's, so a rejected
    position still emits from norm(max(0, p - q)).
    """
    p = as_float(p)
    xp = namespace(p)
    if alpha >= 1.0:
        pi_rej = xp.astype(p > 0, p.dtype)
    else:
        pi_rej = xp.clip(p / (1.0 - alpha), max=1.0)
    return pi_rej, p


@register(
    "mentored", needs_q=True, defaults={"alpha": 0.3}, bounds={"alpha": (0.0, math.inf)}
)  # default: p(x) counts as p(x)/0.7
def mentored(draft, q, p, rng, *, alpha: float, **_):
    """Mentored acceptance: accept x w.p. min(1, min(p(x)/(1-alpha), 1)/q(x)); residual norm(max(0,
    p - q)); bonus p. alpha = 0 is `strict`; acceptance rises with alpha (for alpha < 1)."""
    return _template(mentored_targets, draft, q, p, rng, alpha=alpha)


ROW_LAWS["mentored"] = _template_law(mentored_targets)


# ------------------------------------------------------------------------------------------ fuzzy / r_fuzzy


def fuzzy_sure(q, p, *, T: float):  # q, p: [n, V] -> bool[n]
    """Rows where fuzzy takes the draft outright: JSD(p, q) < T."""
    return jsd(p, q) < T


def fuzzy_accept(x, q, p, *, T: float, **_):  # x: int[n]; q, p: [n, V] -> [n]
    """1 where JSD(p, q) < T, else the strict test's min(1, p(x)/q(x))."""
    q, p = as_float(q), as_float(p)
    xp = namespace(q, p)
    return xp.where(fuzzy_sure(q, p, T=T), 1.0, template_accept(x, q, p))


def fuzzy_recovered(x, q, p, **_):  # q, p: [n, V] -> [n, V]
    """The strict residual, norm(max(0, p - q))."""
    return residual(as_float(p), as_float(q))


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
    sure = fuzzy_sure(q, p[:k], T=T)  # bool[k]
    accept = fuzzy_accept(draft, q, p[:k], T=T)  # [k]
    for i in range(k):
        if sure[i]:
            continue
        if rng.random() < accept[i]:
            continue
        return i, residual_sample(p[i], q[i], rng)
    return k, sample(p[k], rng)


ROW_LAWS["fuzzy"] = RowLaw(fuzzy_accept, fuzzy_recovered)


def _r_fuzzy_pick(sure, q, p):  # sure: bool[n]; q, p: [n, c] -> [n, c]
    """r_fuzzy's pi: row i is q's where sure[i], else p's. Column by column: any columns of q and p give
    those columns of pi."""
    return namespace(q, p).where(sure[:, None], q, p)


def r_fuzzy_targets(x, q, p, *, alpha: float, **_):  # q, p: [n, V] -> ([n, V], [n, V]); x unused
    """pi_rej = pi_res = q if JSD(p, q) < alpha else p."""
    q, p = as_float(q), as_float(p)
    pi = _r_fuzzy_pick(jsd(p, q) < alpha, q, p)
    return pi, pi


def r_fuzzy_accept(x, q, p, *, alpha: float, **_):  # x: int[n]; q, p: [n, V] -> [n]
    """The template's acceptance for `r_fuzzy_targets`, template_accept(x, q, pi_rej), without building
    pi_rej over whole rows: template_accept reads column x of q and pi_rej only, and `_r_fuzzy_pick`
    builds pi column by column, so here it builds column x alone (tests/test_verify_rows.py checks the
    two are equal, bit for bit)."""
    q, p = as_float(q), as_float(p)
    xp = namespace(q, p)
    r = rows_of(xp, p)
    qx, px = q[r, x][:, None], p[r, x][:, None]  # [n, 1]: column x
    at = xp.zeros(p.shape[0], dtype=xp.int64, device=device(p))  # x's column in these [n, 1] rows
    return template_accept(at, qx, _r_fuzzy_pick(jsd(p, q) < alpha, qx, px))


@register("r_fuzzy", needs_q=True, defaults={"alpha": 0.3})  # default: same threshold as fuzzy's T
def r_fuzzy(draft, q, p, rng, *, alpha: float, **_):
    """Fuzzy in the template form: pi_rej = pi_res = q where JSD(p, q) < alpha, else p; bonus p.

    With pi_rej = q the sampled draft is always accepted (ratio q(x)/q(x) = 1), so this equals `fuzzy`
    in distribution. alpha <= 0 is `strict`; acceptance rises with alpha.
    """
    return _template(r_fuzzy_targets, draft, q, p, rng, alpha=alpha)


# accept: the template's, on column x only (`r_fuzzy_accept`); recovered: the template's
ROW_LAWS["r_fuzzy"] = RowLaw(r_fuzzy_accept, _template_law(r_fuzzy_targets).recovered)


# ------------------------------------------------------------------------------------------ cascades


def casc_opt_targets(x, q, p, *, alpha: float, **_):  # q, p: [n, V] -> ([n, V], [n, V]); x unused
    """Defer to the target (r = 1) iff max q < max p - alpha * TV(p, q); pi = (1 - r) q + r p.

    r is 0 or 1, so pi is q (keep the drafter's choice: always accepted) or p (the strict test).
    Since max q - max p <= TV(p, q), every alpha < -1 defers whenever p != q: lossless.
    """
    q, p = as_float(q), as_float(p)
    xp = namespace(q, p)
    defer = xp.max(q, axis=-1) < xp.max(p, axis=-1) - alpha * total_variation(p, q)  # bool[n]
    pi = xp.where(defer[:, None], p, q)
    return pi, pi


@register("casc_opt", needs_q=True, defaults={"alpha": 0.5})  # default: drafter may trail by TV/2
def casc_opt(draft, q, p, rng, *, alpha: float, **_):
    """Speculative cascade, optimal-deferral form (Narasimhan et al. 2024): pi from
    `casc_opt_targets` is used for acceptance and residual; bonus from p (no q at the bonus position).
    alpha -> -inf (any alpha < -1) is `strict`; acceptance rises with alpha."""
    return _template(casc_opt_targets, draft, q, p, rng, alpha=alpha)


ROW_LAWS["casc_opt"] = _template_law(casc_opt_targets)


def casc_tok_top(p, *, alpha: float):  # p: [n, V] -> [n, 1]
    """The bar of the kept set A = {v : p(v) >= (1 - alpha) max p}."""
    xp = namespace(p)
    return (1.0 - alpha) * xp.max(p, axis=-1, keepdims=True)


def one_hot_ids(q):  # q: [n, V] -> int[n] or None
    """Each row's token where every row of q is one-hot (a token-only draft's row), else None.

    q is a probability row, so a largest entry of 1 leaves 0 everywhere else: a max over the rows tells,
    where a test of q's zeros would cost a comparison pass over them (on CPU, torch's comparisons over
    whole rows cost several times a max or a multiply)."""
    xp = namespace(q)
    if q.shape[0] and bool(xp.all(xp.max(q, axis=-1) == 1.0)):
        return xp.argmax(q, axis=-1)
    return None


def casc_tok_in_a(q, p, top):  # q, p: [n, V]; top: [n, 1] -> [n, 1] or None
    """For one-hot q rows (`one_hot_ids`): 1.0 where the row's token is in A = {v : p(v) >= top}, else 0.0,
    which is then q's whole mass on A (None for other rows)."""
    j = one_hot_ids(q)
    if j is None:
        return None
    xp = namespace(q, p)
    return xp.astype(p[rows_of(xp, p), j] >= top[:, 0], p.dtype)[:, None]


def casc_tok_eta(q, p, top, in_a=None):  # q, p: [n, V]; top, in_a: [n, 1] -> [n, 1]
    """eta = 1 - sum_{v in A} q(v), A = {v : p(v) >= top}: the drafter's mass outside A, clipped at 0
    (rounding must not make it negative). For one-hot rows the sum is `casc_tok_in_a`, its only term:
    the very same number."""
    xp = namespace(q, p)
    mass = in_a if in_a is not None else xp.sum(xp.where(p >= top, q, 0.0), axis=-1, keepdims=True)
    return xp.clip(1.0 - mass, min=0.0)


def casc_tok_targets(x, q, p, *, alpha: float, **_):  # q, p: [n, V] -> ([n, V], [n, V]); x unused
    """Token-level cascade: keep the drafter on the tokens the target also rates highly.

    A   = {v : p(v) >= (1 - alpha) max p}          (alpha < 0: A is empty)    `casc_tok_top`
    eta = 1 - sum_{v in A} q(v)                     (drafter mass outside A, handed to the target)    `casc_tok_eta`
    pi  = q * 1[v in A] + eta * p                   (sums to 1)
    """
    q, p = as_float(q), as_float(p)
    xp = namespace(q, p)
    top = casc_tok_top(p, alpha=alpha)
    in_a = casc_tok_in_a(q, p, top)  # one-hot rows: q on A is q times 1 or 0, with no comparison over the rows
    kept = xp.where(p >= top, q, 0.0) if in_a is None else q * in_a  # [n, V]: q on A
    pi = kept + casc_tok_eta(q, p, top, in_a) * p
    return pi, pi


def casc_tok_accept(x, q, p, *, alpha: float, **_):  # x: int[n]; q, p: [n, V] -> [n]
    """The template's acceptance for `casc_tok_targets`, template_accept(x, q, pi), with pi built on
    column x only (the same elementwise steps as `casc_tok_targets`, so the same numbers: checked bit
    for bit in tests/test_verify_rows.py)."""
    q, p = as_float(q), as_float(p)
    xp = namespace(q, p)
    r = rows_of(xp, p)
    top = casc_tok_top(p, alpha=alpha)  # [n, 1]
    qx, px = q[r, x][:, None], p[r, x][:, None]  # [n, 1]: column x
    pix = xp.where(px >= top, qx, 0.0) + casc_tok_eta(q, p, top, casc_tok_in_a(q, p, top)) * px
    at = xp.zeros(p.shape[0], dtype=xp.int64, device=device(p))  # x's column in these [n, 1] rows
    return template_accept(at, qx, pix)


@register("casc_tok", needs_q=True, defaults={"alpha": 0.3})  # default: A = tokens within 70% of max p
def casc_tok(draft, q, p, rng, *, alpha: float, **_):
    """Speculative cascade, token-specific form (Narasimhan et al. 2024): pi from `casc_tok_targets`
    is used for acceptance and residual; bonus from p (no q at the bonus position).

    alpha -> -inf (any alpha < 0: A empty, eta = 1, pi = p) is `strict`. A grows with alpha, but the
    acceptance probability sum_x min(q(x), pi(x)) is NOT monotone in alpha in general, and can fall
    below strict's: adding a token to A shrinks eta, and so pi, on every token outside A.
    """
    return _template(casc_tok_targets, draft, q, p, rng, alpha=alpha)


# accept: the template's, on column x only (`casc_tok_accept`); recovered: the template's
ROW_LAWS["casc_tok"] = RowLaw(casc_tok_accept, _template_law(casc_tok_targets).recovered)

# The lossless rules' row laws, so that sweeps can compare against them with the same function
# (`lossless.strict` is the template with pi = p; `lossless.greedy` keeps the argmax).
ROW_LAWS["strict"] = RowLaw(lambda x, q, p, **_: template_accept(x, as_float(q), as_float(p)), fuzzy_recovered)


def _greedy_accept(x, q, p, **_):  # x: int[n]; p: [n, V] -> [n]: 1 where x = argmax p
    p = as_float(p)
    return argmax_row(p)[rows_of(namespace(p), p), x]


ROW_LAWS["greedy"] = RowLaw(_greedy_accept, typical_recovered)


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

    sum_x q(x) * P(accept x), using the rule's own acceptance definition (`ROW_LAWS`; for template rules
    sum_x min(q(x), pi_rej_x(x))). Parameters: the rule's defaults, overridden by the spec, then `params`.
    """
    spec = rule if isinstance(rule, RuleSpec) else RuleSpec.parse(rule)
    if spec.name not in ROW_LAWS:
        raise ValueError(f"no exact acceptance probability for rule {spec.name!r}")
    kwargs = spec.kwargs()
    kwargs.update(params)
    q_row = np.asarray(q_row, dtype=np.float64)  # [V]
    p_row = np.asarray(p_row, dtype=np.float64)  # [V]
    xs = np.flatnonzero(q_row > 0)  # int[n]: every token the drafter can draft
    q = np.repeat(q_row[None, :], len(xs), axis=0)  # [n, V]
    p = np.repeat(p_row[None, :], len(xs), axis=0)  # [n, V]
    return float(np.sum(q_row[xs] * ROW_LAWS[spec.name].accept(xs, q, p, **kwargs)))
