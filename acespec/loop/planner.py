"""Which verdict outcomes the state cache should pre-draft, and how much each is worth.

The cache (`acespec.draft.cache.StateCache`) drafts and stores; this planner decides what it gets
asked for. While blocks are in flight it queues the likely outcomes of each live block, weighted by
the chance that the block's own assumptions hold, and it answers the one value question the
scheduler cannot: is a pre-draft step worth more than drafting the next block ahead?
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from acespec.loop.records import Block, BonusGuess
from acespec.loop.stats import RunStats

DEFAULT_ACCEPT = 0.7  # acceptance assumed before any verdict


@dataclass(frozen=True)
class ChainLink:
    """One step along the live blocks: `block`, the block after it (`nxt`), that block's guessed bonus
    candidates (`guess`), and `prior` = P(every block before `block` accepted in full with the bonus
    the edge guessed). The last link has block None: its prior is what drafting a new block is worth."""

    block: Block | None
    nxt: Block | None
    guess: tuple | None  # (ids, probs) the drafter ranked for the bonus `nxt` starts with
    prior: float


class CachePlanner:
    def __init__(self, cache, stats: RunStats) -> None:
        self.cache = cache  # a draft.cache.StateCache
        self.stats = stats
        self.planned: set[int] = set()  # blocks whose outcomes the cache has queued (blocks in flight only)
        self.guesses: dict[int, BonusGuess] = {}  # sync mode: the bonus guess drafted past each block

    def forget(self, seq: int) -> None:
        """Block `seq` is answered: nothing more to plan for it."""
        self.planned.discard(seq)
        self.guesses.pop(seq, None)

    def clear(self) -> None:
        self.planned.clear()
        self.guesses.clear()

    def accept_estimates(self) -> list[float]:
        """Conditional acceptance per block position, P(accept i | accepted 0..i-1), Laplace-smoothed."""
        pa, pd = self.stats.pos_accepted, self.stats.pos_drafted
        return [(pa[i] + 1) / ((pa[i - 1] if i else pd[0]) + 2) for i in range(len(pa))] or [DEFAULT_ACCEPT]

    def chain(self, live: Sequence[Block], accept: Sequence[float]) -> Iterator[ChainLink]:
        """The live blocks in order, each with the prior of its assumptions (see `ChainLink`)."""
        prior = 1.0
        for j, b in enumerate(live):
            nxt = live[j + 1] if j + 1 < len(live) else None
            guess = nxt.top[0] if nxt is not None and nxt.overlap and nxt.top and nxt.top[0] is not None else None
            yield ChainLink(b, nxt, guess, prior)
            for i in range(len(b.tokens) - b.overlap):
                prior *= accept[min(i, len(accept) - 1)]
            if guess is not None and nxt is not None:  # a guess is the next block's first token
                ids, probs = guess
                hit = probs[ids == nxt.tokens[0]]
                prior *= float(hit[0]) if len(hit) else 0.0
        yield ChainLink(None, None, None, prior)

    def plan(self, live: Sequence[Block], spec: Sequence[int], committed: Sequence[int], depth: int) -> None:
        """Queue the likely outcomes of the live blocks in flight, oldest first, one block per call.
        A later block's outcomes can only happen if every block before it is accepted in full with the
        bonus the edge guessed, so they are weighted by that probability in the cache's one queue:
        idle time goes to the most probable outcomes, whichever block they belong to. (Planning only
        the oldest block left nothing drafted for the next one, whose verdict comes right after.)
        `depth`: tokens to pre-draft for the likeliest outcomes (the depth the next block will have)."""
        if all(b.seq in self.planned for b in live):
            return  # the common case on every pass of the wait loop: nothing new to plan
        accept = self.accept_estimates()
        for link in self.chain(live, accept):
            if link.prior < self.cache.cfg.min_prob:
                return
            b = link.block
            if b is not None and b.seq not in self.planned:
                if b.top:
                    self._plan_block(link, accept, spec, committed, depth)
                return

    def _plan_block(
        self, link: ChainLink, accept: list[float], spec: Sequence[int], committed: Sequence[int], depth: int
    ) -> None:
        b = link.block
        assert b is not None, "only a link with a block is planned"
        self.planned.add(b.seq)
        rows = list(b.top[b.overlap :])
        draft = b.tokens[b.overlap :]
        bonus_guess = None
        if link.guess is not None and link.nxt is not None:  # a guess comes from the next block
            bonus_guess = link.nxt.tokens[0]  # already in flight: not worth a cache entry
            rows.append(link.guess)
        elif b.seq in self.guesses and self.guesses[b.seq].top is not None:
            rows.append(self.guesses[b.seq].top)
        committed_then = spec[: b.base + b.overlap] if b.base + b.overlap <= len(spec) else committed
        self.cache.plan_block(
            b.seq, list(committed_then), draft, rows, accept, bonus_guess=bonus_guess, prior=link.prior, depth=depth
        )

    def outcomes_first(self, live: Sequence[Block]) -> bool:
        """Should the edge pre-draft before drafting the next block? Each is worth the probability that
        its work gets used: the next batched pre-draft step, the total probability of the outcomes it
        advances; the next block, the probability that every block in flight is accepted in full.
        With deep blocks the block ahead is often the long shot (a 16-token block at 0.95 per token
        is accepted whole about 44% of the time, two in a row 19%), and drafting it anyway left the
        likeliest rejection outcomes undrafted when their verdicts came."""
        if len(live) < 2:
            return False  # keep the target fed first: one block verifying, one queued behind it
        *_, ahead = self.chain(live, self.accept_estimates())
        return self.cache.next_step_value(max_level=1) >= ahead.prior
