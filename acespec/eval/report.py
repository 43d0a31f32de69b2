"""Aggregates and verdicts of the length-inflation harness, and `write_report`, which writes them out as
report.md / report.json and the plots (the tables and plots are drawn by `acespec.eval.render`).

Per arm, over the (prompt, seed) pairs it shares with the `strict` baseline (so every ratio compares
like with like):

- `L`: mean output length (tokens); `lambda = L / L_strict` on the same pairs.
- `l`: mean accepted draft tokens per round, pooled (`sum accepted / sum rounds`); `tau = l + 1`.
- `gain = (l + 1) / (l_strict + 1)`; the point estimate of the net-win test (docs/research/rules.md) is `gain > lambda`.
- rounds per answer relative to strict (`mean rounds / mean rounds_strict`, about `lambda / gain`),
  time to last token relative to strict (mean over mean; noisy, see DESIGN "Measuring").
- accuracy (math: parsed answer; humaneval: pass@1; sharegpt: n/a).
- accepted-token support: median target probability and rank of every accepted draft token, and the
  share accepted with `p < 0.1`.
- where the tokens go: math, tokens up to the first appearance of the correct answer and after it;
  `--think`, tokens inside the trace and after it. With `--think`: runs that hit the budget, runs that
  budget forcing cut, and how many of those it rescued (a correct answer; for ShareGPT, an answer that
  ended by itself).

**Uncertainty** (`acespec.eval.stats`): a paired bootstrap over the (prompt, seed) pairs gives 95%
intervals for lambda, the gain, rounds against strict, TTLT against strict, accuracy and the accuracy
difference. The verdict is read from the interval of rounds against strict (target passes per answer):
**win** when it lies wholly below 1, **loss** when wholly above, **inconclusive** otherwise.

**Guard ablations**: an arm `X+support` or `X+netwin` is compared with its bare rule `X` on the same
pairs (how much of X's length ratio and gain the guard keeps). **Budget forcing**: an arm `X+force` is
compared run by run with `X` (same pairs, same run seeds, so the two share every token up to the
forcing point): runs that hit the budget, runs forcing rescued and runs it turned wrong.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from acespec.eval.config import BASELINE
from acespec.eval.render import make_plots, render_markdown
from acespec.eval.stats import (
    BootstrapConfig,
    accuracy_interval,
    interval,
    mean_delta_interval,
    paired_intervals,
    pooled_gain,
    ratio_of_means,
    resample_indices,
)

GUARD_SUFFIXES = ("+support", "+netwin", "+force")


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def pooled_l(recs: list[dict]) -> float | None:
    rounds = sum(r["rounds"] for r in recs)
    return sum(r["accepted"] for r in recs) / rounds if rounds else None


def net_win(l_rule: float, l_strict: float, lam: float) -> bool:
    """The net-win test: a relaxed rule is a net win only if (l + 1) / (l_strict + 1) > lambda."""
    return (l_rule + 1.0) / (l_strict + 1.0) > lam


def arm_order(records: list[dict], arms: list[str] | None = None) -> list[str]:
    seen: list[str] = []
    for r in records:
        if r["arm"] not in seen:
            seen.append(r["arm"])
    if arms:
        return [a for a in arms if a in seen] + [a for a in seen if a not in arms]
    return ([BASELINE] if BASELINE in seen else []) + [a for a in seen if a != BASELINE]


def _pair(r: dict) -> tuple:
    return (r["prompt_id"], r["seed"])


def _arrays(recs: list[dict]) -> dict[str, np.ndarray]:
    """The per-run values the bootstrap resamples, aligned with `recs` ([n] each)."""
    return {
        "length": np.array([r["length"] for r in recs], dtype=np.float64),
        "accepted": np.array([r["accepted"] for r in recs], dtype=np.float64),
        "rounds": np.array([r["rounds"] for r in recs], dtype=np.float64),
        "wall_s": np.array([r["wall_s"] for r in recs], dtype=np.float64),
        "correct": np.array([np.nan if r.get("correct") is None else float(bool(r["correct"])) for r in recs]),
    }


def _setting(r: dict) -> tuple:
    """How a record was run: one at a time, --parallel N under shared / exact batching, or on vLLM."""
    return (r.get("engine", "llama"), r.get("parallel", 1), r.get("batching", "shared"), r.get("concurrency"))


def _opt(recs: list[dict], key: str) -> np.ndarray:  # -> [n], nan where the record lacks the value
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in recs], dtype=np.float64)


def aggregate(
    records: list[dict], arms: list[str] | None = None, baseline: str = BASELINE, boot: BootstrapConfig | None = None
) -> dict:
    """Per-arm aggregates and bootstrap intervals (see the module docstring). `arms` fixes the order;
    records of other arms are kept."""
    boot = boot or BootstrapConfig()
    by_arm: dict[str, list[dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], []).append(r)
    base = {_pair(r): r for r in by_arm.get(baseline, [])}
    out: dict[str, dict] = {}
    for arm in arm_order(records, arms):
        recs = by_arm[arm]
        paired = [r for r in recs if _pair(r) in base] if base else []
        use = paired if base else recs
        bl = [base[_pair(r)] for r in paired]
        L = _mean(r["length"] for r in use)
        l_rule = pooled_l(use)
        a: dict = {
            "runs": len(recs),
            "paired": len(paired),
            "L": L,
            "l": l_rule,
            "tau": None if l_rule is None else l_rule + 1.0,
            "rounds": _mean(r["rounds"] for r in use),
            "ttlt_s": _mean(r["wall_s"] for r in use),
        }
        if bl:
            L_s, l_s = _mean(r["length"] for r in bl), pooled_l(bl)
            lam = _ratio(L, L_s)
            gain = None if (l_rule is None or l_s is None) else (l_rule + 1.0) / (l_s + 1.0)
            a.update(
                L_strict=L_s,
                l_strict=l_s,
                **{"lambda": lam},
                gain=gain,
                net_win=None if (arm == baseline or lam is None or gain is None) else bool(gain > lam),
                rounds_rel=_ratio(a["rounds"], _mean(r["rounds"] for r in bl)),
                ttlt_rel=_ratio(a["ttlt_s"], _mean(r["wall_s"] for r in bl)),
            )
            ci = paired_intervals(_arrays(paired), _arrays(bl), boot)
            a["verdict"] = "baseline" if arm == baseline else ci["verdict"]
            # time in a shared batch (--parallel N) is not time alone: compare TTLT only within one setting
            same = [i for i, (r, b) in enumerate(zip(paired, bl)) if _setting(r) == _setting(b)]
            a["ttlt_pairs"] = len(same)
            if len(same) < len(paired):
                w, ws = _arrays(paired)["wall_s"][same], _arrays(bl)["wall_s"][same]
                a["ttlt_rel"] = _ratio(float(w.mean()), float(ws.mean())) if same else None
                ci["ttlt_rel"] = (
                    paired_intervals(_arrays([paired[i] for i in same]), _arrays([bl[i] for i in same]), boot)[
                        "ttlt_rel"
                    ]
                    if same
                    else None
                )
        else:
            a.update(
                L_strict=None,
                l_strict=None,
                **{"lambda": None},
                gain=None,
                net_win=None,
                rounds_rel=None,
                ttlt_rel=None,
            )
            ci = {"pairs": 0, "accuracy": accuracy_interval(_arrays(use)["correct"], boot) if use else None}
            a["verdict"] = "baseline" if arm == baseline else "inconclusive"
        a["ci"] = ci
        scored = [r["correct"] for r in use if r.get("correct") is not None]
        a["accuracy"] = (sum(bool(c) for c in scored) / len(scored)) if scored else None
        a["scored"] = len(scored)
        probs = [p for r in use for p in r.get("acc_p", [])]
        ranks = [k for r in use for k in r.get("acc_rank", [])]
        a["accepted_tokens"] = len(probs)
        a["median_p"] = float(statistics.median(probs)) if probs else None
        a["median_rank"] = float(statistics.median(ranks)) if ranks else None
        a["share_p_lt_0.1"] = (sum(p < 0.1 for p in probs) / len(probs)) if probs else None
        a["mean_rank"] = _mean(ranks)
        # where the tokens go
        found = [r for r in use if r.get("pre_answer_tokens") is not None]
        if any("pre_answer_tokens" in r for r in use):
            a["answer_found"] = len(found)
            a["pre_answer_tokens"] = _mean(r["pre_answer_tokens"] for r in found)
            a["post_answer_tokens"] = _mean(r["post_answer_tokens"] for r in found)
            if bl:  # pairs where the answer appears in both runs: the Δ and its interval are over the same pairs
                for key in ("pre_answer_tokens", "post_answer_tokens"):
                    a[key + "_delta"] = _mean(
                        r[key] - b[key] for r, b in zip(paired, bl) if r.get(key) is not None and b.get(key) is not None
                    )
                    ci[key + "_delta"] = mean_delta_interval(_opt(paired, key), _opt(bl, key), boot)
        if any("think_tokens" in r for r in use):
            a["think_tokens"] = _mean(r.get("think_tokens") for r in use)
            a["answer_tokens"] = _mean(r.get("answer_tokens") for r in use)
            a["trace_closed"] = sum(bool(r.get("trace_closed")) for r in use)
            if bl:
                for key in ("think_tokens", "answer_tokens"):
                    a[key + "_delta"] = _mean(
                        r[key] - b[key] for r, b in zip(paired, bl) if r.get(key) is not None and b.get(key) is not None
                    )
                    ci[key + "_delta"] = mean_delta_interval(_opt(paired, key), _opt(bl, key), boot)
        a["hit_budget"] = sum(bool(r.get("hit_budget")) for r in use)
        a["forced"] = sum(bool(r.get("forced")) for r in use)
        a["rescued"] = sum(bool(r.get("rescued")) for r in use)
        used: dict[str, int] = {}
        for r in use:
            used[r.get("rule_used", arm)] = used.get(r.get("rule_used", arm), 0) + 1
        a["rule_used"] = used
        a["lengths"] = [r["length"] for r in use]
        out[arm] = a
    return out


def bare_arm(arm: str, suffix: str) -> str | None:
    """`cactus+support+force` without `suffix` (`+force` -> `cactus+support`); None if it lacks it."""
    parts = arm.split("+")
    g = suffix.lstrip("+")
    if g not in parts[1:]:
        return None
    return "+".join([parts[0]] + [x for x in parts[1:] if x != g])


def guard_ablations(records: list[dict], boot: BootstrapConfig | None = None) -> list[dict]:
    """Each guarded arm (`X+support`, `X+netwin`) against its bare rule `X` and strict, on the pairs
    all three share: lambda and gain of both, and how much of X's excess length and of its gain the
    guard keeps (`(lambda_g - 1) / (lambda_x - 1)`, `(gain_g - 1) / (gain_x - 1)`)."""
    boot = boot or BootstrapConfig()
    by_arm: dict[str, dict] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[_pair(r)] = r
    rows = []
    strict = by_arm.get(BASELINE, {})
    for arm in arm_order(records):
        for suffix in ("+support", "+netwin"):
            bare = bare_arm(arm, suffix)
            if bare is None or bare not in by_arm or "+force" in arm:
                continue
            pairs = sorted(set(by_arm[arm]) & set(by_arm[bare]) & set(strict))
            row: dict = {"arm": arm, "bare": bare, "guard": suffix[1:], "pairs": len(pairs)}
            if len(pairs) < boot.min_pairs:
                rows.append(row)
                continue
            g, x, s = (_arrays([d[k] for k in pairs]) for d in (by_arm[arm], by_arm[bare], strict))
            idx = resample_indices(len(pairs), boot.resamples, boot.seed)  # [B, n]
            lam_g, lam_x = ratio_of_means(g["length"], s["length"], idx), ratio_of_means(x["length"], s["length"], idx)
            gain_g = pooled_gain(g["accepted"], g["rounds"], s["accepted"], s["rounds"], idx)
            gain_x = pooled_gain(x["accepted"], x["rounds"], s["accepted"], s["rounds"], idx)
            rnd_g = ratio_of_means(g["rounds"], s["rounds"], idx)
            full = np.arange(len(pairs))[None, :]  # the point estimate is the statistic on the pairs themselves

            def pt(f, *a, full=full) -> float:
                return float(f(*a, full)[0])

            row.update(
                lambda_guarded=pt(ratio_of_means, g["length"], s["length"]),
                lambda_guarded_ci=interval(lam_g, boot.level),
                lambda_bare=pt(ratio_of_means, x["length"], s["length"]),
                lambda_bare_ci=interval(lam_x, boot.level),
                gain_guarded=pt(pooled_gain, g["accepted"], g["rounds"], s["accepted"], s["rounds"]),
                gain_guarded_ci=interval(gain_g, boot.level),
                gain_bare=pt(pooled_gain, x["accepted"], x["rounds"], s["accepted"], s["rounds"]),
                gain_bare_ci=interval(gain_x, boot.level),
                rounds_rel_guarded=pt(ratio_of_means, g["rounds"], s["rounds"]),
                rounds_rel_guarded_ci=interval(rnd_g, boot.level),
            )
            row["gain_kept"] = (
                (row["gain_guarded"] - 1.0) / (row["gain_bare"] - 1.0) if row["gain_bare"] != 1.0 else None
            )
            row["verdict"] = (
                "inconclusive"
                if row["rounds_rel_guarded_ci"] is None
                else (
                    "win"
                    if row["rounds_rel_guarded_ci"][1] < 1
                    else "loss"
                    if row["rounds_rel_guarded_ci"][0] > 1
                    else "inconclusive"
                )
            )
            rows.append(row)
    return rows


def _outcome(r: dict) -> bool:
    """A run's success: its score where it has one, else (ShareGPT) an answer that ended by itself."""
    return bool(r["correct"]) if r.get("correct") is not None else bool(r.get("finished_eos"))


def forcing_table(records: list[dict], boot: BootstrapConfig | None = None) -> list[dict]:
    """Budget forcing measured: each arm `X+force` against `X` on the same (prompt, seed) pairs.

    A pair *hits the budget* when the unforced run stopped at max tokens without ending. Forcing
    *fires* when the forced run was still inside its trace at the forcing point. Over the pairs where
    it fired: *rescued* = unforced wrong and forced right, *regressions* = unforced right and forced
    wrong (success is correctness, or on ShareGPT an answer that ended by itself), and where the
    tokens went: inside the trace and after it, unforced and forced."""
    boot = boot or BootstrapConfig()
    by_arm: dict[str, dict] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[_pair(r)] = r
    rows = []
    for arm in arm_order(records):
        bare = bare_arm(arm, "+force")
        if bare is None or bare not in by_arm:
            continue
        pairs = sorted(set(by_arm[arm]) & set(by_arm[bare]))
        f = [by_arm[arm][k] for k in pairs]
        u = [by_arm[bare][k] for k in pairs]
        fired = [(a, b) for a, b in zip(f, u) if a.get("forced")]
        fa, ua = [a for a, _ in fired], [b for _, b in fired]
        ok_f = np.array([_outcome(a) for a in fa], dtype=np.float64)  # [m]
        ok_u = np.array([_outcome(b) for b in ua], dtype=np.float64)
        row = {
            "arm": arm,
            "bare": bare,
            "pairs": len(pairs),
            "hit_budget": sum(bool(b.get("hit_budget")) for b in u),
            "fired": len(fired),
            "fired_and_hit": sum(bool(b.get("hit_budget")) for _, b in fired),
            "success_unforced": int(ok_u.sum()),
            "success_forced": int(ok_f.sum()),
            "rescued": int(((ok_u == 0) & (ok_f == 1)).sum()),
            "regressions": int(((ok_u == 1) & (ok_f == 0)).sum()),
            "success_delta_ci": mean_delta_interval(ok_f, ok_u, boot) if fired else None,
            "scored": all(r.get("correct") is not None for r in fa + ua),
        }
        for key in ("think_tokens", "answer_tokens", "length"):
            row[key + "_unforced"] = _mean(b.get(key) for b in ua)
            row[key + "_forced"] = _mean(a.get(key) for a in fa)
        row["length_delta_ci"] = mean_delta_interval(_opt(fa, "length"), _opt(ua, "length"), boot) if fired else None
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ entry point


def write_report(
    records: list[dict],
    out_dir: str | Path,
    *,
    settings: dict,
    command: str,
    arms: list[str] | None = None,
    boot: BootstrapConfig | None = None,
) -> dict:
    """Write report.json, report.md and the PNGs into out_dir; returns the aggregates."""
    out = Path(out_dir)
    boot = boot or BootstrapConfig()
    agg = aggregate(records, arms, boot=boot)
    ablations = guard_ablations(records, boot)
    forcing = forcing_table(records, boot)
    try:
        plots = make_plots(agg, out)
    except (
        ImportError
    ):  # no matplotlib (the vLLM venv): the tables alone; `--report-only DIR` from .venv adds the plots
        plots = []
    md = render_markdown(
        agg,
        settings,
        command,
        dataset=settings.get("dataset", "?"),
        think=bool(settings.get("think")),
        plots=plots,
        ablations=ablations,
        forcing=forcing,
    )
    (out / "report.md").write_text(md, encoding="utf-8")
    payload = {
        "baseline": BASELINE,
        "settings": settings,
        "command": command,
        "records": len(records),
        "bootstrap": {
            "resamples": boot.resamples,
            "level": boot.level,
            "seed": boot.seed,
            "unit": "(prompt, seed) pair",
        },
        "arms": {
            k: {kk: vv for kk, vv in v.items() if kk != "lengths"} | {"lengths": v["lengths"]} for k, v in agg.items()
        },
        "guard_ablations": ablations,
        "budget_forcing": forcing,
        "plots": plots,
    }
    (out / "report.json").write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    return agg
