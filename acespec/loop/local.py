"""The single-process path: drafter and target in one process, the loop with a direct-call transport."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from acespec.control.depth import DepthPolicy, make_policy
from acespec.draft.chain import ChainDrafter
from acespec.loop.loop import LocalTransport, LoopConfig, LoopResult, SpecLoop
from acespec.loop.verifier import TargetVerifier
from acespec.models.base import Model, check_compatible
from acespec.verify import RuleSpec, SamplingParams


@dataclass
class SpecConfig:
    rule: str = "greedy"  # verification rule spec, e.g. strict, coupled, cactus:delta=0.35
    k: int = 4  # draft depth (the starting depth for adaptive policies)
    policy: str = "fixed"  # fixed | adaptive (+2/-1) | controller (prices K, down to plain steps)
    temperature: float = 0.0  # 0 = greedy sampling
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0  # drives every random choice; coupled mode shares it between drafter and target
    max_tokens: int = 128  # generation budget
    spec: bool = True  # False = plain autoregressive decoding with the target (the baseline)
    min_conf: float = 0.0  # stop a block early when the drafter's q(x) drops below this
    stop_ids: frozenset[int] | None = None  # None = the tokenizer's end-of-sequence tokens
    extra: dict = field(default_factory=dict)  # rule parameter overrides

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def rule_spec(self) -> RuleSpec:
        return RuleSpec.parse(self.rule)


def local_policy(spec: str, k: int) -> DepthPolicy:
    """The depth policy `generate` uses. In one process there are no cloud passes to ration and no
    round trip to hide: the controller maximises tokens/s alone, and where no block pays (rows that
    cost nearly a step each, as on a 2-core CPU) it takes plain steps, so speculation does not make
    `generate` slower than plain decoding past what it takes to learn that. Pass one policy to every
    `generate` call of a long-running process (`policy=`) and it learns that once."""
    return make_policy(spec, k, pass_budget=math.inf, k_min=0)


def generate(
    target: Model,
    prompt: Sequence[int],
    cfg: SpecConfig,
    *,
    draft: Model | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    policy: DepthPolicy | None = None,
    verifier_hook: Callable[[TargetVerifier], None] | None = None,
) -> LoopResult:
    """Generate with speculative decoding (or plain decoding when `cfg.spec` is False or no drafter)."""
    rule = cfg.rule_spec
    sp = cfg.sampling
    verifier = TargetVerifier(
        target, prompt, sampling=sp, rule=rule, seed=cfg.seed, max_tokens=cfg.max_tokens, stop_ids=cfg.stop_ids
    )
    if verifier_hook:
        verifier_hook(verifier)
    drafter = None
    if cfg.spec and draft is not None:
        check_compatible(draft, target)
        drafter = ChainDrafter(draft, sampling=sp, rule=rule, seed=cfg.seed)
    if policy is None:
        policy = local_policy(cfg.policy, cfg.k if drafter else 0)
    loop = SpecLoop(
        LocalTransport(verifier),
        prompt,
        drafter=drafter,
        policy=policy,
        config=LoopConfig(mode="sync", max_tokens=cfg.max_tokens, min_conf=cfg.min_conf),
        on_tokens=on_tokens,
    )
    return loop.run()
