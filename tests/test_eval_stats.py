"""Paired bootstrap intervals, verdicts, guard ablations and the budget-forcing table, on hand-built data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from acespec.eval.report import aggregate, bare_arm, forcing_table, guard_ablations, write_report
from acespec.eval.stats import (
    BootstrapConfig,
    interval,
    paired_intervals,
    pooled_gain,
    ratio_of_means,
    resample_indices,
    verdict,
)

BOOT = BootstrapConfig(resamples=2000, seed=7)


def arrays(length, rounds, accepted=None, wall=None, correct=None) -> dict:
    n = len(length)
    return {
        "length": np.asarray(length, dtype=float),
        "rounds": np.asarray(rounds, dtype=float),
        "accepted": np.asarray(accepted if accepted is not None else [0] * n, dtype=float),
        "wall_s": np.asarray(wall if wall is not None else length, dtype=float),
        "correct": np.asarray(correct if correct is not None else [np.nan] * n, dtype=float),
    }


def test_resample_indices_are_seeded_and_in_range():
    a = resample_indices(7, 300, seed=3)
    assert a.shape == (300, 7) and a.min() >= 0 and a.max() <= 6
    assert np.array_equal(a, resample_indices(7, 300, seed=3))
    assert not np.array_equal(a, resample_indices(7, 300, seed=4))


def test_pairing_removes_prompt_variance():
    # prompts from 10 to 1000 tokens; the rule writes exactly twice as much on every one: each resample's
    # ratio of means is exactly 2, so the paired interval is a point, however different the prompts are
    rng = np.random.default_rng(0)
    strict = rng.integers(10, 1000, size=30).astype(float)
    idx = resample_indices(30, 1000, seed=1)
    assert interval(ratio_of_means(2 * strict, strict, idx)) == pytest.approx((2.0, 2.0))
    # unpaired (the rule's runs against other prompts' strict runs) the same data is anything but
    other = resample_indices(30, 1000, seed=2)
    lo, hi = interval(np.asarray(2 * strict)[idx].mean(1) / strict[other].mean(1))
    assert hi - lo > 0.5


def test_net_win_interval_below_one_is_a_win():
    # rounds 0.6-0.8x strict on every pair: the whole interval lies below 1
    rng = np.random.default_rng(1)
    s_rounds = rng.integers(20, 80, size=30).astype(float)
    r_rounds = s_rounds * rng.uniform(0.6, 0.8, size=30)
    ci = paired_intervals(arrays(s_rounds * 4, r_rounds), arrays(s_rounds * 4, s_rounds), BOOT)
    assert ci["rounds_rel"][1] < 1.0 and ci["verdict"] == "win"
    assert ci["lambda"] == pytest.approx((1.0, 1.0))


def test_net_win_interval_straddling_one_is_inconclusive_and_above_is_a_loss():
    # half the pairs save 40% of the rounds, half cost 40% more: the mean ratio is 1, the interval straddles it
    s = np.full(20, 50.0)
    r = np.where(np.arange(20) % 2 == 0, 30.0, 70.0)
    ci = paired_intervals(arrays(s, r), arrays(s, s), BOOT)
    lo, hi = ci["rounds_rel"]
    assert lo < 1.0 < hi and ci["verdict"] == "inconclusive"
    ci = paired_intervals(arrays(s, s * 1.3), arrays(s, s), BOOT)
    assert ci["rounds_rel"][0] > 1.0 and ci["verdict"] == "loss"
    assert verdict(None) == "inconclusive" and verdict((0.5, 1.0)) == "inconclusive" and verdict((0.5, 0.99)) == "win"


def test_too_few_pairs_gives_no_interval():
    ci = paired_intervals(arrays([10.0], [5.0]), arrays([10.0], [9.0]), BOOT)
    assert ci["rounds_rel"] is None and ci["lambda"] is None and ci["verdict"] == "inconclusive"


def test_pooled_gain_matches_the_point_estimate_on_the_pairs_themselves():
    acc, rnd = np.array([60.0, 100.0]), np.array([40.0, 40.0])  # l = 160 / 80 = 2
    acc_s, rnd_s = np.array([30.0, 30.0]), np.array([40.0, 20.0])  # l_s = 60 / 60 = 1
    full = np.arange(2)[None, :]
    assert pooled_gain(acc, rnd, acc_s, rnd_s, full)[0] == pytest.approx(3.0 / 2.0)


def test_accuracy_intervals_and_difference():
    c_s = np.array([1.0] * 10 + [0.0] * 10)
    c_r = c_s.copy()
    c_r[:6] = 0.0  # the rule loses 6 of strict's 10 right answers, gains none
    ci = paired_intervals(arrays([1.0] * 20, [1.0] * 20, correct=c_r), arrays([1.0] * 20, [1.0] * 20, correct=c_s), BOOT)
    lo, hi = ci["accuracy_delta"]
    assert hi < 0.0 and lo >= -1.0  # a paired drop: every resample loses
    lo, hi = ci["accuracy"]
    assert 0.0 <= lo < 0.2 < hi <= 0.5
    same = paired_intervals(arrays([1.0] * 4, [1.0] * 4, correct=[1, 1, 1, 1]), arrays([1.0] * 4, [1.0] * 4, correct=[1, 1, 1, 1]), BOOT)
    assert same["accuracy"] == (1.0, 1.0) and same["accuracy_delta"] == (0.0, 0.0)


def test_intervals_are_deterministic_given_the_seed():
    rng = np.random.default_rng(5)
    a = arrays(rng.integers(50, 300, 25), rng.integers(10, 60, 25), rng.integers(0, 100, 25))
    b = arrays(rng.integers(50, 300, 25), rng.integers(10, 60, 25), rng.integers(0, 100, 25))
    assert paired_intervals(a, b, BOOT) == paired_intervals(a, b, BOOT)
    assert paired_intervals(a, b, BOOT)["lambda"] != paired_intervals(a, b, BootstrapConfig(resamples=2000, seed=8))["lambda"]


# ------------------------------------------------------------------------------------------ report level


def rec(arm, pid, seed, length, rounds, accepted, *, correct=None, wall=1.0, **extra) -> dict:
    r = {"key": f"{arm}|{pid}|{seed}", "arm": arm, "prompt_id": pid, "seed": seed, "length": length, "rounds": rounds,
         "accepted": accepted, "wall_s": wall, "correct": correct, "acc_p": [], "acc_rank": [], "rule_used": arm}
    r.update(extra)
    return r


def synthetic_study(n: int = 30) -> list[dict]:
    """strict; `fast` (same lengths, 0.7x the rounds); `long` (1.3x longer, same l: a loss); `fast+support`
    (back to 0.9x the rounds)."""
    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        L = int(rng.integers(50, 250))
        R = max(10, L // 3)
        c = bool(i % 2)
        out.append(rec("strict", f"p{i}", 0, L, R, 2 * R, correct=c))
        out.append(rec("fast", f"p{i}", 0, L, int(0.7 * R), 2 * R, correct=c))
        out.append(rec("fast+support", f"p{i}", 0, L, int(0.9 * R), 2 * R, correct=c))
        out.append(rec("long", f"p{i}", 0, int(1.3 * L), int(1.3 * R), 2 * int(1.3 * R), correct=c))
    return out


def test_aggregate_carries_intervals_and_verdicts():
    agg = aggregate(synthetic_study(), boot=BOOT)
    assert agg["strict"]["verdict"] == "baseline"
    assert agg["fast"]["verdict"] == "win" and agg["fast"]["ci"]["rounds_rel"][1] < 1.0
    assert agg["long"]["verdict"] == "loss" and agg["long"]["ci"]["lambda"][0] > 1.2
    assert agg["fast"]["ci"]["accuracy_delta"] == (0.0, 0.0)
    lo, hi = agg["strict"]["ci"]["accuracy"]
    assert lo < 0.5 < hi


def test_guard_ablation_rows():
    rows = guard_ablations(synthetic_study(), BOOT)
    assert len(rows) == 1
    r = rows[0]
    assert (r["arm"], r["bare"], r["guard"], r["pairs"]) == ("fast+support", "fast", "support", 30)
    # the same lengths, fewer accepted tokens per round than the bare rule: part of the gain kept
    assert r["lambda_guarded"] == pytest.approx(1.0) and r["lambda_bare"] == pytest.approx(1.0)
    assert 1.0 < r["gain_guarded"] < r["gain_bare"] and 0.0 < r["gain_kept"] < 1.0
    assert r["rounds_rel_guarded_ci"][1] < 1.0 and r["verdict"] == "win"
    assert bare_arm("cactus:delta=0.35+support+force", "+force") == "cactus:delta=0.35+support"
    assert bare_arm("cactus", "+support") is None


def forcing_records() -> list[dict]:
    """30 pairs of strict vs strict+force. Pairs 0-21 hit the budget unforced and forcing fires on them:
    5 rescued (0-4), 2 regressions (5-6), 15 the same (7-21: 3 right both ways, 12 wrong both ways);
    pairs 22-29 end early and forcing never fires."""
    out = []
    for i in range(30):
        if i < 22:
            right_u = i in (5, 6) or 7 <= i < 10
            right_f = i < 5 or 7 <= i < 10
            out.append(rec("strict", f"p{i}", 0, 200, 80, 120, correct=right_u, hit_budget=True, forced=False,
                           think_tokens=200, answer_tokens=0))
            out.append(rec("strict+force", f"p{i}", 0, 200, 78, 120, correct=right_f, hit_budget=False, forced=True,
                           think_tokens=170 + 11, answer_tokens=19))
        else:
            for arm in ("strict", "strict+force"):
                out.append(rec(arm, f"p{i}", 0, 120, 40, 80, correct=True, hit_budget=False, forced=False,
                               think_tokens=100, answer_tokens=20))
    return out


def test_forcing_table_counts_rescues_and_regressions():
    rows = forcing_table(forcing_records(), BOOT)
    assert len(rows) == 1
    r = rows[0]
    assert (r["bare"], r["pairs"], r["hit_budget"], r["fired"], r["fired_and_hit"]) == ("strict", 30, 22, 22, 22)
    assert (r["rescued"], r["regressions"]) == (5, 2)
    assert (r["success_unforced"], r["success_forced"]) == (5, 8)
    lo, hi = r["success_delta_ci"]
    assert lo < 3 / 22 < hi
    assert r["think_tokens_unforced"] == pytest.approx(200) and r["think_tokens_forced"] == pytest.approx(181)
    assert r["answer_tokens_unforced"] == pytest.approx(0) and r["answer_tokens_forced"] == pytest.approx(19)


def test_write_report_renders_intervals_ablations_and_forcing(tmp_path):
    recs = synthetic_study() + [r | {"arm": r["arm"].replace("strict", "fast"), "key": "x" + r["key"]}
                                for r in forcing_records() if r["arm"] == "strict+force"]
    write_report(recs, tmp_path, settings={"dataset": "math", "think": True}, command="acespec eval ...", boot=BOOT)
    md = (tmp_path / "report.md").read_text()
    assert "| `fast` | 30 |" in md and "**win**" in md and "| loss |" in md
    assert "## Guard ablations" in md and "## Budget forcing, measured" in md
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["arms"]["fast"]["ci"]["rounds_rel"][1] < 1.0
    assert rep["budget_forcing"][0]["arm"] == "fast+force" and rep["guard_ablations"][0]["arm"] == "fast+support"
    assert (tmp_path / "lambda_vs_gain.png").read_bytes()[:4] == b"\x89PNG"


def test_ttlt_is_compared_only_within_one_batching_setting():
    recs = []
    for i in range(6):
        recs.append(rec("strict", f"p{i}", 0, 100, 40, 60, wall=2.0))
        if i < 3:  # made under --parallel 8: ten times the wall time, which says nothing about the rule
            recs.append(rec("r", f"p{i}", 0, 100, 40, 60, wall=20.0, parallel=8, batching="shared"))
        else:
            recs.append(rec("r", f"p{i}", 0, 100, 40, 60, wall=3.0))
    a = aggregate(recs, boot=BOOT)["r"]
    assert a["ttlt_pairs"] == 3 and a["ttlt_rel"] == pytest.approx(1.5)
    assert a["ci"]["ttlt_rel"] == pytest.approx((1.5, 1.5)) and a["ci"]["lambda"] == pytest.approx((1.0, 1.0))
