"""The ceiling: the best tokens/s any schedule of a mode could reach on what this run measured.

A benchmark's ratio between two modes says which is faster, not how far either is from what the
hardware allows. The ceiling is that second number. It is computed from a calibration taken from the
same run's own sessions (`calibrate`): the target's pass times as the cloud reported them (every
`BlockVerdict.verify_us`, every cloud-led step's), fitted as t(k) = c0 + c1 k for a pass verifying k draft
tokens; the edge's drafting seconds per token; the link's measured round trip; and the per-token
acceptance a (the geometric law's estimate: tokens kept / (kept + refusals)). Then, with
E(k) = 1 + a + ... + a^k the tokens one pass of k drafts commits:

    cloud-only   1 / t(0)                             the target stepping without a gap
    sync         max_k E(k) / (t(k) + k d + rtt)        each block waits for its draft and its round trip
    pipelined    max_k>=1 E(k) / max(t(k), (k + 1) d)   the target never idle, the round trip hidden;
                                                        the edge drafts k tokens a pass and its guess
                                                        of the pass's bonus token (see below)
    cloud-led    max_k>=0 E(k) / max(t(k), k d)         the target never idle, the edge drafting k
                                                        ahead of the stream; a plain step when no draft pays

Why k + 1 for the edge-led pipeline: to keep the target fed, block n + 1 must leave the edge before
block n's verdict comes back, so it is built on the edge's own guess of block n's bonus token, and
that guess costs the drafter a pass like any draft token (the loop sends it as the block's first
token). A stop-and-wait edge is handed the bonus and drafts k a block; no schedule that hides the
round trip can. (The depth controller's cost model counts the same k + 1, `control/controller.py`.)

Everything the serving engine, the wire and Python add beyond the pass itself is left out on purpose:
that is what a share below 1 is made of. Each benchmark compares the ceiling with its steady rate
(`RunStats.steady`: tokens committed after the first commit, over the time from it to the last): the
ceiling is a stream's steady rate, and the prompt's prefill before the first token is the same cloud
work in every mode. It is a model, not a
proof: acceptance that varies by position commits a little more per block than the geometric law with
the same mean says, and the pass times are medians, so a run at its ceiling can read a few hundredths
above 1 (replayed traces, whose drafts are right in runs, read up to about 1.1). `acespec demo`,
`bench acespec` / `bench wan`, `bench tenants` (per session, on its cell's shared ticks) and `bench sim`
print it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from acespec.loop.stats import RunStats

MODES = ("cloud-only", "sync", "pipelined", "cloud-led", "auto")
MIN_PASSES = 5  # passes at one k before their median stands for t(k) instead of the line


@dataclass(frozen=True)
class Calibration:
    pass_c0_s: float  # a target pass verifying k draft tokens costs c0 + c1 k seconds ...
    pass_c1_s: float  # ... as the cloud reported its passes in this run
    draft_s: float  # edge seconds per drafted token (0: not measured, drafting taken as free)
    rtt_s: float  # the link's round trip
    accept: float  # per-token acceptance, the geometric law's estimate
    k_max: int = 16  # deepest block the maximisation considers
    measured: tuple[
        tuple[int, float], ...
    ] = ()  # (k, median pass) where the run had enough passes at k: used before the line
    seen: tuple[int, ...] = ()  # the depths the run's passes verified (empty: a hand-made calibration, every k priced)

    def priced(self, k: int) -> bool:
        """Whether the run's passes price a pass of k drafts: with passes at one depth only, the line's
        slope is unknown (taken as 0), so only that depth is; with two or more, the line prices any."""
        return not self.seen or len(self.seen) >= 2 or k in self.seen

    def pass_s(self, k: int) -> float:
        for kk, t in self.measured:
            if kk == k:
                return t
        return max(1e-9, self.pass_c0_s + self.pass_c1_s * k)


def expected_tokens(k: int, a: float) -> float:
    """Tokens one pass of k drafts commits when each draft token is kept with probability a, in order."""
    a = min(max(a, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def ceiling(mode: str, cal: Calibration) -> tuple[float, int]:
    """(tokens/s, the K that reaches it) for `mode` on `cal`; (0.0, 0) when the run priced no pass the
    mode could make (e.g. cloud-only's plain step in a run whose every pass verified 4 drafts)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} for a ceiling: choose from {', '.join(MODES)}")
    mode = "cloud-led" if mode == "auto" else mode  # auto is cloud-led on the wire: the same schedules
    if mode == "cloud-only":
        return (1.0 / cal.pass_s(0), 0) if cal.priced(0) else (0.0, 0)
    best, best_k = 0.0, 0
    for k in range(0 if mode in ("cloud-led", "sync") else 1, cal.k_max + 1):
        if not cal.priced(k):
            continue
        e = expected_tokens(k, cal.accept)
        if mode == "sync":
            rate = e / (cal.pass_s(k) + k * cal.draft_s + cal.rtt_s)
        elif mode == "pipelined":
            rate = e / max(cal.pass_s(k), (k + 1) * cal.draft_s)
        else:
            rate = e / max(cal.pass_s(k), k * cal.draft_s)
        if rate > best:
            best, best_k = rate, k
    return best, best_k


def calibrate(runs: Iterable[RunStats], rtt_s: float | None = None, k_max: int = 16) -> Calibration | None:
    """A calibration from the runs of one benchmark (all modes pooled: a cloud-led run's plain steps
    price t(0), an edge-led run's blocks the deeper passes); None when no run reported a pass.
    `rtt_s`: the link's round trip, else the runs' own measurement (`link["rtt_ms_mean"]`)."""
    runs = list(runs)
    passes = [(k, s) for r in runs for k, s in r.passes if s > 0]
    if not passes:
        return None
    ks = np.asarray([k for k, _ in passes], float)
    ts = np.asarray([s for _, s in passes], float)
    # the median pass at each k, then a line through those (for the k the run never verified): one slow
    # pass (a prefill in the same tick, the machine's hiccup) must not tilt the fit
    uk = np.unique(ks)
    med = np.asarray([np.median(ts[ks == k]) for k in uk])
    if len(uk) >= 2:
        c1, c0 = np.polyfit(uk, med, 1, w=np.sqrt([np.sum(ks == k) for k in uk]))
        c1 = max(0.0, float(c1))  # a pass never gets cheaper with more rows
        c0 = float(np.median(med - c1 * uk))
    else:
        c0, c1 = float(med[0]), 0.0
    # the cheapest drafting any run saw, per token the drafter drafted (a doomed block's, a cloud-led
    # chain's that the stream passed: per verified token, a run's waste read as a slower drafter and
    # put the ceiling below what the run reached, 1.17 of it on the simulator's NPU profile); a
    # state cache's pre-drafting counts against its own run only
    drafting = [
        r.draft_s / (r.draft_tokens or r.drafted) for r in runs if (r.draft_tokens or r.drafted) > 0 and r.draft_s > 0
    ]
    judged = sum(r.accepted + r.rejections for r in runs)
    accept = sum(r.accepted for r in runs) / judged if judged else 0.0
    if rtt_s is None:
        rtts = [float(v) for r in runs if (v := r.link.get("rtt_ms_mean"))]
        rtt_s = float(np.median(rtts)) / 1e3 if rtts else 0.0
    # where a k has passes enough for a median of its own, it is used as it is: a CPU's cost is no line
    # (on the default pair a plain step is cheaper than the line's intercept says)
    measured = tuple((int(k), float(m)) for k, m in zip(uk, med) if np.sum(ks == k) >= MIN_PASSES)
    return Calibration(
        pass_c0_s=max(0.0, c0),
        pass_c1_s=c1,
        draft_s=min(drafting) if drafting else 0.0,
        rtt_s=rtt_s,
        accept=accept,
        k_max=k_max,
        measured=measured,
        seen=tuple(int(k) for k in uk),
    )


def for_run(cal: Calibration, run: RunStats) -> Calibration:
    """`cal` with `run`'s own acceptance and round trip where it measured them: a mode is held to the
    drafts it verified (a state cache's hits, a controller's shorter blocks), on the run's shared passes."""
    judged = run.accepted + run.rejections
    rtt = run.link.get("rtt_ms_mean")
    return replace(cal, accept=run.accepted / judged if judged else cal.accept, rtt_s=rtt / 1e3 if rtt else cal.rtt_s)


def against_ceiling(runs: Sequence[RunStats], mode: str, cal: Calibration) -> tuple[float, float, int]:
    """(ceiling tokens/s, steady rate / ceiling, the K of the first run's ceiling) over `runs` of one
    mode: each run is held to its own acceptance and round trip, and the ceiling's time is summed over
    the runs as their own times are (tokens / time, not a mean of rates)."""
    emitted = sum(r.emitted for r in runs)
    tops = [ceiling(mode, for_run(cal, r)) for r in runs]
    ceil_s = sum(r.emitted / top for r, (top, _) in zip(runs, tops) if top > 0)
    n = sum(r.steady()[0] for r in runs)
    dt = sum(r.steady()[1] for r in runs)
    if ceil_s <= 0 or emitted <= 0:
        return 0.0, 0.0, 0
    top = emitted / ceil_s
    return top, (n / dt) / top if dt > 0 else 0.0, tops[0][1]


def describe(cal: Calibration | None) -> str:
    """One line a reader can check the ceilings against."""
    if cal is None:
        return "ceiling: no target pass was reported in this run"
    return (
        f"ceiling calibration (this run's own): target pass {1e3 * cal.pass_s(0):.1f} ms plain, "
        f"{1e3 * cal.pass_c0_s:.1f} + {1e3 * cal.pass_c1_s:.2f} k ms with k drafts;\n"
        f"      drafting {1e3 * cal.draft_s:.2f} ms/token, RTT {1e3 * cal.rtt_s:.0f} ms, acceptance {cal.accept:.3f}"
    )
