"""The cloud side of a cloud-led session, written once: which draft a step verifies, and what it learns.

`LeadState` holds a session's draft board (`loop.board`) and its pricer (`control.lead`). Before each
step the cloud asks `plan(verifier)` for the tokens to verify (none: a plain step, as cloud-only) and
their q rows; after it, `observe` feeds the pricer. The cloud server runs one per cloud-led session;
`LocalLeadLink` runs one in process, so the edge's `FollowLoop` can be tested (and its output law
checked) with no network.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from acespec.control.lead import LeadConfig, LeadMemory, LeadPricer
from acespec.loop.board import BoardDraft, DraftBoard, SparseRow
from acespec.loop.records import Disconnected
from acespec.loop.transport import Clock, LeadLink, StepChunk
from acespec.loop.verifier import BlockVerdict, TargetVerifier
from acespec.verify.sampling import dense_row, sparse_top


class LeadState:
    def __init__(self, config: LeadConfig | None = None, max_drafts: int = 8, memory: LeadMemory | None = None) -> None:
        self.board = DraftBoard(max_drafts)
        self.pricer = LeadPricer(config or LeadConfig(), memory)
        self.steps = 0  # steps planned (verify sequence numbers)

    def take(
        self,
        base: int,
        tokens: Sequence[int],
        parents: Sequence[int] | None,
        q: Sequence[SparseRow] | None,
        committed_len: int,
    ) -> bool:
        return self.board.put(
            BoardDraft(
                base, tuple(tokens), None if parents is None else tuple(parents), None if q is None else tuple(q)
            ),
            committed_len,
        )

    def plan(self, v: TargetVerifier, at_least: int = 0) -> tuple[list[int], np.ndarray | None]:
        """This step's draft: the priced part of the longest that agrees with the stream, and its q rows
        [k, V] for rules that need them (a token-only draft under `strict` gets a one-hot q, which keeps
        the output law exactly p: a token x is kept with probability p(x), else the residual p(y)/(1-p(x))
        over y != x is sampled). `at_least`: verify that many of it even where the pricer would verify
        fewer (a pass budget: `passes_short`)."""
        self.steps += 1
        avail, rows = self.board.usable(v.tokens, self.pricer.cfg.k_max)
        k = max(self.pricer.choose(len(avail)), min(at_least, len(avail)))
        draft = avail[:k]
        if not draft or not v.rule.info.needs_q:
            return draft, None
        V = v.target.vocab_size
        if rows is None:
            q = np.zeros((k, V))
            q[np.arange(k), draft] = 1.0
            return draft, q
        return draft, np.stack([dense_row([i for i, _ in r], [p for _, p in r], V) for r in rows[:k]])

    def tokens_short(self, v: TargetVerifier, budget: float) -> int:
        """Draft tokens the next step must verify, all kept, for the session to stay within `budget`
        target passes per token: with `steps` passes behind it and this one, it must have committed
        at least (steps + 1) / budget tokens, the step's own target token included (0: within it)."""
        made = v.committed - v.prompt_len
        return max(0, math.ceil((self.steps + 1) / budget - 1e-9) - made - 1)

    def observe(self, verdict: BlockVerdict, wall_s: float) -> None:
        # the first step's wall time holds the prompt's prefill (seconds, over several engine ticks; its
        # own pass is the first token's, a plain step's). Taught as the wait outside a pass, it made
        # that wait look like a second at first, and deep drafts nearly free for a dozen steps: on one
        # CPU thread, 5 deep drafts in a 64-token session that plain steps would have beaten
        self.pricer.observe(
            verdict.drafted,
            verdict.accepted,
            verdict.verify_us / 1e6,
            wall_s if self.steps > 1 else None,
            verdict.shared,
            timed=verdict.prefill_rows == 0,
        )


class LocalLeadLink(LeadLink):
    """A cloud-led session in process: a blocking `recv`, or a poll after a draft was sent, takes one
    cloud step (plan, verify, stream) with whatever drafts the board holds; a poll with nothing new
    sent returns None, so the edge drafts between steps. `q_topn` > 0 sends q as the wire would.
    `lazy`: step only when the edge blocks (a cloud slower than the drafter: the edge drafts as far
    ahead, and as wide, as it wants between two steps)."""

    def __init__(
        self,
        verifier: TargetVerifier,
        *,
        config: LeadConfig | None = None,
        q_topn: int = 0,
        lazy: bool = False,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.v = verifier
        self.state = LeadState(config)
        self.q_topn = q_topn
        self.clock = clock
        self._sent = False  # a draft arrived since the last step
        self.lazy = lazy

    def rtt_s(self) -> float | None:
        return 0.0

    def send_draft(
        self, base: int, tokens: Sequence[int], q: np.ndarray | None, parents: Sequence[int] | None = None
    ) -> None:
        rows = None
        if q is not None:
            n = self.q_topn or q.shape[1]
            rows = [tuple(zip(*(a.tolist() for a in sparse_top(row, n)))) for row in q]
        self.state.take(base, tokens, parents, rows, self.v.committed)
        self._sent = True

    def recv(self, timeout: float | None) -> StepChunk | Disconnected | None:
        if self.v.finished:
            return Disconnected("the session has finished")
        if timeout is not None and (self.lazy or not self._sent):
            return None
        self._sent = False
        t0 = self.clock()
        start = self.v.committed
        draft, q = self.state.plan(self.v)
        verdict = self.v.verify(self.state.steps, start, draft, q)
        self.state.observe(verdict, self.clock() - t0)
        return StepChunk(
            start,
            tuple(self.v.tokens[start : verdict.committed]),
            verdict.finished,
            verdict.drafted,
            verdict.accepted,
            verdict.verify_us / 1e6,
            self.clock(),
        )
