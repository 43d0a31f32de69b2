"""The lossless rules: greedy, strict (Leviathan et al. 2023) and coupled (Daliri, Musco, Suresh 2024)."""

from __future__ import annotations

import numpy as np

from acespec.verify.rules import register, template_verify


@register("greedy", needs_q=False, lossless=True)
def greedy(draft, q, p, rng, **_):
    """Accept while the draft token is the target's argmax; emit the target's argmax."""
    # draft: int[k]; p: [k+1, V]
    for i, x in enumerate(draft):
        best = int(np.argmax(p[i]))
        if best != int(x):
            return i, best
    return len(draft), int(np.argmax(p[len(draft)]))


@register("strict", needs_q=True, lossless=True)
def strict(draft, q, p, rng, **_):
    """Rejection sampling: accept x w.p. min(1, p(x)/q(x)); residual norm(max(0, p - q)); bonus from p."""
    # draft: int[k]; q: [k, V]; p: [k+1, V]
    k = len(draft)
    return template_verify(draft, q, p[:k], p[:k], p[k], rng)


def gumbel_noise(seed: int, pos: int, vocab: int) -> np.ndarray:  # -> [vocab]
    """The shared noise for one absolute position; edge and cloud derive the same array from (seed, pos)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(pos)]).gumbel(size=vocab)


def coupled_sample(dist: np.ndarray, seed: int, pos: int) -> int:  # dist: [V]
    """argmax(log dist + g): an exact sample from `dist`, the same token on both sides when dist agrees."""
    if np.count_nonzero(dist) == 1:  # a point mass (greedy): log 0 = -inf elsewhere, so no noise can move it
        return int(np.argmax(dist))
    with np.errstate(divide="ignore"):
        return int(np.argmax(np.log(dist) + gumbel_noise(seed, pos, dist.shape[-1])))


@register("coupled", needs_q=False, lossless=True)
def coupled(draft, q, p, rng, *, seed: int = 0, start_pos: int = 0, **_):
    """Shared-seed Gumbel: accept x iff argmax(log p + g) == x; emit that argmax. `start_pos` is the
    absolute position of draft[0]. The output depends only on p and the seed, never on the drafter."""
    # draft: int[k]; p: [k+1, V]
    for i, x in enumerate(draft):
        t = coupled_sample(p[i], seed, start_pos + i)
        if t != int(x):
            return i, t
    k = len(draft)
    return k, coupled_sample(p[k], seed, start_pos + k)
