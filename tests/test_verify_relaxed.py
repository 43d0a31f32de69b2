"""Relaxed verification rules (acespec.verify.relaxed), tested the way vLLM tests its rejection sampler:
hand-built and seeded random distributions, parametrised sizes, empirical output distributions
compared with a chi-square test against the distribution the rule's definition implies.

The analytic distributions below are re-derived from the formulas in docs/research/rules.md, independently of the code.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import chi2
import pytest

from acespec.verify import RULES, RuleSpec, RuleSpecError, verify_block
from relaxed_laws import CASES, MILD, RELAXED, analytic_first_token, analytic_targets, rand_dist  # noqa: F401

from acespec.verify.relaxed import (
    LOSSLESS_POINTS,
    RELAX_DIRECTION,
    RELAX_PARAM,
    acceptance_probability,
    entropy,
    jsd,
    total_variation,
)

P_MIN = 0.001  # chi-square p-value below which a distribution mismatch is declared

# ------------------------------------------------------------------------------------------ statistics helpers


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed counts to probabilities; cells expecting < 5 are pooled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    if np.any(counts[probs <= 1e-15] > 0):
        return 0.0  # an outcome the distribution says is impossible
    expected = probs * n
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    if len(obs_a) < 2:
        return 1.0
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    return float(chi2.sf(stat, len(obs_a) - 1))


# ------------------------------------------------------------------------------------------ distributions


def sample_rows(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Vectorised inverse-CDF sampling. cdf: [V] (one shared row) or [N, V] (one row per draw); u: [N] -> int[N]."""
    V = cdf.shape[-1]
    if cdf.ndim == 1:
        idx = np.searchsorted(cdf, u * cdf[-1], side="right")
    else:
        idx = (cdf <= u[:, None] * cdf[:, -1:]).sum(axis=-1)
    return np.minimum(idx, V - 1)


def first_token_hist(rule: str, q0: np.ndarray, p0: np.ndarray, params: dict, N: int, seed: int):
    """Run a k=1 block N times with the draft sampled from q0; returns (histogram of the emitted first
    token, number of accepted drafts)."""
    V = len(p0)
    rng = np.random.default_rng(seed)
    drafts = sample_rows(np.cumsum(q0), rng.random(N))
    spec = RuleSpec.parse(rule)
    p = np.stack([p0, np.full(V, 1.0 / V)])  # [2, V]: position 0, then the bonus row
    q = q0[None, :]  # [1, V]
    hist = np.zeros(V, dtype=np.int64)
    n_acc = 0
    for d in drafts:
        acc, nxt = verify_block(spec, np.array([d]), q, p, rng, **params)
        hist[d if acc == 1 else nxt] += 1
        n_acc += acc
    return hist, n_acc


# ------------------------------------------------------------------------------------------ registry, tables


def test_rules_registered_with_documented_defaults_and_flags():
    expected = {
        "typical": ({"eps": 0.09, "delta": 0.3}, False),
        "cactus": ({"delta": 0.35}, True),
        "mentored": ({"alpha": 0.3}, True),
        "fuzzy": ({"T": 0.3}, True),
        "r_fuzzy": ({"alpha": 0.3}, True),
        "casc_opt": ({"alpha": 0.5}, True),
        "casc_tok": ({"alpha": 0.3}, True),
    }
    for name, (defaults, needs_q) in expected.items():
        info = RULES[name]
        assert info.defaults == defaults and info.needs_q is needs_q and not info.lossless
        assert info.doc  # the math is in the docstring
    assert set(RELAX_PARAM) == set(RELAXED) == set(RELAX_DIRECTION)
    assert set(LOSSLESS_POINTS) == set(RELAXED) - {"typical"}
    for name, point in LOSSLESS_POINTS.items():
        assert set(point) == set(RULES[name].defaults)
    for name, param in RELAX_PARAM.items():
        assert param in RULES[name].defaults and RELAX_DIRECTION[name] in (-1, 1)


def test_rule_specs_parse_and_round_trip():
    spec = RuleSpec.parse("cactus:delta=0.35")
    assert spec.kwargs() == {"delta": 0.35} and str(spec) == "cactus:delta=0.35"
    assert RuleSpec.parse("typical:eps=0.2").kwargs() == {"eps": 0.2, "delta": 0.3}
    with pytest.raises(RuleSpecError):
        RuleSpec.parse("mentored:delta=0.1")


def test_divergences():
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.0, 0.0, 1.0])
    assert jsd(p, q) == pytest.approx(math.log(2))  # disjoint supports: the maximum
    assert jsd(p, p) == 0.0
    assert total_variation(p, q) == pytest.approx(1.0)
    assert entropy(p) == pytest.approx(math.log(2))
    assert jsd(np.stack([p, p]), np.stack([q, p])).shape == (2,)


@pytest.mark.parametrize("rule", RELAXED)
def test_empty_block_emits_a_bonus_from_p(rule):
    p = np.array([[0.0, 0.0, 1.0, 0.0]])
    assert verify_block(rule, np.array([], dtype=np.int64), np.zeros((0, 4)), p, np.random.default_rng(0)) == (0, 2)


# ------------------------------------------------------------------------------------------ lossless points


@pytest.mark.parametrize("rule", sorted(LOSSLESS_POINTS))
@pytest.mark.parametrize("V,sparse,seed", [(8, False, 1), (16, True, 2)])
def test_lossless_point_k1_emits_p(rule, V, sparse, seed):
    rng = np.random.default_rng(seed)
    p0, q0 = rand_dist(rng, V, sparse=sparse), rand_dist(rng, V, sparse=sparse)
    hist, _ = first_token_hist(rule, q0, p0, LOSSLESS_POINTS[rule], N=20000, seed=seed + 100)
    assert chi2_pvalue(hist, p0) > P_MIN


@pytest.mark.parametrize("rule", sorted(LOSSLESS_POINTS))
@pytest.mark.parametrize("V,sparse,seed", [(8, False, 3), (12, True, 4)])
def test_lossless_point_k2_first_token_and_two_token_prefix(rule, V, sparse, seed):
    """k=2 blocks drafted from q, with position 1's distributions depending on token 0 (a toy model).

    When the block is rejected at position 0, the second token comes from the next round (a k=1 block
    at the new context), as in the engine. The emitted prefix (y0, y1) must be ~ p0(y0) p1(y1 | y0).
    """
    rng = np.random.default_rng(seed)
    p0, q0 = rand_dist(rng, V, sparse=sparse), rand_dist(rng, V, sparse=sparse)
    p1 = np.stack([rand_dist(rng, V, sparse=sparse) for _ in range(V)])  # [V, V]: p1[y0] is the row at position 1
    q1 = np.stack([rand_dist(rng, V, sparse=sparse) for _ in range(V)])  # [V, V]
    bonus = np.full(V, 1.0 / V)  # position 2 (the bonus of a full accept) does not enter the 2-token prefix
    spec = RuleSpec.parse(rule)
    params = LOSSLESS_POINTS[rule]

    N = 15000
    run = np.random.default_rng(seed + 200)
    d0 = sample_rows(np.cumsum(q0), run.random(N))
    d1 = sample_rows(np.cumsum(q1, axis=-1)[d0], run.random(N))
    first = np.zeros(V, dtype=np.int64)
    pair = np.zeros((V, V), dtype=np.int64)
    for a, b in zip(d0, d1):
        acc, nxt = verify_block(spec, np.array([a, b]), np.stack([q0, q1[a]]), np.stack([p0, p1[a], bonus]), run, **params)
        if acc >= 1:
            y0, y1 = a, (b if acc == 2 else nxt)
        else:
            y0 = nxt
            d = sample_rows(np.cumsum(q1[y0]), run.random(1))[0]
            acc2, nxt2 = verify_block(spec, np.array([d]), q1[y0][None], np.stack([p1[y0], bonus]), run, **params)
            y1 = d if acc2 == 1 else nxt2
        first[y0] += 1
        pair[y0, y1] += 1
    assert chi2_pvalue(first, p0) > P_MIN
    assert chi2_pvalue(pair, p0[:, None] * p1) > P_MIN


# ------------------------------------------------------------------------------------------ relaxed settings


@pytest.mark.parametrize("rule", RELAXED)
@pytest.mark.parametrize("setting", ["default", "mild"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_relaxed_setting_matches_analytic_distribution(rule, setting, case):
    _, q, p = CASES[case]
    prm = RuleSpec.parse(rule).kwargs()  # the registered relaxed default
    if setting == "mild":
        prm.update(MILD[rule])
    expected = analytic_first_token(rule, q, p, prm)
    assert expected.sum() == pytest.approx(1.0)
    N = 10000
    hist, n_acc = first_token_hist(rule, q, p, prm, N=N, seed=1000 + case)
    assert chi2_pvalue(hist, expected) > P_MIN
    # and the exact acceptance probability the module reports agrees with the sampled rule
    a = acceptance_probability(rule, q, p, **prm)
    assert abs(n_acc / N - a) <= 5 * math.sqrt(max(a * (1 - a), 1e-4) / N)


@pytest.mark.parametrize("rule", RELAXED)
def test_relaxed_defaults_really_relax_on_some_case(rule):
    """Guards the test above against being vacuous: on some case the rule's output is not p."""
    prm = RuleSpec.parse(rule).kwargs()
    assert max(total_variation(analytic_first_token(rule, q, p, prm), p) for _, q, p in CASES) > 0.03


@pytest.mark.parametrize("rule", RELAXED)
def test_relaxed_setting_k2_first_token(rule):
    """The first emitted token of a k=2 block depends on position 0 only: same analytic distribution."""
    _, q, p = CASES[0]
    prm = RuleSpec.parse(rule).kwargs()
    V = len(p)
    rng = np.random.default_rng(31)
    q1, p1 = rand_dist(rng, V), rand_dist(rng, V)
    spec = RuleSpec.parse(rule)
    hist = np.zeros(V, dtype=np.int64)
    N = 5000
    d0 = sample_rows(np.cumsum(q), rng.random(N))
    d1 = sample_rows(np.cumsum(q1), rng.random(N))
    for a, b in zip(d0, d1):
        acc, nxt = verify_block(spec, np.array([a, b]), np.stack([q, q1]), np.stack([p, p1, p1]), rng)
        hist[a if acc >= 1 else nxt] += 1
    assert chi2_pvalue(hist, analytic_first_token(rule, q, p, prm)) > P_MIN


# ------------------------------------------------------------------------------------------ monotone acceptance


SWEEPS = {
    "typical": np.linspace(0.5, 0.0, 26),  # eps, decreasing
    "cactus": np.linspace(0.0, 2.0, 41),
    "mentored": np.concatenate([np.linspace(0.0, 0.99, 34), [1.0, 1.5]]),
    "fuzzy": np.linspace(-0.1, 0.8, 46),
    "r_fuzzy": np.linspace(-0.1, 0.8, 46),
    "casc_opt": np.concatenate([[-1e9, -10.0, -1.0], np.linspace(-0.9, 5.0, 60)]),
}


def monotone_cases() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    cases = [(q, p) for _, q, p in CASES]
    for V in (8, 16):
        for sparse in (False, True):
            for conc in (0.3, 1.0, 3.0):
                cases.append((rand_dist(rng, V, sparse=sparse, conc=conc), rand_dist(rng, V, sparse=sparse, conc=conc)))
    return cases


@pytest.mark.parametrize("rule", sorted(SWEEPS))
def test_acceptance_rises_monotonically_with_relaxation(rule):
    param = RELAX_PARAM[rule]
    values = SWEEPS[rule]
    assert np.all(np.diff(values) * RELAX_DIRECTION[rule] > 0)  # the sweep walks in the relaxing direction
    for q, p in monotone_cases():
        acc = [acceptance_probability(rule, q, p, **{param: float(v)}) for v in values]
        assert np.all(np.diff(acc) >= -1e-12), (rule, acc)
        if rule in LOSSLESS_POINTS:  # at the lossless end it is strict's acceptance
            lossless = acceptance_probability(rule, q, p, **LOSSLESS_POINTS[rule])
            assert lossless == pytest.approx(np.minimum(p, q).sum())


def test_casc_tok_acceptance_is_not_monotone_in_alpha():
    """A documented exception: growing A shrinks eta, hence pi, on tokens outside A.

    p = (.5, .3, .2), q = (.1, .1, .8). alpha = 0: A = {0}, eta = .9, acceptance .1 + .1 + .18 = .38.
    alpha = .4: A = {0, 1}, eta = .8, acceptance .1 + .1 + .16 = .36. Strict's is sum min(p, q) = .40.
    """
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.1, 0.8])
    at = {a: acceptance_probability("casc_tok", q, p, alpha=a) for a in (-1e9, 0.0, 0.4, 1.0)}
    assert at[-1e9] == pytest.approx(0.40)
    assert at[0.0] == pytest.approx(0.38)
    assert at[0.4] == pytest.approx(0.36)
    assert at[1.0] == pytest.approx(1.0)  # A = every token, pi = q: everything accepted


def test_casc_tok_endpoints_on_random_rows():
    rng = np.random.default_rng(5)
    for _ in range(20):
        p, q = rand_dist(rng, 10), rand_dist(rng, 10)
        assert acceptance_probability("casc_tok", q, p, alpha=-0.5) == pytest.approx(np.minimum(p, q).sum())
        assert acceptance_probability("casc_tok", q, p, alpha=1.0) == pytest.approx(1.0)


def test_casc_opt_is_lossless_for_every_alpha_below_minus_one():
    rng = np.random.default_rng(6)
    for _ in range(50):
        p, q = rand_dist(rng, 8, conc=0.5), rand_dist(rng, 8, conc=0.5)
        assert acceptance_probability("casc_opt", q, p, alpha=-1.0001) == pytest.approx(np.minimum(p, q).sum())


# ------------------------------------------------------------------------------------------ degenerate rows


def test_typical_under_greedy_p_is_greedy():
    p = np.eye(5)[[3, 1, 4]]  # one-hot rows: [3, V]
    rng = np.random.default_rng(0)
    assert verify_block("typical", [3, 1], None, p, rng) == (2, 4)
    assert verify_block("typical", [3, 2], None, p, rng) == (1, 1)
    assert verify_block("greedy", [3, 2], None, p, rng) == (1, 1)


def test_typical_recovers_argmax_and_threshold_uses_entropy():
    p = np.array([[0.6, 0.3, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]])
    # H(p0) = 0.898 nats: threshold min(0.09, 0.3 * e^-0.898 = 0.122) = 0.09, so 0.1 passes and 0.0 fails
    rng = np.random.default_rng(0)
    assert verify_block("typical", [2], None, p, rng)[0] == 1
    assert verify_block("typical", [3], None, p, rng) == (0, 0)
    # a high threshold rejects: recovered = argmax
    assert verify_block("typical", [1], None, p, rng, eps=0.5, delta=1.0) == (0, 0)


def test_cactus_with_certain_target_and_zero_prob_draft():
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([[0.2, 0.6, 0.2]])
    for _ in range(50):
        assert verify_block("cactus:delta=5", [1], q, p, rng)[0] == 1  # p(x) = 1: H = p, always accepted
        assert verify_block("cactus:delta=5", [0], q, p, rng) == (0, 1)  # p(x) = 0: h = 0, residual is p's


def test_mentored_alpha_at_and_beyond_one_accepts_all_supported_tokens():
    rng = np.random.default_rng(0)
    p = np.array([[0.01, 0.99, 0.0], [0.5, 0.5, 0.0]])
    q = np.array([[0.9, 0.05, 0.05]])
    for alpha in (1.0, 3.0):
        assert all(verify_block("mentored", [0], q, p, rng, alpha=alpha)[0] == 1 for _ in range(20))
        assert all(verify_block("mentored", [2], q, p, rng, alpha=alpha) == (0, 1) for _ in range(20))


def test_casc_tok_with_A_covering_q_never_rejects_inside_A():
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.45, 0.05], [1.0, 0.0, 0.0]])
    q = np.array([[0.5, 0.5, 0.0]])  # A at alpha 0.3 = {0, 1} holds all of q: eta = 0, pi = q
    for x in (0, 1):
        assert all(verify_block("casc_tok", [x], q, p, rng)[0] == 1 for _ in range(20))


def test_identical_p_q_never_rejects_and_rng_is_the_only_randomness():
    rng0 = np.random.default_rng(9)
    p = np.stack([rand_dist(rng0, 8) for _ in range(4)])
    # all but typical (rejects low-probability drafts by design) and casc_tok (a draft outside A gets
    # pi(x) = eta p(x) < q(x), so it can be rejected even when p == q)
    for rule in ["cactus", "mentored", "fuzzy", "r_fuzzy", "casc_opt"]:
        outs = []
        for _ in range(2):
            rng = np.random.default_rng(123)
            outs.append([verify_block(rule, [1, 2, 3], p[:3], p, rng) for _ in range(30)])
            assert all(acc == 3 for acc, _ in outs[-1])
        assert outs[0] == outs[1]  # same seed, same results


# ------------------------------------------------------------------------------------------ parameter ranges


@pytest.mark.parametrize("spec", [
    "cactus:delta=nan", "cactus:delta=inf", "cactus:delta=-inf", "cactus:delta=-0.1",
    "typical:eps=-5,delta=-1", "typical:eps=0.09,delta=-1", "typical:eps=1.5", "mentored:alpha=-0.2",
    "fuzzy:T=nan", "casc_opt:alpha=inf", "r_fuzzy:alpha=-inf",
])
def test_rule_parameters_out_of_range_are_refused(spec):
    """A spec arrives from the wire (HELLO.rule): nan, inf or a value outside a rule's range would make
    it accept anything (typical with eps < 0 accepts every token) or compare false everywhere."""
    with pytest.raises(RuleSpecError) as e:
        RuleSpec.parse(spec)
    assert "finite" in str(e.value) or "must be in" in str(e.value)


@pytest.mark.parametrize("spec", ["cactus:delta=0", "typical:eps=0,delta=0", "typical:eps=1", "mentored:alpha=1.5",
                                  "fuzzy:T=-0.1", "casc_opt:alpha=-1e9", "casc_tok:alpha=-2"])
def test_rule_parameters_in_range_still_parse(spec):
    RuleSpec.parse(spec)
