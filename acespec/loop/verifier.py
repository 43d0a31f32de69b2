"""The target side of one generation: holds the committed prefix and verifies draft blocks.

The cloud server runs one `TargetVerifier` per session; the single-process path calls one
directly. It is the source of truth for the committed prefix.

A block names the committed length `base` it builds on and carries tokens `x`. Pipelined edges
send a block before the previous verdict is back, assuming the previous block will be accepted in
full with the bonus token the edge guessed; that guess is the first token of the next block. So
with `C` the committed length now:

- `C < base` or `C > base + len(x)`: the block is built on a prefix that never happened: dropped.
- otherwise `x[:C - base]` must equal the committed tokens at those positions (else dropped) and
  `x[C - base:]` are the draft tokens to verify (possibly none: then this is a plain target step).

A verify emits `accepted + 1` tokens: the kept draft tokens, then the recovered or bonus token.
Generation stops at an end-of-sequence token or at `max_tokens`; a verdict cut short there keeps the
same shape (`draft[:accepted] + [next_token]`) so both sides apply it the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from acespec.models.base import Model
from acespec.verify import RuleSpec, SamplingParams, probs_from_logits, token_logprobs, verify_block


@dataclass(frozen=True)
class BlockVerdict:
    """The target's answer to one `Block` (a plain target step is a block with no draft tokens). Across the
    network it travels as a VERDICT frame (`acespec.wire.Verdict`), which the edge turns back into one."""

    seq: int  # which block this answers
    accepted: int  # draft tokens kept (after the overlap)
    next_token: int  # recovered or bonus token; -1 when dropped
    committed: int  # committed length after this verdict
    verify_us: int  # time the target spent on this block
    dropped: bool = False  # built on a stale prefix; nothing was verified
    finished: bool = False  # generation is over (end-of-sequence or max_tokens)
    drafted: int = 0  # draft tokens actually verified (len(x) minus the overlap)
    shared: int = 1  # sessions whose rows were in the same target pass (each waited for all of them)
    prefill_rows: int = 0  # prompt rows other sessions had in that pass: its time says little of what a step costs


@dataclass(frozen=True)
class VerifyJob:
    """A block that passed the stale-prefix check and waits for the target's rows (see `prepare`)."""

    seq: int  # the block's sequence number
    committed: int  # committed length it was prepared at; `finish` refuses a session that moved on
    draft: np.ndarray  # [k] draft tokens to verify (the block minus its overlap)
    q: np.ndarray | None  # [k, V] drafter rows, for rules that need q

    @property
    def k(self) -> int:
        return len(self.draft)


@dataclass
class VerifierStats:
    rounds: int = 0  # target passes that verified a block
    dropped: int = 0  # blocks dropped as stale
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens kept
    emitted: int = 0  # tokens committed by verdicts
    verify_s: float = 0.0  # time in target passes and rules


class TargetVerifier:
    def __init__(
        self,
        target: Model,
        prompt: Sequence[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        rule: RuleSpec | str = "strict",
        seed: int = 0,
        max_tokens: int = 256,
        stop_ids: frozenset[int] | None = None,
        logprobs: int = 0,  # 0: none; 1 + m: record each committed token's log-probability and the m likeliest
        clock: Callable[
            [], float
        ] = time.perf_counter,  # what a verify's cost is timed on (a test's or simulator's clock)
    ) -> None:
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        self.target = target
        self.sampling = sampling
        self.rule = rule if isinstance(rule, RuleSpec) else RuleSpec.parse(rule)
        self.seed = int(seed)
        self.rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x5EC])
        self.prompt_len = len(prompt)
        self.tokens: list[int] = [int(t) for t in prompt]  # prompt + committed generation
        self.max_tokens = int(max_tokens)
        self.stop_ids = target.tokenizer.eos_ids if stop_ids is None else stop_ids
        self.finished = self.max_tokens <= 0
        self.stats = VerifierStats()
        self.clock = clock
        # rule-level observations for the eval harness: (target prob, rank) of every accepted token
        self.record_accepted = False
        self.accepted_support: list[tuple[float, int]] = []
        self.last_p: np.ndarray | None = None  # [k+1, V] of the latest verify, for callers that report it
        self.logprobs = int(logprobs)
        # per generated token (index = position - prompt_len), when asked: (log-probability, top alternatives)
        self.token_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = []

    @property
    def committed(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def verify(self, seq: int, base: int, x: Sequence[int], q: np.ndarray | None = None) -> BlockVerdict:
        """Verify block `x` built on committed length `base`; `q`: [len(x), V] drafter rows (rules that need q)."""
        job = self.prepare(seq, base, x, q)
        if isinstance(job, BlockVerdict):
            return job
        t0 = self.clock()
        # keep the cache one token behind the committed prefix, so the pass yields p after it
        n = self.target.sync(self.tokens[:-1])
        logits = self.target.eval(self.tokens[n:] + job.draft.tolist(), last=job.k + 1)
        return self.finish(job, logits, self.clock() - t0)

    def prepare(self, seq: int, base: int, x: Sequence[int], q: np.ndarray | None = None) -> VerifyJob | BlockVerdict:
        """The model-free first half of `verify`: a dropped BlockVerdict for a stale block, else the job whose
        target rows [k+1, V] (the rows after `tokens[-1]` and after each draft token) `finish` needs. A
        batching engine prepares every session's job, evaluates all their rows in one pass, then finishes each."""
        C = self.committed
        o = C - base
        if self.finished or o < 0 or o > len(x) or list(x[:o]) != self.tokens[base:C]:
            self.stats.dropped += 1
            return BlockVerdict(seq, 0, -1, C, 0, dropped=True, finished=self.finished)
        # a block that would run past the context window is cut short: verifying fewer tokens is
        # always allowed (the verdict just accepts at most what was verified)
        room = max(0, self.target.n_ctx - C)
        draft = np.asarray(x[o : o + room], dtype=np.int64)
        qk = None
        if self.rule.info.needs_q:
            qk = (
                np.zeros((0, self.target.vocab_size))
                if len(draft) == 0
                else (None if q is None else np.asarray(q)[o : o + len(draft)])
            )
        return VerifyJob(seq, C, draft, qk)

    def finish(self, job: VerifyJob, logits: np.ndarray, seconds: float) -> BlockVerdict:
        """Apply the rule to the target's rows `logits` [k+1, V] for `job` and commit the outcome; `seconds`
        is what the verify cost (reported to the edge and counted in the stats)."""
        if self.committed != job.committed:
            raise RuntimeError(
                f"verify job prepared at {job.committed}, but the session has committed {self.committed}"
            )
        t0 = self.clock()
        draft, C = job.draft, job.committed
        p = probs_from_logits(logits, self.sampling)  # [k+1, V]
        accepted, nxt = verify_block(self.rule, draft, job.q, p, self.rng, seed=self.seed, start_pos=C)
        self.last_p = p
        verdict = self.commit(job, accepted, int(nxt), seconds + self.clock() - t0, p)
        if self.logprobs:
            # the tokens just committed stand at rows 0.. of this pass (accepted drafts, then the emitted one)
            new = self.tokens[C : verdict.committed]
            self.token_logprobs += token_logprobs(logits[: len(new)], np.asarray(new), self.logprobs - 1)
        return verdict

    def commit(
        self, job: VerifyJob, accepted: int, nxt: int, seconds: float, p: np.ndarray | None = None
    ) -> BlockVerdict:
        """Commit a rule's outcome for `job` (the first `accepted` draft tokens, then `nxt`), cut at
        end-of-sequence or the budget; `p` [k+1, V] only for the eval harness's records."""
        t0 = self.clock()
        draft, k = job.draft, job.k
        emitted, finished = self._cut(draft[:accepted].tolist() + [int(nxt)])
        accepted, nxt = len(emitted) - 1, emitted[-1]
        if self.record_accepted and p is not None:
            for i in range(accepted):
                row = p[i]
                tok = int(draft[i])
                self.accepted_support.append((float(row[tok]), int((row > row[tok]).sum()) + 1))
        self.tokens.extend(emitted)
        self.finished = finished
        dt = seconds + self.clock() - t0
        s = self.stats
        s.rounds += 1
        s.drafted += k
        s.accepted += accepted
        s.emitted += len(emitted)
        s.verify_s += dt
        return BlockVerdict(job.seq, accepted, int(nxt), self.committed, int(dt * 1e6), finished=finished, drafted=k)

    def _cut(self, emitted: list[int]) -> tuple[list[int], bool]:
        """Stop at end-of-sequence or the token budget: (the tokens kept, whether generation is over)."""
        budget = self.prompt_len + self.max_tokens - self.committed
        cut = next((i for i, t in enumerate(emitted) if t in self.stop_ids), None)
        finished = False
        if cut is not None:
            emitted, finished = emitted[: cut + 1], True
        if len(emitted) >= budget:
            emitted, finished = emitted[:budget], True
        return emitted, finished

    def commit_decoded(
        self, emitted: Sequence[int], seconds: float, *, drafted: int = 0, accepted: int = 0
    ) -> BlockVerdict:
        """Commit tokens an engine decoded by itself (vLLM's own speculative decoding verified the
        edge's drafts: `drafted` of them proposed, `accepted` kept), cut at end-of-sequence or the budget."""
        if not emitted:
            raise ValueError("commit_decoded needs at least one token")
        kept, self.finished = self._cut([int(t) for t in emitted])
        self.tokens.extend(kept)
        s = self.stats
        s.rounds += 1
        s.drafted += drafted
        s.accepted += min(accepted, len(kept))
        s.emitted += len(kept)
        s.verify_s += seconds
        return BlockVerdict(
            0,
            min(accepted, len(kept) - 1),
            kept[-1],
            self.committed,
            int(seconds * 1e6),
            finished=self.finished,
            drafted=drafted,
        )

    def warm(self) -> int:
        """Prefill the committed prefix (all but its last token, which verify() always evaluates), so
        the first block only pays for its own tokens; returns how many tokens were evaluated. The
        server runs this as soon as a session opens, while the edge is still prefilling its drafter
        and drafting the first block, so the two prompt prefills overlap instead of adding up."""
        return self.target.prefill(self.tokens[:-1])

    def rollback(self, n: int) -> None:
        """Forget committed tokens past length n (a reconnecting edge never saw them)."""
        if not self.prompt_len <= n <= self.committed:
            raise ValueError(f"cannot roll back to {n}: committed {self.committed}, prompt {self.prompt_len}")
        del self.tokens[n:]
        del self.token_logprobs[n - self.prompt_len :]
        self.finished = (
            self.max_tokens <= 0
            or (n > self.prompt_len and self.tokens[-1] in self.stop_ids)
            or (n - self.prompt_len >= self.max_tokens)
        )

    def step(self, seq: int = 0) -> BlockVerdict:
        """One plain autoregressive target step (a block with no draft tokens)."""
        return self.verify(seq, self.committed, [])
