"""The length-inflation harness on vLLM: `acespec eval --engine vllm --target DIR --draft DIR`.

The study of `acespec.eval.runner` (same jobs, records, report, `--resume`, `--report-only`), run
through vLLM's own speculative decoding with its `draft_model` method: the drafter and the target are
both Hugging Face directories on one vLLM engine (`AsyncLLM`), whose scheduler batches every running
job. The drafter samples its drafts (`draft_sample_method="probabilistic"`), so vLLM hands its rows
(`draft_probs`) to the rejection sampler, where AceSpec's plugin (`acespec/cloud/vllm_plugin.py`)
decides each job's blocks with the job's rule. Every arm, strict included, names its rule in
`extra_args`, so every arm is decided by the same code and draws its randomness the same way; `+support`
asks the plugin for the support filter (`acespec.verify.guards`) around the rule.

**Jobs.** Up to `--concurrency` jobs run at once (vLLM's `max_num_seqs`), each in a thread of its own
that sends its segments (one, two under budget forcing: `acespec.eval.generation.segments`) as vLLM
requests and waits for them. Jobs start in job order; the net-win guard decides each job as it starts
and is fed each result as it finishes, so with more than one job in flight a decision sees the results
of the jobs of its arm finished so far, not of every earlier one (on `--resume` the finished records
are replayed in job order, as everywhere).

**Counts.** From vLLM's per-request speculative statistics (`RequestOutput.outputs[0].spec_decode_metrics`,
`per_request_spec_decode_metrics="summary"`): `drafted` is its draft tokens, `rounds` the target passes
that emitted tokens, `accepted` the drafts kept and emitted. vLLM's prefill pass emits a segment's first
token with no drafts: it is one round, so `rounds` = 1 + verify steps per segment (+ any decode step
vLLM ran without drafts, worked out from the token count), one more than AceSpec's engine counts for
the same text (its prompt is prefilled before the first round, which already carries drafts). A
verify step cut short by the budget or a stop token counts only the drafts it emitted. Arms compare
with each other within a run; l and tau are not those of the single-process path.

**What differs from the single-process path.**
- `wall_s` / `ttft_s` run from the moment a job's first request is sent, prefill and the time spent
  queued behind other jobs included, in a batch shared with them: they are not comparable with the
  single-process path's (prompt prefilled off the clock, one job at a time).
- vLLM's drafter samples at the request's temperature only (no top-k / top-p) and without the
  request's seed, so drafts, and hence records, differ from run to run; the target side is seeded.
- The accepted tokens' support statistics (`acc_p`, `acc_rank`) are not available: records carry
  empty lists, and the report shows n/a there.
- The records say `engine: vllm` and the concurrency they ran under.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from acespec.cloud.vllm_plugin import RULE_ARG, SUPPORT_ARG, support_arg
from acespec.eval.generation import Generation, segments
from acespec.eval.harness import Harness, Job, progress_bar, seed_for
from acespec.models.base import ModelError
from acespec.models.export import hf_tokenizer_fingerprint
from acespec.models.hf import TOKENIZER_FILES, HFTokenizer

SETUP_HINT = "run `bash scripts/setup.sh vllm` and run acespec from .venv-vllm"


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:  # looked up, not imported: importing vLLM takes seconds
        raise ModelError(f"acespec eval --engine vllm needs vLLM, which is not installed here: {SETUP_HINT}")


def load_tokenizer(target: str, draft: str):
    """The target directory's tokenizer (AceSpec builds the prompts and scores the texts with it), after
    checking that the drafter's vocabulary is the same one."""
    for role, d in (("--target", target), ("--draft", draft)):
        if not d or not Path(d).is_dir() or not (Path(d) / "config.json").is_file():
            raise ModelError(
                f"--engine vllm: {role} {d!r} is not a Hugging Face model directory (config.json and "
                "weights); `acespec models export-hf NAME DIR` writes one from a registry GGUF"
            )

    def has_tok(d: str) -> bool:
        return any((Path(d) / f).is_file() for f in TOKENIZER_FILES)

    if not has_tok(target):
        raise ModelError(
            f"--engine vllm: {target} has no tokenizer; the harness builds prompts with the target's "
            "(`acespec models export-hf NAME DIR` writes one with the weights)"
        )
    import transformers  # heavy: the hf extra

    def vocab(d: str) -> int | None:
        return json.loads((Path(d) / "config.json").read_text()).get("vocab_size")

    tok = HFTokenizer(transformers.AutoTokenizer.from_pretrained(target), vocab(target))
    if has_tok(draft):
        other = hf_tokenizer_fingerprint(Path(draft))
        if other != tok.fingerprint:
            raise ModelError(
                f"--engine vllm: the drafter's tokenizer ({draft}, {other}) is not the target's "
                f"({target}, {tok.fingerprint}): its drafts would be other tokens"
            )
    elif vocab(draft) != vocab(target):
        raise ModelError(
            f"--engine vllm: the drafter's vocabulary ({vocab(draft)} ids) is not the target's ({vocab(target)})"
        )
    return tok


class VllmPair:
    """The target with the drafter as vLLM's `draft_model` proposer, on an `AsyncLLM` whose event loop
    runs in a thread of its own; `segment` is called from the jobs' threads."""

    def __init__(self, cfg, eos_ids) -> None:
        self.cfg = cfg
        self.eos = sorted(int(t) for t in eos_ids)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="acespec-eval-vllm", daemon=True)
        self._thread.start()
        self._ids = itertools.count(1)
        self.llm: Any = None  # vLLM's AsyncLLM, made at start (vLLM is imported there)
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs  # heavy: the vllm extra
        from vllm.platforms import current_platform  # heavy: the vllm extra
        from vllm.v1.engine.async_llm import AsyncLLM  # heavy: the vllm extra

        c = self.cfg
        cpu = current_platform.is_cpu()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        args = AsyncEngineArgs(
            model=c.target,
            skip_tokenizer_init=True,
            max_model_len=c.n_ctx,
            enable_prefix_caching=True,
            max_num_seqs=c.concurrency,
            dtype="float32" if cpu else "auto",
            block_size=32 if cpu else None,
            gpu_memory_utilization=0.3 if cpu else 0.9,
            enforce_eager=cpu,
            generation_config="vllm",
            speculative_config={
                "method": "draft_model",
                "model": c.draft,
                "num_speculative_tokens": c.k,
                "draft_sample_method": "probabilistic",
            },
            per_request_spec_decode_metrics="summary",
        )
        self.llm = AsyncLLM.from_engine_args(args)

    def segment(
        self, context: list[int], budget: int, seed: int, extra: dict, gen: Generation, times: list[float]
    ) -> list[int]:
        """One vLLM request: up to `budget` tokens after `context`; adds its counts to `gen` (see the
        module docstring) and the arrival time of its tokens to `times`."""
        return self._call(self._segment(context, budget, seed, extra, gen, times))

    async def _segment(self, context, budget, seed, extra, gen, times) -> list[int]:
        from vllm import SamplingParams  # heavy: the vllm extra
        from vllm.sampling_params import RequestOutputKind  # heavy: the vllm extra

        c = self.cfg
        sp = SamplingParams(
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            seed=seed,
            max_tokens=budget,
            stop_token_ids=self.eos,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra,
        )
        out: list[int] = []
        metrics = None
        async for o in self.llm.generate(
            {"prompt_token_ids": list(context)}, sp, request_id=f"acespec-eval-{next(self._ids)}"
        ):
            c0 = o.outputs[0]
            if c0.token_ids:
                times.append(time.perf_counter())
                out += [int(t) for t in c0.token_ids]
            metrics = c0.spec_decode_metrics or metrics
        m = metrics.to_dict() if metrics is not None else {}
        steps, acc = int(m.get("num_spec_steps", 0)), int(m.get("num_accepted_draft_tokens", 0))
        plain = len(out) - 1 - steps - acc  # > 0: decode steps without drafts; < 0: drafts kept but cut off
        gen.rounds += (1 if out else 0) + steps + max(0, plain)
        gen.accepted += acc + min(0, plain)
        gen.drafted += int(m.get("num_draft_tokens", 0))
        return out

    def close(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None

            async def stop() -> None:  # on the loop that runs it, as AsyncLLM expects
                llm.shutdown()

            self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def rule_args(rule, support: bool, cfg) -> dict:
    """The `extra_args` asking AceSpec's plugin for `rule` (and the support filter)."""
    extra = {RULE_ARG: str(rule)}
    if support:
        extra[SUPPORT_ARG] = support_arg(cfg.min_p, cfg.max_rank)
    return extra


def run_job(pair: VllmPair, tok, ids: list[int], cfg, rule, support: bool, seed: int, force: bool) -> Generation:
    gen = Generation([])
    times: list[float] = []
    extra = rule_args(rule, support, cfg)
    t0 = time.perf_counter()
    gen.tokens = segments(
        lambda ctx, budget, s: pair.segment(ctx, budget, s, extra, gen, times), ids, cfg, tok, seed, gen, force=force
    )
    if times:
        gen.wall_s, gen.ttft_s = times[-1] - t0, times[0] - t0
    return gen


def run_vllm(h: Harness, *, progress: bool = True) -> list[dict]:
    """Run the harness's jobs on vLLM, `cfg.concurrency` at a time; returns the job set's records in job order."""
    cfg = h.cfg
    if not h.todo:  # nothing to run: no vLLM needed
        return [h.replay(j) for j in h.jobs]
    require_vllm()
    tok = load_tokenizer(cfg.target, cfg.draft)
    results: dict[str, dict] = {}
    done_q: queue.Queue = queue.Queue()
    error: BaseException | None = None
    bar = progress_bar(h) if progress else None
    pair = VllmPair(cfg, tok.eos_ids)

    def work(job: Job, rule, support: bool, choice, ids: list[int]) -> None:
        out: Generation | BaseException
        try:
            out = run_job(pair, tok, ids, cfg, rule, support, seed_for(job.seed, job.item.id), job.arm.force)
        except BaseException as e:  # reported to the main thread, which stops starting jobs
            out = e
        done_q.put((job, rule, support, choice, ids, out))

    try:
        pending = iter(h.jobs)
        running = 0
        ready: list = []  # finished and observed by their guard, to be scored and written
        while True:
            while error is None and running < cfg.concurrency:  # start jobs in job order
                job = next(pending, None)
                if job is None:
                    break
                if job.key in h.done:
                    results[job.key] = h.replay(job)
                    continue
                rule, support, choice = h.decide(job)
                ids = h.prompt(tok, job)
                threading.Thread(
                    target=work, args=(job, rule, support, choice, ids), daemon=True, name=f"acespec-eval-{job.key}"
                ).start()
                running += 1
            for job, rule, support, choice, ids, out in ready:  # scoring (HumanEval runs tests) while vLLM works
                results[job.key] = h.finish(
                    job,
                    out,
                    tok,
                    rule,
                    support,
                    choice,
                    len(ids),
                    observed=True,
                    engine="vllm",
                    concurrency=cfg.concurrency,
                )
                if bar is not None:
                    bar.set_postfix_str(f"{job.arm.label} {job.item.id} s{job.seed}", refresh=False)
                    bar.update(1)
            ready.clear()
            if not running:
                break
            job, rule, support, choice, ids, out = done_q.get()
            running -= 1
            if isinstance(out, BaseException):
                error = error or out
                continue
            h.observe(job, out, rule, support)  # before the next job of its arm is decided
            ready.append((job, rule, support, choice, ids, out))
    finally:
        if bar is not None:
            bar.close()
        h.close()
        pair.close()
    if error is not None:
        raise error
    return [results[j.key] for j in h.jobs if j.key in results]
