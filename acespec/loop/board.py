"""The draft board: what a cloud-led session's edge has uploaded, and which of it agrees with the stream.

In a cloud-led session the cloud decodes without waiting and the edge drafts ahead of the stream. A
draft names `base`, the committed length its first token follows, and assumes the committed tokens up
to there; a chain is one path, a tree (the state cache's pre-drafted outcomes) holds alternatives at
a position. Before every step the cloud asks the board for `usable(committed, k)`: the longest path
through any held draft that agrees with every token committed since its base, cut to k tokens. A
draft that disagrees with the stream, or lies wholly behind it, is forgotten.

Pure bookkeeping (no model, no I/O), shared by every engine and by the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

Tokens: TypeAlias = Sequence[int] | np.ndarray  # token ids: a list, or the int array vLLM's proposer holds
SparseRow = tuple[tuple[int, float], ...]  # the wire's sparse q row: (token, prob) pairs


@dataclass
class BoardDraft:
    base: int  # committed length its first token follows
    tokens: tuple[int, ...]  # drafted ids, in topological order
    parents: tuple[int, ...] | None = None  # wire convention: 0 = extends base, j + 1 = extends token j; None = a chain
    q: tuple[SparseRow, ...] | None = None  # per token, the drafter's sparse q (rules that need q)
    children: dict[int, list[int]] = field(init=False, repr=False)  # node (-1 = base) -> its children, first = best

    def __post_init__(self) -> None:
        kids: dict[int, list[int]] = {}
        for i in range(len(self.tokens)):
            up = (i - 1) if self.parents is None else self.parents[i] - 1
            kids.setdefault(up, []).append(i)
        self.children = kids

    def follow(self, committed: Tokens) -> int | None:
        """The node this draft has reached at the committed tokens (-1 = its base), None if it disagrees."""
        if self.base > len(committed):  # assumes tokens the stream has not got (it was rolled back)
            return None
        node = -1
        for pos in range(self.base, len(committed)):
            want = committed[pos]
            child = next((c for c in self.children.get(node, ()) if self.tokens[c] == want), None)
            if child is None:
                return None
            node = child
        return node

    def path_from(self, node: int, k: int) -> list[int]:
        """Up to k draft indices below `node`, taking each node's first (most likely) child."""
        path: list[int] = []
        while len(path) < k:
            kids = self.children.get(node)
            if not kids:
                break
            node = kids[0]
            path.append(node)
        return path


@dataclass
class BoardStats:
    received: int = 0  # drafts put on the board
    refused_ahead: int = 0  # drafts whose base was past the committed length (an edge cannot know that prefix)
    forgotten: int = 0  # drafts dropped: they disagreed with the stream, fell behind it, or were pushed out
    steps: int = 0  # `usable` calls
    usable_steps: int = 0  # of which had a draft that agreed with the stream


class DraftBoard:
    def __init__(self, max_drafts: int = 8) -> None:
        self.max_drafts = max_drafts  # drafts held per session (the newest win): bounds a hostile edge's memory
        self.drafts: list[BoardDraft] = []
        self.stats = BoardStats()

    def put(self, d: BoardDraft, committed_len: int) -> bool:
        """Hold a new draft; refuse one built past the committed length (no edge can have seen it)."""
        if d.base > committed_len or not d.tokens:
            self.stats.refused_ahead += d.base > committed_len
            return False
        if d.base + len(d.tokens) <= committed_len:  # wholly behind the stream on arrival: never walked
            self.stats.forgotten += 1
            return False
        self.stats.received += 1
        self.drafts.append(d)
        if len(self.drafts) > self.max_drafts:
            self.stats.forgotten += len(self.drafts) - self.max_drafts
            del self.drafts[: len(self.drafts) - self.max_drafts]
        return True

    def usable(self, committed: Tokens, k: int) -> tuple[list[int], list[SparseRow] | None]:
        """The longest agreeing continuation (at most k tokens) of any held draft, and its q rows when
        the draft carried them; drafts that disagree or have nothing left are forgotten."""
        self.stats.steps += 1
        best: tuple[BoardDraft, list[int]] | None = None
        keep = []
        for d in self.drafts:
            node = d.follow(committed)
            path = [] if node is None else d.path_from(node, max(k, 1))
            if not path:
                self.stats.forgotten += 1
                continue
            keep.append(d)
            # the longest wins; between equals the newest (it was drafted knowing more of the stream)
            if best is None or len(path) >= len(best[1]):
                best = (d, path)
        self.drafts = keep
        if best is None or k <= 0:
            return [], None
        self.stats.usable_steps += 1
        d, path = best
        path = path[:k]
        return [d.tokens[i] for i in path], (None if d.q is None else [d.q[i] for i in path])

    def reach(self, committed: Sequence[int], k: int) -> int:
        """How many tokens `usable` would give now, without counting a step or forgetting a draft."""
        best = 0
        for d in self.drafts:
            node = d.follow(committed)
            if node is not None:
                best = max(best, len(d.path_from(node, max(k, 1))))
        return min(best, k)

    def clear(self) -> None:
        self.stats.forgotten += len(self.drafts)
        self.drafts.clear()
