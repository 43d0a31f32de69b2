"""The length-inflation report's presentation: report.md's tables and the PNG plots, drawn from the
aggregates that `acespec.eval.report` computes (which also writes the files).

`render_markdown` turns the per-arm aggregates, the guard ablations and the budget-forcing table into
report.md, each point estimate with its 95% interval; `make_plots` draws the length ratio against the
acceptance gain (with the net-win line) and the output lengths per rule. matplotlib, the eval extra, is
imported only when plotting.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from acespec.eval.config import BASELINE


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
