"""Draft-depth policies: how many tokens to draft in the next block.

Interface: `next_k() -> int` before drafting, `update(drafted, accepted, **obs)` after each verdict,
`observe(**obs)` for measurements that come without one (e.g. whether the state cache caught a verdict).
`FixedDepth` and `PlusTwoMinusOne` are the baselines; the cost-model controller lives in `controller.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from acespec.control.controller import DepthController
from acespec.control.policy import DepthPolicy

__all__ = ["DEFAULT_PASS_BUDGET", "DepthPolicy", "FixedDepth", "PlusTwoMinusOne", "make_policy"]


@dataclass
class FixedDepth(DepthPolicy):
    k: int = 4  # tokens per block, every block

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"draft depth must be >= 0, got {self.k}")
        self.name = f"fixed:k={self.k}"

    def next_k(self) -> int:
        return self.k


@dataclass
class PlusTwoMinusOne(DepthPolicy):
    """+2 after a fully accepted block, -1 otherwise (the common heuristic schedule)."""

    k: int = 4  # starting depth
    k_min: int = 1  # never draft fewer
    k_max: int = 16  # never draft more

    def __post_init__(self) -> None:
        self.name = "plus2minus1"

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, **obs: float) -> None:
        if drafted == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted >= drafted else max(self.k_min, self.k - 1)


DEFAULT_PASS_BUDGET = 0.25  # target verify passes per token the edge's controller keeps to (issue 5's bar)


def make_policy(
    spec: str,
    k: int,
    *,
    pipelined: bool = False,
    auto_window: bool = False,
    pass_budget: float = DEFAULT_PASS_BUDGET,
    max_window: int = 8,
    k_min: int = 1,
) -> DepthPolicy:
    """`fixed` / `plus2minus1` (the +2/-1 schedule; `adaptive` is its old name) / `controller` (the
    cost-model controller; the keyword arguments say how the loop runs and what the cloud grants, see
    `ControllerConfig`; `k_min` = 0 lets it take plain steps where no block pays, which only a loop with
    the target at hand should: over a WAN a one-token round trip is slower than the cloud streaming alone)."""
    if spec == "fixed":
        return FixedDepth(k)
    if spec in ("plus2minus1", "adaptive"):  # adaptive: its old name
        return PlusTwoMinusOne(k)
    if spec == "controller":
        return DepthController(
            k_init=max(1, k),
            pipelined=pipelined,
            auto_window=pipelined and auto_window,
            pass_budget=pass_budget,
            max_window=max_window,
            k_min=k_min,
        )
    raise ValueError(f"unknown depth policy {spec!r}; choose fixed, plus2minus1 or controller")
