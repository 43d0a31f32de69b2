"""Run-time guards for relaxed verification (docs/research/rules.md, "Guards"): the net-win guard and budget forcing.

Net-win guard. A relaxed rule accepts more tokens per round (l) but can make the model write more
tokens (length ratio lambda = mean length under the rule / mean length under strict). It pays only if

    (l + 1) / (l_strict + 1) > lambda

so the guard keeps running estimates of l, l_strict and the two mean lengths per task type, and falls
back to `strict` while the inequality fails.

Budget forcing (Muennighoff et al. 2025, "s1"). When a reasoning trace (`<think> ...`) has used a
fraction of the generation budget, inject the end-of-thinking marker so the model still has budget
left to answer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# ------------------------------------------------------------------------------------------ net-win guard


@dataclass(frozen=True)
class NetWinConfig:
    strict_rule: str = "strict"  # the baseline that lambda and l_strict are measured on
    # Observations of *each* arm (per task type) before the estimate is trusted. Until then the guard
    # alternates relaxed, strict, relaxed, ... (then runs whichever arm is still short), so a fresh
    # task type gets its baseline quickly and deterministically.
    n_min: int = 8
    # Weight of a new observation in the moving averages, so the estimate follows a drifting workload
    # (~ the last 1/0.1 = 10 requests). The first 1/ema_weight observations are plainly averaged, so
    # early estimates are not biased towards the first request.
    ema_weight: float = 0.1
    # After warm-up, the probability of running the arm the estimate did not pick. Without it the
    # losing arm's estimate would freeze and the guard could never notice that lengths recovered.
    explore: float = 0.1
    # Back from strict to relaxed only when gain > lambda * (1 + hysteresis): no flapping on noise.
    # (Falling back to strict uses DESIGN's test exactly: gain <= lambda.)
    hysteresis: float = 0.02
    seed: int = 0  # exploration draws come from a per-task-type rng derived from (seed, task_type)

    def __post_init__(self) -> None:
        if self.n_min < 1:
            raise ValueError(f"n_min must be >= 1, got {self.n_min}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"explore must be in [0, 1), got {self.explore}")
        if self.hysteresis < 0.0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")


@dataclass
class _Arm:
    """Moving averages for one rule on one task type."""

    n: int = 0
    length: float = 0.0  # output tokens per request
    accepted: float = 0.0  # mean accepted draft tokens per round (l)

    def update(self, length: float, accepted: float, weight: float) -> None:
        self.n += 1
        w = max(weight, 1.0 / self.n)  # plain mean for the first 1/weight observations, then EMA
        self.length += w * (length - self.length)
        self.accepted += w * (accepted - self.accepted)


@dataclass(frozen=True)
class NetWinEstimate:
    lam: float  # length ratio: mean length under the relaxed rule / under strict
    gain: float  # (l + 1) / (l_strict + 1): tokens per round, relaxed over strict
    l_relaxed: float
    l_strict: float
    n_relaxed: int
    n_strict: int

    @property
    def net_win(self) -> bool:
        return self.gain > self.lam


@dataclass
class _TaskState:
    relaxed: _Arm = field(default_factory=_Arm)
    strict: _Arm = field(default_factory=_Arm)
    relaxed_on: bool = True  # the arm the estimate currently picks (after warm-up)
    warmup_calls: int = 0
    rng: np.random.Generator = field(default_factory=np.random.default_rng)  # NetWinGuard seeds its own


class NetWinGuard:
    """Chooses, per task type, between one relaxed rule and strict; see the module docstring.

    Feed it `observe(...)` after every request (under either rule) and ask `use_relaxed(task_type)` (or
    `rule_for`) before each. The decision is deterministic given the seed and the sequence of calls for
    that task type.
    """

    def __init__(self, relaxed_rule: str, config: NetWinConfig | None = None) -> None:
        self.relaxed_rule = str(relaxed_rule)
        self.config = config or NetWinConfig()
        if self.relaxed_rule == self.config.strict_rule:
            raise ValueError("the relaxed rule and the strict baseline must differ")
        self._tasks: dict[str, _TaskState] = {}

    def _state(self, task_type: str) -> _TaskState:
        st = self._tasks.get(task_type)
        if st is None:
            # crc32, not hash(): str hashes change between processes, and decisions must not
            key = zlib.crc32(str(task_type).encode("utf-8"))
            st = self._tasks[task_type] = _TaskState(rng=np.random.default_rng([self.config.seed, key]))
        return st

    def observe(self, task_type: str, rule_name: str, output_length: float, accepted_per_round: float) -> None:
        """Record one finished request: its rule, output length (tokens) and mean accepted per round."""
        if output_length < 0 or accepted_per_round < 0:
            raise ValueError("output_length and accepted_per_round must be >= 0")
        st = self._state(task_type)
        if rule_name == self.relaxed_rule:
            st.relaxed.update(output_length, accepted_per_round, self.config.ema_weight)
        elif rule_name == self.config.strict_rule:
            st.strict.update(output_length, accepted_per_round, self.config.ema_weight)
        else:
            raise ValueError(
                f"guard compares {self.relaxed_rule!r} with {self.config.strict_rule!r}, not {rule_name!r}"
            )
        # The exploited arm changes only on observations, never on queries, so asking is side-effect free.
        est = self.estimate(task_type)
        if est is None or min(est.n_relaxed, est.n_strict) < self.config.n_min:
            return
        if st.relaxed_on and not est.net_win:
            st.relaxed_on = False
        elif not st.relaxed_on and est.gain > est.lam * (1.0 + self.config.hysteresis):
            st.relaxed_on = True

    def estimate(self, task_type: str) -> NetWinEstimate | None:
        """The current estimate, or None until both arms have at least one observation."""
        st = self._tasks.get(task_type)
        if st is None or st.relaxed.n == 0 or st.strict.n == 0:
            return None
        lam = st.relaxed.length / st.strict.length if st.strict.length > 0 else math.inf
        gain = (st.relaxed.accepted + 1.0) / (st.strict.accepted + 1.0)
        return NetWinEstimate(lam, gain, st.relaxed.accepted, st.strict.accepted, st.relaxed.n, st.strict.n)

    def prefers_relaxed(self, task_type: str) -> bool:
        """The estimate's choice without exploration (True during warm-up: the relaxed rule is presumed)."""
        return self._state(task_type).relaxed_on

    def use_relaxed(self, task_type: str) -> bool:
        """Whether the next request of this task type should run the relaxed rule."""
        st = self._state(task_type)
        n_min = self.config.n_min
        if st.relaxed.n < n_min or st.strict.n < n_min:  # warm-up: collect both arms
            st.warmup_calls += 1
            if st.relaxed.n >= n_min:
                return False
            if st.strict.n >= n_min:
                return True
            return st.warmup_calls % 2 == 1  # relaxed first, then alternate
        choice = st.relaxed_on
        if self.config.explore > 0.0 and st.rng.random() < self.config.explore:
            choice = not choice
        return choice

    def rule_for(self, task_type: str) -> str:
        return self.relaxed_rule if self.use_relaxed(task_type) else self.config.strict_rule


# ------------------------------------------------------------------------------------------ budget forcing

Tag = str | tuple[int, ...]


def _as_tag(tag: str | int | Sequence[int]) -> Tag:
    if isinstance(tag, str):
        return tag
    if isinstance(tag, (int, np.integer)):
        return (int(tag),)
    return tuple(int(t) for t in tag)


def _rfind(seq: str | Sequence[int], tag: Tag) -> int:
    """Start of the last occurrence of tag in seq, or -1. Works for text and for token-id lists."""
    if isinstance(seq, str):
        if not isinstance(tag, str):
            raise TypeError("a text sequence needs a text tag, not token ids")
        return seq.rfind(tag)
    n = len(tag)
    for start in range(len(seq) - n, -1, -1):
        if tuple(seq[start : start + n]) == tag:
            return start
    return -1


def _ends_with_partial(seq: str | Sequence[int], tag: Tag) -> bool:
    """Whether seq ends with a proper, non-empty prefix of tag (the model may be writing it now)."""
    for m in range(1, len(tag)):
        if len(seq) >= m and tuple(seq[len(seq) - m :]) == tuple(tag[:m]):
            return True
    return False


@dataclass
class BudgetForcer:
    """Decides when to force the end of a reasoning trace. One instance per generation.

    Call `check(generated, n_tokens)` after each step. It returns the marker to append (the close tag
    unless `marker` is set) exactly once: the first time the generated sequence is inside a trace
    (an open tag with no close tag after it) and n_tokens >= `threshold` = ceil(fraction * budget).
    It never fires before a trace opens or after it closes, and waits while the text ends with a
    partial close tag (the model is closing the trace itself).

    `generated` is either decoded text (tags are strings; the engine passes its own token count, since
    only the tokenizer can count tokens) or a list of token ids (tags are ids or id sequences; the
    count defaults to the list's length). n_tokens counts all generated tokens, not only the trace's:
    the point is to leave (1 - fraction) of the generation budget for the answer.
    """

    budget: int
    fraction: float = 0.85
    open_tag: str | int | Sequence[int] = "<think>"
    close_tag: str | int | Sequence[int] = "</think>"
    marker: str | int | Sequence[int] | None = None  # what to inject; None = close_tag
    # Chat templates that end the prompt with the open tag (e.g. DeepSeek-R1, Qwen3 thinking mode):
    # the generated part is then inside a trace from its first token.
    opened_in_prompt: bool = False
    fired: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        self.open_tag = _as_tag(self.open_tag)
        self.close_tag = _as_tag(self.close_tag)
        self.marker = self.close_tag if self.marker is None else _as_tag(self.marker)
        if not self.open_tag or not self.close_tag:
            raise ValueError("open_tag and close_tag must be non-empty")
        if isinstance(self.open_tag, str) != isinstance(self.close_tag, str):
            raise ValueError("open_tag and close_tag must both be text or both be token ids")

    @property
    def threshold(self) -> int:
        """Generated-token count at which the trace is cut: ceil(fraction * budget), at least 1."""
        # round first: 0.07 * 100 is 7.000000000000001 in floating point, and must give 7, not 8
        return max(1, math.ceil(round(self.fraction * self.budget, 9)))

    def in_trace(self, generated: str | Sequence[int]) -> bool:
        """Whether `generated` ends inside an open, unclosed reasoning trace."""
        o = _rfind(generated, _as_tag(self.open_tag))
        c = _rfind(generated, _as_tag(self.close_tag))
        if o < 0 and not self.opened_in_prompt:
            return False  # no trace yet
        if c < 0:
            return True  # opened (here or in the prompt) and never closed
        return o > c  # closed at c; open again only if re-opened after it

    def check(self, generated: str | Sequence[int], n_tokens: int | None = None) -> Tag | None:
        """The marker to inject now, or None. See the class docstring."""
        if self.fired:
            return None
        text_mode = isinstance(generated, str)
        if text_mode != isinstance(self.open_tag, str):
            kind = "text" if isinstance(self.open_tag, str) else "token ids"
            raise TypeError(f"this forcer's tags are {kind}; pass generated {kind}")
        if n_tokens is None:
            if text_mode:
                raise ValueError("text view: pass n_tokens (the engine's count of generated tokens)")
            n_tokens = len(generated)
        if n_tokens < self.threshold or not self.in_trace(generated):
            return None
        if _ends_with_partial(generated, _as_tag(self.close_tag)):
            return None  # the model is writing the close tag itself; look again next step
        self.fired = True
        return _as_tag(self.close_tag if self.marker is None else self.marker)

    def reset(self) -> None:
        """Reuse the instance for a new generation."""
        self.fired = False
