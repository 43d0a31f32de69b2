"""The probabilistic state cache: continuations pre-drafted for the likely verdicts of a block in flight.

While the edge waits for the verdict of block `b` (draft tokens x_0..x_{k-1}), it knows what the
verdict can be: `(accepted n, next token t)`. For each likely outcome it drafts, ahead of time, the
block that would follow `committed + x[:n] + [t]`, and keeps the drafter's KV for it in a forked
sequence. When the verdict arrives, a hit is one dict lookup: the next block is already drafted and
the drafter state is already in place, so the edge sends at once instead of drafting on the
critical path. A miss rolls back and drafts fresh.

Outcomes and their estimated probabilities (a_i = measured acceptance at block position i):
- rejection at i with recovered token t != x_i:  P = prod_{j<i} a_j * (1 - a_i) * w_i(t)
- full accept with bonus t:                      P = prod_{j<k} a_j * w_k(t)
where w_i ranks the alternatives at position i: q_i(t) renormalised over t != x_i; in coupled mode the
target's token is argmax(log p + g) with the shared Gumbel noise g, so alternatives are ranked by
log q + g instead (the drafter's best guess of that argmax), which is much sharper. In pipelined mode
the drafter's own bonus guess is already the next block in flight, so it is not cached again.

Mechanism for the drafter state: llama.cpp's unified KV cache holds several sequences; a fork tags the
committed prefix's cells with another sequence id (no copy, no compute), and an entry owns only the
cells of its own few tokens. The alternative, saving and restoring whole context states, copies the
full KV (tens of MB) per entry. Entries live in an LRU map whose byte budget counts everything an
entry holds: the KV of its own tokens, its q rows, and its token list.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from acespec.draft.chain import ChainDrafter

ENTRY_OVERHEAD = 256  # bytes of bookkeeping per entry (key, lists, object headers), counted in the budget
# KV sequences a drafter needs for the cache: its own, a batch being drafted, and the entries of two
# blocks in flight (llama.cpp's unified cache shares cells, so a sequence costs only the cells it adds)
DRAFTER_SLOTS = 40


@dataclass
class CacheConfig:
    budget_bytes: int = 32 << 20  # memory the cache may hold per session
    alternatives: int = 3  # alternatives considered per position
    max_entries_per_block: int = 16  # most outcomes planned for one block in flight (the likeliest go first)
    min_prob: float = 0.003  # skip outcomes less likely than this
    depth: int = 4  # tokens drafted per entry (the most probable outcomes)
    shallow_depth: int = (
        1  # tokens drafted for the less probable ones (a first token already puts their state in place)
    )
    # Most tokens pre-drafted for any outcome; a hit's block is finished after the verdict. Deeper entries
    # for outcomes that come 1-3 times a run took the drafter from the blocks the target was waiting for:
    # at split cores, 100 ms, 2 instead of the block's depth cut pre-drafting from 1.2 to 0.7 s a run and
    # lifted AceSpec from 0.75-0.79 to 0.81-0.84 of its ceiling in 3 runs each (docs/results/bench-ceiling.txt).
    predraft_depth: int = 2
    batch: int = (
        4  # outcomes pre-drafted side by side in one batched pass (breadth first; a pass delays a verdict's answer)
    )


@dataclass
class Entry:
    key: tuple[int, int, int]  # (block seq, accepted n, next token t)
    tokens: list[int]  # the pre-drafted block that follows committed + x[:n] + [t]
    q: np.ndarray | None  # [len(tokens), V] (sparse-truncated rows; only for rules that need q)
    slot: int  # drafter KV sequence holding committed + x[:n] + [t] + tokens[:-1]
    prob: float  # estimated probability of this outcome
    nbytes: int  # what it costs against the budget
    draft_s: float  # time it took to pre-draft (what a hit saves)
    kind: str  # "reject" or "bonus"
    base: int = 0  # committed length before the block's draft tokens
    lead: list[int] = field(default_factory=list)  # the outcome's tokens after `base`: x[:n] + [t]
    top: list = field(default_factory=list)  # the drafter's candidates at each of `tokens`' positions


@dataclass
class CacheMetrics:
    lookups: int = 0  # verdicts that invalidated the speculation and consulted the cache
    hits: int = 0
    lookups_rejected: int = 0  # lookups after a block with a rejected draft token
    hits_rejected: int = 0  # ... that hit
    covered: int = 0  # lookups whose outcome had been planned (drafted in time or not): prediction quality
    covered_rejected: int = 0
    hits_reject: int = 0  # hits on a rejection outcome
    hits_bonus: int = 0  # hits on a full-accept outcome with another bonus token
    entries_drafted: int = 0
    evictions: int = 0
    bytes_held: int = 0
    peak_bytes: int = 0
    time_saved_s: float = 0.0  # drafting time the hits took off the critical path
    lookup_s: float = 0.0  # total time spent in lookups
    predraft_s: float = 0.0  # time spent pre-drafting (off the critical path)
    steps: int = 0  # batched pre-drafting passes

    def as_dict(self) -> dict:
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_rate": round(self.hits / self.lookups, 4) if self.lookups else 0.0,
            "lookups_rejected": self.lookups_rejected,
            "hit_rate_rejected": round(self.hits_rejected / self.lookups_rejected, 4) if self.lookups_rejected else 0.0,
            "coverage": round(self.covered / self.lookups, 4) if self.lookups else 0.0,
            "coverage_rejected": round(self.covered_rejected / self.lookups_rejected, 4)
            if self.lookups_rejected
            else 0.0,
            "hits_reject": self.hits_reject,
            "hits_bonus": self.hits_bonus,
            "entries_drafted": self.entries_drafted,
            "evictions": self.evictions,
            "bytes_held": self.bytes_held,
            "peak_bytes": self.peak_bytes,
            "time_saved_s": round(self.time_saved_s, 4),
            "lookup_us_mean": round(1e6 * self.lookup_s / self.lookups, 2) if self.lookups else 0.0,
            "predraft_s": round(self.predraft_s, 4),
            "predraft_steps": self.steps,
        }


class StateCache:
    def __init__(
        self,
        drafter: ChainDrafter,
        config: CacheConfig | None = None,
        *,
        coupled: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.drafter = drafter
        self.model = drafter.model
        self.cfg = config or CacheConfig()
        self.clock = clock  # step timing, which the scheduler's budgets compare with the loop's clock
        self.coupled = coupled  # rankings come from the shared Gumbel noise: weight them geometrically
        self.entries: OrderedDict[tuple[int, int, int], Entry] = OrderedDict()
        self.metrics = CacheMetrics()
        self.plan: list[tuple[float, tuple[int, int, int], list[int], int, str]] = []  # pending outcomes
        self.planned: set[tuple[int, int, int]] = set()  # every outcome planned for blocks in flight
        self._depth: dict[tuple[int, int, int], int] = {}  # tokens to pre-draft, per planned outcome
        self._active: list[dict] = []  # the entries being drafted, a token each per step, most probable first
        self._step_s: dict[int, float] = {}  # measured seconds of a batched step, by outcomes in the batch
        self.kv_bytes_per_token = int(getattr(self.model, "kv_bytes_per_token", 0))

    # -- planning ---------------------------------------------------------------------------------
    def plan_block(
        self,
        seq: int,
        committed: Sequence[int],
        draft: Sequence[int],  # int[k] the block's draft tokens (after any overlap)
        top: Sequence[tuple[np.ndarray, np.ndarray]],  # per position 0..k(+1): the drafter's best candidates
        accept: Sequence[float],  # estimated conditional acceptance per block position
        *,
        bonus_guess: int | None,  # the drafter's own bonus guess already in flight (pipelined), else None
        prior: float = 1.0,  # probability that the block's own assumptions hold (earlier blocks accepted in full)
        depth: int | None = None,  # tokens to pre-draft for the likeliest outcomes; None = cfg.depth
    ) -> None:
        """Queue the likely outcomes of block `seq`; the queue holds every block's, most probable first.
        The caller passes `depth` (the depth its next block will have) rather than writing it into the
        shared config, which other users of the config would then see change under them."""
        if not top or self.model.n_slots < 2:
            return
        C = len(committed)
        k = len(draft)
        outcomes: list[tuple[float, tuple[int, int, int], list[int], int, str]] = []
        reach = float(prior)
        for i in range(min(k + 1, len(top))):
            a = accept[i] if i < len(accept) else (accept[-1] if accept else 0.5)
            a = float(min(max(a, 0.02), 0.98))
            exclude = draft[i] if i < k else bonus_guess
            p_here = reach * ((1.0 - a) if i < k else 1.0)
            for t, w in self._alternatives(top[i], exclude):
                prob = p_here * w
                if prob >= self.cfg.min_prob:
                    ctx = list(committed) + list(draft[:i]) + [t]
                    outcomes.append((prob, (seq, i, t), ctx, C + i, "reject" if i < k else "bonus"))
            if i < k:
                reach *= a
        outcomes.sort(key=lambda o: -o[0])
        outcomes = outcomes[: self.cfg.max_entries_per_block]
        if not outcomes:
            return
        # the block's most probable outcomes get the full depth, the rest a shallow start
        full = min(self.cfg.predraft_depth, self.cfg.depth if depth is None else depth)
        for prob, key, *_ in outcomes:
            self._depth[key] = full if prob >= 0.5 * outcomes[0][0] else self.cfg.shallow_depth
        self.plan = sorted(self.plan + outcomes, key=lambda o: -o[0])
        self.planned.update(o[1] for o in outcomes)

    def _alternatives(self, cand: tuple[np.ndarray, np.ndarray], exclude: int | None) -> list[tuple[int, float]]:
        ids, probs = cand
        keep = [(int(t), float(p)) for t, p in zip(ids, probs) if int(t) != exclude][: self.cfg.alternatives]
        if not keep:
            return []
        if self.coupled:
            # the first alternative under the perturbed ranking is the likely one; share mass geometrically
            return [(t, 0.6**r) for r, (t, _) in enumerate(keep)]
        excluded = next((float(p) for t, p in zip(ids, probs) if int(t) == exclude), 0.0)
        rest = max(1.0 - excluded, 1e-9)
        return [(t, p / rest) for t, p in keep]

    @property
    def has_work(self) -> bool:
        return bool(self.plan) or bool(self._active)

    def next_step_value(self, max_level: int | None = None) -> float:
        """Total probability of the outcomes the next predraft_step(max_level=...) would advance (the
        same level-by-level order as `_next_group`, ignoring the time budget and free sequences): what
        the step is worth, in the same unit as the chance that a block drafted ahead gets used."""
        n = max(1, self.cfg.batch)
        levels = [(len(a["tokens"]), -a["prob"]) for a in self._active]
        levels += [(0, -o[0]) for o in self.plan[:n] if o[1] not in self.entries]
        if max_level is not None:
            levels = [lv for lv in levels if lv[0] < max_level]
        return -sum(p for _, p in sorted(levels)[:n])

    def step_estimate(self, n: int) -> float:
        """Expected seconds of one batched step over n outcomes, from the steps measured so far (0 before
        any: learn first). A batch costs less than its size in single steps, so scaling a smaller
        measured batch up linearly over-estimates, which errs on the side of answering verdicts on time."""
        if not self._step_s:
            return 0.0
        k = min(self._step_s, key=lambda m: (abs(m - n), -m))
        return self._step_s[k] * max(1.0, n / k)

    def predraft_step(self, budget_s: float | None = None, *, max_level: int | None = None) -> list[Entry]:
        """Advance pre-drafting by one drafter token for each of up to `batch` outcomes (the most probable
        first), in one batched pass, so a verdict never waits for more than one step. With `budget_s`
        (the time until the verdict is expected), advance only as many outcomes as fit in it; none
        if not even one does. With `max_level`, advance only outcomes with fewer pre-drafted tokens
        than that (1: only put likely outcomes' drafter states in place). Returns the entries that
        completed."""
        n = max(1, self.cfg.batch)
        if budget_s is not None:
            while n > 0 and self.step_estimate(n) > budget_s:
                n -= 1
        group = self._next_group(n, max_level)
        if not group:
            return []
        t0 = self.clock()
        keep_q = self.drafter.rule.info.needs_q
        steps = self.drafter.step_many(
            [(a["slot"], a["ctx"] + a["tokens"]) for a in group], keep_top=self.cfg.alternatives + 1
        )
        dt = self.clock() - t0
        self._step_s[n] = dt if n not in self._step_s else 0.7 * self._step_s[n] + 0.3 * dt
        self.metrics.predraft_s += dt
        self.metrics.steps += 1
        done: list[Entry] = []
        for a, (x, _conf, q, cand) in zip(group, steps):
            a["tokens"].append(x)
            a["top"].append(cand)
            if keep_q:
                a["q"].append(q)
            a["seconds"] += dt / len(steps)  # what drafting this entry alone would have cost, roughly
            if len(a["tokens"]) >= a["depth"]:
                self._active.remove(a)
                e = self._store(a)
                if e is not None:
                    done.append(e)
        return done

    def _next_group(self, n: int, max_level: int | None = None) -> list[dict]:
        """Level by level: the outcomes with the fewest pre-drafted tokens go first, the more probable
        first within a level, and a planned outcome not yet started is at level 0. So every likely
        outcome gets its first token (its drafter state in place) before any gets deeper, and a deep
        block from the controller cannot hold the batch while other outcomes wait."""
        group: list[dict] = []
        waiting = sorted(self._active, key=lambda a: (len(a["tokens"]), -a["prob"]))
        if max_level is not None:
            if max_level < 1:
                return group
            waiting = [a for a in waiting if len(a["tokens"]) < max_level]
        while len(group) < n:
            if (not waiting or waiting[0]["tokens"]) and self.plan and self._start_next():
                group.append(self._active[-1])
            elif waiting:
                group.append(waiting.pop(0))
            else:
                break
        return group

    def _start_next(self) -> bool:
        while self.plan:
            prob, key, ctx, fork_at, kind = self.plan.pop(0)
            if key in self.entries:
                continue
            slot = self._free_slot()
            if slot is None:
                # every sequence is taken by a likelier outcome: keep those (evicting them for a less
                # likely one would throw away work), and start this one when a block's verdict frees some
                self.plan.insert(0, (prob, key, ctx, fork_at, kind))
                return False
            n_common = min(fork_at, len(self.model.tokens))
            while n_common > 0 and self.model.tokens[:n_common] != ctx[:n_common]:
                n_common -= 1  # fork only what really matches (the main sequence may have moved on)
            self.model.fork(slot, n_common)
            depth = self._depth.pop(key, self.cfg.shallow_depth)
            self._active.append(
                dict(
                    prob=prob,
                    key=key,
                    ctx=ctx,
                    base=fork_at - key[1],
                    kind=kind,
                    slot=slot,
                    n_common=n_common,
                    depth=max(1, depth),
                    tokens=[],
                    top=[],
                    q=[],
                    seconds=0.0,
                )
            )
            return True
        return False

    def finish_partial(self) -> list[Entry]:
        """Store the entries being drafted, however far they got (a verdict is here: partial work still counts)."""
        active, self._active = self._active, []
        return [e for e in (self._store(a) for a in active) if e is not None]

    def _store(self, a: dict) -> Entry | None:
        if not a["tokens"]:
            self.model.free(a["slot"])
            return None
        ctx, tokens = a["ctx"], a["tokens"]
        q = np.stack(a["q"]) if a["q"] else None
        own_tokens = len(ctx) - a["n_common"] + len(tokens)
        nbytes = (
            ENTRY_OVERHEAD
            + own_tokens * self.kv_bytes_per_token
            + 8 * len(tokens)
            + 12 * sum(len(t[0]) for t in a["top"])
        )
        if q is not None:
            nbytes += int(np.count_nonzero(q)) * 12  # stored sparse: id + prob
        e = Entry(
            a["key"],
            tokens,
            q,
            a["slot"],
            a["prob"],
            nbytes,
            a["seconds"],
            a["kind"],
            base=a["base"],
            lead=list(ctx[a["base"] :]),
            top=a["top"],
        )
        self._insert(e)
        self.metrics.entries_drafted += 1
        return e if e.key in self.entries else None

    # -- storage ----------------------------------------------------------------------------------
    def _used_slots(self) -> set[int]:
        return {e.slot for e in self.entries.values()}

    def _free_slot(self) -> int | None:
        used = self._used_slots() | {self.model.slot} | {a["slot"] for a in self._active}
        for s in range(self.model.n_slots):
            if s not in used:
                return s
        return None

    def _insert(self, e: Entry) -> None:
        if e.nbytes > self.cfg.budget_bytes:
            self.model.free(e.slot)
            return
        while self.metrics.bytes_held + e.nbytes > self.cfg.budget_bytes and self.entries:
            self._evict_lru()
        self.entries[e.key] = e
        self.metrics.bytes_held += e.nbytes
        self.metrics.peak_bytes = max(self.metrics.peak_bytes, self.metrics.bytes_held)

    def _evict_lru(self) -> None:
        _, e = self.entries.popitem(last=False)
        self._drop(e)
        self.metrics.evictions += 1

    def _drop(self, e: Entry) -> None:
        self.metrics.bytes_held -= e.nbytes
        if e.slot != self.model.slot:
            self.model.free(e.slot)

    def discard_block(self, seq: int) -> None:
        """A verdict for block `seq` arrived: its other outcomes can no longer happen."""
        for a in [a for a in self._active if a["key"][0] <= seq]:
            self._active.remove(a)
            self.model.free(a["slot"])
        for key in [k for k in self.entries if k[0] <= seq]:
            self._drop(self.entries.pop(key))
        self.plan = [o for o in self.plan if o[1][0] > seq]
        self.planned = {k for k in self.planned if k[0] > seq}
        self._depth = {k: d for k, d in self._depth.items() if k[0] > seq}

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, seq: int, accepted: int, next_token: int, *, rejected: bool = False) -> Entry | None:
        """O(1): the pre-drafted continuation for this verdict, with its drafter sequence made active."""
        t0 = time.perf_counter()
        e = self.entries.pop((seq, accepted, next_token), None)
        self.metrics.lookup_s += time.perf_counter() - t0
        self.metrics.lookups += 1
        self.metrics.lookups_rejected += rejected
        if (seq, accepted, next_token) in self.planned:
            self.metrics.covered += 1
            self.metrics.covered_rejected += rejected
        if e is None:
            return None
        self.metrics.hits_rejected += rejected
        self.metrics.bytes_held -= e.nbytes
        self.metrics.hits += 1
        if e.kind == "reject":
            self.metrics.hits_reject += 1
        else:
            self.metrics.hits_bonus += 1
        self.metrics.time_saved_s += e.draft_s
        old = self.model.slot
        self.model.activate(e.slot)
        self.model.free(old)
        return e

    def clear(self) -> None:
        for a in self._active:
            self.model.free(a["slot"])
        self._active = []
        for e in list(self.entries.values()):
            self._drop(e)
        self.entries.clear()
        self.plan = []
        self.planned = set()
        self._depth = {}
