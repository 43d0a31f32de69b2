"""N replay edges at once against one cloud: one cell of `acespec bench tenants`, shared with the vLLM
tenants bench (`vllm.py`) and the demo's capacity table; and the parsers of the benches' `--n` / `--modes`.
"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np

from acespec.bench.replay_edge import EdgeRun, ReplayEdge
from acespec.loop.stats import draft_timeliness
from acespec.net.profile import profile_from_args
from acespec.net.wan import WanProxyThread
from acespec.sim.ceiling import against_ceiling, calibrate
from acespec.sim.trace import TraceSet

MODES = ("acespec", "cloud-led", "sync", "cloud-only")
CEILING_MODE = {
    "acespec": "pipelined",
    "cloud-led": "cloud-led",
    "sync": "sync",
    "cloud-only": "cloud-only",
}  # sim/ceiling.py's
DEFAULT_TRACES = "humaneval-n16-t64.json"  # bundled with the package (acespec/sim/traces/)


def bundled_traces(path: str = DEFAULT_TRACES):
    """Acceptance traces to replay: a file, or the name of one bundled with the package."""
    return TraceSet.load(path)


def _percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (a latency that was observed), nan for no samples."""
    return float(np.percentile(xs, 100 * q, method="nearest")) if xs else float("nan")


def run_edges(
    port: int,
    traces,
    mode: str,
    n: int,
    *,
    model_id: str,
    vocab: int,
    rule: str = "greedy",
    temperature: float = 0.0,
    max_tokens: int = 48,
    draft_s: float = 0.03,
    cap_s: float = 120.0,
    seed: int = 0,
    auth: bytes = b"",
    rtt_s: float = 0.0,
) -> dict:
    """N replay edges at once against the cloud listening on `port`; one table row (no engine figures).
    `rtt_s`: the link's round trip, for the cell's ceiling."""
    deadline = time.perf_counter() + cap_s
    edges = [
        ReplayEdge(
            port,
            traces[i % len(traces)],
            mode,
            rule=rule,
            temperature=temperature,
            seed=seed + i,
            max_tokens=max_tokens,
            draft_s=draft_s,
            model_id=model_id,
            vocab=vocab,
            deadline=deadline,
            auth=auth,
            rtt_s=rtt_s,
        )
        for i in range(n)
    ]
    out: list[EdgeRun | None] = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, edges[i].go())) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(cap_s + 60)
    wall = time.perf_counter() - t0
    runs = [r for r in out if r is not None]
    emitted = sum(len(r.tokens) for r in runs)
    # a session's first verdict waits for its own prompt's prefill: reported apart, as time to first verdict
    first = [r.first_s for r in runs if r.first_s == r.first_s]
    lat = [x for r in runs for x in r.latencies]
    # per session against its ceiling (sim/ceiling.py), on the passes this cell's own sessions reported
    # (each a tick shared with the others); cloud-only streams report none, so they have no ceiling here
    cal = calibrate((r.stats for r in runs), rtt_s=rtt_s)
    top, share, _ = against_ceiling([r.stats for r in runs], CEILING_MODE[mode], cal) if cal else (0.0, 0.0, 0)
    return {
        "mode": mode,
        "n": n,
        "rule": rule,
        "wall_s": round(wall, 3),
        "tokens": emitted,
        "first_p50_s": _percentile(first, 0.5),
        "first_max_s": max(first) if first else float("nan"),
        "agg_tok_s": emitted / wall if wall > 0 else 0.0,
        "per_session_tok_s": statistics.mean(len(r.tokens) / r.wall_s for r in runs if r.wall_s > 0) if runs else 0.0,
        "lat_p50_s": _percentile(lat, 0.5),
        "lat_p99_s": _percentile(lat, 0.99),
        "passes_per_token": (sum(r.rounds for r in runs) / emitted) if emitted else float("nan"),
        # cloud-led: the share of the streams' steps that had a usable draft
        "timeliness": draft_timeliness(r.stats for r in runs) if mode == "cloud-led" else None,
        "dropped": sum(r.dropped for r in runs),
        "finished": sum(r.finished for r in runs),
        "capped": sum(not r.finished for r in runs),
        "errors": [r.error for r in runs if r.error],
        "outputs": {r.prompt_id: r.tokens for r in runs},
        "ceiling_tok_s": top or None,
        "of_ceiling": share or None,
    }


def wan_port(stack, port: int, rtt_ms: float) -> int:
    """The port edges reach the server on `port` through: itself on loopback (0 ms), else the WAN
    emulator's `wan` profile at `rtt_ms` in front of it, closed with `stack`."""
    if rtt_ms <= 0:
        return port
    return stack.enter_context(
        WanProxyThread("127.0.0.1", 0, "127.0.0.1", port, profile_from_args("wan", rtt=rtt_ms))
    ).port


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in out):
        raise ValueError(f"every N must be >= 1, got {text!r}")
    return out


def _modes(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {', '.join(bad)}; use {', '.join(MODES)}")
    return out
