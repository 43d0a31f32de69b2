"""The support filter: a guard any rule can run under (docs/research/rules.md, "Guards").

A relaxed rule may accept a draft token the target finds implausible. The support filter rejects a
draft token x at position i, whatever the rule says, when

    p_i(x) < min_p      or      rank_i(x) > max_rank        (rank 1 = argmax; 0 disables the rank test)

Where the filter cuts (the first such position f of the block):

- the rule verifies only the prefix draft[:f] (every rule decides position i from row i alone and
  draws its randomness in position order, so on the positions before f it behaves exactly as on the
  whole block, same rng stream included);
- if the rule rejects inside the prefix, its own result (accepted count and recovered token) stands;
- if it accepts the whole prefix, the token emitted at f is a sample of p_f restricted to the filter's
  support {v : p_f(v) >= min_p and rank_f(v) <= max_rank}, renormalised. So the token emitted at a cut
  passes the same test the draft failed. If no token reaches min_p (a flat row), only the rank test
  applies. The rule's bonus draw for the prefix is discarded (one rng draw, for simplicity).

Only *draft* tokens are filtered: the rule's own recovered and bonus tokens come from distributions
the rule defines (residuals of p, or p) and are emitted unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from acespec.verify.rules import RuleSpec, verify_block
from acespec.verify.sampling import sample


def target_prob_and_rank(p_row: np.ndarray, token: int) -> tuple[float, int]:  # p_row: [V]
    """The target probability of `token` and its rank under p: 1 + #tokens strictly more likely.

    Ties share the better rank (two tokens tied for the maximum both have rank 1), so the rank does
    not depend on token ids. This is what the eval harness records for accepted tokens.
    """
    prob = float(p_row[token])
    return prob, 1 + int(np.count_nonzero(p_row > prob))


def passes(p_row: np.ndarray, token: int, *, min_p: float, max_rank: int) -> bool:  # p_row: [V]
    """Whether a draft token survives the filter at a position with target row p_row."""
    prob, rank = target_prob_and_rank(p_row, token)
    return prob >= min_p and (max_rank <= 0 or rank <= max_rank)


def support_mask(p_row: np.ndarray, *, min_p: float, max_rank: int) -> np.ndarray:  # p_row: [V] -> bool[V]
    """The tokens the filter allows at a position (what a cut samples from); never empty."""
    p_row = np.asarray(p_row, dtype=np.float64)
    if max_rank > 0:
        # rank(v) <= max_rank  <=>  fewer than max_rank tokens are strictly more likely than v
        kth = np.sort(p_row)[::-1][min(max_rank, len(p_row)) - 1]
        by_rank = p_row >= kth
    else:
        by_rank = np.ones_like(p_row, dtype=bool)
    mask = by_rank & (p_row >= min_p) & (p_row > 0)
    if not mask.any():  # no token reaches min_p: keep the rank test alone
        mask = by_rank & (p_row > 0)
    return mask


def first_filtered(draft: np.ndarray, p: np.ndarray, *, min_p: float, max_rank: int) -> int:
    """Index of the first draft token the filter rejects; len(draft) if none. draft: int[k]; p: [>=k, V]."""
    for i, x in enumerate(draft):
        if not passes(p[i], int(x), min_p=min_p, max_rank=max_rank):
            return i
    return len(draft)


@dataclass(frozen=True)
class SupportFilter:
    min_p: float = 0.10  # reject draft tokens the target gives less than this probability
    max_rank: int = 10  # ... or that are not among the target's max_rank likeliest (1 = argmax; 0: no rank test)

    def passes(self, p_row: np.ndarray, token: int) -> bool:
        return passes(p_row, token, min_p=self.min_p, max_rank=self.max_rank)

    def verify(self, rule: str | RuleSpec, draft, q, p, rng: np.random.Generator, **params: float) -> tuple[int, int]:
        return verify_with_support_filter(rule, draft, q, p, rng, min_p=self.min_p, max_rank=self.max_rank, **params)


def verify_with_support_filter(
    rule: str | RuleSpec,
    draft: np.ndarray,  # int[k]
    q: np.ndarray | None,  # [k, V] or None
    p: np.ndarray,  # [k+1, V]
    rng: np.random.Generator,
    *,
    min_p: float = 0.10,
    max_rank: int = 10,
    **params: float,
) -> tuple[int, int]:
    """`verify_block` under the support filter; returns (accepted, next_token). See the module docstring."""
    spec = rule if isinstance(rule, RuleSpec) else RuleSpec.parse(rule)
    draft = np.asarray(draft, dtype=np.int64)
    p = np.asarray(p)
    k = len(draft)
    if p.ndim != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must have shape [k+1, V] = [{k + 1}, V], got {p.shape}")
    f = first_filtered(draft, p, min_p=min_p, max_rank=max_rank)
    if f == k:  # nothing filtered: exactly the plain rule
        return verify_block(spec, draft, q, p, rng, **params)
    if f > 0:
        q_prefix = None if q is None else np.asarray(q)[:f]
        accepted, token = verify_block(spec, draft[:f], q_prefix, p[: f + 1], rng, **params)
        if accepted < f:  # the rule itself rejected before the cut
            return accepted, token
    allowed = np.where(support_mask(p[f], min_p=min_p, max_rank=max_rank), p[f], 0.0)  # [V]
    return f, sample(allowed / allowed.sum(), rng)
