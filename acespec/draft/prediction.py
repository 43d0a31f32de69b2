"""Predicted outputs: a text the client expects most of the answer to repeat, used as drafts.

OpenAI's Predicted Outputs (`prediction: {"type": "content", "content": ...}`) let a code-editing
client send the file it is editing; most of the new file repeats it. `PredictedDrafter` drafts from
that prediction wherever the generation lines up with it, and from the drafter model elsewhere:

- the generation so far is aligned with the prediction by its longest suffix (up to `MAX_NGRAM`
  tokens) that the prediction contains, preferring the occurrence nearest after the last alignment
  (prompt lookup, as in vLLM's n-gram proposer); the draft is what follows it there;
- at the start the prediction's first tokens are the draft;
- with no alignment, or too few predicted tokens to give the loop what it asks for, the model drafts.

Prediction tokens are drafts like any other, so the verification rule decides what is kept: with the
lossless rules the output is exactly what it would have been without a prediction. Rules that need
q see a one-hot q for a predicted token (it was proposed with certainty); `strict` stays exact with it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np

from acespec.draft.chain import ChainDrafter, DraftBlock

MAX_NGRAM = 8  # longest generated suffix looked up in the prediction


class Prediction:
    def __init__(self, tokens: Sequence[int], start: int) -> None:
        self.tokens = [int(t) for t in tokens]  # the predicted output, tokenized
        self.start = int(start)  # position of the generation's first token (the prompt's length)
        self._at = 0  # where in the prediction the generation last lined up

    def continuation(self, context: Sequence[int], n: int) -> list[int]:
        """Up to n predicted tokens after `context` (prompt + generated so far), [] if it does not line up."""
        gen = context[self.start :]
        pred = self.tokens
        if not gen:
            return pred[:n]
        for m in range(min(MAX_NGRAM, len(gen)), 0, -1):
            tail = list(gen[-m:])
            hits = [j for j in range(m, len(pred) + 1) if pred[j - m : j] == tail]
            if hits:
                j = min(hits, key=lambda h: (h < self._at, abs(h - self._at)))
                self._at = j
                return pred[j : j + n]
        return []


def prediction_usage(prediction: Sequence[int], completion: Sequence[int]) -> tuple[int, int]:
    """OpenAI's `accepted_prediction_tokens` (prediction tokens that appear in the completion, in order)
    and `rejected_prediction_tokens` (the rest of the prediction)."""
    sm = difflib.SequenceMatcher(None, list(prediction), list(completion), autojunk=False)
    accepted = sum(b.size for b in sm.get_matching_blocks())
    return accepted, len(prediction) - accepted


class PredictedDrafter(ChainDrafter):
    """A `ChainDrafter` that drafts from a `Prediction` where it lines up, from its model elsewhere."""

    def __init__(self, model, prediction: Prediction, **kw) -> None:
        super().__init__(model, **kw)
        self.prediction = prediction
        self.predicted = 0  # draft tokens taken from the prediction

    def free_ahead(self, context: Sequence[int]) -> int:
        return len(self.prediction.continuation(context, len(self.prediction.tokens)))

    def draft(
        self,
        context: Sequence[int],
        n: int,
        *,
        keep_q: bool | None = None,
        keep_top: int = 0,
        min_conf: float = 0.0,
        min_tokens: int = 1,
        stop=None,
    ) -> DraftBlock:
        cont = self.prediction.continuation(context, n) if n > 0 else []
        if not cont or len(cont) < min_tokens:
            return super().draft(
                context, n, keep_q=keep_q, keep_top=keep_top, min_conf=min_conf, min_tokens=min_tokens, stop=stop
            )
        keep_q = self.rule.info.needs_q if keep_q is None else keep_q
        q = None
        if keep_q:
            q = np.zeros((len(cont), self.model.vocab_size))
            q[np.arange(len(cont)), cont] = 1.0
        top = [(np.array([t]), np.array([1.0])) for t in cont] if keep_top else []
        self.predicted += len(cont)
        self.tokens_drafted += len(cont)
        return DraftBlock(list(cont), q, [1.0] * len(cont), 0.0, top=top)
