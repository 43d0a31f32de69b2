"""Running the simulator over traces x device profiles x RTTs x modes, the summary table, and validation.

Aggregation over the prompts of a trace set (like `acespec bench wan`): tokens/s = total tokens / total
wall time; TTFT = mean; target passes per token and bytes per token = totals / total tokens. Per row, the
ratio of tokens/s to sync and to cloud-only at the same profile and RTT; per (profile, mode), the RTT
sensitivity = tokens/s at the highest RTT / tokens/s at the lowest (RTT 0 when simulated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from acespec.net.profile import WanProfile
from acespec.sim.ceiling import MODES, against_ceiling, calibrate
from acespec.sim.edge import SimResult, parse_mode, simulate
from acespec.sim.link import FrameSizer
from acespec.sim.profiles import DeviceProfile
from acespec.sim.trace import PromptTrace

__all__ = [
    "aggregate",
    "run_grid",
    "format_table",
    "format_assumptions",
    "parse_live",
    "validation_rows",
    "format_validation",
]


def aggregate(results: Sequence[SimResult]) -> dict:
    """Totals over the prompts, computed as `acespec bench wan` summarises live runs."""
    st = [r.stats for r in results]
    n = sum(s.emitted for s in st)
    wall = sum(s.wall_s for s in st)
    after = sum(s.wall_s - s.ttft_s for s in st)
    drafted = sum(s.drafted for s in st)
    lookups = sum(s.cache.get("lookups", 0) for s in st)
    ks = [k for s in st for k in s.k_chosen]
    return {
        "tokens": n,
        "wall_s": round(wall, 4),
        "tok_s": round(n / wall, 3) if wall > 0 else 0.0,
        "tok_s_after_ttft": round(sum(max(s.emitted - 1, 0) for s in st) / after, 3) if after > 0 else 0.0,
        "ttft_s": round(sum(s.ttft_s for s in st) / len(st), 4) if st else 0.0,
        "passes_per_token": round(sum(s.rounds for s in st) / n, 4) if n else 0.0,
        "up_bytes_per_token": round(sum(s.bytes_up for s in st) / n, 2) if n else 0.0,
        "down_bytes_per_token": round(sum(s.bytes_down for s in st) / n, 2) if n else 0.0,
        "acceptance_rate": round(sum(s.accepted for s in st) / drafted, 4) if drafted else None,
        "mean_k": round(sum(ks) / len(ks), 2) if ks else 0.0,
        "dropped_per_token": round(sum(s.dropped for s in st) / n, 4) if n else 0.0,
        "cache_hit_rate": round(sum(s.cache.get("hits", 0) for s in st) / lookups, 4) if lookups else None,
        "branches_per_token": round(sum(s.cache.get("branches_sent", 0) for s in st) / n, 4) if n else 0.0,
    }


PHASE_STARTS = 8  # a varying link: each trace is replayed from this many start times over one whole period


def _starts(net: WanProfile) -> list[float]:
    """When each replay starts: at once on a fixed link; on a varying one, spread over a whole period of
    its switching, so the figures are averages over time, as a user on that link sees them."""
    if not net.varies:
        return [0.0]
    return [2.0 * net.switch_s * i / PHASE_STARTS for i in range(PHASE_STARTS)]


def run_grid(
    traces: Sequence[PromptTrace],
    devices: Sequence[DeviceProfile],
    rtts: Sequence[float],
    modes: Sequence[str],
    *,
    k: int = 4,
    window: int = 2,
    net: WanProfile | None = None,
) -> dict:
    """Every (device, RTT, mode) over every trace. Returns {"rows": [...], "sensitivity": {...}}."""
    if not traces:
        raise ValueError("no traces to replay")
    net = net or WanProfile()
    sizer = FrameSizer()
    rows = []
    for dev in devices:
        for rtt in rtts:
            n = net if net.varies else dataclasses.replace(net, rtt_ms=float(rtt))  # a varying link keeps its phases
            by_mode, runs = {}, {}
            for mode in modes:
                cfg = parse_mode(mode, k=k, window=window)
                res = [simulate(t, dev, n, cfg, sizer, start=s) for t in traces for s in _starts(n)]
                row = {"profile": dev.name, "rtt_ms": float(rtt), "mode": mode, **aggregate(res)}
                by_mode[mode] = row
                runs[mode] = (cfg.mode, res)
                rows.append(row)
            _ceilings(by_mode, runs, n.rtt_ms / 1e3)
            for row in by_mode.values():
                for ref in ("sync", "cloud-only"):
                    base = by_mode.get(ref, {}).get("tok_s")
                    row[f"x_{ref.replace('-', '_')}"] = round(row["tok_s"] / base, 3) if base else None
    sens: dict[str, dict[str, dict]] = {}  # profile -> mode -> its RTT sensitivity
    for dev in devices:
        lo, hi = min(rtts), max(rtts)
        for mode in modes:
            a = next(r["tok_s"] for r in rows if r["profile"] == dev.name and r["rtt_ms"] == lo and r["mode"] == mode)
            b = next(r["tok_s"] for r in rows if r["profile"] == dev.name and r["rtt_ms"] == hi and r["mode"] == mode)
            sens.setdefault(dev.name, {})[mode] = {
                "rtt_lo_ms": lo,
                "rtt_hi_ms": hi,
                "ratio": round(b / a, 3) if a else None,
            }
    return {"rows": rows, "sensitivity": sens}


def _ceilings(by_mode: dict, runs: dict, rtt_s: float) -> None:
    """Each row's ceiling (sim/ceiling.py), calibrated on the simulated passes of every mode at this
    device and RTT, as the live benchmarks calibrate on theirs: the simulator prints the same share."""
    cal = calibrate((r.stats for _, res in runs.values() for r in res), rtt_s=rtt_s)
    for mode, (edge_mode, res) in runs.items():
        top, share, _ = (
            against_ceiling([r.stats for r in res], edge_mode, cal) if cal and edge_mode in MODES else (0, 0, 0)
        )
        by_mode[mode]["ceiling_tok_s"] = round(top, 3) if top else None
        by_mode[mode]["of_ceiling"] = round(share, 3) if share else None


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(result: dict) -> str:
    cols = [
        ("profile", 14),
        ("rtt", 5),
        ("mode", 30),
        ("tok/s", 7),
        ("x sync", 6),
        ("x cloud", 7),
        ("ttft s", 6),
        ("pass/tok", 8),
        ("up B/tok", 8),
        ("dn B/tok", 8),
        ("accept", 6),
        ("K", 4),
        ("hit", 5),
        ("ceil", 7),
        ("steady/ceil", 11),
    ]
    head = " ".join(f"{c:>{w}}" if i > 2 else f"{c:<{w}}" for i, (c, w) in enumerate(cols))
    lines = [head, "-" * len(head)]
    prev = None
    for r in result["rows"]:
        key = (r["profile"], r["rtt_ms"])
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        vals = [
            r["profile"],
            f"{r['rtt_ms']:g}",
            r["mode"],
            _f(r["tok_s"], ".1f"),
            _f(r.get("x_sync"), ".2f"),
            _f(r.get("x_cloud_only"), ".2f"),
            _f(r["ttft_s"], ".3f"),
            _f(r["passes_per_token"], ".3f"),
            _f(r["up_bytes_per_token"], ".1f"),
            _f(r["down_bytes_per_token"], ".1f"),
            _f(r["acceptance_rate"], ".2f"),
            _f(r["mean_k"], ".1f"),
            _f(r["cache_hit_rate"], ".2f"),
            _f(r.get("ceiling_tok_s"), ".1f"),
            _f(r.get("of_ceiling"), ".2f"),
        ]
        lines.append(" ".join(f"{v:>{w}}" if i > 2 else f"{v:<{w}}" for i, (v, (_, w)) in enumerate(zip(vals, cols))))
    for prof, modes in result["sensitivity"].items():
        any_m = next(iter(modes.values()))
        lines.append("")
        lines.append(
            f"RTT sensitivity, {prof} (tok/s at {any_m['rtt_hi_ms']:g} ms / at {any_m['rtt_lo_ms']:g} ms): "
            + ", ".join(f"{m} {_f(v['ratio'], '.2f')}" for m, v in modes.items())
        )
    return "\n".join(lines)


def format_assumptions(devices: Iterable[DeviceProfile], net: WanProfile, k: int, window: int) -> str:
    out = []
    for d in devices:
        out.append(d.describe())
        out.extend(f"  - {n}" for n in d.notes)
    out.append(
        f"network: jitter {net.jitter_ms:g} ms, up {net.up_bps / 1e6:g} Mbit/s, down {net.down_bps / 1e6:g} Mbit/s "
        f"(0 = unlimited), loss {net.loss_pct:g}%; K = {k}, window = {window}"
    )
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ validation
_TOK_KEYS = ("tokens_per_s", "tok_s", "tokens_per_sec")


def parse_live(doc) -> tuple[list[dict], dict]:
    """Live figures from `acespec bench acespec --json` / `acespec bench wan --json` (mode and variant
    names are simulator modes too), or a list of {mode, rtt_ms, tokens_per_s, ...} rows.

    Returns (rows, config) with rows {mode, rtt_ms, tok_s, ttft_s, passes_per_token, up bytes per token,
    cache_hit_rate}."""
    rows: list[dict] = []
    config = doc.get("config", {}) if isinstance(doc, dict) else {}
    if isinstance(doc, dict) and isinstance(doc.get("summary"), dict):
        for rtt, modes in doc["summary"].items():
            for mode, m in modes.items():
                rows.append(_live_row(mode, float(rtt), m))
    else:
        items = doc if isinstance(doc, list) else (doc.get("rows") or doc.get("results") or doc.get("runs") or [])
        for m in items:
            st = m.get("stats", {}) if isinstance(m.get("stats"), dict) else {}
            rows.append(_live_row(m.get("mode", "?"), float(m.get("rtt_ms", m.get("rtt", 0.0))), {**st, **m}))
    if not rows:
        raise ValueError("no live figures found: expected `acespec bench acespec --json` output or a list of rows")
    return rows, config


def _live_row(mode: str, rtt: float, m: dict) -> dict:
    tok = next((m[k] for k in _TOK_KEYS if k in m), None)
    if tok is None and m.get("wall_s"):
        tok = m.get("emitted", 0) / m["wall_s"]
    cache = m["cache"] if isinstance(m.get("cache"), dict) else {}
    return {
        "mode": mode,
        "rtt_ms": rtt,
        "tok_s": tok,
        "ttft_s": m.get("ttft_s"),
        "passes_per_token": m.get("target_passes_per_token", m.get("passes_per_token")),
        "up_bytes_per_token": m.get("bytes_up_per_token"),
        "cache_hit_rate": cache.get("hit_rate"),
    }


VALIDATED = ("tok_s", "ttft_s", "passes_per_token", "up_bytes_per_token")


def validation_rows(sim_rows: Sequence[dict], live_rows: Sequence[dict]) -> list[dict]:
    """Sim vs live per (mode, RTT): both figures, sim / live, and the cache hit rates' difference in points."""
    out = []
    live = {(r["mode"], r["rtt_ms"]): r for r in live_rows}
    for s in sim_rows:
        lv = live.get((s["mode"], s["rtt_ms"]), {})
        row = {"mode": s["mode"], "rtt_ms": s["rtt_ms"]}
        for key in VALIDATED:
            a, b = s.get(key), lv.get(key)
            row[f"sim_{key}"], row[f"live_{key}"] = a, b
            row[f"ratio_{key}"] = round(a / b, 3) if (a is not None and b) else None
        a, b = s.get("cache_hit_rate"), lv.get("cache_hit_rate")
        row["sim_cache_hit_rate"], row["live_cache_hit_rate"] = a, b
        row["hit_rate_points"] = round(100 * (a - b), 1) if (a is not None and b is not None) else None
        out.append(row)
    return out


def max_error(rows: Sequence[dict], key: str = "tok_s") -> float | None:
    """max |sim/live - 1| over the rows that have both figures (a fraction)."""
    errs = [abs(r[f"ratio_{key}"] - 1.0) for r in rows if r.get(f"ratio_{key}") is not None]
    return max(errs) if errs else None


def format_validation(rows: Sequence[dict]) -> str:
    head = (
        f"{'mode':<14} {'rtt':>5} {'sim tok/s':>9} {'live tok/s':>10} {'sim/live':>8} {'sim ttft':>8} {'live ttft':>9} "
        f"{'sim pass/tok':>12} {'live pass/tok':>13} {'sim hit':>7} {'live hit':>8} {'up B/tok sim/live':>17}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['mode']:<14} {r['rtt_ms']:>5g} {_f(r['sim_tok_s'], '.2f'):>9} {_f(r['live_tok_s'], '.2f'):>10} "
            f"{_f(r['ratio_tok_s'], '.3f'):>8} {_f(r['sim_ttft_s'], '.3f'):>8} {_f(r['live_ttft_s'], '.3f'):>9} "
            f"{_f(r['sim_passes_per_token'], '.3f'):>12} {_f(r['live_passes_per_token'], '.3f'):>13} "
            f"{_f(r['sim_cache_hit_rate'], '.2f'):>7} {_f(r['live_cache_hit_rate'], '.2f'):>8} "
            f"{_f(r['ratio_up_bytes_per_token'], '.2f'):>17}"
        )
    return "\n".join(lines)
