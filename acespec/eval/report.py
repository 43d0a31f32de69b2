"""Aggregates, verdicts, report.md / report.json and the plots of the length-inflation harness.

Per arm, over the (prompt, seed) pairs it shares with the `strict` baseline (so every ratio compares
like with like):

- `L`: mean output length (tokens); `lambda = L / L_strict` on the same pairs.
- `l`: mean accepted draft tokens per round, pooled (`sum accepted / sum rounds`); `tau = l + 1`.
- `gain = (l + 1) / (l_strict + 1)`; **net win** iff `gain > lambda` (DESIGN.md).
- rounds per answer relative to strict (`mean rounds / mean rounds_strict`, about `lambda / gain`),
  time to last token relative to strict (mean over mean; noisy, see DESIGN "Measuring").
- accuracy (math: parsed answer; humaneval: pass@1; sharegpt: n/a).
- accepted-token support: median target probability and rank of every accepted draft token, and the
  share accepted with `p < 0.1`.
- where the tokens go: math, tokens up to the first appearance of the correct answer and after it;
  `--think`, tokens inside the trace and after it. With `--think`: runs that hit the budget, runs that
  budget forcing cut, and how many of those it rescued (a correct answer; for ShareGPT, an answer that
  ended by itself).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Iterable

BASELINE = "strict"


def _mean(xs: Iterable[float]) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def pooled_l(recs: list[dict]) -> float | None:
    rounds = sum(r["rounds"] for r in recs)
    return sum(r["accepted"] for r in recs) / rounds if rounds else None


def net_win(l_rule: float, l_strict: float, lam: float) -> bool:
    """DESIGN.md: a relaxed rule is a net win only if (l + 1) / (l_strict + 1) > lambda."""
    return (l_rule + 1.0) / (l_strict + 1.0) > lam


def arm_order(records: list[dict], arms: list[str] | None = None) -> list[str]:
    seen: list[str] = []
    for r in records:
        if r["arm"] not in seen:
            seen.append(r["arm"])
    if arms:
        return [a for a in arms if a in seen] + [a for a in seen if a not in arms]
    return ([BASELINE] if BASELINE in seen else []) + [a for a in seen if a != BASELINE]


def aggregate(records: list[dict], arms: list[str] | None = None, baseline: str = BASELINE) -> dict:
    """Per-arm aggregates (see the module docstring). `arms` fixes the order; records of other arms are kept."""
    by_arm: dict[str, list[dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], []).append(r)
    base = {(r["prompt_id"], r["seed"]): r for r in by_arm.get(baseline, [])}
    out: dict[str, dict] = {}
    for arm in arm_order(records, arms):
        recs = by_arm[arm]
        paired = [r for r in recs if (r["prompt_id"], r["seed"]) in base] if base else []
        use = paired if base else recs
        bl = [base[(r["prompt_id"], r["seed"])] for r in paired]
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
        else:
            a.update(L_strict=None, l_strict=None, **{"lambda": None}, gain=None, net_win=None, rounds_rel=None, ttlt_rel=None)
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
        if any("think_tokens" in r for r in use):
            a["think_tokens"] = _mean(r.get("think_tokens") for r in use)
            a["answer_tokens"] = _mean(r.get("answer_tokens") for r in use)
            a["trace_closed"] = sum(bool(r.get("trace_closed")) for r in use)
        a["hit_budget"] = sum(bool(r.get("hit_budget")) for r in use)
        a["forced"] = sum(bool(r.get("forced")) for r in use)
        a["rescued"] = sum(bool(r.get("rescued")) for r in use)
        used = {}
        for r in use:
            used[r.get("rule_used", arm)] = used.get(r.get("rule_used", arm), 0) + 1
        a["rule_used"] = used
        a["lengths"] = [r["length"] for r in use]
        out[arm] = a
    return out


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


def render_markdown(agg: dict, settings: dict, command: str, *, dataset: str, think: bool, plots: list[str]) -> str:
    lines = [f"# AceSpec length-inflation report: {dataset}", ""]
    lines += ["Acceptance is not speed: a rule is a **net win** only if `(l + 1)/(l_strict + 1) > lambda`, "
              "where `l` is mean accepted draft tokens per round and `lambda = L / L_strict` the length ratio "
              "on the same prompts and seeds.", ""]
    lines += ["| rule | runs | L | λ | l | gain (l+1)/(l_s+1) | rounds vs strict | net win | accuracy | "
              "TTLT vs strict | median p acc. | median rank | p<0.1 share |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for arm, a in agg.items():
        nw = "baseline" if arm == BASELINE else ("**yes**" if a["net_win"] else ("no" if a["net_win"] is False else "n/a"))
        lines.append(
            f"| `{arm}` | {a['runs']} | {_f(a['L'], 1)} | {_f(a['lambda'], 3)} | {_f(a['l'], 2)} | {_f(a['gain'], 3)} | "
            f"{_f(a['rounds_rel'], 3)} | {nw} | {_f(a['accuracy'], pct=True) if a['accuracy'] is not None else 'n/a'} | "
            f"{_f(a['ttlt_rel'], 3)} | {_f(a['median_p'], 3)} | {_f(a['median_rank'], 1)} | "
            f"{_f(a['share_p_lt_0.1'], pct=True) if a['share_p_lt_0.1'] is not None else 'n/a'} |"
        )
    lines.append("")
    guarded = {k: v["rule_used"] for k, v in agg.items() if len(v["rule_used"]) > 1 or "+netwin" in k}
    if guarded:
        lines.append("Net-win guard choices: " + "; ".join(
            f"`{k}`: " + ", ".join(f"{n}x `{r}`" for r, n in v.items()) for k, v in guarded.items()) + ".")
        lines.append("")
    if any("pre_answer_tokens" in a for a in agg.values()):
        lines += ["## Where the tokens go: before and after the first correct answer", "",
                  "Tokens up to the first appearance of the correct answer in the output, and after it (runs "
                  "where it appears).", "",
                  "| rule | answer appears | tokens before | tokens after | Δ before vs strict | Δ after vs strict |",
                  "|---|---:|---:|---:|---:|---:|"]
        b = agg.get(BASELINE, {})
        for arm, a in agg.items():
            if "pre_answer_tokens" not in a:
                continue
            db = None if a["pre_answer_tokens"] is None or b.get("pre_answer_tokens") is None else a["pre_answer_tokens"] - b["pre_answer_tokens"]
            da = None if a["post_answer_tokens"] is None or b.get("post_answer_tokens") is None else a["post_answer_tokens"] - b["post_answer_tokens"]
            lines.append(f"| `{arm}` | {a['answer_found']}/{a['paired'] or a['runs']} | {_f(a['pre_answer_tokens'], 1)} | "
                         f"{_f(a['post_answer_tokens'], 1)} | {_f(db, 1)} | {_f(da, 1)} |")
        lines.append("")
    if think:
        lines += ["## Reasoning trace and budget", "",
                  "| rule | tokens in trace | tokens after trace | trace closed | hit budget | forced | rescued |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for arm, a in agg.items():
            n = a["paired"] or a["runs"]
            lines.append(f"| `{arm}` | {_f(a.get('think_tokens'), 1)} | {_f(a.get('answer_tokens'), 1)} | "
                         f"{a.get('trace_closed', 0)}/{n} | {a['hit_budget']}/{n} | {a['forced']}/{n} | "
                         f"{a['rescued']}/{a['forced']} |")
        lines += ["", "*hit budget*: stopped at max tokens without ending by itself. *forced*: budget forcing "
                  "injected `</think>`. *rescued*: a forced run that then produced a correct answer (ShareGPT: "
                  "an answer that ended by itself).", ""]
    lines += ["## Columns", "",
              "- *L*: mean output tokens; *λ*: L / L_strict on the same (prompt, seed) pairs; *l*: accepted draft "
              "tokens per round, pooled (mean acceptance length τ = l + 1).",
              "- *rounds vs strict*: target passes per answer relative to strict (≈ λ / gain): below 1 saves "
              "target work. *TTLT vs strict*: time to the last token relative to strict (wall clock, noisy on "
              "shared CPUs; see DESIGN.md, Measuring).",
              "- *median p acc.*, *median rank*, *p<0.1 share*: the target probability and rank (1 = argmax) "
              "of every accepted draft token.", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += ["## Settings", ""]
    for k, v in settings.items():
        lines.append(f"- `{k}`: {json.dumps(v)}")
    lines += ["", "## Command", "", "```", command, "```", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots


def make_plots(agg: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    # 1. length ratio vs acceptance gain, with the net-win line lambda = (l+1)/(l_s+1)
    pts = [(arm, a["gain"], a["lambda"]) for arm, a in agg.items() if a["gain"] is not None and a["lambda"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    if pts:
        xs = [p[1] for p in pts]
        ys = [p[2] for p in pts]
        lo = min(xs + ys + [1.0]) * 0.95
        hi = max(xs + ys + [1.0]) * 1.05
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="net-win line  λ = (l+1)/(l_strict+1)")
        ax.fill_between([lo, hi], [lo, lo], [lo, hi], color="tab:green", alpha=0.08, label="net win (below the line)")
        for arm, x, y in pts:
            ax.scatter([x], [y], s=40, zorder=3)
            ax.annotate(arm, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xlabel("acceptance gain (l + 1) / (l_strict + 1)")
    ax.set_ylabel("length ratio λ = L / L_strict")
    ax.set_title("Length inflation vs acceptance gain")
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


def write_report(records: list[dict], out_dir: str | Path, *, settings: dict, command: str, arms: list[str] | None = None) -> dict:
    """Write report.json, report.md and the PNGs into out_dir; returns the aggregates."""
    out = Path(out_dir)
    agg = aggregate(records, arms)
    plots = make_plots(agg, out)
    md = render_markdown(agg, settings, command, dataset=settings.get("dataset", "?"), think=bool(settings.get("think")), plots=plots)
    (out / "report.md").write_text(md, encoding="utf-8")
    payload = {
        "baseline": BASELINE,
        "settings": settings,
        "command": command,
        "records": len(records),
        "arms": {k: {kk: vv for kk, vv in v.items() if kk != "lengths"} | {"lengths": v["lengths"]} for k, v in agg.items()},
        "plots": plots,
    }
    (out / "report.json").write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    return agg
