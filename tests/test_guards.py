"""Guards: the support filter (acespec.verify.guards), the net-win guard and budget forcing
(acespec.control.guards)."""

from __future__ import annotations

import numpy as np
import pytest

from acespec.control.guards import BudgetForcer, NetWinConfig, NetWinGuard
from acespec.verify import RuleSpec, verify_block
from acespec.verify.guards import (
    SupportFilter,
    first_filtered,
    support_mask,
    target_prob_and_rank,
    verify_with_support_filter,
)



def rand_dist(rng: np.random.Generator, V: int) -> np.ndarray:
    return rng.dirichlet(np.ones(V))


# ------------------------------------------------------------------------------------------ support filter

# p rows for a 3-token block (+ bonus row): token 3 at position 1 has p = 0.05 (< 0.10) and rank 4
P = np.array(
    [
        [0.50, 0.20, 0.15, 0.10, 0.05, 0.0],
        [0.40, 0.25, 0.20, 0.05, 0.06, 0.04],
        [0.30, 0.30, 0.20, 0.10, 0.05, 0.05],
        [1 / 6] * 6,
    ]
)
Q = np.full((3, 6), 1 / 6)  # a uniform drafter: relaxed rules gladly accept anything


def test_target_prob_and_rank():
    row = np.array([0.1, 0.4, 0.4, 0.05, 0.05])
    assert target_prob_and_rank(row, 1) == (0.4, 1)
    assert target_prob_and_rank(row, 2) == (0.4, 1)  # ties share the better rank
    assert target_prob_and_rank(row, 0) == (0.1, 3)
    assert target_prob_and_rank(row, 4) == (0.05, 4)


def test_defaults_are_the_recommended_ones():
    f = SupportFilter()
    assert (f.min_p, f.max_rank) == (0.10, 10)


@pytest.mark.parametrize(
    "rule,params",
    [("r_fuzzy", {"alpha": 100.0}), ("typical", {"eps": 0.0, "delta": 0.0}), ("mentored", {"alpha": 1.0}), ("casc_tok", {"alpha": 1.0})],
)
def test_filter_rejects_low_probability_token_the_rule_accepts(rule, params):
    draft = np.array([0, 4, 1])  # p(4) at position 1 is 0.06 < 0.10
    for seed in range(30):
        assert verify_block(rule, draft, Q, P, np.random.default_rng(seed), **params)[0] == 3  # the rule alone
        acc, tok = verify_with_support_filter(rule, draft, Q, P, np.random.default_rng(seed), **params)
        assert acc == 1
        prob, rank = target_prob_and_rank(P[1], tok)
        assert prob >= 0.10 and rank <= 10  # the token emitted at the cut passes the filter itself


def test_filter_rejects_by_rank():
    draft = np.array([0, 3])  # p(3) at position 1 is 0.05: rank 5 of 6
    f = SupportFilter(min_p=0.0, max_rank=3)
    p = P[[0, 1, 3]]
    for seed in range(30):
        acc, tok = f.verify("r_fuzzy:alpha=100", draft, Q[:2], p, np.random.default_rng(seed))
        assert acc == 1 and tok in (0, 1, 2)
    # rank 4 passes max_rank 4; max_rank 0 disables the rank test
    assert SupportFilter(min_p=0.0, max_rank=4).passes(P[1], 4)
    assert SupportFilter(min_p=0.0, max_rank=0).passes(P[1], 5)


def test_first_position_filtered_gives_zero_accepted():
    acc, tok = verify_with_support_filter("r_fuzzy:alpha=100", np.array([5, 0]), Q[:2], P[[0, 1, 3]], np.random.default_rng(0))
    assert acc == 0 and tok in (0, 1, 2, 3)  # p(5) = 0 at position 0; emitted token from the support


def test_without_a_filtered_token_it_is_exactly_the_rule():
    rng0 = np.random.default_rng(3)
    for rule in ["strict", "cactus", "typical:eps=0.01", "casc_opt"]:
        for seed in range(40):
            V = 8
            p = np.stack([rand_dist(rng0, V) for _ in range(4)])
            q = np.stack([rand_dist(rng0, V) for _ in range(3)])
            draft = np.array([int(np.argmax(p[i])) for i in range(3)])  # argmax tokens always pass
            spec = RuleSpec.parse(rule)
            plain = verify_block(spec, draft, q if spec.info.needs_q else None, p, np.random.default_rng(seed))
            guarded = verify_with_support_filter(
                spec, draft, q if spec.info.needs_q else None, p, np.random.default_rng(seed), min_p=0.0, max_rank=1
            )
            assert plain == guarded


def test_rejection_before_the_cut_is_the_rules_own():
    """Positions before the cut see the same rng stream as without the filter."""
    rng0 = np.random.default_rng(4)
    V = 8
    seen = 0
    for seed in range(300):
        p = np.stack([rand_dist(rng0, V) for _ in range(4)])
        q = np.stack([rand_dist(rng0, V) for _ in range(3)])
        draft = np.array([rng0.choice(V, p=q[i]) for i in range(3)])
        f = first_filtered(draft, p, min_p=0.05, max_rank=10)
        plain = verify_block("strict", draft, q, p, np.random.default_rng(seed))
        guarded = verify_with_support_filter("strict", draft, q, p, np.random.default_rng(seed), min_p=0.05)
        if plain[0] < f:
            assert guarded == plain
            seen += 1
        else:
            assert guarded[0] == min(f, plain[0])
    assert seen > 50


def test_token_at_the_cut_is_p_restricted_to_the_support():
    p = np.array([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05], [1 / 6] * 6])
    expected = np.where(p[0] >= 0.10, p[0], 0.0)
    expected /= expected.sum()
    rng = np.random.default_rng(8)
    hist = np.zeros(6, dtype=np.int64)
    for _ in range(6000):
        acc, tok = verify_with_support_filter("strict", np.array([5]), Q[:1], p, rng)
        assert acc == 0
        hist[tok] += 1
    n = hist.sum()
    # every cell within 5 binomial standard deviations; tokens outside the support never appear
    assert np.all(np.abs(hist / n - expected) <= 5 * np.sqrt(expected * (1 - expected) / n))
    assert hist[expected == 0].sum() == 0


def test_support_mask_falls_back_to_rank_when_nothing_reaches_min_p():
    flat = np.full(20, 0.05)
    flat[0] = 0.06
    assert support_mask(flat, min_p=0.10, max_rank=3).sum() == 20  # all tie at rank 2 behind token 0
    peaked = np.array([0.07, 0.06, 0.05, 0.04] + [0.78 / 16] * 16)
    assert list(np.flatnonzero(support_mask(peaked, min_p=0.10, max_rank=2))) == [0, 1]
    assert list(np.flatnonzero(support_mask(np.array([0.5, 0.5, 0.0]), min_p=0.0, max_rank=0))) == [0, 1]


def test_shape_check():
    with pytest.raises(ValueError):
        verify_with_support_filter("strict", np.array([0, 1]), Q[:2], P[:2], np.random.default_rng(0))


# ------------------------------------------------------------------------------------------ net-win guard


def feed(guard: NetWinGuard, task: str, rule: str, length: float, accepted: float, n: int) -> None:
    for _ in range(n):
        guard.observe(task, rule, length, accepted)


def test_guard_falls_back_to_strict_on_length_inflation_and_returns_on_recovery():
    g = NetWinGuard("cactus:delta=0.35", NetWinConfig(n_min=5, explore=0.0, ema_weight=0.2))
    feed(g, "math", "strict", 100, 2.0, 5)
    feed(g, "math", "cactus:delta=0.35", 200, 3.0, 5)  # gain 4/3 < lambda 2: a net loss
    est = g.estimate("math")
    assert est.lam == pytest.approx(2.0) and est.gain == pytest.approx(4 / 3) and not est.net_win
    assert not g.use_relaxed("math") and g.rule_for("math") == "strict"
    # lengths recover: lambda -> 1.05 < 4/3
    for _ in range(40):
        g.observe("math", "cactus:delta=0.35", 105, 3.0)
        g.observe("math", "strict", 100, 2.0)
    assert g.estimate("math").lam == pytest.approx(1.05, rel=0.01)
    assert g.use_relaxed("math") and g.rule_for("math") == "cactus:delta=0.35"
    # inflate again: back to strict
    feed(g, "math", "cactus:delta=0.35", 300, 3.0, 40)
    assert not g.use_relaxed("math")


def test_guard_keeps_relaxed_rule_when_it_is_a_net_win_and_task_types_are_independent():
    g = NetWinGuard("fuzzy", NetWinConfig(n_min=3, explore=0.0))
    feed(g, "code", "strict", 100, 1.0, 3)
    feed(g, "code", "fuzzy", 110, 2.0, 3)  # gain 1.5 > 1.1
    feed(g, "chat", "strict", 100, 1.0, 3)
    feed(g, "chat", "fuzzy", 180, 2.0, 3)  # gain 1.5 < 1.8
    assert all(g.use_relaxed("code") for _ in range(10))
    assert not any(g.use_relaxed("chat") for _ in range(10))


def test_guard_boundary_is_designs_inequality():
    g = NetWinGuard("fuzzy", NetWinConfig(n_min=1, explore=0.0))
    g.observe("t", "strict", 100, 1.0)
    g.observe("t", "fuzzy", 150, 2.0)  # gain 1.5 == lambda 1.5: not a net win -> strict
    assert not g.prefers_relaxed("t")


def test_guard_hysteresis_needs_a_clear_win_to_switch_back():
    g = NetWinGuard("fuzzy", NetWinConfig(n_min=1, explore=0.0, ema_weight=1.0, hysteresis=0.1))
    g.observe("t", "strict", 100, 1.0)
    g.observe("t", "fuzzy", 200, 1.0)
    assert not g.prefers_relaxed("t")
    g.observe("t", "fuzzy", 100, 1.05)  # gain 1.025 > lambda 1.0, but not by 10%
    assert not g.prefers_relaxed("t")
    g.observe("t", "fuzzy", 100, 1.3)  # gain 1.15 > 1.1
    assert g.prefers_relaxed("t")


def test_guard_warmup_alternates_until_both_arms_have_n_min():
    g = NetWinGuard("mentored", NetWinConfig(n_min=2, explore=0.0))
    assert [g.use_relaxed("x") for _ in range(4)] == [True, False, True, False]
    feed(g, "x", "mentored", 100, 2.0, 2)
    assert [g.use_relaxed("x") for _ in range(3)] == [False] * 3  # relaxed has its n_min: collect strict
    feed(g, "x", "strict", 100, 1.0, 2)
    assert g.use_relaxed("x")  # warm-up over; gain 1.5 > lambda 1.0


def test_guard_exploration_is_seeded_and_near_its_rate():
    def decisions(seed: int) -> list[bool]:
        g = NetWinGuard("fuzzy", NetWinConfig(n_min=2, explore=0.2, seed=seed))
        feed(g, "t", "strict", 100, 1.0, 2)
        feed(g, "t", "fuzzy", 100, 2.0, 2)
        return [g.use_relaxed("t") for _ in range(2000)]

    a, b, c = decisions(1), decisions(1), decisions(2)
    assert a == b and a != c
    assert 0.75 < np.mean(a) < 0.85  # the winner, except for ~20% exploration


def test_guard_rejects_unknown_rule_names_and_bad_config():
    g = NetWinGuard("fuzzy")
    with pytest.raises(ValueError):
        g.observe("t", "cactus", 10, 1.0)
    with pytest.raises(ValueError):
        NetWinGuard("strict")
    with pytest.raises(ValueError):
        NetWinConfig(explore=1.0)
    assert g.estimate("never-seen") is None


# ------------------------------------------------------------------------------------------ budget forcing


def test_budget_forcer_injects_exactly_at_threshold_and_once():
    f = BudgetForcer(budget=100)
    assert f.threshold == 85
    text = "<think> let me see"
    assert [f.check(text, n) for n in range(85)] == [None] * 85
    assert f.check(text, 85) == "</think>"
    assert f.check(text, 86) is None and f.check(text, 99) is None  # never twice
    f.reset()
    assert f.check(text, 90) == "</think>"  # late checks still fire (once)


@pytest.mark.parametrize("budget,fraction,expected", [(100, 0.07, 7), (10, 0.85, 9), (1, 0.85, 1), (2048, 0.85, 1741)])
def test_budget_forcer_threshold_rounding(budget, fraction, expected):
    assert BudgetForcer(budget, fraction).threshold == expected


def test_budget_forcer_never_outside_a_trace():
    f = BudgetForcer(budget=10)
    assert f.check("no reasoning here", 9) is None  # before any <think>
    assert f.check("<think>done</think> The answer is 4", 9) is None  # trace already closed
    assert f.check("<think>a</think> answer <think>again", 9) == "</think>"  # re-opened trace
    g = BudgetForcer(budget=10)
    assert g.check("<think>ok</think>", 10) is None and not g.fired


def test_budget_forcer_waits_while_the_model_writes_the_close_tag():
    f = BudgetForcer(budget=10)
    assert f.check("<think>almost </thi", 9) is None
    assert not f.fired
    assert f.check("<think>almost </think>", 10) is None  # it closed on its own
    assert f.check("<think>x <", 10) is None  # '<' could start '</think>': wait one step
    assert f.check("<think>x < y", 11) == "</think>"  # it did not: inject now


def test_budget_forcer_token_ids_and_prompt_opened_trace():
    f = BudgetForcer(budget=20, open_tag=151667, close_tag=[151668])
    toks = [1, 151667] + [5] * 16
    assert f.check(toks) == (151668,)  # 18 tokens >= 17
    assert BudgetForcer(budget=20, open_tag=[9, 8], close_tag=[9, 7]).check([9, 8, 1, 9, 7] + [3] * 20) is None
    g = BudgetForcer(budget=20, open_tag=[9, 8], close_tag=[9, 7])
    assert g.check([9, 8] + [3] * 14 + [9]) is None  # ends with a partial close tag
    assert g.check([9, 8] + [3] * 15 + [4]) == (9, 7)
    # a chat template that opened the trace in the prompt
    h = BudgetForcer(budget=10, opened_in_prompt=True)
    assert h.check("thinking...", 9) == "</think>"
    assert BudgetForcer(budget=10, opened_in_prompt=True).check("x</think>answer", 9) is None


def test_budget_forcer_marker_and_input_checks():
    f = BudgetForcer(budget=10, marker="\n</think>\n\nFinal answer:")
    assert f.check("<think>", 9) == "\n</think>\n\nFinal answer:"
    with pytest.raises(ValueError):
        BudgetForcer(budget=10).check("<think>")  # text needs the engine's token count
    with pytest.raises(TypeError):
        BudgetForcer(budget=10).check([1, 2, 3])  # text tags, token input
    with pytest.raises(ValueError):
        BudgetForcer(budget=0)
