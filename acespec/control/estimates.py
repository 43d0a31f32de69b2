"""The estimators under the depth controllers (`controller.py`, `lead.py`): the expected tokens a drafted block
emits given per-position acceptance, a bias-corrected EMA, and the online fit of a verification's cost
against the tokens it verifies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def expected_tokens(accept: Sequence[float] | float, k: int) -> float:
    """E[K] = 1 + sum_{j=1..K} prod_{i<j} a_i: expected tokens a round emits when K tokens are drafted.

    `accept` is the per-position conditional acceptance a_0, a_1, ... (at least K values), or one
    number for a constant a, in which case this equals (1 - a^(K+1)) / (1 - a)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    a = (
        np.full(k, float(accept))
        if isinstance(accept, (int, float, np.number))
        else np.asarray(accept, dtype=float)[:k]
    )
    if len(a) < k:
        raise ValueError(f"need {k} acceptance values, got {len(a)}")
    return float(1.0 + np.sum(np.cumprod(a)))


class _Ema:
    """Bias-corrected exponential moving average: the first sample is taken as is."""

    __slots__ = ("w", "s", "n", "prior")

    def __init__(self, w: float, prior: float) -> None:
        self.w, self.s, self.n, self.prior = w, 0.0, 0.0, prior

    def add(self, x: float) -> None:
        self.s = (1.0 - self.w) * self.s + self.w * x
        self.n = (1.0 - self.w) * self.n + self.w

    @property
    def value(self) -> float:
        return self.s / self.n if self.n > 0.0 else self.prior

    @property
    def seen(self) -> bool:
        return self.n > 0.0


class VerifyTimeFit:
    """Online least squares with forgetting for t_v(n) = c0 + c1 n (n = tokens verified).

    Minimises sum_t lam^(age_t) (y_t - c0 - c1 n_t)^2 + rho [(c0 - p0)^2 + (c0 + c1 N - p0 - p1 N)^2]:
    the prior line (p0, p1) as two pseudo-observations at n = 0 and n = N with weight rho. Plain steps
    (n = 0) and blocks (n > 0) each age only with their own kind: a controller taking plain steps
    keeps what its last blocks measured of a row's cost (aged by every step, a run of plain steps
    forgot it within ~1 / (1 - forget) steps and brought a block back to re-measure it)."""

    def __init__(
        self, c0: float, c1: float, *, forget: float = 0.98, prior_weight: float = 1e-3, n_ref: float = 16.0
    ) -> None:
        self.p0, self.p1 = float(c0), float(c1)
        self.forget, self.rho, self.n_ref = float(forget), float(prior_weight), float(max(n_ref, 1.0))
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0  # blocks (n > 0)
        self.sw0 = self.sy0 = 0.0  # plain steps (n = 0)
        self.count = 0
        self.c0, self.c1 = self.p0, self.p1

    def add(self, n: float, y: float) -> None:
        lam = self.forget
        if n == 0:
            self.sw0 = lam * self.sw0 + 1.0
            self.sy0 = lam * self.sy0 + y
        else:
            self.sw = lam * self.sw + 1.0
            self.sx = lam * self.sx + n
            self.sy = lam * self.sy + y
            self.sxx = lam * self.sxx + n * n
            self.sxy = lam * self.sxy + n * y
        self.count += 1
        self._solve()

    @property
    def has_slope(self) -> bool:
        """Both plain steps and blocks measured: the line's two ends are data, not the prior."""
        return self.sw0 > 0.0 and self.sw > 0.0

    def _solve(self) -> None:
        rho, N = self.rho, self.n_ref
        y0, yN = self.p0, self.p0 + self.p1 * N
        sw, sx, sy = self.sw + self.sw0 + 2 * rho, self.sx + rho * N, self.sy + self.sy0 + rho * (y0 + yN)
        sxx, sxy = self.sxx + rho * N * N, self.sxy + rho * N * yN
        det = sw * sxx - sx * sx
        if det > 1e-12 * max(1.0, sw * sxx):
            self.c1 = (sw * sxy - sx * sy) / det
            self.c0 = (sy - self.c1 * sx) / sw
        elif sw > 0:  # every sample at one n and no prior weight: keep the prior slope through the mean
            self.c1 = self.p1
            self.c0 = (sy - self.c1 * sx) / sw

    def predict(self, n: np.ndarray | float) -> np.ndarray | float:
        return max(self.c0, 0.0) + max(self.c1, 0.0) * np.asarray(n, dtype=float)
