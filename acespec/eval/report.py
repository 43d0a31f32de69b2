"""Aggregates, verdicts, report.md / report.json and the plots of the length-inflation harness.

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
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

import numpy as np

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

BASELINE = "strict"
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


# ------------------------------------------------------------------------------------------ formatting


def _f(x, nd: int = 2, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if pct:
        return f"{100 * x:.0f}%"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def _ci(x, ci, nd: int = 3, pct: bool = False) -> str:
    """`0.921 [0.850, 0.990]`: a point estimate and its 95% interval (just the point where there is none)."""
    if x is None:
        return "n/a"
    if pct:
        head = f"{100 * x:.0f}%"
        return head if not ci else f"{head} [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"
    head = _f(float(x), nd)
    return head if not ci else f"{head} [{ci[0]:.{nd}f}, {ci[1]:.{nd}f}]"


_VERDICT = {"win": "**win**", "loss": "loss", "inconclusive": "inconclusive", "baseline": "baseline"}


def render_markdown(
    agg: dict,
    settings: dict,
    command: str,
    *,
    dataset: str,
    think: bool,
    plots: list[str],
    ablations: list[dict] | None = None,
    forcing: list[dict] | None = None,
) -> str:
    lines = [f"# AceSpec length-inflation report: {dataset}", ""]
    lines += [
        "Acceptance is not speed: a rule saves target work only if `(l + 1)/(l_strict + 1) > lambda`, "
        "where `l` is mean accepted draft tokens per round and `lambda = L / L_strict` the length ratio "
        "on the same prompts and seeds. Brackets are 95% intervals from a paired bootstrap over the "
        "(prompt, seed) pairs. **Net win** is read from the interval of rounds against strict: *win* when "
        "it lies wholly below 1, *loss* when wholly above, *inconclusive* when it contains 1.",
        "",
    ]
    lines += [
        "| rule | pairs | L | λ | l | gain (l+1)/(l_s+1) | rounds vs strict | net win | accuracy | "
        "TTLT vs strict | median p acc. | median rank | p<0.1 share |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for arm, a in agg.items():
        ci = a.get("ci", {})
        nw = _VERDICT.get(a.get("verdict"), "n/a")
        lines.append(
            f"| `{arm}` | {a['paired'] or a['runs']} | {_f(a['L'], 1)} | {_ci(a['lambda'], None if arm == BASELINE else ci.get('lambda'))} | "
            f"{_f(a['l'], 2)} | {_ci(a['gain'], None if arm == BASELINE else ci.get('gain'))} | "
            f"{_ci(a['rounds_rel'], None if arm == BASELINE else ci.get('rounds_rel'))} | {nw} | "
            f"{_ci(a['accuracy'], ci.get('accuracy'), pct=True)} | "
            f"{_ci(a['ttlt_rel'], None if arm == BASELINE else ci.get('ttlt_rel'))} | {_f(a['median_p'], 3)} | {_f(a['median_rank'], 1)} | "
            f"{_f(a['share_p_lt_0.1'], pct=True) if a['share_p_lt_0.1'] is not None else 'n/a'} |"
        )
    lines.append("")
    deltas = [
        (arm, a["ci"]["accuracy_delta"])
        for arm, a in agg.items()
        if arm != BASELINE and a.get("ci", {}).get("accuracy_delta")
    ]
    if deltas:
        lines.append(
            "Accuracy against strict on the same pairs (rule minus strict, percentage points, 95% interval): "
            + "; ".join(f"`{arm}` [{100 * lo:+.0f}, {100 * hi:+.0f}]" for arm, (lo, hi) in deltas)
            + "."
        )
        lines.append("")
    guarded = {k: v["rule_used"] for k, v in agg.items() if len(v["rule_used"]) > 1 or "+netwin" in k}
    if guarded:
        lines.append(
            "Net-win guard choices: "
            + "; ".join(f"`{k}`: " + ", ".join(f"{n}x `{r}`" for r, n in v.items()) for k, v in guarded.items())
            + "."
        )
        lines.append("")
    if ablations:
        lines += [
            "## Guard ablations",
            "",
            "Each guarded rule against its bare rule, on the (prompt, seed) pairs both share with strict. "
            "*gain kept*: (gain_guarded - 1) / (gain_bare - 1), the share of the bare rule's acceptance gain "
            "the guard keeps. A guard does its job when λ comes back to about 1 and part of the gain stays.",
            "",
            "| rule | guard | pairs | λ bare | λ guarded | gain bare | gain guarded | gain kept | rounds vs strict (guarded) | net win (guarded) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in ablations:
            if "lambda_guarded" not in r:
                lines.append(
                    f"| `{r['bare']}` | {r['guard']} | {r['pairs']} | n/a | n/a | n/a | n/a | n/a | n/a | inconclusive |"
                )
                continue
            lines.append(
                f"| `{r['bare']}` | {r['guard']} | {r['pairs']} | {_ci(r['lambda_bare'], r['lambda_bare_ci'])} | "
                f"{_ci(r['lambda_guarded'], r['lambda_guarded_ci'])} | {_ci(r['gain_bare'], r['gain_bare_ci'])} | "
                f"{_ci(r['gain_guarded'], r['gain_guarded_ci'])} | {_f(r['gain_kept'], 2)} | "
                f"{_ci(r['rounds_rel_guarded'], r['rounds_rel_guarded_ci'])} | {_VERDICT[r['verdict']]} |"
            )
        lines.append("")
    if any("pre_answer_tokens" in a for a in agg.values()):
        lines += [
            "## Where the tokens go: before and after the first correct answer",
            "",
            "Tokens up to the first appearance of the correct answer in the output, and after it (runs "
            "where it appears). The Δ intervals are over the pairs where it appears under both rules.",
            "",
            "| rule | answer appears | tokens before | tokens after | Δ before vs strict | Δ after vs strict |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for arm, a in agg.items():
            if "pre_answer_tokens" not in a:
                continue
            # paired: the mean of rule - strict over the pairs where both found the answer (the means in the
            # columns before are over every run that found it, so their difference is not the paired Δ)
            db = 0.0 if arm == BASELINE else a.get("pre_answer_tokens_delta")
            da = 0.0 if arm == BASELINE else a.get("post_answer_tokens_delta")
            ci = {} if arm == BASELINE else a.get("ci", {})
            lines.append(
                f"| `{arm}` | {a['answer_found']}/{a['paired'] or a['runs']} | {_f(a['pre_answer_tokens'], 1)} | "
                f"{_f(a['post_answer_tokens'], 1)} | {_ci(db, ci.get('pre_answer_tokens_delta'), 1)} | "
                f"{_ci(da, ci.get('post_answer_tokens_delta'), 1)} |"
            )
        lines.append("")
    if think:
        lines += [
            "## Reasoning trace and budget",
            "",
            "| rule | tokens in trace | tokens after trace | Δ in trace vs strict | Δ after trace vs strict | trace closed | hit budget | forced | forced, then right |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for arm, a in agg.items():
            n = a["paired"] or a["runs"]
            ci = {} if arm == BASELINE else a.get("ci", {})
            lines.append(
                f"| `{arm}` | {_f(a.get('think_tokens'), 1)} | {_f(a.get('answer_tokens'), 1)} | "
                f"{_ci(a.get('think_tokens_delta'), ci.get('think_tokens_delta'), 1)} | "
                f"{_ci(a.get('answer_tokens_delta'), ci.get('answer_tokens_delta'), 1)} | "
                f"{a.get('trace_closed', 0)}/{n} | {a['hit_budget']}/{n} | {a['forced']}/{n} | {a['rescued']}/{a['forced']} |"
            )
        lines += [
            "",
            "*hit budget*: stopped at max tokens without ending by itself. *forced*: budget forcing "
            "injected `</think>`. *forced, then right*: a forced run whose answer was correct (ShareGPT: ended "
            "by itself); whether forcing *rescued* it takes the same run without forcing (an `X+force` arm "
            "next to `X`, below). Δ: mean over the same (prompt, seed) pairs, rule minus strict.",
            "",
        ]
    if forcing:
        lines += [
            "## Budget forcing, measured",
            "",
            "Each `X+force` arm against `X` on the same (prompt, seed) pairs and run seeds: run one at a time or "
            "with `--batching exact`, the two share every token up to the forcing point (under shared batching "
            "they can part earlier, which adds noise in both directions). *hit budget*: the unforced run stopped at max tokens without "
            "ending. *fired*: the forced run was still inside its trace at the forcing point. Over the pairs "
            "where it fired: *rescued* = wrong without forcing and right with it; *regressions* = the reverse "
            "(success is a correct answer; where nothing is scored, an answer that ended by itself).",
            "",
            "| rule | pairs | hit budget (unforced) | fired | right unforced | right forced | rescued | regressions | "
            "Δ success [95%] | tokens in trace, unforced → forced | tokens after trace, unforced → forced |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in forcing:
            d = r["success_delta_ci"]
            dtxt = (
                "n/a"
                if not r["fired"]
                else (
                    f"{100 * (r['success_forced'] - r['success_unforced']) / r['fired']:+.0f} pp"
                    + (f" [{100 * d[0]:+.0f}, {100 * d[1]:+.0f}]" if d else "")
                )
            )
            lines.append(
                f"| `{r['bare']}` | {r['pairs']} | {r['hit_budget']} | {r['fired']} | {r['success_unforced']}/{r['fired']} | "
                f"{r['success_forced']}/{r['fired']} | {r['rescued']} | {r['regressions']} | {dtxt} | "
                f"{_f(r['think_tokens_unforced'], 1)} → {_f(r['think_tokens_forced'], 1)} | "
                f"{_f(r['answer_tokens_unforced'], 1)} → {_f(r['answer_tokens_forced'], 1)} |"
            )
        lines.append("")
    lines += [
        "## Columns",
        "",
        "- *L*: mean output tokens; *λ*: L / L_strict on the same (prompt, seed) pairs; *l*: accepted draft "
        "tokens per round, pooled (mean acceptance length τ = l + 1).",
        "- *rounds vs strict*: target passes per answer relative to strict (≈ λ / gain): below 1 saves "
        "target work. *TTLT vs strict*: time to the last token relative to strict (wall clock, noisy on "
        "shared CPUs; see docs/design/architecture.md, Measuring).",
        "- *median p acc.*, *median rank*, *p<0.1 share*: the target probability and rank (1 = argmax) "
        "of every accepted draft token (n/a for runs on `--engine vllm`, which does not report them; there "
        "*rounds* counts vLLM's prefill pass, which emits the first token with no drafts, and times include "
        "prefill and queueing in a shared batch: acespec/eval/vllm_runner.py)."
        if settings.get("engine") == "vllm"
        else "of every accepted draft token.",
        "- *pairs*: (prompt, seed) pairs this rule shares with strict; every ratio and interval is over them. "
        "Intervals: percentile bootstrap, 4000 resamples of the pairs, seeded; with few pairs they are too "
        "narrow (about 90% coverage at n = 10), so read verdicts at n >= 30.",
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += ["## Settings", ""]
    for k, v in settings.items():
        lines.append(f"- `{k}`: {json.dumps(v)}")
    lines += ["", "## Command", "", "```", command, "```", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots


def make_plots(agg: dict, out_dir: Path) -> list[str]:
    import matplotlib  # heavy: the eval extra (plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: the eval extra (plots)

    names: list[str] = []
    # 1. length ratio vs acceptance gain, with the net-win line lambda = (l+1)/(l_s+1)
    pts = [
        (arm, a["gain"], a["lambda"], a.get("ci", {}))
        for arm, a in agg.items()
        if a["gain"] is not None and a["lambda"] is not None
    ]
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    if pts:

        def err(x: float, ci) -> list[list[float]]:  # matplotlib wants [[below], [above]]
            return [[x - ci[0]], [ci[1] - x]] if ci else [[0.0], [0.0]]

        edges = [1.0]
        for _, x, y, ci in pts:
            edges += [x, y] + list(ci.get("gain") or ()) + list(ci.get("lambda") or ())
        lo, hi = min(edges) * 0.97, max(edges) * 1.03
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="net-win line  λ = (l+1)/(l_strict+1)")
        ax.fill_between([lo, hi], [lo, lo], [lo, hi], color="tab:green", alpha=0.08, label="net win (below the line)")
        for arm, x, y, ci in pts:
            ax.errorbar(
                [x],
                [y],
                xerr=err(x, ci.get("gain")),
                yerr=err(y, ci.get("lambda")),
                fmt="o",
                ms=5,
                capsize=3,
                lw=1,
                zorder=3,
            )
            ax.annotate(arm, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xlabel("acceptance gain (l + 1) / (l_strict + 1)")
    ax.set_ylabel("length ratio λ = L / L_strict")
    ax.set_title("Length inflation vs acceptance gain (bars: 95% paired bootstrap)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "lambda_vs_gain.png", dpi=110)
    plt.close(fig)
    names.append("lambda_vs_gain.png")

    # 2. output-length distribution per rule
    arms = [arm for arm, a in agg.items() if a["lengths"]]
    fig, ax = plt.subplots(figsize=(max(6.4, 1.3 * len(arms) + 2), 4.8))
    if arms:
        data = [agg[a]["lengths"] for a in arms]
        ax.boxplot(data, showmeans=True)
        ax.set_xticks(range(1, len(arms) + 1), arms, rotation=20, ha="right", fontsize=8)
        for i, d in enumerate(data, start=1):
            jitter = [i + 0.12 * ((j * 7919) % 11 - 5) / 5 for j in range(len(d))]
            ax.scatter(jitter, d, s=8, alpha=0.4, zorder=3)
    ax.set_ylabel("output length (tokens)")
    ax.set_title("Output length per rule")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "lengths.png", dpi=110)
    plt.close(fig)
    names.append("lengths.png")
    return names


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
