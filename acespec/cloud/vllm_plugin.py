"""AceSpec's verification rules inside vLLM's rejection sampler: a vLLM plugin.

vLLM's rejection sampler has no hook for other rules, but vLLM loads two kinds of out-of-tree code
in every one of its processes before the engine starts, from entry points of installed packages
(acespec's `pyproject.toml` declares both):

- `vllm.general_plugins` -> `register()`: puts `rejection_sample` below in place of vLLM's function
  of that name (`vllm/v1/sample/rejection_sampler.py`, which its `RejectionSampler.forward` calls),
  and adds `AceSpecRules` to the logits processors vLLM builds with speculative decoding on (where it
  builds no custom ones);
- `vllm.logits_processors` -> `AceSpecRules`: a logits processor that changes no logits and only
  follows which request sits in which batch row, with the rule it asked for.

A request asks for a rule with `SamplingParams(extra_args={"acespec_rule": "cactus:delta=0.35"})`
(vLLM's OpenAI server fills `extra_args` from `vllm_xargs`); `ACESPEC_VLLM_RULE` in the environment
gives every sampled request of the engine a default. For those requests' rows the draft block is
decided by `acespec.verify.verify_block`, the rules' single definition, on the rows vLLM's sampler
would use: the target's probabilities after temperature / top-k / top-p, the drafter's probabilities
when vLLM has them (`draft_probs`; token-only drafts, as from n-gram or `custom_class` proposers, are
one-hot), and vLLM's own bonus token (drawn from the target's bonus row, as every rule does). Greedy
requests, and requests that ask for nothing, keep vLLM's own result: with no rule asked for anywhere
in a step, the step is vLLM's, bit for bit.

The plugin patches one vLLM version (`VLLM_VERSION`). Under another, it patches nothing; a request or
an environment that asks for a rule is then refused at once, rather than silently verified by
vLLM's strict sampler.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from acespec.verify import RuleSpec, verify_block
from acespec.verify.rules import RuleSpecError

log = logging.getLogger("acespec.vllm.plugin")

VLLM_VERSION = "0.32.0"  # the vLLM whose rejection_sample this replaces (its signature and batch layout)
RULE_ARG = "acespec_rule"  # SamplingParams.extra_args key
ENV_RULE = "ACESPEC_VLLM_RULE"  # every sampled request's rule unless it names its own
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: no token at this position

_state = {"patched": False, "original": None}


def _version_ok() -> bool:
    import vllm

    return getattr(vllm, "__version__", "") == VLLM_VERSION


def engine_rule() -> RuleSpec | None:
    text = os.environ.get(ENV_RULE, "").strip()
    return RuleSpec.parse(text) if text else None


def register() -> None:
    """The `vllm.general_plugins` entry point: runs in every vLLM process; patches once per process."""
    if _state["patched"]:
        return
    if not _version_ok():
        import vllm

        if os.environ.get(ENV_RULE):
            raise RuntimeError(f"{ENV_RULE} asks for AceSpec's rules, but the plugin patches vLLM {VLLM_VERSION} and this "
                               f"is vLLM {getattr(vllm, '__version__', '?')}: its rejection sampler is left as it is")
        log.warning("acespec's vLLM plugin knows vLLM %s, not %s: leaving the rejection sampler alone", VLLM_VERSION,
                    getattr(vllm, "__version__", "?"))
        return
    engine_rule()  # a malformed ACESPEC_VLLM_RULE fails the engine's start, not its first step
    import vllm.v1.sample.logits_processor as lp
    import vllm.v1.sample.rejection_sampler as rs

    _state["original"] = rs.rejection_sample
    rs.rejection_sample = rejection_sample
    # with speculative decoding on, vLLM builds no custom logits processors (they could change logits
    # its rejection sampler must see unchanged); AceSpecRules changes none, and it is how the sampler
    # learns each row's rule, so it joins them there too
    original_build = lp.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        procs = original_build(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        if vllm_config.speculative_config and not is_pooling_model and not any(isinstance(x, AceSpecRules) for x in procs.all):
            procs = lp.LogitsProcessors([*procs.all, AceSpecRules(vllm_config, device, is_pin_memory)])
        return procs

    _rebind(original_build, build_logitsprocs)
    _state["patched"] = True


def _rebind(old, new) -> None:
    """Point every loaded module's reference to `old` (`from m import f` copies) at `new`."""
    import sys

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace or not getattr(module, "__name__", "").startswith("vllm"):
            continue
        for attr, value in list(namespace.items()):
            if value is old:
                setattr(module, attr, new)


def _rule_of(params) -> RuleSpec | None:
    text = (getattr(params, "extra_args", None) or {}).get(RULE_ARG)
    return RuleSpec.parse(str(text)) if text else None


try:  # the logits processor needs vLLM's base class; without vLLM this module still imports (docs, tests)
    from vllm.v1.sample.logits_processor import LogitsProcessor as _Base
except ImportError:  # pragma: no cover - exercised only where vLLM is absent
    _Base = object  # type: ignore[assignment,misc]


class AceSpecRules(_Base):  # type: ignore[misc,valid-type]
    """Follows the persistent batch: row -> the rule its request asked for (or the engine's default).
    Changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        try:
            rule = _rule_of(sampling_params)
        except RuleSpecError as e:
            raise ValueError(f"extra_args[{RULE_ARG!r}]: {e}") from None
        if rule is not None and rule.name in ("greedy", "coupled"):
            raise ValueError(f"extra_args[{RULE_ARG!r}]: {rule.name} is not a rejection rule (vLLM decodes greedy itself; "
                             "coupled's shared-seed draw needs AceSpec's own engines): ask for strict or a relaxed rule")
        if rule is not None and not _version_ok():
            raise ValueError(f"extra_args[{RULE_ARG!r}] needs vLLM {VLLM_VERSION}, which acespec's plugin patches")

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        self.rows: dict[int, RuleSpec] = {}
        self.default = engine_rule()

    def is_argmax_invariant(self) -> bool:
        return True  # it never changes a logit

    def apply(self, logits):
        return logits

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _, _ in batch_update.added:
            rule = _rule_of(params) or (self.default if params is not None else None)
            if rule is not None and rule.name != "strict" and not getattr(params, "temperature", 0.0) == 0.0:
                self.rows[i] = rule  # strict is what vLLM does itself; greedy requests keep vLLM's argmax
            else:
                self.rows.pop(i, None)
        from vllm.v1.sample.logits_processor import MoveDirectionality

        for a, b, how in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if how == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb


def _tracker(sampling_metadata) -> AceSpecRules | None:
    procs = getattr(sampling_metadata, "logitsprocs", None)
    for lp in (procs.all if procs is not None else ()):
        if isinstance(lp, AceSpecRules):
            return lp
    return None


def _rng(sampling_metadata, i: int, fallback: np.random.Generator) -> np.random.Generator:
    """A seeded request draws from its own torch generator (so its output stays seed-determined)."""
    g = sampling_metadata.generators.get(i)
    if g is None:
        return fallback
    import torch

    return np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=g, device=g.device)))


_fallback = np.random.default_rng()


def apply_rules(out, rules: dict[int, RuleSpec], draft_token_ids, num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata) -> None:
    """Rewrite the rows of `out` [batch, max_spec_len + 1] whose request has a rule, from the same inputs
    vLLM's sampler had: draft ids [num_tokens], target logits [num_tokens, V] after the sampling
    constraints, draft probs [num_tokens, V] or None, bonus ids [batch, 1]."""
    import torch

    starts = np.concatenate([[0], np.cumsum(num_draft_tokens)[:-1]]).astype(np.int64)
    todo = [i for i in rules if i < len(num_draft_tokens) and num_draft_tokens[i] > 0]
    if not todo:
        return
    # one conversion for every row a rule decides, then numpy per request
    idx = np.concatenate([np.arange(starts[i], starts[i] + num_draft_tokens[i]) for i in todo])
    sel = torch.from_numpy(idx)
    P = torch.softmax(target_logits[sel].to(torch.float64), dim=-1).cpu().numpy()  # [rows, V]
    Q = draft_probs[sel].to(torch.float64).cpu().numpy() if draft_probs is not None else None  # [rows, V]
    D = draft_token_ids[sel].to(torch.int64).cpu().numpy()  # [rows]
    bonus_ids = bonus_token_ids[:, 0].cpu().numpy()
    V = P.shape[1]
    rows = np.arange(V)
    emitted = np.full((len(todo), out.shape[1]), PLACEHOLDER, dtype=np.int64)
    at = 0
    for j, i in enumerate(todo):
        n = int(num_draft_tokens[i])
        draft, p = D[at : at + n], P[at : at + n]
        q = Q[at : at + n] if Q is not None else (rows[None, :] == draft[:, None]).astype(np.float64)  # token-only: one-hot
        bonus = (rows == bonus_ids[i]).astype(np.float64)[None, :]  # vLLM drew it from the target's bonus row
        a, nxt = verify_block(rules[i], draft, q, np.vstack([p, bonus]), _rng(sampling_metadata, i, _fallback))
        emitted[j, :a] = draft[:a]
        emitted[j, a] = nxt
        at += n
    out[torch.tensor(todo)] = torch.from_numpy(emitted).to(out.dtype)


def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                     bonus_token_ids, sampling_metadata, **kw):
    """vLLM's `rejection_sample`, then AceSpec's rule on the rows whose request asked for one."""
    tracker = _tracker(sampling_metadata)
    rules = tracker.rows if tracker is not None else {}
    logits = target_logits.clone() if rules else None  # vLLM's sampler may change its input in place
    out = _state["original"](draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                             target_logits, bonus_token_ids, sampling_metadata, **kw)
    if rules:
        apply_rules(out, rules, draft_token_ids, num_draft_tokens, draft_probs, logits, bonus_token_ids, sampling_metadata)
    return out


# -- vLLM's sampler outside an engine, as a CPU worker has it (tests, `acespec bench plugin-cost`) -----
def cpu_sampler():
    """vLLM's rejection-sampler module with what a CPU worker sets up first (its kernels and their
    overrides, AceSpec's expand fix), patched by this plugin."""
    from vllm.platforms import current_platform

    from acespec.cloud.vllm_proposer import ensure_expand_is_right

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    ensure_expand_is_right()
    register()
    import vllm.v1.sample.rejection_sampler as rs

    return rs


def sampling_metadata(B: int, rules: dict, seeds: list[int] | None = None, temperature: float = 1.0):
    """vLLM's SamplingMetadata for B sampled requests, with an AceSpecRules tracker holding `rules`
    (row -> RuleSpec) and, if `seeds`, one seeded generator per row."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    tracker = AceSpecRules(None, torch.device("cpu"), False)
    tracker.rows = dict(rules)
    gens = {} if seeds is None else {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
    z = torch.zeros(B)
    return SamplingMetadata(temperature=torch.full((B,), temperature), all_greedy=False, all_random=True, top_p=None,
                            top_k=None, generators=gens, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                            frequency_penalties=z, presence_penalties=z, repetition_penalties=torch.ones(B),
                            output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None, bad_words_token_ids={},
                            logitsprocs=LogitsProcessors([tracker]))
