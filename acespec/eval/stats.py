"""Paired bootstrap intervals for the length-inflation harness: pure functions on numpy arrays.

Every arm is compared with `strict` on the same (prompt, seed) pairs, so the unit of resampling is the
pair: one resample draws n pair indices with replacement and recomputes each statistic on both arms'
values at those indices. Prompt-to-prompt variance (the largest by far: one prompt asks for a haiku,
the next for an essay) then cancels within each resample instead of widening the interval.

All statistics of one report are computed on the *same* index matrix (`resample_indices(n, B, seed)`),
so a report is deterministic given its seed, and intervals of different arms over the same pairs are
drawn from the same resamples.

Intervals are percentiles of the bootstrap distribution (2.5% and 97.5% for 95%). With few pairs the
percentile interval is too narrow (it covers about 90% at n = 10), which is one more reason the
verdicts need n >= 30.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BootstrapConfig:
    resamples: int = 4000  # B: enough that the 2.5% / 97.5% percentiles move < 0.005 between seeds
    level: float = 0.95  # two-sided coverage of every interval
    seed: int = 0  # the resample indices; a report is reproducible given it
    min_pairs: int = 2  # fewer pairs than this: no interval, verdict "inconclusive"


def resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:  # -> int[B, n]
    """B bootstrap resamples of n pair indices (with replacement)."""
    if n < 1 or resamples < 1:
        raise ValueError(f"need n >= 1 and resamples >= 1, got n={n}, resamples={resamples}")
    return np.random.default_rng([int(seed), 0xB007]).integers(0, n, size=(resamples, n))


def mean_samples(x: np.ndarray, idx: np.ndarray) -> np.ndarray:  # x: [n], idx: [B, n] -> [B]
    """The mean of x on every resample."""
    return np.asarray(x, dtype=np.float64)[idx].mean(axis=1)


def ratio_of_means(a: np.ndarray, b: np.ndarray, idx: np.ndarray) -> np.ndarray:  # a, b: [n], idx: [B, n] -> [B]
    """mean(a) / mean(b) on every resample (lambda, rounds and TTLT against strict). A resample whose
    denominator is 0 gives nan, which `interval` ignores."""
    num = mean_samples(a, idx)
    den = mean_samples(b, idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1.0), np.nan)


def pooled_gain(
    acc: np.ndarray, rounds: np.ndarray, acc_s: np.ndarray, rounds_s: np.ndarray, idx: np.ndarray
) -> np.ndarray:  # all: [n], idx: [B, n] -> [B]
    """(l + 1) / (l_strict + 1) on every resample, with l pooled as sum(accepted) / sum(rounds), the
    way the point estimate is computed (a run's l is weighted by its rounds, not counted once)."""

    def l_of(a: np.ndarray, r: np.ndarray) -> np.ndarray:
        sa = np.asarray(a, dtype=np.float64)[idx].sum(axis=1)
        sr = np.asarray(r, dtype=np.float64)[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(sr > 0, sa / np.where(sr > 0, sr, 1.0), np.nan)

    return (l_of(acc, rounds) + 1.0) / (l_of(acc_s, rounds_s) + 1.0)


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float] | None:  # samples: [B]
    """The percentile interval of a bootstrap distribution; None if no resample gave a number."""
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return None
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(s, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def verdict(ci: tuple[float, float] | None) -> str:
    """Net win from the interval of rounds against strict (target passes per answer): `win` when it
    lies wholly below 1, `loss` wholly above, `inconclusive` when it contains 1 (or there is none)."""
    if ci is None:
        return "inconclusive"
    lo, hi = ci
    if hi < 1.0:
        return "win"
    if lo > 1.0:
        return "loss"
    return "inconclusive"


def paired_intervals(rule: dict[str, np.ndarray], strict: dict[str, np.ndarray], cfg: BootstrapConfig) -> dict:
    """Intervals of one arm against strict over n paired (prompt, seed) runs.

    `rule` and `strict` hold arrays [n] aligned by pair: `length`, `accepted`, `rounds`, `wall_s`, and
    optionally `correct` (1.0 / 0.0, nan where unscored). Returns {statistic: (lo, hi) or None} for
    `lambda`, `gain`, `rounds_rel`, `ttlt_rel`, `accuracy`, `accuracy_delta` (rule minus strict, on
    the pairs scored in both), plus `verdict` and `pairs`."""
    n = len(rule["length"])
    out: dict = {"pairs": n}
    keys = ("lambda", "gain", "rounds_rel", "ttlt_rel", "accuracy", "accuracy_delta")
    if n < cfg.min_pairs:
        out.update({k: None for k in keys})
        out["verdict"] = "inconclusive"
        return out
    idx = resample_indices(n, cfg.resamples, cfg.seed)  # [B, n]
    out["lambda"] = interval(ratio_of_means(rule["length"], strict["length"], idx), cfg.level)
    out["gain"] = interval(
        pooled_gain(rule["accepted"], rule["rounds"], strict["accepted"], strict["rounds"], idx), cfg.level
    )
    out["rounds_rel"] = interval(ratio_of_means(rule["rounds"], strict["rounds"], idx), cfg.level)
    out["ttlt_rel"] = interval(ratio_of_means(rule["wall_s"], strict["wall_s"], idx), cfg.level)
    out["accuracy"] = out["accuracy_delta"] = None
    c, cs = rule.get("correct"), strict.get("correct")
    if c is not None:
        c = np.asarray(c, dtype=np.float64)
        out["accuracy"] = accuracy_interval(c, cfg)
        if cs is not None:
            cs = np.asarray(cs, dtype=np.float64)
            both = np.isfinite(c) & np.isfinite(cs)
            if both.sum() >= cfg.min_pairs:
                d = c[both] - cs[both]  # [m]: +1 rescued, -1 lost, 0 same
                out["accuracy_delta"] = interval(
                    mean_samples(d, resample_indices(len(d), cfg.resamples, cfg.seed)), cfg.level
                )
    out["verdict"] = verdict(out["rounds_rel"])
    return out


def accuracy_interval(
    correct: np.ndarray, cfg: BootstrapConfig
) -> tuple[float, float] | None:  # correct: [n], nan = unscored
    """Bootstrap interval of the share correct among the scored runs."""
    c = np.asarray(correct, dtype=np.float64)
    c = c[np.isfinite(c)]
    if c.size < cfg.min_pairs:
        return None
    return interval(mean_samples(c, resample_indices(len(c), cfg.resamples, cfg.seed)), cfg.level)


def mean_delta_interval(a: np.ndarray, b: np.ndarray, cfg: BootstrapConfig) -> tuple[float, float] | None:  # a, b: [n]
    """Interval of mean(a - b) over paired values (e.g. tokens inside the trace, rule minus strict)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size < cfg.min_pairs:
        return None
    return interval(mean_samples(d, resample_indices(len(d), cfg.resamples, cfg.seed)), cfg.level)
