"""Verification rules as pure functions over numpy arrays (no I/O, no model calls).

Use `verify_block(rule, draft, q, p, rng, **params) -> (accepted, next_token)`; rules are named and
parameterised as `name` or `name:param=value,...` everywhere (CLI, reports, wire).
"""

from acespec.verify.rules import RULES, RuleInfo, RuleSpec, RuleSpecError, register, template_verify, verify_block
from acespec.verify.sampling import SamplingParams, probs_from_logits, sample, softmax
from acespec.verify import lossless as _lossless  # noqa: F401  (registers greedy, strict, coupled)
from acespec.verify.lossless import coupled_sample, gumbel_noise

try:  # the relaxed rules live in their own module; registering them is a side effect of the import
    from acespec.verify import relaxed as _relaxed  # noqa: F401
except ImportError:  # pragma: no cover - only while the module does not exist yet
    pass

__all__ = [
    "RULES", "RuleInfo", "RuleSpec", "RuleSpecError", "register", "template_verify", "verify_block",
    "SamplingParams", "probs_from_logits", "sample", "softmax", "coupled_sample", "gumbel_noise",
]
