"""Typed records the loop, its scheduler, its cache planner and the transports share, and the loop's settings
(`LoopConfig`, which the scheduler reads too).

In-flight state is held in these, not in string-keyed dicts or bare tuples, so each field says what
it is and a reader can follow a block from drafting to its verdict.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class Outcome(NamedTuple):
    """One possible verdict of a block: (block seq, accepted count, next token). A plain tuple to the
    state cache, whose entries are keyed the same way."""

    seq: int
    accepted: int
    next_token: int


@dataclass
class Block:
    seq: int  # sequence number, increasing per session
    base: int  # committed length the block builds on
    tokens: list[int]  # overlap (guessed bonus of the previous block, if pipelined) + draft tokens
    q: np.ndarray | None = None  # [len(tokens), V] drafter rows, for rules that need q
    overlap: int = 0  # how many leading tokens are assumptions about the previous block
    doomed: bool = False  # a verdict already showed the assumptions it builds on were wrong
    alt_key: Outcome | None = None  # a branch: the outcome (seq, accepted, next) it continues
    top: list = field(default_factory=list)  # the drafter's candidates per token (for the state cache)
    sent_at: float = 0.0  # the loop's clock when it was sent
    cached: int = 0  # leading draft tokens (after the overlap) that the state cache had pre-drafted


@dataclass
class Disconnected:
    """What `recv` returns when the link to the target broke; the loop then calls `resume`."""

    reason: str = ""


@dataclass(frozen=True)
class LinkSample:
    """One block's round trip as the transport saw it (times on the loop's clock)."""

    sent_at: float  # the block was handed to the link
    arrival: float  # its verdict reached the edge
    verify_s: float  # the target's verify time, as it reported it
    bytes_up: int  # the block's frame bytes (0 where nothing is framed, e.g. in process)
    bytes_down: int  # the verdict's frame bytes
    tokens: int  # tokens the block carried (overlap included): what its bytes paid for

    @property
    def rtt_s(self) -> float:
        return max(0.0, self.arrival - self.sent_at - self.verify_s)


@dataclass
class InFlight:
    """The blocks sent and not yet answered, in send order (verdicts come back in that order), and the
    branch blocks among them by the outcome each continues."""

    blocks: deque[Block] = field(default_factory=deque)
    branches: dict[Outcome, Block] = field(default_factory=dict)

    def live(self) -> list[Block]:
        """The blocks the edge still counts on: not doomed, not branches (the target drops or skips
        those by itself, so they hold no place in the window)."""
        return [b for b in self.blocks if not b.doomed and b.alt_key is None]

    def clear(self) -> None:
        self.blocks.clear()
        self.branches.clear()


@dataclass(frozen=True)
class BonusGuess:
    """Sync mode with a cache: the drafter drafts one token past the block it sends. That token is its
    guess of the bonus, and its candidates let the planner weigh the full-accept outcomes."""

    token: int
    top: tuple | None  # (ids, probs) the drafter ranked at that position, or None if it kept none


@dataclass
class LoopConfig:
    mode: str = "sync"  # "sync" (stop-and-wait) or "pipelined"
    window: int = 2  # pipelined: most blocks in flight (the least, with auto_window)
    auto_window: bool = False  # pipelined: grow the window to cover the round trip (see Scheduler.window)
    max_window: int = 8  # auto_window's ceiling
    min_conf: float = 0.0  # stop a block early when q(x) drops below this (a policy with min_conf overrides it)
    max_tokens: int = 128  # generation budget (the target enforces it too)
    branches: bool = False  # send pre-drafted outcomes as branch blocks, so the target can continue past a rejection

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "pipelined"):
            raise ValueError(f"mode must be sync or pipelined, got {self.mode!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
