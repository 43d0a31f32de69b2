"""The length-inflation harness: run every (rule, prompt, seed) through the single-process path.

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

from collections.abc import Callable
from pathlib import Path

from acespec.eval.config import (  # re-exported in __all__: the harness's public names
    ABLATIONS,
    ARM_GUARDS,
    BASELINE,
    GUARD_NAMES,
    IDENTITY_FIELDS,
    Arm,
    EvalConfig,
    ablated,
    build_arms,
    parse_arm,
    split_rules,
)
from acespec.eval.generation import (
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
from acespec.eval.harness import (
    Harness,
    Job,
    RecordWriter,
    load_pair,
    make_record,
    progress_bar,
    read_records,
    record_key,
    seed_for,
)
from acespec.eval.parallel import run_parallel
from acespec.eval.vllm_runner import run_vllm
from acespec.models.base import check_compatible


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
        return run_vllm(h, progress=progress)
    if cfg.parallel > 1:
        return run_parallel(h, target=target, draft=draft, progress=progress)
    if h.todo and target is None:
        target, draft = load_pair(cfg)
    if h.todo:
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
            gen = run_generation(
                target, draft, ids, cfg, rule, seed_for(job.seed, job.item.id), support=support, force=job.arm.force
            )
            results.append(h.finish(job, gen, target.tokenizer, rule, support, choice, len(ids)))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        h.close()
    return results


__all__ = [
    "ABLATIONS",
    "ARM_GUARDS",
    "BASELINE",
    "GUARD_NAMES",
    "IDENTITY_FIELDS",
    "ablated",
    "make_record",
    "progress_bar",
    "THINK_CLOSE",
    "THINK_MARKER",
    "THINK_OPEN",
    "THINK_SYSTEM",
    "Arm",
    "EvalConfig",
    "Generation",
    "Harness",
    "Job",
    "RecordWriter",
    "SupportFilteredSpec",
    "analyse",
    "build_arms",
    "parse_arm",
    "prefill",
    "prompt_ids",
    "load_pair",
    "read_records",
    "record_key",
    "run_eval",
    "run_generation",
    "seed_for",
    "split_rules",
    "token_index_of_byte",
]
