"""Verification rules as pure functions over numpy arrays (no I/O, no model calls).

Use `verify_block(rule, draft, q, p, rng, **params) -> (accepted, next_token)`; rules are named and
parameterised as `name` or `name:param=value,...` everywhere (CLI, reports, wire).
"""

# importing the rule modules registers their rules (greedy, strict, coupled; then the relaxed ones)
from acespec.verify.lossless import coupled_sample, gumbel_noise
from acespec.verify.rules import RULES, RuleInfo, RuleSpec, RuleSpecError, register, template_verify, verify_block
from acespec.verify.sampling import SamplingParams, probs_from_logits, sample, softmax, token_logprobs

# isort: split
# after the lossless ones, so RULES lists them first
from acespec.verify import relaxed

__all__ = [
    "RULES",
    "RuleInfo",
    "RuleSpec",
    "RuleSpecError",
    "register",
    "template_verify",
    "verify_block",
    "SamplingParams",
    "probs_from_logits",
    "sample",
    "softmax",
    "token_logprobs",
    "coupled_sample",
    "gumbel_noise",
    "relaxed",  # a module: importing it registers the relaxed rules
]
