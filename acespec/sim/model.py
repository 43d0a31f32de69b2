r"""A discrete-event model of the edge-cloud protocol, driven by recorded acceptance traces.

What is simulated
-----------------
Three actors on one clock: the edge (drafter + the loop of `acespec.engine.loop.SpecLoop`), the cloud
(one `TargetVerifier` session, blocks processed one at a time in arrival order), and the two directions
of the link. Only time is simulated; which tokens are accepted comes from the trace (`acespec.sim.trace`):
a block is described by where it starts (`base`), how many tokens it carries (`L`), and `m`, how many of
its leading tokens equal the target's output y there:

    block built on the true context at position j:   m = min(a_j, L)
    block built on a context that was wrong already:  m = 0 (assumed: no chance matches)
    branch for outcome (n, t) of a block at s:        m = n + 1 + min(a_{s+n+1}, depth) if that outcome is the
                                                      real one, else the length of its matching lead

The cloud applies exactly `TargetVerifier.verify`'s rule: with C its committed length and o = C - base,
the block is dropped if o < 0, o > L or m < o (its assumed tokens are not what was committed); otherwise it
verifies the L - o tokens after the overlap, accepts min(m - o, L - o) and emits one more token (the
recovered or bonus token, which is y at that position), cut at the end of y.

Timing (all in seconds; `DeviceProfile` supplies the numbers, `WanProfile` the network):

    drafting n tokens          n * t_d  (+ P * t_dprefill for the first block: the drafter's prompt)
    cloud pass over K drafts   t_v(K)   (+ P * t_prefill for the first pass: the target's prompt)
    frame of B bytes           serialisation 8 (B + 52 per 1448-byte segment) / rate, FIFO per direction,
                               then RTT/2 + U(-jitter/2, +jitter/2) (clamped >= 0; never reorders);
                               loss: a frame that loses a segment arrives max(200 ms, 2 RTT) later
    frame sizes                the real wire encoding (`acespec.wire.encode`) of HELLO, WELCOME, DRAFT,
                               VERDICT, TOKENS: DRAFT = 11 + ~3 bytes/token, VERDICT ~15 bytes
    shared CPU (cpu-here)      processor sharing: while the edge and the cloud both compute, the edge's
                               work advances at 1/contention_draft and the cloud's at 1/contention_verify

Modes
-----
    cloud-only   HELLO up; the cloud prefills and streams one TOKENS frame per step:
                 TTFT = RTT + P t_prefill + t_v(0), then one token per t_v(0) (RTT-insensitive after TTFT)
    sync         stop and wait: draft K, send, wait for the verdict (RTT + t_v(K) + serialisation), repeat
    pipelined    up to W blocks in flight; each block after the first assumes the previous one is accepted in
                 full and starts with the drafter's guess of its bonus token (right iff a_j >= K + 1 for the
                 block drafted at j); drafting the next block overlaps the round trip
    +cache       the state cache (`acespec.draft.cache`): while the edge would block, it pre-drafts the most
                 likely outcomes (n accepted, token t) of the oldest block in flight, most probable first;
                 probabilities from the running per-position acceptance and the drafter's top-4 q at each
                 position; a verdict whose outcome was pre-drafted is a hit and the next block is sent at once
                 (its drafting time is skipped)
    +branches    each pre-drafted outcome is also sent as a branch block; on a hit the cloud has it already
                 and verifies it right after the block it continues, without a round trip for the edge
    +adaptive    draft depth from `PlusTwoMinusOne`; +ctrl: `AdaptiveController` (cost model), both through
                 the DepthPolicy interface (fixed K if they do not import)
    +ideal       the cache as designed rather than as the live loop does it today: pre-drafting yields the
                 moment a verdict arrives (the live `predraft_one` finishes the entry first), keeping what was
                 drafted when the verdict is that very outcome; a block sent from a cache hit is itself
                 planned (the live loop keeps no q rows for it, so it is not), and in sync mode an entry drafts
                 one token more, its bonus guess, like a fresh sync block with a cache does

The edge follows `SpecLoop.run` step for step (window accounting, doomed blocks, branch bookkeeping,
cache planning of the oldest live block, `discard_block` on every verdict).

Cache outcomes are keyed by (block, position of the next token, rank of that token under the drafter),
i.e. exactly; the live loop keys them by (block, accepted count, token id), which names another position
when the cloud verified the block from before its overlap (a doomed block was verified in between).

Known simplifications: draft tokens after a block's first mismatch are assumed never to match by chance;
verify time does not grow with context length; no PING traffic; the drafter's KV slots are unlimited;
teacher-forced acceptance can differ from the live drafter's in near-ties (llama.cpp batch numerics:
the recorder reports how often, `engine_agreement`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from acespec.net.profile import MIN_RTO_MS, WanProfile
from acespec.sim.profiles import DeviceProfile
from acespec.sim.trace import PromptTrace

__all__ = ["SimConfig", "SimResult", "simulate", "parse_mode", "MODES_DEFAULT", "FrameSizer"]

SEGMENT = 1448  # TCP payload per segment
PACKET_OVERHEAD = 52  # TCP/IP header bytes per segment (counted in serialisation time, not in wire bytes)

MODES_DEFAULT = (
    "cloud-only", "sync", "sync+cache", "sync+branches+ideal", "pipelined", "pipelined+cache",
    "pipelined+branches+ideal", "pipelined+adaptive", "pipelined+ctrl", "pipelined+branches+ideal+ctrl",
)


@dataclass
class SimConfig:
    mode: str = "sync"  # cloud-only | sync | pipelined
    k: int = 4  # draft depth (the starting depth for adaptive policies)
    window: int = 2  # pipelined: most live blocks in flight
    cache: bool = False  # state cache
    branches: bool = False  # send pre-drafted outcomes as branch blocks (implies cache)
    policy: str = "fixed"  # fixed | adaptive (+2/-1) | controller
    ideal: bool = False  # cache as designed (preemptible pre-drafting, plan blocks sent from a hit)
    handshake: bool = True  # pay HELLO -> WELCOME (one RTT) before the first DRAFT, as the live edge does
    min_conf: float = 0.0  # stop a block early when the drafter's q(x) < this
    cache_alternatives: int = 3  # CacheConfig.alternatives
    cache_max_entries: int = 8  # CacheConfig.max_entries_per_block
    cache_min_prob: float = 0.01  # CacheConfig.min_prob
    cache_hits: bool = True  # False: every lookup misses (a counterfactual that keeps all of the cache's costs)
    label: str = ""  # name in reports

    def __post_init__(self) -> None:
        if self.mode not in ("cloud-only", "sync", "pipelined"):
            raise ValueError(f"mode must be cloud-only, sync or pipelined, got {self.mode!r}")
        if self.branches:
            self.cache = True
        if self.k < 0 or self.window < 1:
            raise ValueError("need k >= 0 and window >= 1")
        if self.policy not in ("fixed", "adaptive", "controller"):
            raise ValueError(f"policy must be fixed, adaptive or controller, got {self.policy!r}")
        if not self.label:
            self.label = self.mode + ("+branches" if self.branches else "+cache" if self.cache else "") + (
                "+ideal" if self.ideal and self.cache else "") + {"fixed": "", "adaptive": "+adaptive", "controller": "+ctrl"}[self.policy]


def parse_mode(spec: str, *, k: int = 4, window: int = 2, **kw) -> SimConfig:
    """`pipelined+cache`, `sync+branches+ideal`, `pipelined+ctrl`, `cloud-only`, `pipelined+branches:k=8`
    (a per-mode draft depth), ... -> SimConfig."""
    text, _, opt = spec.strip().partition(":")
    if opt:
        key, _, val = opt.partition("=")
        if key.strip() != "k" or not val.strip().isdigit():
            raise ValueError(f"bad mode option {opt!r} in {spec!r}; the only option is k=N")
        k = int(val)
    parts = [p.strip() for p in text.split("+") if p.strip()]
    if not parts:
        raise ValueError("empty mode")
    base, mods = parts[0], set(parts[1:])
    unknown = mods - {"cache", "branches", "ideal", "adaptive", "ctrl"}
    if unknown:
        raise ValueError(f"unknown mode modifier(s) {sorted(unknown)} in {spec!r}; use +cache, +branches, +ideal, +adaptive, +ctrl")
    policy = "controller" if "ctrl" in mods else "adaptive" if "adaptive" in mods else "fixed"
    return SimConfig(mode=base, k=k, window=window, cache="cache" in mods or "branches" in mods or "ideal" in mods,
                     branches="branches" in mods, ideal="ideal" in mods, policy=policy, label=spec, **kw)


@dataclass
class SimResult:
    label: str
    n: int  # tokens generated
    wall_s: float  # start (HELLO) to the last token at the edge
    ttft_s: float  # start to the first token at the edge
    passes: int  # cloud target passes (verified blocks; plain steps in cloud-only)
    dropped: int  # dropped verdicts the edge received (blocks built on a prefix that did not happen)
    bytes_up: int
    bytes_down: int
    rounds_drafted: int = 0
    rounds_accepted: int = 0
    blocks_sent: int = 0
    mean_k: float = 0.0
    draft_s: float = 0.0  # edge time spent drafting blocks
    predraft_s: float = 0.0  # edge time spent pre-drafting cache entries
    wait_s: float = 0.0  # edge time blocked on a verdict
    lookups: int = 0
    hits: int = 0
    branches_sent: int = 0
    branch_hits: int = 0
    partial_hits: int = 0  # +ideal: verdicts that matched the pre-draft they interrupted (only its rest is drafted)
    stale_ready: int = 0  # cache hits whose block no longer fitted when sent (a doomed block was verified meanwhile)
    token_times: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def passes_per_token(self) -> float:
        return self.passes / self.n if self.n else 0.0


# ------------------------------------------------------------------------------------------- wire sizes
# Session ids are random below 2**21 (protocol v2): all but 1/128 of them take 3 varint bytes.
SIM_SESSION_ID = 1 << 20


class FrameSizer:
    """Bytes of each frame as `acespec.wire.encode` writes it (memoised by the varint sizes that matter)."""

    def __init__(self) -> None:
        from acespec import wire as wf

        self.wf = wf
        self._memo: dict = {}

    def _enc(self, frame) -> int:
        return len(self.wf.encode(frame))

    def hello(self, prompt: Iterable[int], max_tokens: int, mode_cloud_only: bool) -> int:
        wf = self.wf
        return self._enc(wf.Hello(model_id="vocab:151936:0123456789abcdef", max_tokens=max_tokens, prompt=tuple(prompt),
                                  temperature=0.0, rule="greedy", mode=wf.Mode.CLOUD_ONLY if mode_cloud_only else wf.Mode.SPECULATIVE))

    def welcome(self, committed: int) -> int:
        return self._enc(self.wf.Welcome(session=SIM_SESSION_ID, committed=committed, max_draft_tokens=64, secret=bytes(32)))

    def draft(self, seq: int, base: int, tokens: tuple[int, ...]) -> int:
        return self._enc(self.wf.Draft(session=SIM_SESSION_ID, seq=seq, base=base, tokens=tokens))

    def verdict(self, seq: int, accepted: int, next_token: int, verify_us: int, committed: int, dropped: bool, finished: bool) -> int:
        key = ("v", _vs(seq), _vs(accepted), _vs(next_token), _vs(verify_us), _vs(committed))
        if key not in self._memo:
            self._memo[key] = self._enc(self.wf.Verdict(seq=seq, accepted=accepted, next_token=next_token, verify_us=verify_us,
                                                        committed=committed, dropped=dropped, finished=finished))
        return self._memo[key]

    def tokens(self, start: int, toks: tuple[int, ...], finished: bool) -> int:
        return self._enc(self.wf.Tokens(start=start, tokens=toks, finished=finished))


def _vs(v: int) -> int:
    return max(1, (int(v).bit_length() + 6) // 7)


# ------------------------------------------------------------------------------------------- kernel
@dataclass
class _Work:
    seconds: float  # work at full speed
    interruptible: bool = False  # a frame arriving in the inbox ends it early


class _Wait:
    """Block until the inbox holds a frame."""


class _Proc:
    def __init__(self, sim: "_Kernel", role: str) -> None:
        self.sim, self.role = sim, role
        self.inbox: deque = deque()
        self.gen = None
        self.waiting = False
        self.job: list | None = None  # [remaining, rate, last_update, version, interruptible]
        self.done = False

    def start(self, gen) -> None:
        self.gen = gen
        self.sim.at(self.sim.now, lambda: self._step(None), prio=2)

    def _step(self, value) -> None:
        if self.done:
            return
        try:
            cmd = self.gen.send(value)
        except StopIteration:
            self.done = True
            return
        if isinstance(cmd, _Work):
            if cmd.seconds <= 0:
                self.sim.at(self.sim.now, lambda: self._step(True), prio=2)
            else:
                self.sim.cpu_begin(self, cmd)
        elif isinstance(cmd, _Wait):
            if self.inbox:
                self.sim.at(self.sim.now, lambda: self._step(None), prio=2)
            else:
                self.waiting = True
        else:  # pragma: no cover
            raise TypeError(f"bad command {cmd!r}")

    def deliver(self, frame) -> None:
        self.inbox.append(frame)
        if self.waiting:
            self.waiting = False
            self.sim.at(self.sim.now, lambda: self._step(None), prio=2)
        elif self.job is not None and self.job[4] and not getattr(frame, "dropped", False):
            # a dropped verdict changes nothing the pre-draft depends on: keep drafting
            self.sim.cpu_end(self, completed=False)


class _Kernel:
    def __init__(self, shared_cpu: bool, slowdown: dict[str, float]) -> None:
        self.now = 0.0
        self._q: list = []
        self._n = 0
        self.shared = shared_cpu
        self.slowdown = slowdown
        self.active: list[_Proc] = []
        self.stopped = False
        self._ver = 0

    def at(self, t: float, fn: Callable[[], None], prio: int = 1) -> None:
        self._n += 1
        heapq.heappush(self._q, (t, prio, self._n, fn))

    def run(self) -> None:
        while self._q and not self.stopped:
            t, _, _, fn = heapq.heappop(self._q)
            self.now = max(self.now, t)
            fn()

    # processor sharing between the edge and the cloud (only when shared_cpu)
    def _rate(self, p: _Proc) -> float:
        if self.shared and len(self.active) > 1:
            return 1.0 / self.slowdown.get(p.role, 1.0)
        return 1.0

    def _settle(self) -> None:
        for p in self.active:
            j = p.job
            j[0] = max(0.0, j[0] - (self.now - j[2]) * j[1])
            j[2] = self.now

    def _reschedule(self) -> None:
        for p in self.active:
            j = p.job
            j[1] = self._rate(p)
            self._ver += 1  # globally unique, so a stale completion event of an earlier job never matches
            j[3] = ver = self._ver
            self.at(self.now + j[0] / j[1], lambda p=p, ver=ver: self._complete(p, ver), prio=1)

    def cpu_begin(self, p: _Proc, w: _Work) -> None:
        if w.interruptible and any(not getattr(f, "dropped", False) for f in p.inbox):
            self.at(self.now, lambda: p._step(w.seconds), prio=2)  # interrupted before it began
            return
        self._settle()
        p.job = [w.seconds, 1.0, self.now, 0, w.interruptible]
        self.active.append(p)
        self._reschedule()

    def _complete(self, p: _Proc, ver: int) -> None:
        if p.job is None or p.job[3] != ver:
            return
        self.cpu_end(p, completed=True)

    def cpu_end(self, p: _Proc, completed: bool) -> None:
        """End p's job; p resumes with True, or with the work still left (seconds) if it was interrupted."""
        self._settle()
        left = p.job[0]
        self.active.remove(p)
        p.job = None
        self._reschedule()
        value = True if completed else left
        self.at(self.now, lambda: p._step(value), prio=2)


class _Link:
    """One direction: FIFO serialisation at `bps`, then a one-way delay with jitter and loss stalls."""

    def __init__(self, sim: _Kernel, net: WanProfile, bps: float, rng: np.random.Generator) -> None:
        self.sim, self.net, self.bps, self.rng = sim, net, bps, rng
        self.free = 0.0
        self.last_arrival = 0.0
        self.bytes = 0
        self.frames = 0

    def send(self, nbytes: int, frame, dest: _Proc) -> float:
        now = self.sim.now
        self.bytes += nbytes
        self.frames += 1
        segs = max(1, math.ceil(nbytes / SEGMENT))
        start = max(now, self.free)
        ser = 8.0 * (nbytes + PACKET_OVERHEAD * segs) / self.bps if self.bps > 0 else 0.0
        self.free = start + ser
        delay = self.net.rtt_ms / 2e3
        if self.net.jitter_ms > 0:
            delay = max(0.0, delay + self.rng.uniform(-self.net.jitter_ms / 2e3, self.net.jitter_ms / 2e3))
        if self.net.loss_pct > 0 and self.rng.random() < 1.0 - (1.0 - self.net.loss_pct / 100.0) ** segs:
            delay += max(MIN_RTO_MS, 2.0 * self.net.rtt_ms) / 1e3
        arrival = max(self.free + delay, self.last_arrival)
        self.last_arrival = arrival
        self.sim.at(arrival, lambda: dest.deliver(frame), prio=0)
        return arrival


# ------------------------------------------------------------------------------------------- frames
@dataclass
class _Block:
    seq: int
    base: int  # generated-token index where tokens[0] stands
    L: int  # tokens carried (overlap + draft)
    overlap: int  # leading tokens that are assumptions about earlier blocks
    m: int  # leading tokens equal to y
    true_ctx: bool  # built on a context equal to y[:base]
    has_q: bool = True  # the edge kept q rows (so the cache can plan it)
    doomed: bool = False
    alt_key: tuple | None = None  # branch: the outcome (seq, position, rank) it continues
    sent_at: float = 0.0


@dataclass
class _VerdictMsg:
    seq: int
    accepted: int
    committed: int
    verify_s: float
    dropped: bool = False
    finished: bool = False


@dataclass
class _Entry:
    key: tuple  # (block seq, position of the next token t, rank of t under the drafter)
    depth: int
    prob: float
    s: int  # where the block whose outcome this is starts drafting (base + overlap)
    committed: int = -1  # committed length when the hit made it the next block
    left: float = 0.0  # drafting still owed (+ideal: a pre-draft the verdict interrupted)


class _Hello:
    pass


class _WelcomeMsg:
    pass


@dataclass
class _TokensMsg:
    count: int
    finished: bool


# ------------------------------------------------------------------------------------------- the run
def make_policy(cfg: SimConfig):
    """The depth policy through the DepthPolicy interface; fixed K when a policy does not import."""
    from acespec.control.depth import FixedDepth

    if cfg.policy == "adaptive":
        try:
            from acespec.control.depth import PlusTwoMinusOne

            return PlusTwoMinusOne(cfg.k)
        except Exception:  # noqa: BLE001 - an optional policy that does not import falls back
            return FixedDepth(cfg.k)
    if cfg.policy == "controller":
        try:
            from acespec.control.adaptive import AdaptiveController

            try:
                return AdaptiveController(k_init=cfg.k, pipelined=cfg.mode == "pipelined")
            except TypeError:
                return AdaptiveController(k_init=cfg.k)
        except Exception:  # noqa: BLE001
            return FixedDepth(cfg.k)
    return FixedDepth(cfg.k)


class _Run:
    def __init__(self, trace: PromptTrace, dev: DeviceProfile, net: WanProfile, cfg: SimConfig, sizer: FrameSizer) -> None:
        self.tr, self.dev, self.net, self.cfg, self.sizer = trace, dev, net, cfg, sizer
        self.N = trace.n
        self.P = trace.prompt_len
        self.a = list(trace.accept) + [0]
        self.rank = list(trace.rank)
        self.top_q = trace.top_q
        self.y = list(trace.tokens) or [0]
        self.prompt_ids = list(trace.prompt_tokens) or [100000] * self.P
        self.sim = _Kernel(dev.shared_cpu, {"edge": dev.contention_draft, "cloud": dev.contention_verify})
        rng = np.random.default_rng([int(net.seed) & 0xFFFFFFFF, 0x51])
        self.edge = _Proc(self.sim, "edge")
        self.cloud = _Proc(self.sim, "cloud")
        self.up = _Link(self.sim, net, net.up_bps, np.random.default_rng(rng.integers(1 << 62)))
        self.down = _Link(self.sim, net, net.down_bps, np.random.default_rng(rng.integers(1 << 62)))
        self.res = SimResult(cfg.label, self.N, 0.0, 0.0, 0, 0, 0, 0)

    # -- helpers -------------------------------------------------------------------------------------
    def tok(self, j: int) -> int:
        return self.y[min(max(j, 0), len(self.y) - 1)]

    def q_at(self, j: int) -> list[float]:
        return self.top_q[j] if 0 <= j < self.N else [1.0, 0.0, 0.0, 0.0]

    def run(self) -> SimResult:
        if self.cfg.mode == "cloud-only":
            self.edge.start(self._edge_cloud_only())
            self.cloud.start(self._cloud_only())
        else:
            self.edge.start(self._edge_spec())
            self.cloud.start(self._cloud_spec())
        self.sim.run()
        r = self.res
        r.bytes_up, r.bytes_down = self.up.bytes, self.down.bytes
        return r

    def _finish(self) -> None:
        self.res.wall_s = self.sim.now
        self.edge.done = True
        # let the cloud answer what is still in flight (those bytes are part of the session), then stop

    # -- cloud-only --------------------------------------------------------------------------------------
    def _edge_cloud_only(self):
        self.up.send(self.sizer.hello(self.prompt_ids, self.N, True), _Hello(), self.cloud)
        got = 0
        while got < self.N:
            yield _Wait()
            f = self.edge.inbox.popleft()
            if isinstance(f, _TokensMsg):
                if got == 0:
                    self.res.ttft_s = self.sim.now
                got += f.count
                self.res.token_times.extend([self.sim.now] * f.count)
                if f.finished:
                    break
        self._finish()

    def _cloud_only(self):
        yield _Wait()
        self.cloud.inbox.popleft()
        dev = self.dev
        for j in range(self.N):
            t = dev.cloud_step_s + (self.P * dev.target_prefill_s_per_token if j == 0 else 0.0)
            yield _Work(t)
            self.res.passes += 1
            fin = j == self.N - 1
            self.down.send(self.sizer.tokens(self.P + j, (self.tok(j),), fin), _TokensMsg(1, fin), self.edge)

    # -- speculative: the cloud --------------------------------------------------------------------------
    def _cloud_spec(self):
        dev, sz = self.dev, self.sizer
        C = 0
        finished = self.N == 0
        prefilled = False
        while True:
            yield _Wait()
            f = self.cloud.inbox.popleft()
            if isinstance(f, _Hello):
                self.down.send(sz.welcome(self.P), _WelcomeMsg(), self.edge)
                continue
            b: _Block = f
            o = C - b.base
            if finished or o < 0 or o > b.L or b.m < o:
                self.down.send(sz.verdict(b.seq, 0, 0, 0, self.P + C, True, finished),
                               _VerdictMsg(b.seq, 0, C, 0.0, dropped=True, finished=finished), self.edge)
                continue
            k = b.L - o
            acc = min(b.m - o, k)
            emitted = min(acc + 1, self.N - C)
            acc = emitted - 1
            t = dev.verify_s(k) + (0.0 if prefilled else self.P * dev.target_prefill_s_per_token)
            prefilled = True
            t0 = self.sim.now
            yield _Work(t)
            dt = self.sim.now - t0
            C += emitted
            finished = C >= self.N
            self.res.passes += 1
            self.down.send(sz.verdict(b.seq, acc, self.tok(C - 1), int(dt * 1e6), self.P + C, False, finished),
                           _VerdictMsg(b.seq, acc, C, dt, finished=finished), self.edge)

    # -- speculative: the edge (SpecLoop.run, step for step) ------------------------------------------------
    def _edge_spec(self):
        cfg, r = self.cfg, self.res
        self.policy = make_policy(cfg)
        self.min_conf = cfg.min_conf
        self.C = 0  # committed (generated tokens)
        self.spec_len = 0  # the edge's speculative context length (generated part)
        self.spec_true = 0  # ... equal to y up to here
        self.inflight: deque[_Block] = deque()
        self.seq = 0
        self.finished = self.N == 0
        self.ready: _Entry | None = None
        self.partial: tuple | None = None  # +ideal: (outcome key, drafting left) of an interrupted pre-draft
        self.planned: set[int] = set()
        self.extra: set[int] = set()  # sync + cache: blocks whose bonus-position q row is known
        self.alts: dict[tuple, _Block] = {}
        self.plan: list[tuple[float, tuple, int]] = []  # (prob, key, block start s) pending pre-drafts
        self.plan_block: _Block | None = None
        self.entries: dict[tuple, _Entry] = {}
        self.pos_drafted: list[int] = []
        self.pos_accepted: list[int] = []
        self.k_chosen: list[int] = []
        self.tokens_drafted = 0  # on the critical path (cache pre-drafts excluded), as the live loop counts
        self.rtt_samples: list[float] = []
        self.first_draft = True
        window = 1 if cfg.mode == "sync" else cfg.window

        self.up.send(self.sizer.hello(self.prompt_ids, self.N, False), _Hello(), self.cloud)
        if cfg.handshake:
            while True:
                t0 = self.sim.now
                yield _Wait()
                r.wait_s += self.sim.now - t0
                if isinstance(self.edge.inbox.popleft(), _WelcomeMsg):
                    break
        while not self.finished:
            while self.inflight:
                blocking = sum(1 for b in self.inflight if not b.doomed and b.alt_key is None) >= window
                self._plan_cache()
                v = None
                if blocking and cfg.cache and self.plan:
                    v = self._poll()
                    if v is None:
                        e = yield from self._predraft_one()
                        if e is not None and cfg.branches:
                            self._send_branch(e)
                        continue
                elif blocking:
                    t0 = self.sim.now
                    while True:
                        v = self._poll()
                        if v is not None:
                            break
                        yield _Wait()
                    r.wait_s += self.sim.now - t0
                else:
                    v = self._poll()
                if v is None:
                    break
                yield from self._apply(v)
                if self.finished:
                    break
            if self.finished:
                break
            yield from self._send_next_block()
        r.mean_k = float(np.mean(self.k_chosen)) if self.k_chosen else 0.0
        self._finish()

    def _poll(self) -> _VerdictMsg | None:
        while self.edge.inbox:
            f = self.edge.inbox.popleft()
            if isinstance(f, _VerdictMsg):
                return f
        return None

    def _draft_time(self, n: int) -> float:
        t = n * self.dev.draft_s_per_token
        if self.first_draft:
            t += self.P * self.dev.draft_prefill_s_per_token
            self.first_draft = False
        return t

    def _send(self, b: _Block) -> None:
        if self.res.blocks_sent > 64 * (self.N + 16):
            raise RuntimeError(f"simulated edge livelocked ({self.res.blocks_sent} blocks for {self.N} tokens, committed {self.C})")
        b.sent_at = self.sim.now
        toks = tuple(self.tok(b.base + i) for i in range(b.L))
        self.up.send(self.sizer.draft(b.seq, self.P + b.base, toks), b, self.cloud)
        self.inflight.append(b)
        self.res.blocks_sent += 1

    def _send_next_block(self):
        cfg = self.cfg
        k = int(self.policy.next_k())
        live = [b for b in self.inflight if not b.doomed and b.alt_key is None]
        overlap = 1 if live else 0
        base = live[-1].base + live[-1].L if live else self.spec_len
        has_q = True
        extra_row = False
        stale = False
        if self.ready is not None and not live:
            L = self.ready.depth
            # a doomed block verified after the hit (o = 0) moved the committed prefix: the entry no longer fits
            stale = self.ready.committed != self.C
            self.res.stale_ready += stale
            left, self.ready = self.ready.left, None
            if left > 0:  # +ideal: finish the interrupted pre-draft of this very outcome
                self.res.draft_s += left
                yield _Work(left)
            has_q = cfg.ideal  # the live loop sends the entry's tokens without q rows, so never plans that block
            extra_row = bool(self._entry_extra())
        elif k + overlap > 0:
            extra = 1 if (cfg.cache and cfg.mode == "sync") else 0
            n = k + overlap + extra
            # early stop at a low-confidence token (min_conf), after overlap + 1 tokens
            if self.min_conf > 0:
                for i in range(n):
                    if i + 1 >= overlap + 1 and self.q_at(base + i)[0] < self.min_conf:
                        n = i + 1
                        break
            t = self._draft_time(n)
            self.tokens_drafted += n
            self.res.draft_s += t
            yield _Work(t)
            if extra and n == k + overlap + extra:
                extra_row = True
                L = n - 1
            else:
                L = n
        else:
            L = 0
        self.k_chosen.append(L - overlap)
        true_ctx = self.spec_true >= base and self.spec_len >= base and not stale
        m = min(self.a[base] if base < self.N else 0, L) if true_ctx else 0
        b = _Block(self.seq, base, L, overlap, m, true_ctx, has_q=has_q)
        if extra_row:
            self.extra.add(b.seq)
        self.seq += 1
        self.spec_len = base + L
        if true_ctx:
            self.spec_true = base + m
        self._send(b)

    # -- the state cache ----------------------------------------------------------------------------------
    def _accept_estimates(self) -> list[float]:
        pa, pd = self.pos_accepted, self.pos_drafted
        return [(pa[i] + 1) / ((pa[i - 1] if i else pd[0]) + 2) for i in range(len(pa))] or [0.7]

    def _plan_cache(self) -> None:
        cfg = self.cfg
        if not cfg.cache or self.plan:
            return
        live = [b for b in self.inflight if not b.doomed and b.alt_key is None]
        if not live or live[0].seq in self.planned or not live[0].has_q:
            return
        b = live[0]
        self.planned.add(b.seq)
        s = b.base + b.overlap
        k = b.L - b.overlap
        exclude_bonus_guess = False
        bonus_row = False
        if len(live) > 1 and live[1].overlap and live[1].has_q:
            bonus_row, exclude_bonus_guess = True, True
        elif b.seq in self.extra:
            bonus_row = True
        accept = self._accept_estimates()
        depth = max(1, int(self.policy.next_k()))
        outcomes = []
        reach = 1.0
        for i in range(k + (1 if bonus_row else 0)):
            a = accept[i] if i < len(accept) else accept[-1]
            a = float(min(max(a, 0.02), 0.98))
            q = self.q_at(s + i)
            if i < k or exclude_bonus_guess:
                ranks = range(1, 1 + cfg.cache_alternatives)
                rest = max(1.0 - q[0], 1e-9)
            else:
                ranks = range(0, cfg.cache_alternatives)
                rest = 1.0
            p_here = reach * ((1.0 - a) if i < k else 1.0)
            for rk in ranks:
                if rk >= len(q) or q[rk] <= 0:
                    continue
                prob = p_here * q[rk] / rest
                if prob >= cfg.cache_min_prob:
                    outcomes.append((prob, (b.seq, s + i, rk), s, depth))
            if i < k:
                reach *= a
        outcomes.sort(key=lambda o: -o[0])
        self.plan = outcomes[: cfg.cache_max_entries]
        self.plan_block = b

    def _predraft_one(self):
        prob, key, s, depth = self.plan.pop(0)
        if key in self.entries:
            return None
        # +ideal in sync mode: an entry drafts one token more, its bonus guess, as a fresh sync block does,
        # so the block sent from a hit can be planned with its bonus outcomes too
        t = (depth + self._entry_extra()) * self.dev.draft_s_per_token
        self.res.predraft_s += t
        done = yield _Work(t, interruptible=self.cfg.ideal)
        if done is not True:
            # +ideal: a verdict interrupted it; if that verdict turns out to be this very outcome, the
            # drafting done so far is kept and only the rest is paid (see _apply / _send_next_block)
            self.partial = (key, float(done), depth, s)
            return None
        e = _Entry(key, depth, prob, s)
        self.entries[key] = e
        return e

    def _entry_extra(self) -> int:
        return 1 if (self.cfg.ideal and self.cfg.mode == "sync") else 0

    def _send_branch(self, e: _Entry) -> None:
        seq, pos, rk = e.key
        n = pos - e.s
        s = e.s
        L = n + 1 + e.depth
        m = self._lead_match(s, n, rk, e.depth, self.plan_block)
        b = _Block(self.seq, s, L, n + 1, m, True, has_q=False, alt_key=e.key)
        self.seq += 1
        self._send(b)
        self.alts[e.key] = b
        self.res.branches_sent += 1

    def _lead_match(self, s: int, n: int, rk: int, depth: int, blk: _Block | None) -> int:
        """Leading tokens of a branch (x[:n] + [t] + entry) that equal y."""
        if blk is None or not blk.true_ctx:
            return 0
        a_s = self.a[s] if s < self.N else 0
        if a_s < n:
            return a_s
        p = s + n
        if p >= self.N or self.rank[p] != rk:
            return n
        return n + 1 + min(self.a[p + 1] if p + 1 < self.N else 0, depth)

    # -- applying a verdict (SpecLoop._apply) ----------------------------------------------------------------
    def _apply(self, v: _VerdictMsg):
        r = self.res
        blk = self.inflight.popleft()
        assert v.seq == blk.seq, (v.seq, blk.seq)
        if blk.alt_key is not None:
            self.alts.pop(blk.alt_key, None)
        if v.dropped:
            r.dropped += 1
            if v.finished:
                self.finished = True
            return
        o = self.C - blk.base
        drafted = blk.L - o
        if v.committed != self.C + v.accepted + 1:
            raise AssertionError(f"edge/cloud disagree: {self.C} + {v.accepted} + 1 != {v.committed}")
        self.C = v.committed
        # per-position counts, as RunStats.observe_block
        while len(self.pos_drafted) < drafted:
            self.pos_drafted.append(0)
            self.pos_accepted.append(0)
        for i in range(drafted):
            self.pos_drafted[i] += 1
            if i < v.accepted:
                self.pos_accepted[i] += 1
        r.rounds_drafted += drafted
        r.rounds_accepted += v.accepted
        # as the live edge: a sample is the verdict's delay minus verify time (queueing at the target included);
        # the controller sees the minimum of the last 8
        self.rtt_samples.append(max(0.0, self.sim.now - blk.sent_at - v.verify_s))
        obs = {"verify_s": v.verify_s, "rtt_s": min(self.rtt_samples[-8:])}
        if self.tokens_drafted:
            obs["draft_s_per_token"] = r.draft_s / self.tokens_drafted
        self.policy.update(drafted, v.accepted, **obs)
        mc = getattr(self.policy, "min_conf", None)
        if mc is not None:
            self.min_conf = float(mc)
        if r.ttft_s == 0.0:
            r.ttft_s = self.sim.now
        r.token_times.extend([self.sim.now] * (v.accepted + 1))
        if v.finished:
            self.finished = True
        if self.dev.edge_overhead_s > 0:
            yield _Work(self.dev.edge_overhead_s)
        n = self.C
        # the outcome, in the cache's terms: (seq, accepted, rank of the next token under the drafter)
        # keyed by the next token's position, not by the accepted count: a block can be verified from
        # before or after its overlap (o != overlap when a doomed block was verified in between), and the
        # live loop's (seq, accepted, token) key then means another position (see the module notes)
        out_rank = self.rank[n - 1] if (blk.true_ctx and 0 < n <= self.N) else -1
        key = (v.seq, n - 1, out_rank)
        if blk.alt_key is None:
            for kk in [kk for kk in self.alts if kk[0] == blk.seq]:
                if kk != key:
                    self.alts.pop(kk).doomed = True
        if self.spec_len < n or self.spec_true < n:
            self.spec_len = self.spec_true = n
            branch = self.alts.pop(key, None)
            for b in self.inflight:
                if b is not branch:
                    b.doomed = True
            if self.cfg.cache and not v.finished:
                r.lookups += 1
                hit = self.entries.pop(key, None) if (out_rank >= 0 and self.cfg.cache_hits) else None
                if hit is None and self.partial is not None and self.partial[0] == key and self.cfg.cache_hits:
                    # the interrupted pre-draft was for this outcome: finish it instead of drafting afresh
                    pkey, left, depth, s0 = self.partial
                    hit = _Entry(pkey, depth, 0.0, s0, left=left)
                    r.partial_hits += 1
                if hit is not None:
                    r.hits += hit.left == 0.0
                    if branch is not None:
                        branch.alt_key = None
                        if self.cfg.ideal:
                            branch.has_q = True
                            if self._entry_extra():
                                self.extra.add(branch.seq)
                        self.spec_len = n + hit.depth
                        self.spec_true = n + min(self.a[n] if n < self.N else 0, hit.depth)
                        r.branch_hits += 1
                    else:
                        hit.committed = n
                        self.ready = hit
        self.partial = None
        if self.cfg.cache:
            for kk in [kk for kk in self.entries if kk[0] <= v.seq]:
                del self.entries[kk]
            self.plan = [o for o in self.plan if o[1][0] > v.seq]


def simulate(trace: PromptTrace, device: DeviceProfile, net: WanProfile, cfg: SimConfig,
             sizer: FrameSizer | None = None) -> SimResult:
    """Replay one prompt's trace under a device profile, a network and a protocol configuration."""
    run = _Run(trace, device, net, cfg, sizer or FrameSizer())
    return run.run()
