"""A simulated edge: the live edge's own loop, on virtual time, over a simulated link.

`simulate` replays one trace: a `Kernel` (virtual time), a `SimCloud` (real `TargetVerifier`, passes
priced by the device profile), and one `SimEdge`, which does what `acespec.edge.runtime.run_edge`
does: send HELLO, prefill the drafter's prompt while the handshake is in flight, then run the
`SpecLoop` that `build_loop` builds for the live edge, with the same `StateCache` and depth policy,
over a `SimTransport`. The drafter is a replay model whose every call costs the profile's time, so
`ChainDrafter`, the cache's step timings and the scheduler's budgets all read the virtual clock.
Nothing of the loop is copied here: a change to the loop changes the simulation.

Modes name live configurations: `cloud-only`, `cloud-led` (the live `FollowLoop` over a
`SimLeadLink`), `auto` (the same, its drafter joining after the first token), `sync`, `pipelined`, with `+cache`, `+branches`,
`+plus2minus1` (the +2/-1 schedule; `+adaptive` is its old name), `+ctrl` (the cost-model controller), `+autowin` (a window sized to
the round trip), and `:k=N`; `bench acespec`'s variant names (`+cache`, `acespec`, `acespec:k=8`, ...)
mean what they mean there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from acespec.config import OLD_CHOICES
from acespec.draft.cache import DRAFTER_SLOTS
from acespec.draft.chain import ChainDrafter
from acespec.edge.runtime import MODES, EdgeConfig, build_loop
from acespec.loop.follow import FollowConfig, FollowLoop
from acespec.loop.handoff import DrafterJob
from acespec.loop.lead import LeadState
from acespec.loop.loop import SpecLoop
from acespec.loop.records import Block, LinkSample
from acespec.loop.stats import RunStats
from acespec.loop.transport import LeadLink, StepChunk, Transport
from acespec.loop.verifier import BlockVerdict, TargetVerifier
from acespec.net.profile import WanProfile
from acespec.sim.cloud import CloudCost, SentBlock, SimCloud, SimCloudSession, Streamed
from acespec.sim.kernel import Kernel, Mailbox, SimThread
from acespec.sim.link import FrameSizer, SimLink
from acespec.sim.profiles import DeviceProfile
from acespec.sim.replay import ReplayModel, TraceVocab
from acespec.sim.trace import PromptTrace
from acespec.verify import RuleSpec, SamplingParams

__all__ = [
    "SimConfig",
    "SimResult",
    "SimEdge",
    "SimTransport",
    "simulate",
    "parse_mode",
    "MODES_DEFAULT",
    "LIVE_VARIANTS",
]

MODES_DEFAULT = ("cloud-only", "sync", "pipelined", "+cache", "+branches", "acespec")

# `acespec bench acespec`'s variants, as modes (the same settings that bench gives them)
LIVE_VARIANTS = {
    "+cache": "pipelined+cache",
    "+branches": "pipelined+branches",
    "acespec": "pipelined+branches+ctrl+autowin",
    "acespec:+2/-1": "pipelined+branches+plus2minus1+autowin",
}
FIXED_DEPTH = "pipelined+branches+autowin"  # acespec:k=N: bench acespec's full system at a fixed depth N
LEAD_MODES = ("cloud-led", "auto")  # the cloud streams; the edge follows (`FollowLoop`)


@dataclass
class SimConfig:
    mode: str = "sync"  # cloud-only | sync | pipelined
    k: int = 4  # draft depth (the starting depth for plus2minus1 and the controller)
    window: int = 2  # pipelined: blocks in flight (the least, with auto_window)
    cache: bool = False  # the state cache
    branches: bool = False  # send pre-drafted outcomes as branch blocks (implies cache)
    policy: str = "fixed"  # fixed | plus2minus1 (+2/-1) | controller
    auto_window: bool = False  # pipelined: a window sized to the round trip
    label: str = ""  # name in reports

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.k < 0 or self.window < 1:
            raise ValueError("need k >= 0 and window >= 1")
        if self.policy not in ("fixed", "plus2minus1", "controller"):
            raise ValueError(f"policy must be fixed, plus2minus1 or controller, got {self.policy!r}")
        self.cache = self.cache or self.branches
        if not self.label:
            self.label = (
                self.mode
                + ("+branches" if self.branches else "+cache" if self.cache else "")
                + {"fixed": "", "plus2minus1": "+plus2minus1", "controller": "+ctrl"}[self.policy]
                + ("+autowin" if self.auto_window else "")
            )

    def edge_config(self, max_tokens: int):
        """The live edge's configuration for this mode."""
        return EdgeConfig(
            mode=self.mode,
            k=self.k,
            window=self.window,
            policy=self.policy,
            auto_window=self.auto_window,
            cache=self.cache,
            branches=self.branches,
            max_tokens=max_tokens,
        )


def parse_mode(spec: str, *, k: int = 4, window: int = 2) -> SimConfig:
    """`pipelined+cache`, `sync`, `pipelined+branches+ctrl:k=8`, `acespec`, ... -> SimConfig."""
    label = spec.strip()
    text, _, opt = LIVE_VARIANTS.get(label, label).partition(":")
    if text == "acespec" and opt:
        text = FIXED_DEPTH
    if opt:
        key, _, val = opt.partition("=")
        if key.strip() != "k" or not val.strip().isdigit():
            raise ValueError(f"bad mode option {opt!r} in {spec!r}; the only option is k=N")
        k = int(val)
    parts = [p.strip() for p in text.split("+") if p.strip()]
    if not parts:
        raise ValueError("empty mode")
    base, mods = parts[0], {OLD_CHOICES["policy"].get(m, m) for m in parts[1:]}  # +adaptive: the old name
    unknown = mods - {"cache", "branches", "plus2minus1", "ctrl", "autowin"}
    if unknown:
        raise ValueError(
            f"unknown mode modifier(s) {sorted(unknown)} in {spec!r}; use +cache, +branches, +plus2minus1, +ctrl, +autowin"
        )
    policy = "controller" if "ctrl" in mods else "plus2minus1" if "plus2minus1" in mods else "fixed"
    return SimConfig(
        mode=base,
        k=k,
        window=window,
        cache="cache" in mods,
        branches="branches" in mods,
        policy=policy,
        auto_window="autowin" in mods,
        label=label,
    )


@dataclass
class SimResult:
    label: str
    stats: RunStats  # the loop's own statistics, as the live edge reports them
    n: int  # tokens generated
    passes: int  # accelerator passes that verified this session's blocks (or its cloud-only steps)
    tokens: list[int] = field(default_factory=list)  # what the edge committed, in the trace's real ids

    @property
    def wall_s(self) -> float:
        return self.stats.wall_s

    @property
    def ttft_s(self) -> float:
        return self.stats.ttft_s

    @property
    def tokens_per_s(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else 0.0


class SimTransport(Transport):
    """DRAFT frames up a simulated link to the simulated cloud, verdicts back through the edge's
    mailbox; link timing recorded exactly as `TcpTransport` records it."""

    def __init__(self, edge: SimEdge) -> None:
        self.e = edge
        self.sent_at: dict[int, tuple[float, int, int]] = {}

    def send(self, block: Block) -> None:
        e = self.e
        toks = tuple(int(t) for t in block.tokens)
        nbytes = e.sizer.draft(block.seq, block.base, tuple(int(e.vocab.real_id[t]) for t in toks))
        self.sent_at[block.seq] = (e.k.now(), nbytes, len(toks))
        sent = SentBlock(block.seq, block.base, toks)
        e.up.send(nbytes, lambda t: e.cloud.draft(e.session, sent))

    def recv(self, timeout: float | None = None) -> BlockVerdict | None:
        item = self.e.next_frame(BlockVerdict, timeout)
        if item is None:
            return None
        t, v, nbytes = item
        sent = self.sent_at.pop(v.seq, None)
        if sent is not None:
            self._record(LinkSample(sent[0], t, v.verify_us / 1e6, sent[1], nbytes, sent[2]))
        return v


class SimLeadLink(LeadLink):
    """A cloud-led session's steps down and drafts up, over the simulated links; the round trip the
    lead depth prices is the link profile's (the live link measures it with PINGs)."""

    def __init__(self, edge: SimEdge, rtt_s: float) -> None:
        self.e = edge
        self._rtt = rtt_s

    def rtt_s(self) -> float | None:
        return self._rtt

    def send_draft(self, base: int, tokens, q, parents=None) -> None:
        e = self.e
        toks = tuple(int(t) for t in tokens)
        par = None if parents is None else tuple(parents)
        nbytes = e.sizer.draft(0, base, tuple(int(e.vocab.real_id[t]) for t in toks), par)
        e.up.send(nbytes, lambda t: e.cloud.lead_draft(e.session, base, toks, par))

    def recv(self, timeout: float | None):
        item = self.e.next_frame(Streamed, timeout)
        if item is None:
            return None
        t, f, _ = item
        return StepChunk(f.start, f.tokens, f.finished, f.drafted, f.accepted, f.verify_s, t)


class SimJob(DrafterJob):
    """Drafter work beside the edge's loop, on a simulated thread of its own (`FollowLoop`'s jobs)."""

    def __init__(self, edge: SimEdge, fn) -> None:
        self.edge = edge
        self.thread = edge.k.spawn(fn, name="drafter-job")

    def done(self) -> bool:
        return self.thread.done

    def wait(self) -> None:
        while not self.thread.done:  # the kernel re-raises what the job raised
            self.edge.thread.sleep(1e-3)


class SimEdge:
    """One edge on a kernel: its two links, its session at the cloud, and the simulated thread that
    runs the live edge's code. `result` is set when its generation ends."""

    def __init__(
        self,
        kernel: Kernel,
        cloud: SimCloud,
        trace: PromptTrace,
        device: DeviceProfile,
        net: WanProfile,
        cfg: SimConfig,
        sizer: FrameSizer,
        *,
        seed: int = 0,
        start: float = 0.0,
        name: str = "edge",
    ) -> None:
        self.k, self.cloud, self.trace, self.device, self.cfg, self.sizer = kernel, cloud, trace, device, cfg, sizer
        self.vocab = TraceVocab(trace)
        rng = np.random.default_rng([int(net.seed) & 0xFFFFFFFF, 0x51, int(seed)])
        self.up = SimLink(kernel, net, True, np.random.default_rng(rng.integers(1 << 62)))
        self.down = SimLink(kernel, net, False, np.random.default_rng(rng.integers(1 << 62)))
        self.inbox = Mailbox(kernel)
        verifier = TargetVerifier(
            ReplayModel(self.vocab, "target", n_slots=1),
            self.vocab.prompt,
            rule="greedy",
            max_tokens=trace.n,
            stop_ids=frozenset(),
        )
        self.session = SimCloudSession(
            verifier,
            self.down,
            self.inbox,
            real_id=lambda i: int(self.vocab.real_id[i]),
            cloud_only=cfg.mode == "cloud-only",
            lead=LeadState(memory=cloud.lead_memory) if cfg.mode in LEAD_MODES else None,
        )
        self.rtt_s = net.rtt_ms / 1e3
        self.result: SimResult | None = None
        self.thread: SimThread = kernel.spawn(self._run, name, at=start)

    def next_frame(self, kind: type, timeout: float | None):
        """The next (arrival time, frame, bytes) of type `kind` in the mailbox, None on timeout; the
        edge pays its per-frame overhead (decoding the frame and the loop's bookkeeping)."""
        while True:
            item = self.inbox.get(self.thread, timeout)
            if item is None:
                return None
            if isinstance(item[1], kind):
                self.thread.sleep(self.device.edge_overhead_s)
                return item

    def _run(self) -> None:
        tr, v = self.trace, self.vocab
        t0 = self.k.now()
        cloud_only = self.cfg.mode == "cloud-only"
        nbytes = self.sizer.hello([int(v.real_id[t]) for t in v.prompt], tr.n, cloud_only)
        self.up.send(nbytes, lambda t: self.cloud.hello(self.session))
        stats, tokens = self._stream(t0) if cloud_only else self._speculate(t0, lead=self.cfg.mode in LEAD_MODES)
        stats.bytes_up, stats.bytes_down = self.up.bytes, self.down.bytes
        self.result = SimResult(
            self.cfg.label, stats, stats.emitted, self.session.passes, [int(v.real_id[t]) for t in tokens]
        )

    def _speculate(self, t0: float, *, lead: bool = False) -> tuple[RunStats, list[int]]:
        def drafting(
            sizes,
        ) -> None:  # a drafter call takes the time of the simulated thread making it (the loop's, or a job's)
            thread = self.k.current
            assert thread is not None, "the drafter runs on a simulated thread"
            thread.sleep(self.device.draft_call_s(sizes))

        model = ReplayModel(self.vocab, "draft", n_slots=DRAFTER_SLOTS, on_eval=drafting)
        drafter = ChainDrafter(model, sampling=SamplingParams(), rule=RuleSpec.parse("greedy"), clock=self.k.now)
        # the prompt's prefill while HELLO -> WELCOME is in flight, as the live edge does; cloud-led's goes on
        # beside its loop, which would otherwise hold the stream's first tokens until it is done
        job, late = None, self.cfg.mode == "auto"  # auto: the drafter joins after the first token, as live
        if lead and not late:
            job = SimJob(self, lambda: drafter.prefill(self.vocab.prompt))
        elif not lead:
            drafter.prefill(self.vocab.prompt)
        while True:  # the handshake
            item = self.inbox.get(self.thread, None)
            if item[1] == "welcome":
                break
        loop: FollowLoop | SpecLoop
        if lead:
            given = [drafter] if late else []
            loop = FollowLoop(
                SimLeadLink(self, self.rtt_s),
                self.vocab.prompt,
                drafter=None if late else drafter,
                config=FollowConfig(max_tokens=self.trace.n),
                clock=self.k.now,
                job=job,
                spawn=lambda fn: SimJob(self, fn),
                source=(lambda: given.pop() if given else None) if late else None,
                after_first=late,
            )
        else:
            loop = build_loop(
                SimTransport(self), drafter, self.vocab.prompt, self.cfg.edge_config(self.trace.n), clock=self.k.now
            )
        res = loop.run(t0)
        return res.stats, res.tokens

    def _stream(self, t0: float) -> tuple[RunStats, list[int]]:
        """Cloud-only: count the streamed tokens as they arrive (the live edge's `_cloud_only`)."""
        stats = RunStats()
        tokens: list[int] = []
        while True:
            t, f, _ = self.inbox.get(self.thread, None)
            if not isinstance(f, Streamed):
                continue
            stats.observe_tokens(len(f.tokens), t - t0)
            stats.rounds += len(f.tokens)
            tokens.extend(f.tokens)
            if f.finished:
                break
        stats.wall_s = self.k.now() - t0
        return stats, tokens


def simulate(
    trace: PromptTrace,
    device: DeviceProfile,
    net: WanProfile,
    cfg: SimConfig,
    sizer: FrameSizer | None = None,
    *,
    cost: CloudCost | None = None,
    start: float = 0.0,
) -> SimResult:
    """Replay one prompt's trace: one edge, one cloud accelerator (priced by `cost`, default the device
    profile's t_v(K)), the network `net`, the live configuration `cfg`. `start`: when the request comes,
    in seconds since the link came up (on a varying link, which phase it meets)."""
    if trace.n == 0:
        raise ValueError(f"trace {trace.id} has no tokens to replay")
    kernel = Kernel()
    cloud = SimCloud(kernel, cost or device, sizer or FrameSizer())
    edge = SimEdge(kernel, cloud, trace, device, net, cfg, cloud.sizer, start=start)
    kernel.run()
    if edge.result is None:
        raise RuntimeError(f"simulated edge stalled at {kernel.t:.3f} s ({cfg.label}, trace {trace.id})")
    return edge.result
