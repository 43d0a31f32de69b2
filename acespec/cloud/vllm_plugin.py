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
gives every sampled request of the engine a default. Those requests' draft blocks are decided by the
rule's row law (`acespec.verify.relaxed.ROW_LAWS`: the rules' single definition, written against the
array API, which `verify_block` runs on numpy) in torch (`acespec.cloud.vllm_rules`), every such request
of the step at once, on the rows vLLM's sampler would use: the target's probabilities after temperature
/ top-k / top-p, the drafter's probabilities when vLLM has them (`draft_probs`; token-only drafts, as
from n-gram or `custom_class` proposers, are one-hot), and vLLM's own bonus token (drawn from the
target's bonus row, as every rule does). Greedy requests, and requests that ask for nothing (or get the
engine's default `strict`), go through vLLM's own sampler, which sees only their rows; with no rule
asked for anywhere in a step, the step is vLLM's, bit for bit. A request that names `strict` itself is
decided here like every other rule (same law as vLLM's, AceSpec's draws), so arms compared with each
other (`acespec eval --engine vllm`) are all decided by one code path. A seeded request draws its
uniforms from its own generator, so its output stays determined by its seed.

`extra_args={"acespec_support": "min_p=0.1,max_rank=10"}` next to a rule puts the request under the
support filter (`acespec.verify.guards.verify_with_support_filter`): a draft the target gives less than
min_p, or ranks below max_rank, stops its block whatever the rule says, and the token emitted there is
drawn from the target's row restricted to the filter's support.

`extra_args={"acespec_net_win": "math"}` next to a relaxed rule puts the request under the net-win guard
of its task type ("math"), which picks whether it runs the rule or strict (`acespec.cloud.vllm_guard`).

With speculative decoding on a CPU, the tracker also checks vLLM 0.32's CPU expand kernel in the worker,
when the first request that asks for a rule arrives, and repairs it
(`acespec.cloud.vllm_proposer.ensure_expand_is_right`): broken, it divides the target's rows by garbage
in every sampled speculative step, whichever method drafts (found with `draft_model`: NaN and flat rows,
nothing accepted). From then on the engine's other requests get the repaired kernel too.

The plugin patches one vLLM version (`VLLM_VERSION`). Under another, it patches nothing; a request or
an environment that asks for a rule is then refused at once, rather than silently verified by
vLLM's strict sampler.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from acespec import env as acespec_env
from acespec.cloud import vllm_proposer
from acespec.cloud.vllm_board import prompt_key
from acespec.cloud.vllm_guard import NET_WIN_ARG, PLACEHOLDER, GuardedRequests, net_win_of
from acespec.cloud.vllm_proposer import ensure_expand_is_right
from acespec.cloud.vllm_rules import apply_rules
from acespec.verify import RULES, RuleSpec
from acespec.verify.rules import RuleSpecError

log = logging.getLogger("acespec.vllm.plugin")

VLLM_VERSION = "0.32.0"  # the vLLM whose rejection_sample this replaces (its signature and batch layout)
RULE_ARG = "acespec_rule"  # SamplingParams.extra_args key
SUPPORT_ARG = "acespec_support"  # extra_args key: the support filter around the rule, "min_p=0.1,max_rank=10"
ENV_RULE = acespec_env.VLLM_RULE.name  # every sampled request's rule unless it names its own

_state = {"patched": False, "original": None}


def _version_ok() -> bool:
    import vllm  # heavy: the vllm extra

    return getattr(vllm, "__version__", "") == VLLM_VERSION


def engine_rule() -> RuleSpec | None:
    text = acespec_env.vllm_rule()
    return RuleSpec.parse(text) if text else None


def register() -> None:
    """The `vllm.general_plugins` entry point: runs in every vLLM process; patches once per process."""
    if _state["patched"]:
        return
    if not _version_ok():
        import vllm  # heavy: the vllm extra

        if acespec_env.vllm_rule():
            raise RuntimeError(
                f"{ENV_RULE} asks for AceSpec's rules, but the plugin patches vLLM {VLLM_VERSION} and this "
                f"is vLLM {getattr(vllm, '__version__', '?')}: its rejection sampler is left as it is"
            )
        log.warning(
            "acespec's vLLM plugin knows vLLM %s, not %s: leaving the rejection sampler alone",
            VLLM_VERSION,
            getattr(vllm, "__version__", "?"),
        )
        return
    engine_rule()  # a malformed ACESPEC_VLLM_RULE fails the engine's start, not its first step
    import vllm.v1.sample.logits_processor as lp  # heavy: the vllm extra
    import vllm.v1.sample.rejection_sampler as rs  # heavy: the vllm extra

    _state["original"] = rs.rejection_sample
    rs.rejection_sample = rejection_sample
    # with speculative decoding on, vLLM builds no custom logits processors (they could change logits
    # its rejection sampler must see unchanged); AceSpecRules changes none, and it is how the sampler
    # learns each row's rule, so it joins them there too
    original_build = lp.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        procs = original_build(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        if (
            vllm_config.speculative_config
            and not is_pooling_model
            and not any(isinstance(x, AceSpecRules) for x in procs.all)
        ):
            procs = lp.LogitsProcessors([*procs.all, AceSpecRules(vllm_config, device, is_pin_memory)])
        return procs

    _rebind(original_build, build_logitsprocs)
    _state["patched"] = True


def _rebind(old, new) -> None:
    """Point every loaded module's reference to `old` (`from m import f` copies) at `new`."""
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


def support_arg(min_p: float, max_rank: int) -> str:
    """The `extra_args[SUPPORT_ARG]` value asking for the support filter with these settings."""
    return f"min_p={float(min_p)!r},max_rank={int(max_rank)}"


def _support_of(params) -> tuple[float, int] | None:
    """(min_p, max_rank) of the support filter a request asked for (`acespec.verify.guards`), or None."""
    text = (getattr(params, "extra_args", None) or {}).get(SUPPORT_ARG)
    if not text:
        return None
    try:
        kv = dict(part.split("=", 1) for part in str(text).replace(" ", "").split(","))
        min_p, max_rank = float(kv.pop("min_p", 0.10)), int(kv.pop("max_rank", 10))
    except ValueError:
        raise ValueError(f"extra_args[{SUPPORT_ARG!r}] = {text!r}: write min_p=P,max_rank=R") from None
    if kv or not 0.0 <= min_p <= 1.0 or max_rank < 0:
        raise ValueError(
            f"extra_args[{SUPPORT_ARG!r}] = {text!r}: only min_p in [0, 1] and max_rank >= 0 (0: no rank test)"
        )
    return min_p, max_rank


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
            raise ValueError(
                f"extra_args[{RULE_ARG!r}]: {rule.name} is not a rejection rule (vLLM decodes greedy itself; "
                "coupled's shared-seed draw needs AceSpec's own engines): ask for strict or a relaxed rule"
            )
        if rule is not None and not _version_ok():
            raise ValueError(f"extra_args[{RULE_ARG!r}] needs vLLM {VLLM_VERSION}, which acespec's plugin patches")
        task = net_win_of(sampling_params)
        if task is not None and (rule is None or rule.name == "strict"):
            raise ValueError(
                f"extra_args[{NET_WIN_ARG!r}] chooses between a relaxed rule and strict: name the relaxed rule "
                f"in extra_args[{RULE_ARG!r}]"
            )
        if _support_of(sampling_params) is not None and rule is None:
            raise ValueError(
                f"extra_args[{SUPPORT_ARG!r}] filters a rule's drafts: name the rule in extra_args[{RULE_ARG!r}]"
            )

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        self.rows: dict[int, RuleSpec] = {}
        self.support: dict[int, tuple[float, int]] = {}  # row -> (min_p, max_rank): the support filter it asked for
        self.prompts: dict[int, Sequence[int]] = {}  # row -> its prompt, for rules that need q (see `key`)
        self._keys: dict[tuple[int, int], int] = {}  # (row, length) -> board key of the prompt's first length tokens
        self.guard = GuardedRequests()  # the rows whose requests are under the net-win guard
        self.default = engine_rule()
        # in a CPU worker: vLLM 0.32's CPU expand kernel is to be checked (and repaired) before a rule decides
        self._check_expand = vllm_config is not None and getattr(device, "type", str(device)) == "cpu"

    def key(self, i: int, length: int) -> int | None:
        """The board key (`vllm_board.prompt_key`) of row i's first `length` prompt tokens: a session's
        request reopened after a rollback or a resume carries its committed tokens in its prompt."""
        prompt = self.prompts.get(i)
        if prompt is None or len(prompt) < length:
            return None
        k = self._keys.get((i, length))
        if k is None:
            k = self._keys[(i, length)] = prompt_key(prompt[:length])
        return k

    def is_argmax_invariant(self) -> bool:
        return True  # it never changes a logit

    def apply(self, logits):
        return logits

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.guard.leave(i, self.rows.pop(i, None))
            self.support.pop(i, None)
            self.prompts.pop(i, None)
        if batch_update.removed or batch_update.added or batch_update.moved:
            self._keys.clear()
        for i, params, prompt, output in batch_update.added:
            own = _rule_of(params)
            rule = own or (self.default if params is not None else None)
            self.rows.pop(i, None)
            self.support.pop(i, None)
            self.prompts.pop(i, None)
            self.guard.rows.pop(i, None)
            task = net_win_of(params) if own is not None and own.name != "strict" else None
            if task is not None and own is not None and getattr(params, "temperature", 0.0) != 0.0:
                rule = self.guard.join(i, task, own, params, output)
            # greedy requests keep vLLM's argmax; the engine's default strict is what vLLM does itself, but
            # a request that names strict is decided here too, so it draws its randomness as every other
            # rule request does (and can have the support filter)
            if rule is None or getattr(params, "temperature", 0.0) == 0.0 or (rule.name == "strict" and own is None):
                continue
            self.rows[i] = rule
            if RULES[rule.name].needs_q and prompt is not None:
                self.prompts[i] = prompt
            support = _support_of(params)
            if support is not None:
                self.support[i] = support
        if self.rows and self._check_expand:
            # vLLM 0.32's CPU expand kernel corrupts every sampled speculative step (acespec/cloud/vllm_proposer.py):
            # the custom_class proposer repairs it at start; with any other method (draft_model, ngram) it is
            # repaired here, before the first step a rule decides (this runs before that step samples), and
            # not before, so an engine where no request asks for a rule stays vLLM's, bit for bit

            ensure_expand_is_right()
            self._check_expand = False
        from vllm.v1.sample.logits_processor import MoveDirectionality  # heavy: the vllm extra

        tables: tuple[dict[int, Any], ...] = (self.rows, self.support, self.prompts, self.guard.rows)  # one move each
        for table in tables:
            for a, b, how in batch_update.moved:
                ra, rb = table.pop(a, None), table.pop(b, None)
                if ra is not None:
                    table[b] = ra
                if how == MoveDirectionality.SWAP and rb is not None:
                    table[a] = rb


def _tracker(sampling_metadata) -> AceSpecRules | None:
    procs = getattr(sampling_metadata, "logitsprocs", None)
    for lp in procs.all if procs is not None else ():
        if isinstance(lp, AceSpecRules):
            return lp
    return None


def _metadata_for(sampling_metadata, reqs: list[int]):
    """`sampling_metadata` for the requests `reqs` only (renumbered 0..), in the fields vLLM's
    `rejection_sample` reads: temperature, all_greedy / all_random and the seeded generators."""
    import torch  # heavy: the hf extra

    gens = {j: sampling_metadata.generators[i] for j, i in enumerate(reqs) if i in sampling_metadata.generators}
    t = sampling_metadata.temperature
    if t is None:
        return replace(sampling_metadata, generators=gens)
    t = t[torch.as_tensor(reqs, device=t.device)]
    return replace(
        sampling_metadata,
        temperature=t,
        generators=gens,
        all_greedy=bool((t == 0).all()),
        all_random=bool((t != 0).all()),
    )


EDGE_Q = {
    "sent": 0,
    "one_hot": 0,
}  # this worker's drafted requests under rules that need q: with the edge's rows, without


def _edge_q(tracker, rules: dict[int, RuleSpec], draft_token_ids, num_draft_tokens) -> dict[int, list]:
    """batch index -> the q rows a cloud-led edge sent with exactly the tokens this request drafted
    (left by the proposer, `vllm_proposer.edge_q`), for the requests whose rule needs q."""
    counts = np.asarray(num_draft_tokens, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    out: dict[int, list] = {}
    lengths = sorted({plen for (_, plen) in vllm_proposer.edge_q})
    for i, spec in rules.items():
        n = int(counts[i])
        if not n or not RULES[spec.name].needs_q:
            continue
        mine = tuple(draft_token_ids[starts[i] : starts[i] + n].tolist())
        for plen in lengths:
            got = vllm_proposer.edge_q.get((tracker.key(i, plen), plen))
            if got is not None and got[0][:n] == mine and len(got[1]) >= n:
                out[i] = got[1][:n]
                EDGE_Q["sent"] += 1
                vllm_proposer.q_used(got[2])
                break
        else:
            EDGE_Q["one_hot"] += 1
    return out


def rejection_sample(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu_num_draft_tokens,
    draft_probs,
    target_logits,
    bonus_token_ids,
    sampling_metadata,
    **kw,
):
    """vLLM's `rejection_sample` for the requests without a rule, AceSpec's rule for the others."""
    tracker = _tracker(sampling_metadata)
    B = len(num_draft_tokens)
    rules = {i: r for i, r in (tracker.rows.items() if tracker is not None else ()) if i < B}
    if not rules:
        return _state["original"](
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            **kw,
        )
    import torch  # heavy: the hf extra

    device = target_logits.device
    out = torch.full((B, max_spec_len + 1), PLACEHOLDER, dtype=torch.int32, device=device)
    ruled = sorted(rules)
    edge_q = _edge_q(tracker, rules, draft_token_ids, num_draft_tokens) if draft_probs is None else None
    out[torch.as_tensor(ruled, device=device)] = apply_rules(
        rules,
        ruled,
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        draft_probs,
        target_logits,
        bonus_token_ids,
        sampling_metadata,
        support=tracker.support,
        edge_q=edge_q,
    )
    others = [i for i in range(B) if i not in rules]
    if others:  # vLLM's own sampler on their rows only: the rule requests' rows cost it nothing
        counts = np.asarray(num_draft_tokens, dtype=np.int64)
        starts = np.cumsum(counts) - counts
        rows = torch.as_tensor(
            np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in others]), device=device
        )
        sub = [int(counts[i]) for i in others]
        at = torch.as_tensor(others, device=device)
        out[at] = _state["original"](
            draft_token_ids[rows],
            sub,
            max_spec_len,
            torch.as_tensor(np.cumsum(sub), dtype=cu_num_draft_tokens.dtype, device=device),
            None if draft_probs is None else draft_probs[rows],
            target_logits[rows],
            bonus_token_ids[at],
            _metadata_for(sampling_metadata, others),
            **kw,
        )
    if tracker.guard.rows:
        tracker.guard.step(out.cpu(), num_draft_tokens)
    return out


# -- vLLM's sampler outside an engine, as a CPU worker has it (tests, `acespec bench plugin-cost`) -----
def cpu_sampler():
    """vLLM's rejection-sampler module with what a CPU worker sets up first (its kernels and their
    overrides, AceSpec's expand fix), patched by this plugin."""
    from vllm.platforms import current_platform  # heavy: the vllm extra

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    ensure_expand_is_right()
    register()
    import vllm.v1.sample.rejection_sampler as rs  # heavy: the vllm extra

    return rs


def sampling_metadata(
    B: int, rules: dict, seeds: list[int] | None = None, temperature: float = 1.0, support: dict | None = None
):
    """vLLM's SamplingMetadata for B sampled requests, with an AceSpecRules tracker holding `rules`
    (row -> RuleSpec) and `support` (row -> (min_p, max_rank)) and, if `seeds`, one seeded generator per row."""
    import torch  # heavy: the hf extra
    from vllm.v1.sample.logits_processor import LogitsProcessors  # heavy: the vllm extra
    from vllm.v1.sample.metadata import SamplingMetadata  # heavy: the vllm extra

    tracker = AceSpecRules(None, torch.device("cpu"), False)
    tracker.rows = dict(rules)
    tracker.support = dict(support or {})
    gens = {} if seeds is None else {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
    z = torch.zeros(B)
    return SamplingMetadata(
        temperature=torch.full((B,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators=gens,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=z,
        presence_penalties=z,
        repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors([tracker]),
    )
