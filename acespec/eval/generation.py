"""One generation of the length-inflation harness, and what is measured on it (see `acespec.eval.runner`).

`run_generation` prefills the prompt, then runs the single-process path once (twice under budget
forcing: up to the forcing point, then after the end-of-thinking marker); `analyse` scores the output
and says where its tokens fall.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from acespec.control.guards import BudgetForcer
from acespec.eval import humaneval, mathgen
from acespec.eval.config import EvalConfig
from acespec.eval.datasets import Item
from acespec.loop import SpecConfig, generate
from acespec.verify import RULES, RuleSpec
from acespec.verify.guards import verify_with_support_filter

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
THINK_MARKER = "\n</think>\n\n"
THINK_SYSTEM = (
    "You are a careful assistant. First reason step by step inside <think> and </think> tags. "
    "After </think>, give your final answer."
)


class SupportFilteredSpec(RuleSpec):
    """A rule spec whose verify function runs the rule under the support filter.

    The target verifier calls `verify_block(self.rule, ...)`, which looks the rule up through
    `spec.info`; overriding `info` here puts the filter in that path without changing the engine."""

    # set once in __init__ (the spec is frozen, as RuleSpec is)
    _base: RuleSpec
    _min_p: float
    _max_rank: int

    def __init__(self, base: RuleSpec, min_p: float, max_rank: int) -> None:
        object.__setattr__(self, "name", base.name)
        object.__setattr__(self, "params", base.params)
        object.__setattr__(self, "_base", RuleSpec(base.name, base.params))
        object.__setattr__(self, "_min_p", float(min_p))
        object.__setattr__(self, "_max_rank", int(max_rank))

    @property
    def info(self):
        base_spec, min_p, max_rank = self._base, self._min_p, self._max_rank

        def fn(draft, q, p, rng, **kw):
            return verify_with_support_filter(base_spec, draft, q, p, rng, min_p=min_p, max_rank=max_rank, **kw)

        return dataclasses.replace(RULES[self.name], fn=fn)

    def __str__(self) -> str:
        return str(self._base) + "+support"


@dataclass
class Generation:
    tokens: list[int]
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_s: float = 0.0  # time to last token: from the start of generation (prompt already prefilled) to the last token
    ttft_s: float = 0.0
    support: list[tuple[float, int]] = field(default_factory=list)  # (p, rank) of every accepted draft token
    forced: bool = False  # budget forcing injected the end-of-thinking marker
    marker_tokens: int = 0
    segments: int = 1


def prompt_ids(tokenizer, item: Item, cfg: EvalConfig) -> list[int]:
    if item.kind == "humaneval" and cfg.humaneval_mode == "completion":
        ids = tokenizer.encode(item.payload["problem"]["prompt"])
    elif cfg.think:
        msgs = [{"role": "system", "content": THINK_SYSTEM}, {"role": "user", "content": item.text}]
        ids = list(tokenizer.chat_prompt(msgs)) + tokenizer.encode(THINK_OPEN + "\n")
    else:
        ids = list(tokenizer.chat_prompt([{"role": "user", "content": item.text}]))
    if not ids:
        raise ValueError(f"prompt of {item.id} is empty after tokenization")
    return ids


def prefill(model, ids: list[int]) -> None:
    """Make the model's KV cache hold ids[:-1] (what the engine syncs to before its first pass)."""
    n = model.sync(ids[:-1])
    model.eval(ids[n:-1], last=0)


def run_generation(
    target, draft, ids: list[int], cfg: EvalConfig, rule: RuleSpec, seed: int, *, support: bool, force: bool = False
) -> Generation:
    """Generate one answer (two segments under budget forcing: `--guard budget`, or `force` for a `+force`
    arm); see `acespec.eval.runner`'s docstring."""
    tok = target.tokenizer
    # Evaluate the prompt into both KV caches before the clock starts, the same way for every rule: with
    # caches reused across jobs, whichever rule ran first on a prompt would otherwise pay its prefill alone.
    for m in (target, draft):
        if m is not None:
            prefill(m, ids)
    t0 = time.perf_counter()
    times: list[float] = []
    gen = Generation([])
    spec: RuleSpec = SupportFilteredSpec(rule, cfg.min_p, cfg.max_rank) if support else rule

    def segment(context: list[int], budget: int, seg_seed: int) -> list[int]:
        verifiers = []

        def hook(v) -> None:
            v.record_accepted = True
            v.rule = spec
            verifiers.append(v)

        def on_tokens(_toks: list[int]) -> None:
            times.append(time.perf_counter())

        sc = SpecConfig(
            rule=str(rule),
            k=cfg.k,
            policy="fixed",
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=seg_seed,
            max_tokens=budget,
        )
        res = generate(target, context, sc, draft=draft, on_tokens=on_tokens, verifier_hook=hook)
        gen.rounds += res.stats.rounds
        gen.drafted += res.stats.drafted
        gen.accepted += res.stats.accepted
        if verifiers:
            gen.support.extend(verifiers[0].accepted_support)
        return list(res.tokens)

    out = segments(segment, ids, cfg, tok, seed, gen, force=force)
    gen.tokens = out
    if times:
        gen.wall_s = times[-1] - t0
        gen.ttft_s = times[0] - t0
    return gen


def segments(
    segment, ids: list[int], cfg: EvalConfig, tok, seed: int, gen: Generation, *, force: bool = False
) -> list[int]:
    """The output of one job: `segment(context, budget, seed) -> tokens` once, or, under budget forcing
    (`--guard budget`, or `force` for a `+force` arm), up to the forcing point and then again after the
    end-of-thinking marker (see `acespec.eval.runner`). Sets `gen.forced`, `marker_tokens`, `segments`;
    any engine's generation (`run_generation`, the vLLM harness) goes through it."""
    if not (cfg.think and (cfg.budget or force)):
        return segment(ids, cfg.max_tokens, seed)
    forcer = BudgetForcer(
        budget=cfg.max_tokens,
        fraction=cfg.budget_fraction,
        open_tag=THINK_OPEN,
        close_tag=THINK_CLOSE,
        marker=THINK_MARKER,
        opened_in_prompt=True,
    )
    marker_ids = list(tok.encode(THINK_MARKER, special=True))
    # the forcing point, moved earlier only where the whole marker and one answer token would not fit
    cut = max(1, min(forcer.threshold, cfg.max_tokens - len(marker_ids) - 1))
    out = segment(ids, cut, seed)
    ended = bool(out) and out[-1] in tok.eos_ids
    if not ended and len(out) < cfg.max_tokens:
        # at the forcing point by construction; check() decides whether the trace is still open
        marker = forcer.check(tok.decode(out), max(len(out), forcer.threshold))
        ext: list[int] = []
        if marker is not None:
            ext = marker_ids[: cfg.max_tokens - len(out)]
            gen.forced, gen.marker_tokens = True, len(ext)
        out += ext
        left = cfg.max_tokens - len(out)
        if left > 0:
            gen.segments = 2
            out += segment(ids + out, left, (seed * 31 + 7) & 0x7FFFFFFF)
    return out


# ------------------------------------------------------------------------------------------ scoring


def token_index_of_byte(pieces: list[bytes], byte_end: int) -> int:
    """How many leading tokens it takes to produce the first `byte_end` bytes of the output."""
    total = 0
    for i, b in enumerate(pieces):
        total += len(b)
        if total >= byte_end:
            return i + 1
    return len(pieces)


def analyse(item: Item, gen: Generation, tokenizer, cfg: EvalConfig) -> dict:
    """Text, accuracy and where the tokens fall (before/after the first correct answer; in/out of the trace)."""
    toks = gen.tokens
    pieces = [tokenizer.decode_bytes([t]) for t in toks]
    out_bytes = b"".join(pieces)
    text = tokenizer.decode(toks)
    eos = bool(toks) and toks[-1] in tokenizer.eos_ids
    rec: dict = {"text": text, "finished_eos": eos, "hit_budget": (not eos) and len(toks) >= cfg.max_tokens}

    answer_text = text
    if cfg.think:
        close = out_bytes.find(THINK_CLOSE.encode())
        if close >= 0:
            think = token_index_of_byte(pieces, close + len(THINK_CLOSE))
            rec["trace_closed"] = True
            answer_text = text[text.find(THINK_CLOSE) + len(THINK_CLOSE) :] if THINK_CLOSE in text else ""
        else:
            think = len(toks)
            rec["trace_closed"] = False
            answer_text = ""  # no answer outside an unclosed trace
        rec["think_tokens"] = think
        rec["answer_tokens"] = len(toks) - think

    correct: bool | None = None
    if item.kind == "math":
        ans = int(item.payload["answer"])
        got = mathgen.parse_answer(answer_text)
        correct = got == ans
        rec["answer"] = ans
        rec["parsed_answer"] = got
        end = mathgen.first_answer_end(out_bytes, ans)
        if end is None:
            rec["pre_answer_tokens"] = None
            rec["post_answer_tokens"] = None
        else:
            t = token_index_of_byte(pieces, end)
            rec["pre_answer_tokens"] = t
            rec["post_answer_tokens"] = len(toks) - t
    elif item.kind == "humaneval":
        res = humaneval.score(item.payload["problem"], answer_text, mode=cfg.humaneval_mode, timeout=cfg.exec_timeout)
        correct = res.passed
        rec["exec_status"] = res.status
        if res.detail:
            rec["exec_detail"] = res.detail
    rec["correct"] = correct
    if gen.forced:
        rec["rescued"] = bool(correct) if correct is not None else bool(eos)
    return rec
