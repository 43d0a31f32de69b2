"""Losslessness of the lossless rules (greedy, strict, coupled), in the style of vLLM's sampler tests:
hand-built distributions, parametrised sizes, seeded determinism and statistical convergence.

The statistical tests run the whole engine (`acespec.loop.generate`: drafter, chain drafting, the loop,
the target-side verifier) on the exact toy model, and compare the empirical distribution of the first
three emitted tokens with the target's exact distribution over 3-token sequences, computed analytically
from `ToyModel.logits_for_context` and `probs_from_logits`. A chi-square test over sequences (rare cells
pooled) must give p > 0.001; every sample must lie in the target's support. All runs are seeded, so the
file is deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import replace

import numpy as np
from scipy.stats import chi2
import pytest

from acespec.loop import SpecConfig, generate
from acespec.models.toy import ToyModel
from acespec.verify import SamplingParams, coupled_sample, probs_from_logits, softmax, verify_block

P_MIN = 1e-3  # chi-square p-value threshold
VOCAB = 6  # 6^3 = 216 possible 3-token sequences
PROMPT = [1, 2]
LENGTH = 3


# ------------------------------------------------------------------------------------------ statistics
def pooled_chisquare(counts: Counter, exact: dict, n: int, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson chi-square of observed `counts` against `exact` probabilities (cells with p > 0). Cells with
    expected count < min_expected are pooled into one cell (grown with the next-smallest cells until it
    reaches min_expected). Returns (statistic, degrees of freedom, p-value)."""
    cells = sorted((p, s) for s, p in exact.items() if p > 0.0)
    small = [s for p, s in cells if n * p < min_expected]
    big = [s for p, s in cells if n * p >= min_expected]
    bins: list[list] = [[s] for s in big]
    if small:
        pool = small
        while bins and n * sum(exact[s] for s in pool) < min_expected:
            pool = pool + bins.pop(0)
        bins.insert(0, pool)
    stat = 0.0
    for b in bins:
        e = n * sum(exact[s] for s in b)
        o = sum(counts.get(s, 0) for s in b)
        stat += (o - e) ** 2 / e
    df = len(bins) - 1
    assert df >= 1, "too few cells for a chi-square test"
    return stat, df, float(chi2.sf(stat, df))


def exact_sequences(target: ToyModel, prompt: list[int], sp: SamplingParams, length: int = LENGTH) -> dict:
    """{tuple of `length` tokens: exact probability under the target}, zero-probability sequences omitted."""
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == length:
            out[seq] = prob
            return
        p = probs_from_logits(target.logits_for_context(prompt + list(seq)), sp)
        for t in np.flatnonzero(p > 0):
            walk(seq + (int(t),), prob * float(p[t]))

    walk((), 1.0)
    return out


def assert_matches_target(counts: Counter, exact: dict, n: int, label: str) -> float:
    outside = [s for s in counts if s not in exact]
    assert not outside, f"{label}: sampled sequences outside the target's support: {outside[:5]}"
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    stat, df, pval = pooled_chisquare(counts, exact, n)
    assert pval > P_MIN, f"{label}: chi2={stat:.1f} df={df} p={pval:.2e} (n={n})"
    return pval


# ----------------------------------------------------------------------------------------- the models
TARGET = ToyModel(vocab=VOCAB, seed=1)
GOOD_DRAFT = ToyModel(vocab=VOCAB, seed=1, noise=0.7, noise_seed=3)  # close to the target
# a deliberately bad drafter: another table, peakier, plus big noise
BAD_DRAFT = ToyModel(vocab=VOCAB, seed=77, scale=4.0, noise=3.0, noise_seed=11)


def sample_counts(cfg: SpecConfig, draft: ToyModel | None, n: int, seed0: int) -> tuple[Counter, int, int]:
    """Run `n` seeded generations of LENGTH tokens; returns (sequence counts, drafted, accepted)."""
    counts: Counter = Counter()
    drafted = accepted = 0
    for i in range(n):
        res = generate(TARGET, PROMPT, replace(cfg, seed=seed0 + i, max_tokens=LENGTH), draft=draft)
        assert len(res.tokens) == LENGTH
        counts[tuple(res.tokens)] += 1
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    return counts, drafted, accepted


# (rule, drafter, k, temperature, top_k, top_p, samples)
STAT_CASES = [
    ("strict", "good", 1, 1.0, 0, 1.0, 7000),
    ("strict", "good", 2, 1.0, 0, 1.0, 7000),
    ("strict", "good", 4, 1.0, 0, 1.0, 7000),
    ("strict", "good", 2, 0.5, 0, 1.0, 7000),
    ("strict", "good", 4, 1.5, 0, 1.0, 7000),
    ("strict", "good", 2, 1.0, 3, 1.0, 7000),
    ("strict", "good", 4, 1.0, 0, 0.8, 7000),
    ("strict", "good", 1, 0.7, 4, 0.9, 7000),
    ("strict", "bad", 4, 1.0, 0, 1.0, 7000),
    ("strict", "bad", 2, 1.5, 3, 1.0, 7000),
    ("strict", "bad", 1, 0.5, 0, 0.9, 7000),
    ("coupled", "good", 2, 1.0, 0, 1.0, 7000),
    ("coupled", "good", 4, 0.5, 0, 1.0, 7000),
    ("coupled", "bad", 1, 1.5, 0, 1.0, 7000),
    ("coupled", "good", 4, 1.0, 3, 1.0, 7000),
    ("coupled", "good", 2, 1.0, 0, 0.8, 7000),
]


def test_sample_budget():
    assert sum(c[-1] for c in STAT_CASES) >= 100_000


@pytest.mark.parametrize(
    "rule,which,k,temperature,top_k,top_p,n",
    STAT_CASES,
    ids=[f"{r}-{w}-k{k}-T{t}-topk{tk}-topp{tp}" for r, w, k, t, tk, tp, _ in STAT_CASES],
)
def test_first_tokens_match_target_distribution(rule, which, k, temperature, top_k, top_p, n):
    draft = GOOD_DRAFT if which == "good" else BAD_DRAFT
    cfg = SpecConfig(rule=rule, k=k, temperature=temperature, top_k=top_k, top_p=top_p)
    exact = exact_sequences(TARGET, PROMPT, cfg.sampling)
    seed0 = 1_000_003 * (STAT_CASES.index((rule, which, k, temperature, top_k, top_p, n)) + 1)
    counts, drafted, accepted = sample_counts(cfg, draft, n, seed0)
    assert drafted > 0  # speculation actually happened
    if which == "good":
        assert accepted > 0
    assert_matches_target(counts, exact, n, f"{rule}/{which}/k={k}/T={temperature}/top_k={top_k}/top_p={top_p}")


def test_chi_square_has_power():
    """The check above is not vacuous: plain sampling from the *drafter* (a model close to the target)
    fails it clearly at a fraction of the sample size."""
    sp = SamplingParams(1.0)
    exact = exact_sequences(TARGET, PROMPT, sp)
    counts: Counter = Counter()
    n = 3000
    for i in range(n):
        res = generate(GOOD_DRAFT, PROMPT, SpecConfig(rule="strict", temperature=1.0, seed=i, max_tokens=LENGTH, spec=False))
        counts[tuple(res.tokens)] += 1
    _, _, pval = pooled_chisquare(counts, exact, n)
    assert pval < 1e-6


def test_pipelined_strict_matches_target_distribution(pipelined):
    """Strict stays lossless when the edge pipelines blocks (guessed bonus tokens, stale blocks dropped)."""
    cfg = SpecConfig(rule="strict", k=1, temperature=1.0)
    exact = exact_sequences(TARGET, PROMPT, cfg.sampling)
    counts: Counter = Counter()
    dropped = 0
    n = 3000
    for i in range(n):
        res, _, _ = pipelined(TARGET, PROMPT, replace(cfg, seed=7_000_000 + i, max_tokens=LENGTH), draft=GOOD_DRAFT, window=2)
        counts[tuple(res.tokens)] += 1
        dropped += res.stats.dropped
    assert dropped > 0  # the pipelined path (and its stale-block handling) was exercised
    assert_matches_target(counts, exact, n, "strict pipelined k=1")


# ------------------------------------------------------------------------- coupled: drafter-invariance
def reference_decode(target: ToyModel, prompt: list[int], sp: SamplingParams, n: int, pick) -> list[int]:
    """Plain token-by-token decoding straight from the toy model's table (no engine)."""
    ctx = list(prompt)
    for _ in range(n):
        p = probs_from_logits(target.logits_for_context(ctx), sp)
        ctx.append(pick(p, len(ctx)))
    return ctx[len(prompt) :]


BIG_TARGET = ToyModel(vocab=64, seed=5)
DRAFTERS = [
    ToyModel(vocab=64, seed=5, noise=0.1, noise_seed=1),
    ToyModel(vocab=64, seed=5, noise=1.0, noise_seed=2),
    ToyModel(vocab=64, seed=5, noise=3.0, noise_seed=3),
    ToyModel(vocab=64, seed=99, scale=3.0),  # an unrelated table
    ToyModel(vocab=64, seed=5),  # the target itself
]
SAMPLING = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 8, 1.0), (1.0, 0, 0.85)]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_coupled_output_is_drafter_and_depth_invariant(seed, temperature, top_k, top_p):
    prompt = [3, 14, 15]
    base = SpecConfig(rule="coupled", temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=40)
    plain = generate(BIG_TARGET, prompt, replace(base, spec=False)).tokens
    ref = reference_decode(BIG_TARGET, prompt, base.sampling, 40, lambda p, pos: coupled_sample(p, seed, pos))
    assert plain == ref
    for draft in DRAFTERS:
        for k in (1, 2, 4, 7):
            out = generate(BIG_TARGET, prompt, replace(base, k=k), draft=draft).tokens
            assert out == plain, f"drafter {draft.name} k={k}"
        out = generate(BIG_TARGET, prompt, replace(base, k=2, policy="plus2minus1"), draft=draft).tokens
        assert out == plain, f"drafter {draft.name} adaptive"


def test_coupled_differs_across_seeds():
    outs = {tuple(generate(BIG_TARGET, [1, 2], SpecConfig(rule="coupled", temperature=1.0, seed=s, max_tokens=20)).tokens) for s in range(10)}
    assert len(outs) == 10


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("prompt", [[0], [7, 7, 7], [63, 1, 2, 3]])
def test_greedy_speculative_equals_greedy_autoregressive(prompt):
    cfg = SpecConfig(rule="greedy", max_tokens=50)
    plain = generate(BIG_TARGET, prompt, replace(cfg, spec=False)).tokens
    assert plain == reference_decode(BIG_TARGET, prompt, cfg.sampling, 50, lambda p, pos: int(np.argmax(p)))
    for draft in DRAFTERS:
        for k in (1, 3, 4, 8):
            assert generate(BIG_TARGET, prompt, replace(cfg, k=k), draft=draft).tokens == plain
        assert generate(BIG_TARGET, prompt, replace(cfg, policy="plus2minus1"), draft=draft).tokens == plain
        # the other lossless rules degenerate to greedy at temperature 0
        for rule in ("strict", "coupled"):
            assert generate(BIG_TARGET, prompt, replace(cfg, rule=rule, k=3), draft=draft).tokens == plain


def test_greedy_seed_does_not_matter():
    outs = {tuple(generate(BIG_TARGET, [4], SpecConfig(rule="greedy", seed=s, max_tokens=30), draft=DRAFTERS[1]).tokens) for s in range(5)}
    assert len(outs) == 1


def test_strict_is_seed_deterministic():
    cfg = SpecConfig(rule="strict", temperature=1.0, seed=42, max_tokens=40)
    a = generate(BIG_TARGET, [1], cfg, draft=DRAFTERS[1]).tokens
    b = generate(BIG_TARGET, [1], cfg, draft=DRAFTERS[1]).tokens
    c = generate(BIG_TARGET, [1], replace(cfg, seed=43), draft=DRAFTERS[1]).tokens
    assert a == b and a != c


# ------------------------------------------------------------------------------------ probs_from_logits
@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 1.5, 4.0])
@pytest.mark.parametrize("vocab", [2, 7, 64, 1000])
def test_temperature_is_softmax_of_scaled_logits(temperature, vocab):
    logits = np.random.default_rng(vocab).standard_normal((3, vocab)) * 3
    p = probs_from_logits(logits, SamplingParams(temperature))
    np.testing.assert_allclose(p, softmax(logits / temperature), rtol=1e-12, atol=1e-15)
    assert p.dtype == np.float64 and p.shape == (3, vocab)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)
    # a 1-D row gives the same as the batched row
    np.testing.assert_allclose(probs_from_logits(logits[1], SamplingParams(temperature)), p[1])


def test_greedy_is_one_hot_on_argmax_first_on_ties():
    logits = np.array([[0.0, 2.0, 1.0, 2.0], [5.0, -1.0, 5.0, 0.0], [-3.0, -2.0, -1.0, -4.0]])
    p = probs_from_logits(logits, SamplingParams(0.0))
    np.testing.assert_array_equal(p, np.eye(4)[[1, 0, 2]])
    # top-k / top-p do not change greedy
    np.testing.assert_array_equal(probs_from_logits(logits, SamplingParams(0.0, top_k=1, top_p=0.1)), p)


def test_top_k_breaks_ties_by_token_id():
    logits = np.array([1.0, 3.0, 3.0, 3.0, 0.0])
    p = probs_from_logits(logits, SamplingParams(1.0, top_k=2))
    np.testing.assert_allclose(p, [0.0, 0.5, 0.5, 0.0, 0.0])
    p = probs_from_logits(logits, SamplingParams(1.0, top_k=4))
    assert p[4] == 0.0 and p[0] > 0.0
    # top_k >= V keeps everything
    np.testing.assert_allclose(probs_from_logits(logits, SamplingParams(1.0, top_k=5)), softmax(logits))
    np.testing.assert_allclose(probs_from_logits(logits, SamplingParams(1.0, top_k=50)), softmax(logits))


def test_top_p_keeps_the_minimal_set():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    for top_p, kept in [(0.45, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.97, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])]:
        p = probs_from_logits(logits, SamplingParams(1.0, top_p=top_p))
        assert list(np.flatnonzero(p)) == kept, top_p
        base = np.array([0.5, 0.3, 0.15, 0.05])[kept]
        np.testing.assert_allclose(p[kept], base / base.sum(), rtol=1e-12)
    # ties at the boundary: the lower ids win, and exactly-reached mass stops the set
    p = probs_from_logits(np.zeros(4), SamplingParams(1.0, top_p=0.5))
    np.testing.assert_allclose(p, [0.5, 0.5, 0.0, 0.0])
    # a tiny top_p keeps only the most likely token
    p = probs_from_logits(logits, SamplingParams(1.0, top_p=1e-9))
    np.testing.assert_array_equal(p, [1.0, 0.0, 0.0, 0.0])


def _reference_probs(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Slow, obvious implementation: sort by (logit desc, id), cut top-k, softmax, cut the minimal
    prefix (by (p desc, id)) whose mass reaches top_p, renormalise."""
    V = len(logits)
    x = logits / sp.temperature
    order = sorted(range(V), key=lambda i: (-x[i], i))
    kept = order[: sp.top_k] if sp.top_k else order
    e = np.exp(x[kept] - max(x[kept]))
    probs = dict(zip(kept, e / e.sum()))
    out = np.zeros(V)
    mass = 0.0
    for i in sorted(kept, key=lambda i: (-probs[i], i)):
        out[i] = probs[i]
        mass += probs[i]
        if mass >= sp.top_p:
            break
    return out / out.sum()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("vocab", [5, 32, 257])
def test_probs_from_logits_matches_reference(seed, vocab):
    rng = np.random.default_rng([seed, vocab])
    for _ in range(10):
        logits = rng.standard_normal(vocab) * rng.uniform(0.5, 4)
        sp = SamplingParams(
            float(rng.choice([0.3, 0.8, 1.0, 1.7])), int(rng.choice([0, 1, 3, vocab // 2])), float(rng.choice([1.0, 0.95, 0.6, 0.2]))
        )
        np.testing.assert_allclose(probs_from_logits(logits, sp), _reference_probs(logits, sp), atol=1e-12)


def test_sampling_params_validation():
    for bad in (dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
                dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.01)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ------------------------------------------------------------------------------- verify_block (unit)
def _dists(rng, k: int, V: int) -> np.ndarray:
    return rng.dirichlet(np.ones(V) * 0.7, size=k)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("V", [2, 16, 300])
def test_strict_accepts_everything_when_q_equals_p(k, V):
    rng = np.random.default_rng([k, V])
    p = _dists(rng, k + 1, V)
    for trial in range(50):
        draft = np.array([rng.choice(V, p=p[i]) for i in range(k)])
        acc, nxt = verify_block("strict", draft, p[:k], p, np.random.default_rng(trial))
        assert acc == k and 0 <= nxt < V and p[k, nxt] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_strict_rejects_at_zero_when_q_is_disjoint_from_p(k):
    V = 8
    p = np.zeros((k + 1, V))
    p[:, :4] = 0.25  # target mass on tokens 0..3
    q = np.zeros((k, V))
    q[:, 4:] = 0.25  # drafter mass on 4..7
    for s in range(50):
        rng = np.random.default_rng(s)
        draft = np.array([rng.integers(4, 8) for _ in range(k)])
        acc, nxt = verify_block("strict", draft, q, p, rng)
        assert acc == 0 and nxt in range(4)


def test_strict_single_position_statistics():
    """Accept probability is sum(min(p, q)) = 1 - TV(p, q) and the emitted token is distributed as p."""
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = np.array([[0.1, 0.2, 0.3, 0.4]])
    n = 20000
    rng = np.random.default_rng(2024)
    firsts: Counter = Counter()
    accepts = 0
    for _ in range(n):
        x = rng.choice(4, p=q[0])
        acc, nxt = verify_block("strict", np.array([x]), q, p, rng)
        accepts += acc
        firsts[(x,) if acc else (nxt,)] += 1
    expected_accept = np.minimum(p[0], q[0]).sum()
    assert abs(accepts / n - expected_accept) < 4 * math.sqrt(expected_accept * (1 - expected_accept) / n)
    assert_matches_target(firsts, {(t,): float(p[0, t]) for t in range(4) if p[0, t] > 0}, n, "strict one position")


def test_coupled_single_position_statistics():
    """Over seeds, the emitted token is distributed as p and acceptance is >= (1 - TV)/(1 + TV)."""
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    n = 20000
    firsts: Counter = Counter()
    accepts = 0
    for seed in range(n):
        x = coupled_sample(q, seed, 10)
        acc, nxt = verify_block("coupled", np.array([x]), None, p, np.random.default_rng(0), seed=seed, start_pos=10)
        accepts += acc
        firsts[(x,) if acc else (nxt,)] += 1
    tv = np.maximum(p[0] - q, 0).sum()
    assert accepts / n > (1 - tv) / (1 + tv) - 4 * math.sqrt(0.25 / n)
    assert_matches_target(firsts, {(t,): float(p[0, t]) for t in range(3)}, n, "coupled one position")


@pytest.mark.parametrize("k", [1, 2, 5])
def test_coupled_unit(k):
    rng = np.random.default_rng(k)
    V = 12
    p = _dists(rng, k + 1, V)
    seed, start = 77, 40
    want = [coupled_sample(p[i], seed, start + i) for i in range(k + 1)]
    # the target's own samples as the draft: everything accepted, the bonus is the next sample
    assert verify_block("coupled", np.array(want[:k]), None, p, rng, seed=seed, start_pos=start) == (k, want[k])
    # a wrong token at position j: rejected there, and the emitted token is still the target's sample
    for j in range(k):
        draft = np.array(want[:k])
        draft[j] = (draft[j] + 1) % V
        assert verify_block("coupled", draft, None, p, rng, seed=seed, start_pos=start) == (j, want[j])
    # one-hot target on a token the drafter did not pick: reject at 0 with that token
    hot = np.zeros((k + 1, V))
    hot[:, 3] = 1.0
    assert verify_block("coupled", np.full(k, 5), None, hot, rng, seed=seed, start_pos=start) == (0, 3)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_unit(k):
    rng = np.random.default_rng(k)
    V = 9
    p = _dists(rng, k + 1, V)
    best = p.argmax(-1)
    assert verify_block("greedy", best[:k], None, p, rng) == (k, int(best[k]))
    for j in range(k):
        draft = best[:k].copy()
        draft[j] = (draft[j] + 1) % V
        assert verify_block("greedy", draft, None, p, rng) == (j, int(best[j]))


def test_empty_draft_is_a_plain_step():
    p = np.array([[0.0, 1.0, 0.0]])
    rng = np.random.default_rng(0)
    assert verify_block("greedy", np.array([], dtype=int), None, p, rng) == (0, 1)
    assert verify_block("strict", np.array([], dtype=int), np.zeros((0, 3)), p, rng) == (0, 1)
    assert verify_block("coupled", np.array([], dtype=int), None, p, rng, seed=3, start_pos=0) == (0, 1)


def test_verify_block_shape_errors():
    rng = np.random.default_rng(0)
    p = np.full((3, 4), 0.25)
    q = np.full((2, 4), 0.25)
    draft = np.array([1, 2])
    for rule in ("greedy", "strict", "coupled"):
        with pytest.raises(ValueError):
            verify_block(rule, draft, q, p[:2], rng)  # p needs k+1 rows
        with pytest.raises(ValueError):
            verify_block(rule, draft, q, p[0], rng)  # p must be 2-D
        with pytest.raises(ValueError):
            verify_block(rule, np.array([1, 2, 3]), q, p, rng)
    with pytest.raises(ValueError):
        verify_block("strict", draft, None, p, rng)  # strict needs q
    with pytest.raises(ValueError):
        verify_block("strict", draft, q[:1], p, rng)  # q needs k rows
    with pytest.raises(ValueError):
        verify_block("strict", draft, np.full((2, 5), 0.2), p, rng)  # q needs V columns
    with pytest.raises(ValueError):
        verify_block("nope", draft, q, p, rng)  # unknown rule (RuleSpecError is a ValueError)


def test_all_lossless_rules_registered_as_lossless():
    from acespec.verify import RULES

    for name, needs_q in (("greedy", False), ("strict", True), ("coupled", False)):
        assert RULES[name].lossless and RULES[name].needs_q is needs_q


@pytest.mark.parametrize("V", [3, 50])
def test_gumbel_coupled_sample_is_exact(V):
    """coupled_sample over seeds is an exact sample of its distribution (the basis of the coupled rule)."""
    dist = np.random.default_rng(V).dirichlet(np.ones(V))
    dist[0] = 0.0
    dist /= dist.sum()
    n = 20000
    counts = Counter((coupled_sample(dist, s, 3),) for s in range(n))
    assert (0,) not in counts
    assert_matches_target(counts, {(t,): float(dist[t]) for t in range(V)}, n, f"gumbel V={V}")


def test_coupled_sample_of_a_point_mass_is_its_token_and_other_rows_still_draw_noise():
    """A greedy row (one entry 1, the rest 0) is answered without drawing the 151,936 Gumbel numbers a
    row costs (4 ms a token); a row with any other nonzero entry keeps the full draw."""
    V = 1000
    one_hot = np.zeros(V)
    one_hot[417] = 1.0
    assert {coupled_sample(one_hot, s, p) for s in range(50) for p in range(4)} == {417}
    near = np.full(V, 0.0)
    near[417], near[3] = 0.5, 0.5
    assert {coupled_sample(near, s, 0) for s in range(200)} == {3, 417}


def test_exact_sequences_is_a_distribution():
    for sp in (SamplingParams(1.0), SamplingParams(0.5, top_k=2), SamplingParams(1.0, top_p=0.5)):
        exact = exact_sequences(TARGET, PROMPT, sp)
        assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-12)
        assert all(len(s) == LENGTH for s in exact)
    assert len(exact_sequences(TARGET, PROMPT, SamplingParams(1.0))) == VOCAB**LENGTH
    assert len(exact_sequences(TARGET, PROMPT, SamplingParams(1.0, top_k=2))) == 2**LENGTH
    assert set(itertools.product(range(VOCAB), repeat=1)) >= set(exact_sequences(TARGET, PROMPT, SamplingParams(0.0), 1))
