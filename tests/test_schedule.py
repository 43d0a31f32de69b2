"""The loop's parts on their own: the scheduler's timing (on a fake clock), the cache planner's choices,
the link estimates the controller gets, and the transport's declared link timing.

A fake clock makes every due time exact: the scheduler reads time only through the clock it is given,
which is what lets a simulator drive the same loop on virtual time.
"""

from __future__ import annotations

import pytest

from acespec.control.depth import FixedDepth
from acespec.draft.cache import CacheConfig, StateCache
from acespec.draft.chain import ChainDrafter
from acespec.loop import SpecConfig, generate
from acespec.loop.loop import LoopConfig, SpecLoop
from acespec.loop.planner import CachePlanner
from acespec.loop.records import Block, InFlight, LinkSample, Outcome
from acespec.loop.schedule import Scheduler, uplink_bytes_per_token, uplink_rate
from acespec.loop.stats import RunStats
from acespec.loop.transport import LocalTransport, Transport
from acespec.loop.verifier import TargetVerifier
from acespec.models.toy import ToyModel
from acespec.verify import RuleSpec, SamplingParams

PROMPT = [1, 2, 3]


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Timed(Transport):
    """A transport that only carries the declared link timing (the scheduler reads nothing else)."""

    def __init__(self, rtts=(), last_arrival=None) -> None:
        for r in rtts:
            self._record(LinkSample(0.0, r, 0.0, 0, 0, 1))
        self.last_arrival = last_arrival

    def send(self, block):
        pass

    def recv(self, timeout=None):
        return None


def scheduler(transport, *, mode="pipelined", window=2, auto_window=False, rounds=2, verify_s=0.6, clock=None):
    stats = RunStats(rounds=rounds, verify_s=verify_s)
    inflight = InFlight()
    return Scheduler(LoopConfig(mode=mode, window=window, auto_window=auto_window), transport, stats, inflight,
                     clock or FakeClock())


def toy_drafter():
    return ChainDrafter(ToyModel(vocab=64, seed=1, scale=3.0, noise=0.5, noise_seed=3), sampling=SamplingParams(0.0),
                        rule=RuleSpec.parse("greedy"))


# --------------------------------------------------------------------------- due times and slack
def test_dues_chain_one_verify_apart_behind_a_busy_target():
    """Network bound (sent + rtt + verify) for the first block; each later one no earlier than the one
    before it plus a verify; the previous verdict's arrival bounds the first."""
    clock = FakeClock(10.0)
    s = scheduler(Timed(rtts=[0.3, 0.2, 0.25]), clock=clock)  # rtt = min of recent = 0.2, verify 0.3
    s.inflight.blocks.extend([Block(0, 3, [1, 2], sent_at=10.0), Block(1, 5, [3, 4], sent_at=10.0)])
    assert s.dues() == pytest.approx([10.5, 10.8])
    clock.t = 10.1
    assert s.until_verdict() == pytest.approx(0.4)
    s.transport.last_arrival = 10.4  # the target answered the block before them late
    assert s.dues() == pytest.approx([10.7, 11.0])


def test_doomed_blocks_and_branches_have_no_due_time():
    s = scheduler(Timed(rtts=[0.2]))
    s.inflight.blocks.extend([
        Block(0, 3, [1], sent_at=100.0, doomed=True),
        Block(1, 3, [1], sent_at=100.0, alt_key=Outcome(0, 0, 5)),
        Block(2, 3, [1], sent_at=100.0),
    ])
    assert s.dues() == pytest.approx([100.5])


def test_no_link_timing_means_no_estimates_and_the_configured_window():
    """A transport that measured nothing (the base class's defaults) leaves the scheduler without
    estimates: no due times, no slack, and the window as configured."""
    s = scheduler(Timed(), window=3, auto_window=True)
    s.inflight.blocks.append(Block(0, 3, [1, 2], sent_at=100.0))
    s.drafted(10, 0.2)
    assert s.rtt() is None and s.dues() is None and s.slack(4) is None and s.window() == 3


def test_slack_is_what_is_left_after_drafting_the_next_block_in_time():
    clock = FakeClock(0.0)
    s = scheduler(Timed(rtts=[0.2]), clock=clock)
    s.drafted(20, 0.4)  # 20 ms a token: 4 tokens and the guessed bonus take 0.1 s
    s.inflight.blocks.extend(Block(i, 3 + 5 * i, [1, 2, 3, 4, 5], sent_at=0.0) for i in range(3))
    assert s.slack(4) == pytest.approx(1.1 - 0.2 - 0.1)  # last due at 1.1, half an rtt each way
    assert s.slack(9) == pytest.approx(1.1 - 0.2 - 0.2)  # a deeper next block leaves less


def test_window_grows_to_cover_the_round_trip_up_to_its_ceiling():
    s = scheduler(Timed(rtts=[0.4]), window=2, auto_window=True, rounds=4, verify_s=0.4)  # cycle 0.5 s
    assert s.window() == 2  # no block drafted yet: no estimate of a block's drafting time
    s.stats.k_chosen, s.stats.draft_s = [4, 4], 0.2  # 0.1 s a block
    assert s.window() == 6  # ceil(0.5 / 0.1) + 1
    s.stats.draft_s = 0.02
    assert s.window() == s.cfg.max_window
    assert scheduler(Timed(rtts=[0.4]), mode="sync").window() == 1


# --------------------------------------------------------------------------- the transport's timing
def test_local_transport_reports_a_link_that_costs_nothing():
    """In process the verdict exists when send returns: the round trip is ~0 and it is reported, so
    the scheduler and the controller see a zero-latency link instead of no link at all."""
    T = ToyModel(vocab=64, seed=1, scale=3.0)
    clock = FakeClock(5.0)
    t = LocalTransport(TargetVerifier(T, PROMPT, sampling=SamplingParams(0.0), rule=RuleSpec.parse("greedy")),
                       clock=clock)
    t.send(Block(0, len(PROMPT), [4, 5]))
    assert list(t.rtt_samples) == [0.0] and t.last_arrival == 5.0
    assert t.recv(0.0).seq == 0
    assert t.link_samples[0].tokens == 2


def test_the_loop_reads_time_only_from_its_clock():
    """A loop on a clock that never moves measures zero wall time and zero latencies, whatever the
    computer's own clock does: nothing in the loop reads the wall clock behind the caller's back."""
    T, D = ToyModel(vocab=64, seed=1, scale=3.0), ToyModel(vocab=64, seed=1, scale=3.0, noise=0.5, noise_seed=3)
    rs, sp = RuleSpec.parse("greedy"), SamplingParams(0.0)
    clock = FakeClock(7.0)
    v = TargetVerifier(T, PROMPT, sampling=sp, rule=rs, max_tokens=24)
    rounds = []
    loop = SpecLoop(LocalTransport(v, clock=clock), PROMPT, drafter=ChainDrafter(D, sampling=sp, rule=rs),
                    policy=FixedDepth(3), config=LoopConfig(mode="pipelined", max_tokens=24), clock=clock,
                    on_round=rounds.append)
    res = loop.run()
    assert res.tokens == generate(T, PROMPT, SpecConfig(max_tokens=24, spec=False)).tokens
    assert res.stats.wall_s == 0.0 and res.stats.wait_s == 0.0 and set(res.stats.token_times) == {0.0}
    assert rounds and all(r.latency_s == 0.0 for r in rounds)


# --------------------------------------------------------------------------- link estimates
def _samples(rate_bps, sizes, rtt=0.25, jitter=()):
    out = []
    for i, b in enumerate(sizes):
        j = jitter[i % len(jitter)] if jitter else 0.0
        out.append(LinkSample(0.0, rtt + 8 * b / rate_bps + j, 0.0, b, 13, max(1, (b - 12) // 190)))
    return out


def test_uplink_rate_is_fitted_from_round_trips_that_grow_with_block_size():
    sizes = [400, 1600, 800, 2400, 1200, 600, 2000, 1000]
    assert uplink_rate(_samples(64e3, sizes)) == pytest.approx(64e3)
    noisy = uplink_rate(_samples(64e3, sizes, jitter=(0.01, -0.012, 0.004, -0.003)))
    assert noisy == pytest.approx(64e3, rel=0.15)


def test_uplink_rate_stays_unknown_when_block_sizes_cannot_show_it():
    """Token ids only (a few bytes a token): sizes vary by tens of bytes, which jitter swamps, and the
    uplink is not what limits such blocks anyway."""
    assert uplink_rate(_samples(64e3, [20, 24, 22, 26, 20, 28], jitter=(0.01, -0.01))) is None
    assert uplink_rate(_samples(64e3, [400, 1600])) is None  # too few blocks
    assert uplink_rate([LinkSample(0.0, 0.0, 0.0, 0, 0, 4)] * 8) is None  # in process: no bytes at all


def test_bytes_per_token_is_the_slope_so_the_frame_header_is_not_spread_over_tokens():
    frames = [LinkSample(0.0, 0.1, 0.0, 12 + 2 * n, 13, n) for n in (2, 5, 9, 4, 17)]
    assert uplink_bytes_per_token(frames) == pytest.approx(2.0)
    same = [LinkSample(0.0, 0.1, 0.0, 20, 13, 4)] * 5  # every block the same length: the pooled ratio
    assert uplink_bytes_per_token(same) == pytest.approx(5.0)
    assert uplink_bytes_per_token([]) is None


# --------------------------------------------------------------------------- the cache planner
def _planner_with_blocks(n_blocks=2, k=3, **cfg):
    dr = toy_drafter()
    cache = StateCache(dr, CacheConfig(**{"max_entries_per_block": 4, "depth": 2, "predraft_depth": 16, **cfg}))
    stats = RunStats()
    planner = CachePlanner(cache, stats)
    spec, live = list(PROMPT), []
    for i in range(n_blocks):
        overlap = 1 if live else 0
        d = dr.draft(spec, k + overlap, keep_top=cache.cfg.alternatives + 1)
        live.append(Block(i, len(spec), d.tokens, overlap=overlap, top=d.top))  # as the loop builds them
        spec = spec + d.tokens
    return planner, cache, live, spec


def test_planner_plans_the_oldest_unplanned_block_with_the_depth_it_is_given():
    """One block per call, oldest first; the depth is passed to the cache, whose config stays as it was."""
    planner, cache, live, spec = _planner_with_blocks()
    planner.plan(live, spec, PROMPT, depth=7)
    assert planner.planned == {0} and {o[1][0] for o in cache.plan} == {0}
    assert cache.cfg.depth == 2 and max(cache._depth.values()) == 7
    planner.plan(live, spec, PROMPT, depth=7)
    assert planner.planned == {0, 1}
    planner.forget(0)
    assert planner.planned == {1}


def test_no_outcome_is_pre_drafted_deeper_than_predraft_depth():
    """The likeliest outcomes get the block's depth up to `predraft_depth`; a hit's block is finished
    after its verdict, so the drafter's time goes to the blocks the target is waiting for."""
    planner, cache, live, spec = _planner_with_blocks(predraft_depth=2)
    planner.plan(live, spec, PROMPT, depth=7)
    assert max(cache._depth.values()) == 2
    while cache.has_work:
        cache.predraft_step()
    assert cache.entries and max(len(e.tokens) for e in cache.entries.values()) == 2
    assert CacheConfig().predraft_depth == 2


def test_planner_weights_a_later_block_by_the_chance_its_assumptions_hold():
    planner, _, live, _ = _planner_with_blocks()
    planner.stats.observe_block(3, 3)  # every position accepted once: (1 + 1) / (1 + 2) each
    accept = planner.accept_estimates()
    assert accept == pytest.approx([2 / 3] * 3)
    links = list(planner.chain(live, accept))
    assert [link.block.seq if link.block else None for link in links] == [0, 1, None]
    assert links[0].prior == 1.0
    ids, probs = live[1].top[0]
    guess = float(probs[ids == live[1].tokens[0]][0])  # the drafter's own bonus guess, under its q
    assert links[1].prior == pytest.approx((2 / 3) ** 3 * guess)
    assert links[2].prior < links[1].prior


def test_outcomes_go_first_only_with_the_target_fed_and_a_long_shot_ahead():
    planner, cache, live, spec = _planner_with_blocks()
    planner.plan(live, spec, PROMPT, depth=2)
    assert not planner.outcomes_first(live[:1])  # one block in flight: keep the target fed first
    ahead = list(planner.chain(live, planner.accept_estimates()))[-1].prior
    assert planner.outcomes_first(live) == (cache.next_step_value(max_level=1) >= ahead)


# --------------------------------------------------------------------------- what the controller is fed
class SlowUplink(LocalTransport):
    """A real verifier behind a synthetic link: 250 ms round trip plus serialisation at 64 kbit/s of
    a frame that costs 12 bytes plus 193 per token (q rows on the wire), stamped on a fake clock. Its
    verdicts become visible only every third poll, so the loop has idle time to pre-draft."""

    def __init__(self, verifier, clock) -> None:
        super().__init__(verifier, clock=clock)
        self.polls = 0

    def send(self, block) -> None:
        v = self.verifier.verify(block.seq, block.base, block.tokens, block.q)
        nbytes = 12 + 193 * len(block.tokens)
        t = self.clock()
        verify = 0.03  # a fixed synthetic verify time, so every figure below is exact
        self._record(LinkSample(t, t + 0.25 + 8 * nbytes / 64e3 + verify, verify, nbytes, 13, len(block.tokens)))
        self._out.append(v)

    def recv(self, timeout=None):
        self.polls += 1
        if timeout == 0.0 and self.polls % 3:
            return None
        return super().recv(timeout)


def test_the_loop_feeds_the_controller_the_link_and_the_cache():
    """Round trip, uplink rate, uplink bytes per draft token and state-cache bytes per entry reach the
    policy with every verdict, measured from the transport's samples and the cache's entries."""
    from acespec.control.depth import DepthPolicy

    class Recording(DepthPolicy):
        def __init__(self):
            self.obs, self.i = [], 0

        def next_k(self):
            return (2, 6, 10)[self.i % 3]  # block sizes that vary, so the uplink's per-byte cost shows

        def update(self, drafted, accepted, **obs):
            self.i += 1
            self.obs.append(obs)

    T, D = ToyModel(vocab=64, seed=1, scale=3.0), ToyModel(vocab=64, seed=1, scale=3.0, noise=0.5, noise_seed=3)
    rs, sp = RuleSpec.parse("greedy"), SamplingParams(0.0)
    clock = FakeClock()
    dr = ChainDrafter(D, sampling=sp, rule=rs)
    policy = Recording()
    loop = SpecLoop(SlowUplink(TargetVerifier(T, PROMPT, sampling=sp, rule=rs, max_tokens=80), clock), PROMPT,
                    drafter=dr, policy=policy, config=LoopConfig(mode="pipelined", max_tokens=80),
                    cache=StateCache(dr, CacheConfig()), clock=clock)
    loop.run()
    late = policy.obs[-1]
    assert late["rtt_s"] == pytest.approx(0.25 + 8 * (12 + 193 * 2) / 64e3)  # the smallest block's trip
    assert late["up_bps"] == pytest.approx(64e3)
    assert late["bytes_per_token"] == pytest.approx(193.0)
    fed = [o["cache_bytes_per_entry"] for o in policy.obs if "cache_bytes_per_entry" in o]
    assert fed and all(b > 0 for b in fed)
