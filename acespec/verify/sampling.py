"""Turning logits into the sampling distributions `p` and `q`.

Both sides of a speculative step must use the *same* sampling parameters, otherwise even the
lossless rules stop being lossless; so there is exactly one function that does it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy: the distribution is one-hot on the argmax
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set with mass >= top_p; 1.0 keeps all

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def softmax(logits: np.ndarray) -> np.ndarray:  # logits: [..., V]
    x = np.asarray(logits, dtype=np.float64)
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def token_logprobs(
    logits: np.ndarray, tokens: np.ndarray, m: int, floor: float = -9999.0
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """What OpenAI's `logprobs` report: per row i of `logits` [n, V], the log-probability of `tokens[i]`
    and the `m` likeliest (token, log-probability) pairs, likeliest first (ties by id), from the raw
    log-softmax (before temperature, top-k and top-p), each at least `floor`."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - np.max(x, axis=-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))  # [n, V]
    out = []
    for row, tok in zip(lp, tokens):
        top: tuple[tuple[int, float], ...] = ()
        if m:
            k = min(m, row.size)
            # the m likeliest, and any tied with the last of them (argpartition would pick among ties at random)
            cand = np.flatnonzero(row >= -np.partition(-row, k - 1)[k - 1])
            cand = cand[np.lexsort((cand, -row[cand]))][:k]
            top = tuple((int(t), max(floor, float(row[t]))) for t in cand)
        out.append((max(floor, float(row[int(tok)])), top))
    return out


def probs_from_logits(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Distribution after temperature, top-k and top-p. logits: [..., V] -> float64 [..., V].

    Ties at the top-k / top-p boundary are broken by token id (stable sort) so that the edge and
    the cloud, given equal logits, always cut the same set.
    """
    x = np.asarray(logits, dtype=np.float64)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    if sp.greedy:
        out = np.zeros_like(x)
        out[np.arange(x.shape[0]), np.argmax(x, axis=-1)] = 1.0
        return out[0] if squeeze else out
    x = x / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        # kth largest per row; keep everything >= it, then trim ties by id order
        order = np.argsort(-x, axis=-1, kind="stable")
        mask = np.zeros_like(x, dtype=bool)
        np.put_along_axis(mask, order[:, : sp.top_k], True, axis=-1)
        x = np.where(mask, x, -np.inf)
    p = softmax(x)
    if sp.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        # keep a token if the mass strictly before it is < top_p (so at least one survives)
        keep_sorted = (cum - sorted_p) < sp.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    return p[0] if squeeze else p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:  # p: [V]
    """Inverse-CDF sampling; robust to rows that sum to 1 only up to rounding."""
    c = np.cumsum(p)
    u = rng.random() * c[-1]
    return int(min(np.searchsorted(c, u, side="right"), len(p) - 1))


def sparse_top(q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:  # q: [V]
    """The `n` most likely tokens of `q` and their probabilities, renormalised and rounded to float32.

    The drafter must sample from exactly this truncated row, and the target must verify against it:
    rejection sampling is lossless for *any* q, provided both sides use the same one. Rounding to
    float32 here (what the wire carries) makes the two bit-identical.
    """
    n = min(int(n), q.shape[-1])
    ids = np.argpartition(-q, n - 1)[:n] if n < q.shape[-1] else np.arange(q.shape[-1])
    ids = ids[q[ids] > 0]
    ids = ids[np.argsort(-q[ids], kind="stable")]
    probs = (q[ids] / q[ids].sum()).astype(np.float32)
    return ids.astype(np.int64), probs


def dense_row(ids, probs, vocab: int) -> np.ndarray:  # -> [vocab]
    """Inverse of `sparse_top`: a float64 row holding exactly the float32 probabilities.

    A row from `sparse_top` already sums to 1 up to float32 rounding (< 1e-6), and is *not*
    renormalised: renormalising in float64 gives values that are not float32, which the wire would
    round again, so the cloud would rebuild a row a few ulps off the one the edge sampled from.
    Left as is, the row survives edge -> wire (float32) -> cloud bit for bit. Rows that are further
    from 1 are renormalised.
    """
    row = np.zeros(vocab, dtype=np.float64)
    row[np.asarray(ids, dtype=np.int64)] = np.asarray(probs, dtype=np.float32).astype(np.float64)
    s = row.sum()
    return row / s if s > 0 and abs(s - 1.0) > 1e-6 else row
