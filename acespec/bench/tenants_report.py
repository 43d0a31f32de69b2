"""`acespec bench tenants`'s report: the table, the ratios measured side by side, the never-slower grid
(cloud-led against cloud-only in every RTT x N cell) and the plot. Pure functions of the result dict
that `bench/tenants.py` builds (and writes with `--json`), so a committed JSON can be re-read with them.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def _line(r: dict) -> str:
    return (
        f"{r['engine']:8s} {r['mode']:10s} N={r['n']:<3d} RTT {r.get('rtt_ms', 0):g} ms {r['agg_tok_s']:7.2f} tok/s agg, {r['per_session_tok_s']:6.2f}/session, "
        f"p50 {r['lat_p50_s']:.3f} s, p99 {r['lat_p99_s']:.3f} s, {r['passes_per_token']:.3f} passes/token"
        + (f", {r['capped']} capped" if r["capped"] else "")
        + (f", errors {r['errors'][:2]}" if r["errors"] else "")
    )


def _mean_row(runs: list[dict]) -> dict:
    """One cell's repeated runs as one row: the mean of each figure the ratios use."""
    if len(runs) == 1:
        return runs[0]
    keys = ("agg_tok_s", "per_session_tok_s", "lat_p99_s", "passes_per_token")
    return {**runs[0], **{k: statistics.mean(r[k] for r in runs) for k in keys}, "timeliness": _timeliness(runs)}


def _timeliness(runs: list[dict]) -> float | None:
    """The cloud-led runs' mean draft timeliness (None where a run has none: files from before it)."""
    got = [r.get("timeliness") for r in runs]
    values = [float(x) for x in got if x is not None]
    return statistics.mean(values) if values and len(values) == len(got) else None


def _on_time(t: float | None) -> str:
    return "" if t is None else f", drafts on time at {t:.2f} of steps"


def never_slower(rows: list[dict]) -> list[str]:
    """The cloud-led bar, cell by cell: per-session tok/s against cloud-only's on the same engine at the
    same RTT and N, and whether its text is cloud-only's (greedy and coupled must give it exactly)."""
    cells: dict = {}
    for r in rows:
        if r["mode"] in ("cloud-led", "cloud-only"):
            cells.setdefault((r["engine"], r.get("rtt_ms", 0.0), r["n"]), {}).setdefault(r["mode"], []).append(r)
    grid = [(k, v["cloud-led"], v["cloud-only"]) for k, v in sorted(cells.items()) if len(v) == 2]
    if not grid:
        return []
    runs = max(len(led) for _, led, _ in grid)
    out = [
        "never slower: cloud-led per-session tok/s / cloud-only's (same engine, RTT and N"
        + (f"; means over {runs} interleaved runs, the modes in turn first" if runs > 1 else "")
        + "), and its text against cloud-only's"
    ]
    worst, differ, total, texts_differ, texts = None, 0, 0, 0, 0
    for (engine, rtt, n), led, plain in grid:
        ratio = statistics.mean(r["per_session_tok_s"] for r in led) / max(
            statistics.mean(r["per_session_tok_s"] for r in plain), 1e-9
        )
        d = t = td = 0
        for a_run, b_run in zip(plain, led):
            for pid, toks in a_run["outputs"].items():
                other = b_run["outputs"].get(pid, [])
                t += len(toks)
                first = next((i for i, (a, b) in enumerate(zip(toks, other)) if a != b), min(len(toks), len(other)))
                if first < max(len(toks), len(other)):  # a token differs; everything after it follows from it
                    td += 1
                    d += len(toks) - first
        differ, total, texts_differ, texts = (
            differ + d,
            total + t,
            texts_differ + td,
            texts + sum(len(r["outputs"]) for r in plain),
        )
        worst = min(worst or (ratio, rtt, n), (ratio, rtt, n))
        spread = ""
        if len(led) > 1:
            each = [x["per_session_tok_s"] / max(y["per_session_tok_s"], 1e-9) for x, y in zip(led, plain)]
            spread = f" (runs {min(each):.2f}-{max(each):.2f}x)"
        passes = statistics.mean(r["passes_per_token"] for r in led)
        out.append(
            f"  {engine:8s} RTT {rtt:5g} ms  N={n:<3d} {ratio:5.2f}x{spread} at {passes:.2f} passes/token"
            f"{_on_time(_timeliness(led))}, {td} texts differ ({d} of {t} tokens from the first difference on)"
            + ("" if ratio >= 1.0 else "  <- slower")
        )
    assert worst is not None, "a grid has at least one cell"
    out.append(
        f"  worst cell {worst[0]:.2f}x (RTT {worst[1]:g} ms, N = {worst[2]}): "
        + ("never slower in this run" if worst[0] >= 1.0 else "SLOWER than cloud-only in at least one cell")
        + f"; {texts_differ} of {texts} texts differ from cloud-only's ({differ} of {total} tokens from the first "
        "difference on)"
    )
    return out


def _share(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(result: dict) -> str:
    rows = result["rows"]
    out = [
        f"=== acespec bench tenants: {len(rows)} cells; {result['max_tokens']} tokens per session, K = {result.get('k', 4)}, "
        f"drafting {1e3 * result['draft_s_per_token']:.1f} ms/token (replayed), tick budget {result['tick_tokens']} tokens, "
        f"{result.get('rule', 'greedy')}"
        + (f" at T = {result['temperature']:g}" if result.get("temperature") else "")
        + (
            f", replaying the drafter's {result['trace_rule']} chains"
            if result.get("temperature") and result.get("trace_rule")
            else ""
        )
        + " ===",
        f"{'engine':8s} {'mode':10s} {'N':>3s} {'RTT ms':>6s} {'agg tok/s':>10s} {'tok/s/sess':>10s} {'first s':>8s} {'p50 s':>7s} {'p99 s':>7s} "
        f"{'passes/tok':>10s} {'KV peak MB':>10s} {'KV alloc MB':>11s} {'capped':>6s} {'sess/ceil':>9s}",
    ]
    for r in rows:
        out.append(
            f"{r['engine']:8s} {r['mode']:10s} {r['n']:3d} {r.get('rtt_ms', 0):6g} {r['agg_tok_s']:10.2f} {r['per_session_tok_s']:10.2f} "
            f"{r['first_p50_s']:8.2f} {r['lat_p50_s']:7.3f} {r['lat_p99_s']:7.3f} {r['passes_per_token']:10.3f} {r['kv_peak_mb']:10.1f} "
            f"{r['kv_alloc_mb']:11.1f} {r['capped']:6d} {_share(r.get('of_ceiling')):>9s}"
        )
    out.append(
        "first s: median over sessions of HELLO -> first verdict (cloud-only: first token), prompt prefill "
        "included; p50/p99: blocks sent after it, DRAFT -> VERDICT (cloud-only: gap between later tokens)"
    )
    out.append(
        "sess/ceil: a session's steady rate over its ceiling (acespec/sim/ceiling.py) on the passes its cell's "
        "sessions reported; cloud-only streams report none"
    )
    if any(r["mode"] == "cloud-led" for r in rows):
        out.append(
            "cloud-led: each cell's server starts from the pricer memory the engine's earlier cells left "
            "(acceptance, row costs), as one long-running server would"
        )
    rtts = sorted({r.get("rtt_ms", 0.0) for r in rows})
    ratios = []
    for rtt, n in sorted({(r.get("rtt_ms", 0.0), r["n"]) for r in rows}):
        groups: dict = {}
        for r in rows:
            if r.get("rtt_ms", 0.0) == rtt:
                groups.setdefault((r["engine"], r["mode"], r["n"]), []).append(r)
        by = {key: _mean_row(runs) for key, runs in groups.items()}  # repeats: the modes' means
        a, s, c = (
            by.get(("batched", "acespec", n)),
            by.get(("serial", "acespec", n)),
            by.get(("batched", "cloud-only", n)),
        )
        parts = []
        if a and s:
            parts.append(f"AceSpec batched / serial server {a['agg_tok_s'] / max(s['agg_tok_s'], 1e-9):.2f}x")
        if a and c:
            parts.append(f"AceSpec / cloud-only (same engine) {a['agg_tok_s'] / max(c['agg_tok_s'], 1e-9):.2f}x")
        led = by.get(("batched", "cloud-led", n))
        if led and c:
            parts.append(
                f"cloud-led / cloud-only per session {led['per_session_tok_s'] / max(c['per_session_tok_s'], 1e-9):.2f}x "
                f"at {led['passes_per_token']:.2f} passes/token{_on_time(led.get('timeliness'))}"
            )
        one = by.get(("batched", "acespec", 1))
        if a and one:
            parts.append(
                f"agg vs N=1 {a['agg_tok_s'] / max(one['agg_tok_s'], 1e-9):.2f}x, p99 vs N=1 {a['lat_p99_s'] / max(one['lat_p99_s'], 1e-9):.2f}x"
            )
        sh = by.get(("shared", "acespec", n))
        if a and sh:
            parts.append(f"shared pass / exact {sh['agg_tok_s'] / max(a['agg_tok_s'], 1e-9):.2f}x")
        if parts:
            ratios.append((f"RTT {rtt:g} ms, " if len(rtts) > 1 else "") + f"N={n}: " + "; ".join(parts))
    if ratios:
        out.append("ratios (same run):")
        out.extend("  " + x for x in ratios)
    out.extend(never_slower(rows))
    inv = result.get("invariance")
    if inv:
        out.append("same text whatever the load (each session alone vs all together):")
        for label, key in (
            ("batched, exact (one KV stream and one pass per session)", "after"),
            ("shared pass (one unified KV cache), before", "before"),
        ):
            for r in inv.get(key, []):
                out.append(
                    f"  {label}: {r['rule']}: {r['tokens_differ']} of {r['tokens']} tokens differ "
                    f"({r['sessions_differ']} of {r['n']} sessions); {r['row_blocks_differ']} of {r['row_blocks']} "
                    f"verified row blocks not bit-identical" + (f", errors {r['errors'][:2]}" if r["errors"] else "")
                )
    return "\n".join(out)


def plot(result: dict, png: str) -> None:
    import matplotlib  # heavy: the eval extra (plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: the eval extra (plots)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["engine"], r["mode"]), []).append(r)
    for (eng, mode), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["n"])
        label = f"{mode} ({eng})"
        style = "--" if eng == "serial" else "-"
        ax1.plot([r["n"] for r in rs], [r["agg_tok_s"] for r in rs], style, marker="o", label=label)
        ax2.plot([r["n"] for r in rs], [r["lat_p99_s"] for r in rs], style, marker="o", label=label)
    for ax, title in ((ax1, "aggregate committed tokens/s"), (ax2, "verdict latency p99 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent edges N")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle("acespec bench tenants: one cloud (Qwen2.5-Coder-1.5B, 2 CPU cores), N replayed edges", fontsize=10)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
