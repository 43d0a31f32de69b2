"""The length-inflation harness: run every (rule, prompt, seed) through the single-process engine.

Acceptance is not speed: a relaxed rule that accepts more draft tokens per round (`l`) can also make
the model write more tokens (`lambda = L / L_strict`). This module produces the raw observations; the
`report` module turns them into verdicts.

**Arms.** Each entry of `--rules` is an *arm*: a rule spec (`strict`, `cactus:delta=0.35`,
`typical:eps=0.09,delta=0.3`) optionally followed by guards, `+support`, `+netwin` and/or `+force`
(`cactus:delta=0.35+support`). `--guard support` / `--guard netwin` add that guard to every lossy rule
in the list (lossless rules are left alone: they are the baseline). `--guard budget` is a generation
guard and applies to every arm, strict included, so lengths stay comparable. `strict` is added if
missing: it is the baseline that lambda is measured against.

**Ablations.** `--ablate support,netwin,force` keeps every arm and adds guarded copies as rows next to
it: `X+support` and `X+netwin` after each lossy rule `X`, `X+force` (budget forcing on that arm
alone, needs `--think`) after every arm, strict included. A `+force` arm runs the same (prompt, seed)
pairs with the same run seeds as its unforced arm, so (one at a time, or `--parallel` with exact
batching) the two share every token up to the forcing point and the report can count, run by run,
what forcing rescued and what it broke.

- `+support`: the support filter of `acespec.verify.guards` (reject a draft token with `p < min_p` or
  rank > `max_rank`) wrapped around the rule, on the target side.
- `+netwin`: the net-win guard of `acespec.control.guards`, fed after every request of the arm with
  its output length and accepted-per-round; before every request it picks the relaxed rule or
  `strict`. Records say which (`rule_used`). On resume its state is rebuilt by replaying the finished
  records of the arm in job order.
- budget forcing (`--think --guard budget`): the engine has no way to inject tokens mid-generation, so
  the harness splits the generation: it generates up to the forcing point `ceil(fraction *
  max_tokens)` tokens (earlier only if the marker plus one answer token would not fit after it); if the output is then still inside the `<think>` trace, it appends the end-of-
  thinking marker (`"\\n</think>\\n\\n"`, tokenised with special tokens allowed) to the context and
  generates again with what is left of the budget; if the trace had already closed it just continues.
  The marker tokens count as output tokens (they are in the answer) but not as rounds. The second
  segment reuses the target's and drafter's KV caches (the prompt is not re-evaluated) and is seeded
  from the same run seed.

**Prompting.** Chat prompts (the default pair is instruct-tuned): one user turn with the item's text.
With `--think`, a system turn asks the model to reason inside `<think>...</think>` and then answer,
and the assistant turn is pre-filled with `<think>\\n` so every output starts inside the trace (the
default pair does not think natively; a model that does works the same way). HumanEval in
`completion` mode feeds the raw stub instead.

**Sampling and seeds.** Relaxed rules read `q`, so sampling is at temperature > 0 (default 0.7, no
top-k / top-p, so the tails that relaxed rules let through are visible in the accepted-token
statistics). Every arm uses the same run seed for a given (prompt, seed) pair: `seed_for(seed,
prompt_id)`, so lambda compares like with like. (Two rules share the random stream only until their
first different decision; the pairing removes prompt-to-prompt variance, not sampling variance.)

**Timing.** Time to last token runs from the start of generation to the last emitted token. The
prompt is evaluated into both models' KV caches before the clock starts, identically for every rule
(the caches are reused between jobs, so otherwise the first rule on a prompt alone would pay for the
prefill). Two cores are shared on the development machines: read times as ratios within one run.

**Records.** `records.jsonl` gets one JSON object per finished job, appended and flushed as the job
finishes; its key is `arm|prompt_id|seed`. A resumed run skips every key already there (a torn last
line of an interrupted write is ignored and overwritten).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from acespec.eval.generation import (  # re-exported in __all__: the harness's public names
    THINK_CLOSE,
    THINK_MARKER,
    THINK_OPEN,
    THINK_SYSTEM,
    Generation,
    SupportFilteredSpec,
    analyse,
    prefill,
    prompt_ids,
    run_generation,
    token_index_of_byte,
)
from acespec.eval.datasets import Item, load_items
from acespec.verify import RuleSpec, RuleSpecError

GUARD_NAMES = ("support", "netwin", "budget")
ARM_GUARDS = ("support", "netwin", "force")
ABLATIONS = ARM_GUARDS  # what --ablate can add next to each arm
BASELINE = "strict"

# Settings that change what a record means: a resumed run must not mix records made under others.
IDENTITY_FIELDS = (
    "dataset", "draft", "target", "max_tokens", "think", "budget", "k", "temperature", "top_k", "top_p",
    "data_seed", "min_p", "max_rank", "budget_fraction", "humaneval_mode", "netwin_min", "min_chars", "max_chars",
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
    batching: str = "shared"  # --parallel: shared (one pass, weights read once) | exact (a pass per job, same bits as alone)
    engine: str = "llama"  # llama: the single-process engine | vllm: vLLM's own speculative decoding (vllm_runner)
    concurrency: int = 16  # --engine vllm: jobs in flight at once (vLLM's max_num_seqs)
    humaneval_mode: str = "chat"  # chat | completion
    exec_timeout: float = 10.0  # HumanEval: seconds per program
    min_chars: int = 32  # ShareGPT length filter (characters of the first user turn)
    max_chars: int = 2000

    @property
    def budget(self) -> bool:
        return "budget" in self.guards

    def validate(self) -> None:
        from acespec.eval.datasets import DATASETS

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
                raise ValueError("--guard budget already forces every arm; +force arms compare forced with unforced runs")
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
                raise ValueError("--parallel and --batching are the llama.cpp harness's; on --engine vllm, vLLM's "
                                 "scheduler batches the jobs: set how many run at once with --concurrency N")
            if not self.target or not self.draft:
                raise ValueError("--engine vllm needs --target DIR and --draft DIR (Hugging Face model directories; "
                                 "`acespec models export-hf NAME DIR` writes them from the registry's GGUFs)")
        elif self.concurrency != EvalConfig.concurrency:
            raise ValueError("--concurrency is --engine vllm's; the llama.cpp harness runs jobs at once with --parallel N")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["budget"] = self.budget
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EvalConfig":
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


def seed_for(seed: int, prompt_id: str) -> int:
    """The run seed of (seed, prompt): the same for every arm."""
    return (int(seed) * 1_000_003 + zlib.crc32(prompt_id.encode("utf-8"))) & 0x7FFFFFFF


def record_key(arm: str, prompt_id: str, seed: int) -> str:
    return f"{arm}|{prompt_id}|{int(seed)}"


def read_records(path: str | Path) -> list[dict]:
    """All complete records of a records.jsonl (a torn last line is skipped)."""
    out: list[dict] = []
    p = Path(path)
    if not p.exists():
        return out
    with open(p, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "key" in rec:
                out.append(rec)
    return out


class RecordWriter:
    """Appends one JSON line per record and flushes it to disk at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # cut a torn last line left by an interrupted write, so the next record starts on its own line
        if self.path.exists():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                with open(self.path, "r+b") as f:
                    f.truncate(keep)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


# ------------------------------------------------------------------------------------------ the harness


@dataclass
class Job:
    item: Item
    seed: int
    arm: Arm

    @property
    def key(self) -> str:
        return record_key(self.arm.label, self.item.id, self.seed)


def make_record(job: Job, gen: Generation, analysis: dict, rule_used: str, prompt_len: int, guard_choice: str | None) -> dict:
    probs = [round(p, 5) for p, _ in gen.support]
    ranks = [int(r) for _, r in gen.support]
    rec = {
        "key": job.key,
        "arm": job.arm.label,
        "rule_used": rule_used,
        "prompt_id": job.item.id,
        "dataset": job.item.kind,
        "seed": job.seed,
        "run_seed": seed_for(job.seed, job.item.id),
        "prompt_tokens": prompt_len,
        "length": len(gen.tokens),
        "rounds": gen.rounds,
        "drafted": gen.drafted,
        "accepted": gen.accepted,
        "l": gen.accepted / gen.rounds if gen.rounds else 0.0,
        "tau": 1.0 + gen.accepted / gen.rounds if gen.rounds else 0.0,
        "wall_s": round(gen.wall_s, 5),
        "ttft_s": round(gen.ttft_s, 5),
        "forced": gen.forced,
        "marker_tokens": gen.marker_tokens,
        "acc_p": probs,
        "acc_rank": ranks,
    }
    if guard_choice is not None:
        rec["guard_choice"] = guard_choice
    rec.update(analysis)
    rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return rec


class Harness:
    """What the sequential and the parallel harness share: the job list, the finished records, the net-win
    guards, and turning a finished generation into a written record."""

    def __init__(self, cfg: EvalConfig, out: Path, log: Callable[[str], None] | None = None) -> None:
        from acespec.control.guards import NetWinConfig, NetWinGuard

        self.cfg = cfg
        self.arms = build_arms(cfg.rules, cfg.guards, cfg.ablate)
        items = load_items(cfg.dataset, cfg.n, data_seed=cfg.data_seed, min_chars=cfg.min_chars, max_chars=cfg.max_chars)
        self.jobs = [Job(it, s, a) for it in items for s in cfg.seeds for a in self.arms]
        self.path = out / "records.jsonl"
        self.done = {r["key"]: r for r in read_records(self.path)}
        self.todo = [j for j in self.jobs if j.key not in self.done]
        if log:
            log(f"{len(self.jobs)} jobs ({len(self.arms)} rules x {len(items)} prompts x {len(cfg.seeds)} seeds), "
                f"{len(self.jobs) - len(self.todo)} already done")
        self.guards = {
            a.label: NetWinGuard(str(a.rule) + ("+support" if a.support else ""), NetWinConfig(n_min=cfg.netwin_min))
            for a in self.arms if a.netwin
        }
        self.writer: RecordWriter | None = None
        self._prompts: dict[str, list[int]] = {}

    def replay(self, job: Job) -> dict:
        """A finished job of this run: feed its decision and observation to its arm's guard, in job order."""
        rec = self.done[job.key]
        guard = self.guards.get(job.arm.label)
        if guard is not None:
            guard.use_relaxed(job.item.kind)
            guard.observe(job.item.kind, rec["rule_used"], rec["length"], rec["l"])
        return rec

    def decide(self, job: Job) -> tuple[RuleSpec, bool, str | None]:
        """(rule, support filter, net-win guard choice) for a job about to run."""
        arm, guard = job.arm, self.guards.get(job.arm.label)
        if guard is None:
            return arm.rule, arm.support, None
        if guard.use_relaxed(job.item.kind):
            return arm.rule, arm.support, "relaxed"
        return RuleSpec.parse(BASELINE), False, "strict"

    def prompt(self, tokenizer, job: Job) -> list[int]:
        ids = self._prompts.get(job.item.id)
        if ids is None:
            ids = self._prompts[job.item.id] = prompt_ids(tokenizer, job.item, self.cfg)
        return ids

    def observe(self, job: Job, gen: Generation, rule: RuleSpec, support: bool) -> None:
        """Feed a finished generation to its arm's net-win guard (what the arm's next decision depends on)."""
        guard = self.guards.get(job.arm.label)
        if guard is not None:
            guard.observe(job.item.kind, str(rule) + ("+support" if support else ""), len(gen.tokens),
                          gen.accepted / gen.rounds if gen.rounds else 0.0)

    def finish(self, job: Job, gen: Generation, tokenizer, rule: RuleSpec, support: bool, choice: str | None,
               prompt_len: int, *, observed: bool = False, **extra) -> dict:
        """Score a finished generation, feed the arm's guard (unless `observed` already), write and keep the record."""
        rule_used = str(rule) + ("+support" if support else "")
        rec = make_record(job, gen, analyse(job.item, gen, tokenizer, self.cfg), rule_used, prompt_len, choice)
        rec.update(extra)
        if not observed:
            self.observe(job, gen, rule, support)
        if self.writer is None:
            self.writer = RecordWriter(self.path)
        self.writer.write(rec)
        self.done[job.key] = rec
        return rec

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def load_pair(cfg: EvalConfig, **kwargs):
    """The (target, drafter) the config names; kwargs go to the runtime (llama.cpp: n_slots, ...)."""
    from acespec.models import load_model
    from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    n_ctx = kwargs.pop("n_ctx", cfg.n_ctx)
    return (load_model(cfg.target or DEFAULT_TARGET, n_ctx=n_ctx, **kwargs),
            load_model(cfg.draft or DEFAULT_DRAFT, n_ctx=n_ctx, **kwargs))


def run_eval(
    cfg: EvalConfig,
    out_dir: str | Path,
    *,
    target=None,
    draft=None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Run every job not yet in `out_dir/records.jsonl`; returns the records of this job set (old + new).
    With `cfg.parallel > 1` the jobs run several at a time (`acespec.eval.parallel`); with `cfg.engine ==
    "vllm"` on vLLM (`acespec.eval.vllm_runner`)."""
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h = Harness(cfg, out, log)
    if cfg.engine == "vllm":
        from acespec.eval.vllm_runner import run_vllm

        return run_vllm(h, progress=progress)
    if cfg.parallel > 1:
        from acespec.eval.parallel import run_parallel

        return run_parallel(h, target=target, draft=draft, progress=progress)
    if h.todo and target is None:
        target, draft = load_pair(cfg)
    if h.todo:
        from acespec.models.base import check_compatible

        check_compatible(draft, target)
    bar = progress_bar(h) if progress else None
    results: list[dict] = []
    try:
        for job in h.jobs:
            if job.key in h.done:
                results.append(h.replay(job))
                continue
            rule, support, choice = h.decide(job)
            ids = h.prompt(target.tokenizer, job)
            if bar is not None:
                bar.set_postfix_str(f"{job.arm.label} {job.item.id} s{job.seed}", refresh=False)
            gen = run_generation(target, draft, ids, cfg, rule, seed_for(job.seed, job.item.id), support=support,
                                 force=job.arm.force)
            results.append(h.finish(job, gen, target.tokenizer, rule, support, choice, len(ids)))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        h.close()
    return results


def progress_bar(h: Harness):
    if not h.todo:
        return None
    from tqdm import tqdm

    return tqdm(total=len(h.jobs), initial=len(h.jobs) - len(h.todo), file=sys.stderr, unit="run", dynamic_ncols=True)


__all__ = [
    "THINK_CLOSE", "THINK_MARKER", "THINK_OPEN", "THINK_SYSTEM", "Arm", "EvalConfig", "Generation", "Harness", "Job",
    "RecordWriter", "SupportFilteredSpec", "analyse", "build_arms", "parse_arm", "prefill", "prompt_ids",
    "load_pair", "read_records", "record_key", "run_eval", "run_generation", "seed_for", "split_rules", "token_index_of_byte",
]
