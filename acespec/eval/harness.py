"""What the sequential, the parallel and the vLLM runs of the length-inflation harness share: the job list,
the records file, the net-win guards and the loading of the model pair (see `acespec.eval.runner`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from acespec.control.guards import NetWinConfig, NetWinGuard
from acespec.eval.config import BASELINE, Arm, EvalConfig, build_arms
from acespec.eval.datasets import Item, load_items
from acespec.eval.generation import Generation, analyse, prompt_ids
from acespec.models import load_model
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from acespec.verify import RuleSpec


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


def make_record(
    job: Job, gen: Generation, analysis: dict, rule_used: str, prompt_len: int, guard_choice: str | None
) -> dict:
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
        self.cfg = cfg
        self.arms = build_arms(cfg.rules, cfg.guards, cfg.ablate)
        items = load_items(
            cfg.dataset, cfg.n, data_seed=cfg.data_seed, min_chars=cfg.min_chars, max_chars=cfg.max_chars
        )
        self.jobs = [Job(it, s, a) for it in items for s in cfg.seeds for a in self.arms]
        self.path = out / "records.jsonl"
        self.done = {r["key"]: r for r in read_records(self.path)}
        self.todo = [j for j in self.jobs if j.key not in self.done]
        if log:
            log(
                f"{len(self.jobs)} jobs ({len(self.arms)} rules x {len(items)} prompts x {len(cfg.seeds)} seeds), "
                f"{len(self.jobs) - len(self.todo)} already done"
            )
        self.guards = {
            a.label: NetWinGuard(str(a.rule) + ("+support" if a.support else ""), NetWinConfig(n_min=cfg.netwin_min))
            for a in self.arms
            if a.netwin
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
            guard.observe(
                job.item.kind,
                str(rule) + ("+support" if support else ""),
                len(gen.tokens),
                gen.accepted / gen.rounds if gen.rounds else 0.0,
            )

    def finish(
        self,
        job: Job,
        gen: Generation,
        tokenizer,
        rule: RuleSpec,
        support: bool,
        choice: str | None,
        prompt_len: int,
        *,
        observed: bool = False,
        **extra,
    ) -> dict:
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
    n_ctx = kwargs.pop("n_ctx", cfg.n_ctx)
    return (
        load_model(cfg.target or DEFAULT_TARGET, n_ctx=n_ctx, **kwargs),
        load_model(cfg.draft or DEFAULT_DRAFT, n_ctx=n_ctx, **kwargs),
    )


def progress_bar(h: Harness):
    if not h.todo:
        return None
    return tqdm(total=len(h.jobs), initial=len(h.jobs) - len(h.todo), file=sys.stderr, unit="run", dynamic_ncols=True)
