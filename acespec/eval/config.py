"""The settings of the length-inflation harness (`EvalConfig`) and its arms: what `--rules`, `--guard` and
`--ablate` turn into (see `acespec.eval.runner` for what each means).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from acespec.eval.datasets import DATASETS
from acespec.verify import RuleSpec, RuleSpecError

GUARD_NAMES = ("support", "netwin", "budget")
ARM_GUARDS = ("support", "netwin", "force")
ABLATIONS = ARM_GUARDS  # what --ablate can add next to each arm
BASELINE = "strict"

# Settings that change what a record means: a resumed run must not mix records made under others.
IDENTITY_FIELDS = (
    "dataset",
    "draft",
    "target",
    "max_tokens",
    "think",
    "budget",
    "k",
    "temperature",
    "top_k",
    "top_p",
    "data_seed",
    "min_p",
    "max_rank",
    "budget_fraction",
    "humaneval_mode",
    "netwin_min",
    "min_chars",
    "max_chars",
    "engine",
)


# ------------------------------------------------------------------------------------------ config


@dataclass
class EvalConfig:
    rules: list[str] = field(default_factory=lambda: ["strict", "cactus:delta=0.35"])  # as typed (arms before --guard)
    guards: list[str] = field(default_factory=list)  # support | netwin | budget
    ablate: list[str] = field(default_factory=list)  # support | netwin | force: guarded copies next to each arm
    dataset: str = "math"
    n: int = 8  # prompts
    seeds: list[int] = field(default_factory=lambda: [0])
    max_tokens: int = 256
    think: bool = False
    draft: str = ""  # model specs; "" = the registry defaults
    target: str = ""
    n_ctx: int = 4096
    k: int = 4  # draft depth (fixed policy)
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    data_seed: int = 0  # which math problems / which ShareGPT shuffle
    min_p: float = 0.10  # support filter
    max_rank: int = 10
    budget_fraction: float = 0.85  # budget forcing point
    netwin_min: int = 8  # net-win guard: observations of each arm before trusting its estimate
    parallel: int = 1  # jobs run at once through one batched pass per model (1: one at a time)
    batching: str = (
        "shared"  # --parallel: shared (one pass, weights read once) | exact (a pass per job, same bits as alone)
    )
    engine: str = "llama"  # llama: the single-process path | vllm: vLLM's own speculative decoding (vllm_runner)
    concurrency: int = 16  # --engine vllm: jobs in flight at once (vLLM's max_num_seqs)
    humaneval_mode: str = "chat"  # chat | completion
    exec_timeout: float = 10.0  # HumanEval: seconds per program
    min_chars: int = 32  # ShareGPT length filter (characters of the first user turn)
    max_chars: int = 2000

    @property
    def budget(self) -> bool:
        return "budget" in self.guards

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        for g in self.guards:
            if g not in GUARD_NAMES:
                raise ValueError(f"unknown guard {g!r}; choose from {', '.join(GUARD_NAMES)}")
        if self.budget and not self.think:
            raise ValueError("--guard budget forces the end of a <think> trace: it needs --think")
        for g in self.ablate:
            if g not in ABLATIONS:
                raise ValueError(f"unknown ablation {g!r}; choose from {', '.join(ABLATIONS)}")
        arms = build_arms(self.rules, self.guards, self.ablate)  # raises on a bad spec
        if any(a.force for a in arms):
            if not self.think:
                raise ValueError("+force forces the end of a <think> trace: it needs --think")
            if self.budget:
                raise ValueError(
                    "--guard budget already forces every arm; +force arms compare forced with unforced runs"
                )
        if self.batching not in ("shared", "exact"):
            raise ValueError("--batching must be shared or exact")
        if self.n < 1 or self.max_tokens < 1 or not self.seeds or self.parallel < 1:
            raise ValueError("--n, --max-tokens, --seeds and --parallel must be at least 1")
        if not 0.0 < self.budget_fraction <= 1.0:
            raise ValueError("--budget-fraction must be in (0, 1]")
        if self.humaneval_mode not in ("chat", "completion"):
            raise ValueError("--humaneval-mode must be chat or completion")
        if self.humaneval_mode == "completion" and self.think:
            raise ValueError("--think needs chat prompting (--humaneval-mode chat)")
        if self.engine not in ("llama", "vllm"):
            raise ValueError("--engine must be llama or vllm")
        if self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.engine == "vllm":
            if self.parallel != 1 or self.batching != "shared":
                raise ValueError(
                    "--parallel and --batching are the llama.cpp harness's; on --engine vllm, vLLM's "
                    "scheduler batches the jobs: set how many run at once with --concurrency N"
                )
            if not self.target or not self.draft:
                raise ValueError(
                    "--engine vllm needs --target DIR and --draft DIR (Hugging Face model directories; "
                    "`acespec models export-hf NAME DIR` writes them from the registry's GGUFs)"
                )
        elif self.concurrency != EvalConfig.concurrency:
            raise ValueError(
                "--concurrency is --engine vllm's; the llama.cpp harness runs jobs at once with --parallel N"
            )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["budget"] = self.budget
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EvalConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ------------------------------------------------------------------------------------------ arms


@dataclass(frozen=True)
class Arm:
    label: str  # canonical: rule spec + "+guard" suffixes, e.g. "cactus:delta=0.35+support"
    rule: RuleSpec
    support: bool = False
    netwin: bool = False
    force: bool = False  # budget forcing on this arm alone (a generation guard: the rule stays what it is)

    @property
    def lossless(self) -> bool:
        return self.rule.info.lossless and not self.support and not self.netwin


def split_rules(text: str | Iterable[str]) -> list[str]:
    """Split `--rules strict,cactus:delta=0.35,typical:eps=0.09,delta=0.3` into arm strings.

    A comma-separated piece that has `=` but no `:` continues the previous rule's parameters; `;` and
    whitespace always separate."""
    parts: list[str] = []
    items = [text] if isinstance(text, str) else list(text)
    for chunk in items:
        for piece in re.split(r"[;\s]+", chunk.strip()):
            for sub in piece.split(","):
                sub = sub.strip()
                if not sub:
                    continue
                head = sub.split("+", 1)[0]
                if parts and "=" in head and ":" not in head:
                    parts[-1] = parts[-1] + "," + sub
                else:
                    parts.append(sub)
    return parts


def parse_arm(text: str, extra_guards: Iterable[str] = ()) -> Arm:
    rule_text, *guards = [s.strip() for s in text.split("+")]
    spec = RuleSpec.parse(rule_text)
    for g in guards:
        if g not in ARM_GUARDS:
            raise RuleSpecError(f"unknown guard {g!r} in {text!r}; a rule takes +support, +netwin and/or +force")
    gs = set(guards)
    if not spec.info.lossless:  # --guard applies to the lossy rules only
        gs |= set(extra_guards) & set(ARM_GUARDS)
    if "netwin" in gs and spec.name == BASELINE:
        raise RuleSpecError("the net-win guard compares a relaxed rule with strict; strict+netwin means nothing")
    label = str(spec) + "".join(f"+{g}" for g in ARM_GUARDS if g in gs)
    return Arm(label, spec, "support" in gs, "netwin" in gs, "force" in gs)


def ablated(arm: Arm, ablate: Iterable[str]) -> list[Arm]:
    """The guarded copies `--ablate` puts next to `arm`: +support / +netwin for a lossy rule, +force for any."""
    out = []
    for g in ablate:
        if g == "force" and not arm.force:
            out.append(parse_arm(arm.label + "+force"))
        elif g in ("support", "netwin") and not arm.rule.info.lossless and not getattr(arm, g) and not arm.force:
            out.append(parse_arm(arm.label + "+" + g))
    return out


def build_arms(rules: Iterable[str], guards: Iterable[str] = (), ablate: Iterable[str] = ()) -> list[Arm]:
    arms: list[Arm] = []

    def add(a: Arm) -> None:
        if a.label not in {x.label for x in arms}:
            arms.append(a)

    parsed = [parse_arm(t, guards) for t in split_rules(list(rules))]
    if not any(a.label == BASELINE for a in parsed):
        parsed.insert(0, parse_arm(BASELINE))
    ablate = list(ablate)
    for a in parsed:
        add(a)
        for b in ablated(a, ablate):
            add(b)
            # +force also on the guarded copies, so every row has its forced twin
            for c in ablated(b, ["force"] if "force" in ablate else []):
                add(c)
    return arms


# ------------------------------------------------------------------------------------------ records
