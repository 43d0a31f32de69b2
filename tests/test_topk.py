"""Verifying from top-K rows (verify/topk.py), on exact toy distributions: which (rule, sampling) pairs
are exact, and the coupled draw's distance from the full one, bounded and measured."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from acespec.verify import RuleSpec, SamplingParams, coupled_sample, probs_from_logits
from acespec.verify.topk import TopKRuleError, dense_logits, tail_mass_bound, topk_exactness


def _logprobs(seed: int, vocab: int, spread: float = 2.0) -> np.ndarray:  # -> [vocab], log p normalised
    x = np.random.default_rng(seed).normal(0, spread, vocab)
    return x - np.log(np.exp(x).sum())


def _tempered_tail(lp: np.ndarray, k: int, t: float) -> float:
    """The exact tempered mass outside the top k (what the bound bounds)."""
    p = probs_from_logits(lp, SamplingParams(temperature=t))
    return float(np.sort(p)[: len(p) - k].sum())


@pytest.mark.parametrize("vocab,k", [(50, 5), (200, 20), (1000, 20)])
@pytest.mark.parametrize("t", [0.3, 0.7, 1.0, 1.5, 3.0])
@pytest.mark.parametrize("seed", range(5))
def test_tail_bound_holds_and_is_exact_at_temperature_one(vocab, k, t, seed):
    lp = _logprobs(seed, vocab)
    top = np.sort(lp)[::-1][:k]
    bound = tail_mass_bound(top, vocab, t)
    true = _tempered_tail(lp, k, t)
    assert bound >= true - 1e-12
    assert bound <= 1.0
    if t == 1.0:
        assert bound == pytest.approx(true, rel=1e-9, abs=1e-12)


def test_tail_bound_edges():
    lp = _logprobs(0, 30)
    assert tail_mass_bound(np.sort(lp)[::-1][:10], 30, 0.0) == 0.0  # greedy: the argmax is known
    assert tail_mass_bound(lp, 30, 1.0) == pytest.approx(0.0, abs=1e-12)  # everything known
    # a tiny temperature makes the tail vanish, a huge one makes it approach the tail's share of tokens
    top = np.sort(lp)[::-1][:10]
    assert tail_mass_bound(top, 30, 0.01) < 1e-6
    assert tail_mass_bound(top, 30, 1e6) == pytest.approx(20 / 30, rel=1e-3)


@pytest.mark.parametrize("vocab,k,t", [(40, 4, 1.0), (40, 8, 0.7), (100, 10, 1.3)])
def test_coupled_over_top_k_differs_from_the_full_draw_exactly_as_often_as_the_tail_mass(vocab, k, t):
    """The coupled draw over the top K equals the full-vocabulary draw unless the full draw lands
    outside the top K, which happens with probability p_T(outside): over many seeds the disagreement
    rate must match that mass (two-sided binomial test), and the bound must be at least it."""
    lp = _logprobs(vocab + k, vocab, spread=1.0)
    order = np.argsort(-lp)
    known = {int(i): float(lp[i]) for i in order[:k]}
    full = probs_from_logits(lp, SamplingParams(temperature=t))
    trunc = probs_from_logits(dense_logits(known, vocab), SamplingParams(temperature=t))
    n = 4000
    differ = sum(coupled_sample(full, seed, 0) != coupled_sample(trunc, seed, 0) for seed in range(n))
    tail = _tempered_tail(lp, k, t)
    assert 0.02 < tail < 0.9  # the test has something to detect
    assert stats.binomtest(differ, n, tail).pvalue > 1e-3
    assert tail_mass_bound(np.array(list(known.values())), vocab, t) >= tail - 1e-12
    # power: a rate off by a quarter of the tail would be caught
    assert stats.binomtest(int(round(n * tail * 1.25)), n, tail).pvalue < 1e-3


@pytest.mark.parametrize("rule", ["greedy", "strict", "coupled", "cactus", "fuzzy", "casc_opt"])
def test_every_rule_is_exact_at_temperature_zero(rule):
    assert topk_exactness(RuleSpec.parse(rule), SamplingParams(), 20) == "exact"


def test_top_k_sampling_inside_k_is_exact_for_every_rule():
    for rule in ("strict", "coupled", "cactus"):
        assert topk_exactness(RuleSpec.parse(rule), SamplingParams(temperature=0.8, top_k=20, top_p=0.9), 20) == "exact"


def test_sampled_rules_that_read_the_whole_row_are_refused():
    assert topk_exactness(RuleSpec.parse("coupled"), SamplingParams(temperature=1.0), 20) == "bounded"
    assert topk_exactness(RuleSpec.parse("greedy"), SamplingParams(temperature=1.0), 20) == "exact"
    for rule, sp in (("strict", SamplingParams(temperature=1.0)), ("cactus", SamplingParams(temperature=0.5)),
                     ("coupled", SamplingParams(temperature=1.0, top_p=0.95)),
                     ("strict", SamplingParams(temperature=1.0, top_k=21))):
        with pytest.raises(TopKRuleError, match="top 20 tokens"):
            topk_exactness(RuleSpec.parse(rule), sp, 20)


def test_dense_logits_keeps_given_values_and_rejects_bad_ids():
    row = dense_logits({3: -0.5, 7: -1.25}, 10)
    assert row[3] == -0.5 and row[7] == -1.25 and np.isneginf(row).sum() == 8
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dense_logits({10: 0.0}, 10)
    assert not math.isnan(probs_from_logits(row, SamplingParams(temperature=1.0)).sum())
