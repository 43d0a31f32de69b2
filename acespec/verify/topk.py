"""Verifying from top-K rows: what an engine that returns only the K most likely tokens per position
(vLLM's `logprobs=K`) can verify, and how far its output law can be from the target's.

Such an engine gives, at each position, the log-probabilities of its top K tokens (plus the token
actually there, when it asked for the prompt's rows) under the *raw* target distribution p (temperature
1, no top-k/top-p). `dense_logits` turns them into a full row, -inf elsewhere, and the ordinary rules
run on it unchanged:

- greedy sampling (temperature 0): the argmax is in the top K, so every rule is exact;
- `top_k <= K`: the sampling distribution lives inside the top K, so it is exact as well;
- otherwise the coupled rule draws argmax(log p_T + g) over the known tokens only. It differs from the
  full draw only when the full argmax falls outside them, which happens with probability p_T(outside),
  so the total-variation distance between the two output laws is at most p_T(outside) per position.
  `tail_mass_bound` bounds that mass from what the engine returned.

Rules that need p at tokens the engine did not return (strict's residual, the relaxed rules' targets)
are exact only at temperature 0; `topk_exactness` says which (rule, sampling) pairs an engine serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from acespec.verify.rules import RuleSpec
from acespec.verify.sampling import SamplingParams


class TopKRuleError(ValueError):
    """This rule, at these sampling parameters, needs target probabilities a top-K engine does not have."""


def topk_exactness(rule: RuleSpec, sp: SamplingParams, k: int) -> str:
    """`exact` (the output law is the target's), `bounded` (coupled: within the tail mass of the
    target's, see `tail_mass_bound`), or TopKRuleError for a pair a top-K engine must refuse."""
    if sp.greedy or (sp.top_k and sp.top_k <= k):
        return "exact"
    if rule.name in ("greedy", "coupled"):
        if sp.top_p < 1.0:
            raise TopKRuleError(
                f"top_p {sp.top_p:g} needs the whole target row to find the nucleus, and this engine returns only the "
                f"top {k} tokens per position: use top_k <= {k} (exact) or top_p = 1"
            )
        return "exact" if rule.name == "greedy" else "bounded"
    raise TopKRuleError(
        f"rule {rule} at temperature {sp.temperature:g} needs the target's full distribution, and this engine returns "
        f"only the top {k} tokens per position: use temperature 0, top_k <= {k}, or the coupled rule"
    )


def dense_logits(entries: Mapping[int, float], vocab: int) -> np.ndarray:  # -> [vocab]
    """A full logits row from {token id: log p}: -inf at every token not given (ids >= vocab are an error)."""
    row = np.full(vocab, -np.inf, dtype=np.float64)
    for t, lp in entries.items():
        if not 0 <= t < vocab:
            raise ValueError(f"token id {t} outside the vocabulary [0, {vocab})")
        row[t] = lp
    return row


def tail_mass_bound(logprobs: np.ndarray, vocab: int, temperature: float, *, floor: float | None = None) -> float:
    """Upper bound on the tempered target mass p_T(outside) of the tokens NOT in `logprobs`.

    logprobs: [m] raw log p of the known tokens (normalised over the whole vocabulary); every unknown token
    has raw log p <= `floor` (the smallest top-K value; default min(logprobs)). With u = 1 - sum(exp) the
    raw mass of the n = vocab - m unknown tokens and a = exp(floor), the tempered mass sum x^(1/T) over
    x_j in [0, a], sum x_j = u is largest when the x_j are as equal as possible for T >= 1 (concave) and
    as lopsided as possible for T < 1 (convex); dividing by the known tempered mass plus that maximum
    bounds the share."""
    lp = np.asarray(logprobs, dtype=np.float64)
    n = vocab - lp.size
    if temperature == 0.0 or n <= 0:
        return 0.0
    u = max(0.0, 1.0 - float(np.exp(lp).sum()))
    if u == 0.0:
        return 0.0
    inv_t = 1.0 / temperature
    shift = float(lp.max())  # work relative to the top token: exp(l / T) underflows for small T
    known = float(np.exp((lp - shift) * inv_t).sum())
    a = math.exp(float(lp.min()) if floor is None else float(floor))
    if inv_t <= 1.0:
        each = min(u / n, a)
        out = n * math.exp((math.log(each) - shift) * inv_t) if each > 0 else 0.0
    else:
        full, rest = divmod(u, a)
        out = full * math.exp((math.log(a) - shift) * inv_t) + (
            math.exp((math.log(rest) - shift) * inv_t) if rest > 0 else 0.0
        )
    return out / (known + out)
