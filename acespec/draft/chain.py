"""Chain drafting: the drafter proposes a block of tokens one after another.

The drafter picks each token the way the verification rule expects: argmax for `greedy`, the
shared-seed Gumbel argmax for `coupled` (so the draft equals the target's own sample whenever the
two distributions agree), and a plain sample from `q` for the rejection-sampling rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from acespec.models.base import Model
from acespec.verify import RuleSpec, SamplingParams, coupled_sample, gumbel_noise, probs_from_logits, sample, softmax
from acespec.verify.sampling import dense_row, sparse_top

# tokens a stoppable prefill evaluates between looks at its stop: about 0.25 s of a 0.5B drafter on one
# CPU core (pieces of 256 left 1.1 s between a 2,000-token prompt's last streamed token and the response's end)
PREFILL_PIECE = 64


@dataclass
class DraftBlock:
    tokens: list[int]  # drafted ids, in order
    q: np.ndarray | None  # [len(tokens), V] drafter distributions, when asked for
    conf: list[float] = field(default_factory=list)  # q(x) of each drafted token
    seconds: float = 0.0  # wall time spent drafting
    top: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per position: (ids, q(ids)), best first
    catchup_s: float = 0.0  # of `seconds`: reading committed tokens the drafter had not seen (after plain steps)


class TokenPicker:
    """How the drafter chooses a token from its distribution, matching the rule that will verify it."""

    def __init__(self, rule: RuleSpec, sampling: SamplingParams, seed: int) -> None:
        self.mode = (
            "greedy"
            if (rule.name == "greedy" or sampling.greedy)
            else ("coupled" if rule.name == "coupled" else "sample")
        )
        self.sampling = sampling
        self.seed = int(seed)
        self.rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xD4AF7])

    def ranking(self, q: np.ndarray, pos: int, m: int) -> tuple[np.ndarray, np.ndarray]:  # q: [V]
        """The m tokens the target is most likely to emit here, best first, with their q. In coupled
        mode the target emits argmax(log p + g) with the shared noise g, so log q + g ranks them."""
        if self.mode == "coupled":
            with np.errstate(divide="ignore"):
                score = np.log(q) + gumbel_noise(self.seed, pos, len(q))
        else:
            score = q
        m = min(m, len(q))
        ids = np.argpartition(-score, m - 1)[:m] if m < len(q) else np.arange(len(q))
        ids = ids[np.argsort(-score[ids], kind="stable")]
        ids = ids[q[ids] > 0]
        return ids, q[ids]

    def pick(self, q: np.ndarray, pos: int) -> int:  # q: [V]
        if self.mode == "greedy":
            return int(np.argmax(q))
        if self.mode == "coupled":
            return coupled_sample(q, self.seed, pos)
        return sample(q, self.rng)


class ChainDrafter:
    def __init__(
        self,
        model: Model,
        *,
        sampling: SamplingParams,
        rule: RuleSpec,
        seed: int = 0,
        q_topn: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        # q_topn > 0: draft from the top-n truncation of q, the form in which q crosses the wire
        self.q_topn = q_topn if rule.info.needs_q else 0
        self.sampling = sampling
        self.rule = rule
        self.picker = TokenPicker(rule, sampling, seed)
        self.tokens_drafted = 0
        self.clock = clock  # what `DraftBlock.seconds` is measured on (a simulator's virtual clock)

    def free_ahead(self, context: Sequence[int]) -> int:
        """Tokens this drafter can propose after `context` at no model cost (a prediction's); 0 here."""
        return 0

    def prefill(self, context: Sequence[int], stop: Callable[[], bool] | None = None) -> None:
        """Put all of `context` but its last token in the drafter's cache (draft() evaluates the last
        one for its first row), so the prompt prefill can run while the edge waits on the network.

        `stop`, asked between pieces of PREFILL_PIECE tokens, leaves the rest undone when it says so:
        a run that ends while a long prompt's prefill is still under way gives its drafter back within
        a piece, not seconds later (what is held stays; a later draft evaluates what is missing)."""
        ctx = context[:-1]
        if stop is None:
            self.model.prefill(ctx)
            return
        for a in range(self.model.sync(ctx), len(ctx), PREFILL_PIECE):
            if stop():
                return
            self.model.eval(list(ctx[a : a + PREFILL_PIECE]), last=0)

    def missing(self, context: Sequence[int]) -> int:
        """Tokens of `context` but its last that the drafter's cache does not hold (what a draft after
        `context` would evaluate first); the cache is left as it is."""
        toks, n = self.model.tokens, min(len(self.model.tokens), len(context) - 1)
        if toks[:n] != list(context[:n]):
            n = next(i for i in range(n) if toks[i] != context[i])
        return len(context) - 1 - n

    def draft(
        self,
        context: Sequence[int],
        n: int,
        *,
        keep_q: bool | None = None,
        keep_top: int = 0,
        min_conf: float = 0.0,
        min_tokens: int = 1,
        stop: Callable[[], bool] | None = None,
    ) -> DraftBlock:
        """Draft up to `n` tokens after `context`; stop early once a token's q(x) < min_conf
        (after `min_tokens`), since a low-confidence token is likely rejected and everything after it
        wasted. `keep_top` > 0 also records the drafter's best `keep_top` candidates at each position
        (what the state cache plans outcomes from). `stop`, if given, is asked after each token
        whether to return what is drafted so far (the loop's "a verdict came in"); drafting on
        from `context + tokens` later continues where this call left off."""
        t0 = self.clock()
        keep_q = self.rule.info.needs_q if keep_q is None else keep_q
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        conf: list[float] = []
        top: list[tuple[np.ndarray, np.ndarray]] = []
        if n <= 0:
            return DraftBlock([], None, [], 0.0)
        m = self.model.sync(context[:-1])
        fresh = list(context[m:])
        t1 = self.clock()
        logits = self.model.eval(fresh, last=1)[-1]
        # A drafter that kept up reads at most two new tokens here (the bonus and the last draft). More
        # means it sat out plain steps (a depth controller at K = 0): that reading is catching up, not
        # drafting, and is reported apart so it does not price every later draft token (its share per
        # token is taken as even; the last token's share stays with the draft).
        catchup = (self.clock() - t1) * (len(fresh) - 1) / len(fresh) if len(fresh) > 2 else 0.0
        pos = len(context)
        while True:
            x, c, q, cand = self._choose(logits, pos, keep_top)
            tokens.append(x)
            conf.append(c)
            if keep_q:
                rows.append(q)
            if keep_top:
                top.append(cand)
            pos += 1
            if len(tokens) >= n or (len(tokens) >= min_tokens and c < min_conf):
                break
            if stop is not None and stop():
                break
            logits = self.model.eval([x])[0]
        self.tokens_drafted += len(tokens)
        qarr = np.stack(rows) if keep_q else None
        return DraftBlock(tokens, qarr, conf, self.clock() - t0, top=top, catchup_s=catchup)

    def step_many(
        self, items: Sequence[tuple[int, Sequence[int]]], *, keep_top: int = 0
    ) -> list[tuple[int, float, np.ndarray, tuple[np.ndarray, np.ndarray] | None]]:
        """Draft one token after each of several contexts, each in its own drafter sequence, in one
        batched pass: `items` is (slot, context) per sequence. Returns (token, q(token), q row,
        candidates) per item, chosen exactly as `draft` would choose them."""
        model = self.model
        main = model.slot
        work = []
        try:
            for slot, ctx in items:
                model.activate(slot)
                m = model.sync(ctx[:-1])
                work.append((slot, list(ctx[m:])))
        finally:
            model.activate(main)
        out = []
        for (_slot, ctx), logits in zip(items, model.eval_many(work)):
            x, c, q, cand = self._choose(logits, len(ctx), keep_top)
            out.append((x, c, q, cand))
        self.tokens_drafted += len(out)
        return out

    def _choose(self, logits: np.ndarray, pos: int, keep_top: int):  # logits: [V]
        """The token at position `pos`, its confidence, the q row it came from, and the best candidates."""
        if self.sampling.greedy and not self.q_topn:
            return self._choose_greedy(logits, keep_top)
        q = probs_from_logits(logits, self.sampling)
        if self.q_topn:
            q = dense_row(*sparse_top(q, self.q_topn), len(q))
        x = self.picker.pick(q, pos)
        # greedy sampling makes q one-hot; confidence and alternatives come from the soft distribution
        soft = softmax(logits) if self.sampling.greedy else q
        cand = self.picker.ranking(soft, pos, keep_top) if keep_top else None
        return x, float(soft[x]), q, cand

    def _choose_greedy(self, logits: np.ndarray, keep_top: int):  # logits: [V]
        """`_choose` at temperature 0, without the vocabulary-sized float64 rows: the token is the first
        argmax of the logits (what argmax of the one-hot q picks), its confidence the softmax at it, and
        the candidates the logits' top entries (softmax keeps their order), each with its softmax value.
        On a 151,936-entry row the general path spent 1.1 ms a token in numpy (1.5 with the cache's
        candidates: a float64 copy, a one-hot row, a float64 softmax), this one 0.23 (0.5); a drafter
        pass costs 50-70 ms here, so it is a few percent of drafting, taken from the edge's core."""
        logits = np.asarray(logits, dtype=np.float32)
        x = int(np.argmax(logits))
        top = logits[x]
        z = float(np.exp(logits - top).sum(dtype=np.float64))  # float32 exps of values <= 0, summed in float64
        q = np.zeros(len(logits))
        q[x] = 1.0
        cand = None
        if keep_top:
            m = min(keep_top, len(logits))
            ids = np.argpartition(-logits, m - 1)[:m] if m < len(logits) else np.arange(len(logits))
            ids = ids[np.argsort(-logits[ids], kind="stable")]
            p = np.exp(logits[ids].astype(np.float64) - float(top)) / z
            keep = p > 0
            cand = (ids[keep], p[keep])
        return x, 1.0 / z, q, cand
