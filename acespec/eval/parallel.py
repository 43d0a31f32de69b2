"""The parallel harness: several (prompt, seed, arm) jobs at once, one batched pass per model per step.

On 2 CPU cores a one-sequence pass is bound by reading the weights: the 1.5B target costs about 84 ms
for 1 token and 209 ms for 5, the 0.5B drafter 37 ms for 1 token (`docs/results/bench-cost.txt`).
Evaluating eight sequences' tokens in one pass reads the weights once for all of them, so a batched
step costs far less than eight steps. That is where the throughput comes from, for the drafter (one
token per step: the most memory-bound of all) as much as for the target.

**How.** Each running job is an ordinary `run_generation` (the single-process path, the loop written
once) in a thread of its own, on a *lane*: a `LaneModel` view of one KV sequence of a shared model
(llama.cpp with `n_slots = parallel`, one unified KV cache). A lane's `eval` does not run the model:
it hands its tokens to the `Gang` and waits. When every running job is waiting, the last one to arrive
evaluates all pending calls, one `eval_batch` per model (target blocks and drafter steps of different
jobs in the same call), and wakes the others. A finished job holds the next pass until the harness has
started its replacement, in lane order, so which jobs share each pass is fixed by the job list, not by
thread timing: a rerun of the same run makes the same passes. Between model calls the jobs' Python work (sampling,
the rules) runs as usual. Lanes keep their KV between jobs, and a free lane prefers the next job on
the prompt it already holds, so the prompt is prefilled once per lane, not once per job.

**Not batch-invariant.** One pass over a unified KV cache computes a sequence's rows in company: the
matmul tiling and the order of the attention sums depend on what else is in the batch, so rows differ
in the last bits from a one-at-a-time run, and a sampled token can flip where two candidates are
nearly tied. Outputs are therefore not identical to `--parallel 1`. The study stays paired: every
arm of every pair runs under the same batching, and batching noise favours no rule. Records carry
`parallel`; the report leaves TTLT against strict out for pairs made under different settings (time
in a shared batch is not time alone). With a batch-invariant runtime (the toy model) the records are
the same as one at a time, timings aside; the tests check that. `--batching exact` gives each lane a KV
stream and a pass of its own (the cloud's exact batching): the same texts as one at a time on
llama.cpp too (4 of 4 in a check on the default pair), but on CPU no shared weight reads, so little
speed-up; it is there for checking, and for runtimes where a pass per sequence is cheap.

**Net-win guard.** Its decision for a job depends on every earlier job of its arm, so an arm with the
guard has at most one job in flight, in job order; the other lanes run other arms meanwhile. Resume
replays finished records in the same order as the sequential harness, so decisions match.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np

from acespec.eval.generation import Generation, run_generation
from acespec.eval.harness import Harness, Job, load_pair, progress_bar, seed_for
from acespec.models.base import Model, ModelError, check_compatible


@dataclass(eq=False)
class _Call:
    model: Model  # the shared model
    slot: int
    new: list[int]
    want: int
    rows: np.ndarray | None = None  # [want, V] once evaluated
    error: BaseException | None = None


class Gang:
    """Gathers the model calls of the running jobs and evaluates them together (see the module docstring).

    `live` counts the jobs that will call again before they finish. A flush happens when all of them
    are waiting and nothing is *held*: a finished job holds the gang until the harness has replaced it
    (`settle`, then `resume`), so which jobs share a pass never depends on thread timing, and the calls
    of a pass are ordered by lane. No two threads ever touch a model at once (rollbacks take the lock)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._live = 0
        self._pending: list[_Call] = []
        self._hold = 1  # the harness is dispatching the first jobs
        self.flushes = 0  # batched steps
        self.calls = 0  # model calls they served

    def join(self) -> None:
        with self.lock:
            self._live += 1

    def leave(self) -> None:
        """A job finished: hold the gang until the harness has seen it and started what replaces it."""
        with self.lock:
            self._live -= 1
            self._hold += 1
            self.lock.notify_all()

    def settle(self) -> None:
        """Wait until every running job is waiting on a call (its finished company has left by then)."""
        with self.lock:
            while len(self._pending) < self._live:
                self.lock.wait()

    def resume(self) -> None:
        """The harness has replaced the finished jobs: let the next pass go once everyone is waiting."""
        with self.lock:
            self._hold = 0
            self._flush_if_ready()

    def call(self, model: Model, slot: int, new: list[int], want: int) -> np.ndarray:
        c = _Call(model, slot, list(new), want)
        with self.lock:
            self._pending.append(c)
            self.lock.notify_all()  # `settle` may be waiting for this
            self._flush_if_ready()
            while c.rows is None and c.error is None:
                self.lock.wait()
        if c.error is not None:
            raise c.error
        assert c.rows is not None  # the wait above ends with rows or an error
        return c.rows

    def _flush_if_ready(self) -> None:  # holds the lock
        if self._hold or not self._pending or len(self._pending) < self._live:
            return
        calls, self._pending = sorted(self._pending, key=lambda c: c.slot), []
        groups: dict[int, list[_Call]] = {}
        for c in calls:
            groups.setdefault(id(c.model), []).append(c)
        for group in groups.values():
            try:
                rows = group[0].model.eval_batch([(c.slot, c.new, c.want) for c in group])
                for c, r in zip(group, rows):
                    c.rows = r
            except BaseException as e:  # every caller of the failed batch hears it
                for c in group:
                    c.error = e
        self.flushes += 1
        self.calls += len(calls)
        self.lock.notify_all()


class LaneModel(Model):
    """One KV sequence (`lane`) of a shared model, as a Model of its own whose evals go through a Gang."""

    def __init__(self, shared: Model, lane: int, gang: Gang, n_ctx: int) -> None:
        super().__init__()
        if lane >= shared.n_slots:
            raise ModelError(
                f"{shared.name} holds {shared.n_slots} KV sequences; lane {lane} needs more "
                "(--parallel needs a runtime with one sequence per lane: llama.cpp or the toy model)"
            )
        self.shared, self.lane, self.gang = shared, lane, gang
        self.name = f"{shared.name}[{lane}]"
        self.vocab_size = shared.vocab_size
        self.n_ctx = n_ctx  # this lane's share of the unified cache
        self.tokenizer = shared.tokenizer
        with gang.lock:
            shared.open_slot(lane)

    def _eval(self, new: list[int], want: int) -> np.ndarray:
        return self.gang.call(self.shared, self.lane, new, want)

    def _rollback(self, n: int) -> None:
        with self.gang.lock:
            prev = self.shared.slot
            try:
                self.shared.activate(self.lane)
                self.shared.rollback(n)
            finally:
                self.shared.activate(prev)


def make_lanes(target: Model, draft: Model, n: int, n_ctx: int) -> tuple[Gang, list[tuple[LaneModel, LaneModel]]]:
    gang = Gang()
    return gang, [(LaneModel(target, i, gang, n_ctx), LaneModel(draft, i, gang, n_ctx)) for i in range(n)]


class _Scheduler:
    """Which job a free lane runs next: job order, except that a lane prefers the prompt it holds, and an
    arm under the net-win guard runs one job at a time, its finished records replayed in order."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.queue: list[Job] = list(h.jobs)
        self.busy_arms: set[str] = set()  # net-win arms with a job in flight
        self.results: dict[str, dict] = {}

    def next(self, prompt_id: str | None) -> Job | None:
        blocked: set[str] = set()
        first = None
        keep: list[Job] = []
        chosen = None
        for j in self.queue:
            label = j.arm.label
            if chosen is not None:
                keep.append(j)
                continue
            if j.arm.netwin and (label in blocked or label in self.busy_arms):
                blocked.add(label)  # a later job of this arm waits for the earlier ones
                keep.append(j)
                continue
            if j.key in self.h.done:
                self.results[j.key] = self.h.replay(j)  # in job order, for the guard's sake
                continue
            if j.arm.netwin:
                blocked.add(label)
            if j.item.id == prompt_id or prompt_id is None:
                chosen = j
                continue
            if first is None:
                first = j
            keep.append(j)
        if chosen is None and first is not None:
            chosen = first
            keep.remove(first)
        self.queue = keep
        if chosen is not None and chosen.arm.netwin:
            self.busy_arms.add(chosen.arm.label)
        return chosen

    def finished(self, job: Job) -> None:
        self.busy_arms.discard(job.arm.label)


def run_parallel(h: Harness, *, target=None, draft=None, progress: bool = True) -> list[dict]:
    """Run the harness's jobs `cfg.parallel` at a time; returns the records of the job set, in job order."""
    cfg = h.cfg
    n = cfg.parallel
    sched = _Scheduler(h)
    if not h.todo:
        while sched.next(None) is not None:  # replays only
            pass
        return [sched.results[j.key] for j in h.jobs]
    if target is None:
        if cfg.batching == "shared":
            # one unified KV cache per model, a lane's n_ctx of it per lane: one pass for every lane, the
            # weights read once, which is the point
            target, draft = load_pair(cfg, n_ctx=cfg.n_ctx * n, n_slots=n, batch_invariant=False)
        else:
            # a KV stream of n_ctx per lane and a pass per lane: the same bits as one at a time
            target, draft = load_pair(cfg, n_ctx=cfg.n_ctx, n_slots=n, batch_invariant=True)
    check_compatible(draft, target)
    gang, lanes = make_lanes(target, draft, n, cfg.n_ctx)
    held: list[str | None] = [None] * n  # the prompt each lane's KV holds
    free = list(range(n))  # lanes without a job
    done_q: queue.Queue = queue.Queue()
    running = 0
    error: BaseException | None = None
    bar = progress_bar(h) if progress else None

    def work(lane: int, job: Job, rule, support: bool, choice: str | None, ids: list[int]) -> None:
        t, d = lanes[lane]
        out: Generation | BaseException
        try:
            out = run_generation(
                t, d, ids, cfg, rule, seed_for(job.seed, job.item.id), support=support, force=job.arm.force
            )
        except BaseException as e:  # reported to the main thread, which stops dispatching
            out = e
        done_q.put((lane, job, rule, support, choice, out))  # before leaving: `settle` then finds it queued
        gang.leave()

    def dispatch() -> None:
        nonlocal running
        for lane in sorted(free):  # lane order, so a rerun puts the same jobs in the same lanes
            if error is not None:
                return
            job = sched.next(held[lane])
            if job is None:
                return
            free.remove(lane)
            rule, support, choice = h.decide(job)
            ids = h.prompt(target.tokenizer, job)
            held[lane] = job.item.id
            gang.join()  # before the thread starts: a pass must wait for its first call
            threading.Thread(
                target=work, args=(lane, job, rule, support, choice, ids), daemon=True, name=f"acespec-eval-lane{lane}"
            ).start()
            running += 1

    try:
        dispatch()
        gang.resume()
        while running:
            finished = [done_q.get()]
            gang.settle()  # every job that finished with this pass has queued its result by now
            while not done_q.empty():
                finished.append(done_q.get_nowait())
            finished.sort(key=lambda f: f[0])
            ok = []
            for lane, job, rule, support, choice, out in finished:
                running -= 1
                free.append(lane)
                sched.finished(job)
                if isinstance(out, BaseException):
                    error = error or out
                    held[lane] = None  # its KV state is unknown: the next job there re-syncs from scratch
                    continue
                h.observe(job, out, rule, support)  # a net-win arm's next decision depends on it
                ok.append((job, rule, support, choice, out))
            dispatch()
            gang.resume()
            for job, rule, support, choice, out in ok:  # scoring (HumanEval runs tests) while the lanes work
                ids = h.prompt(target.tokenizer, job)
                sched.results[job.key] = h.finish(
                    job,
                    out,
                    target.tokenizer,
                    rule,
                    support,
                    choice,
                    len(ids),
                    observed=True,
                    parallel=n,
                    batching=cfg.batching,
                )
                if bar is not None:
                    bar.set_postfix_str(f"{job.arm.label} {job.item.id} s{job.seed}", refresh=False)
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        h.close()
    if error is not None:
        raise error
    return [sched.results[j.key] for j in h.jobs if j.key in sched.results]
