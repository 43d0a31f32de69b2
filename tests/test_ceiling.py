"""The ceiling every speed benchmark prints beside its measurement (`sim/ceiling.py`): hand-computed
cases of each mode's schedule, the calibration read from a run's own statistics, and a real session
that records the passes the calibration needs."""

from __future__ import annotations

import pytest

from acespec.sim.ceiling import Calibration, calibrate, ceiling, expected_tokens
from acespec.loop.stats import RunStats


@pytest.mark.parametrize("k,a,want", [(0, 0.7, 1.0), (3, 0.0, 1.0), (3, 1.0, 4.0), (2, 0.5, 1.75), (4, 0.9, 4.0951)])
def test_expected_tokens_is_the_truncated_geometric_sum(k, a, want):
    assert expected_tokens(k, a) == pytest.approx(want, rel=1e-4)


def test_cloud_only_is_the_target_stepping_without_a_gap():
    cal = Calibration(pass_c0_s=0.2, pass_c1_s=0.01, draft_s=0.005, rtt_s=0.1, accept=0.8)
    assert ceiling("cloud-only", cal) == (pytest.approx(5.0), 0)


def test_pipelined_drafts_until_the_edge_cannot_keep_the_target_fed():
    # a GPU's shape (a pass costs the same for any k): deeper is better until the k drafts and the
    # guess of the bonus token each block starts the next one with take longer than the pass itself,
    # at k + 1 = t0 / d = 10
    cal = Calibration(pass_c0_s=0.1, pass_c1_s=0.0, draft_s=0.01, rtt_s=0.1, accept=0.9, k_max=16)
    rate, k = ceiling("pipelined", cal)
    assert k == 9 and rate == pytest.approx(expected_tokens(9, 0.9) / 0.1)
    # past it the edge sets the pace: k drafts and the guess, (k + 1) d a block
    assert ceiling("pipelined", Calibration(0.1, 0.0, 0.01, 0.1, accept=1.0, k_max=16))[0] == pytest.approx(100.0)


def test_only_the_edge_led_pipeline_drafts_a_guess_of_the_bonus_token():
    # the same pass and drafter: a pipelined block of k drafts costs the edge (k + 1) draft passes, a
    # cloud-led step's k drafts cost k (the stream hands it every token it did not draft)
    cal = Calibration(pass_c0_s=0.2, pass_c1_s=0.0, draft_s=0.05, rtt_s=0.1, accept=0.9, k_max=8)
    pipe, led = ceiling("pipelined", cal), ceiling("cloud-led", cal)
    assert pipe == (pytest.approx(max(expected_tokens(j, 0.9) / max(0.2, (j + 1) * 0.05) for j in range(1, 9))), 3)
    assert led == (pytest.approx(max(expected_tokens(j, 0.9) / max(0.2, j * 0.05) for j in range(9))), 4)
    assert pipe[0] <= 1 / 0.05  # never more than one committed token per draft pass


def test_sync_pays_drafting_and_the_round_trip_on_every_block():
    cal = Calibration(pass_c0_s=0.1, pass_c1_s=0.02, draft_s=0.01, rtt_s=0.1, accept=0.8, k_max=0)
    assert ceiling("sync", cal) == (pytest.approx(1 / 0.2), 0)  # k = 0: a plain step and its round trip
    deep = Calibration(pass_c0_s=0.1, pass_c1_s=0.02, draft_s=0.01, rtt_s=0.1, accept=0.8, k_max=16)
    rate, k = ceiling("sync", deep)
    best = max(expected_tokens(j, 0.8) / (0.1 + 0.02 * j + 0.01 * j + 0.1) for j in range(17))
    assert rate == pytest.approx(best) and rate < ceiling("pipelined", deep)[0]


@pytest.mark.parametrize("a", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("c1", [0.0, 0.05, 0.5])
def test_cloud_led_never_sits_below_cloud_only_and_drafts_nothing_the_target_refuses(a, c1):
    cal = Calibration(pass_c0_s=0.1, pass_c1_s=c1, draft_s=0.002, rtt_s=0.1, accept=a)
    led, k = ceiling("cloud-led", cal)
    assert led >= ceiling("cloud-only", cal)[0]
    if a == 0.0:
        assert k == 0  # no draft is ever kept: a plain step is the best schedule


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        ceiling("warp", Calibration(0.1, 0.0, 0.0, 0.0, 0.5))


def _stats(passes, accepted, rejections, drafted, draft_s, rtt_ms=None):
    r = RunStats()
    for k, s in passes:
        r.observe_pass(k, s)
    r.accepted, r.rejections, r.drafted, r.draft_s = accepted, rejections, drafted, draft_s
    if rtt_ms is not None:
        r.link["rtt_ms_mean"] = rtt_ms
    return r


def test_calibrate_reads_a_runs_own_passes_acceptance_drafting_and_link():
    led = _stats([(0, 0.1)] * 3 + [(0, 5.0)], accepted=0, rejections=0, drafted=0, draft_s=0.0, rtt_ms=100.0)  # one hiccup
    edge = _stats([(4, 0.3)] * 3, accepted=6, rejections=2, drafted=12, draft_s=0.12, rtt_ms=100.0)
    cal = calibrate([led, edge])
    assert cal.pass_c0_s == pytest.approx(0.1) and cal.pass_c1_s == pytest.approx(0.05)
    assert cal.measured == () and cal.pass_s(2) == pytest.approx(0.2)  # too few passes at any k for its own median
    assert cal.accept == pytest.approx(0.75) and cal.draft_s == pytest.approx(0.01) and cal.rtt_s == pytest.approx(0.1)
    assert calibrate([RunStats()]) is None


def test_drafting_is_priced_per_token_drafted_not_per_token_verified():
    """A cloud-led chain the stream passed, a doomed block: tokens drafted and never verified. Priced
    per verified token, that waste reads as a slower drafter, and the ceiling falls below the run."""
    wasteful = _stats([(2, 0.02)] * 6, accepted=10, rejections=2, drafted=12, draft_s=0.6)
    wasteful.draft_tokens = 60  # 48 of them drafted for nothing
    assert calibrate([wasteful]).draft_s == pytest.approx(0.01)
    legacy = _stats([(2, 0.02)] * 6, accepted=10, rejections=2, drafted=12, draft_s=0.6)  # no count: per verified token
    assert calibrate([legacy]).draft_s == pytest.approx(0.05)


def test_a_real_session_records_every_pass_the_target_reported():
    from acespec.cloud.server import CloudServerThread, ServerConfig
    from acespec.edge.client import ConnectConfig
    from acespec.edge.runtime import EdgeConfig, run_edge
    from acespec.models.toy import ToyModel
    from paced_toy import PassCostToy

    # a bare toy pass takes microseconds, nearly none of them fixed: on a loaded machine the fit of
    # c0 + c1 k could land at c0 = 0 by noise alone. A pass with a real fixed cost, as a GPU's has.
    target = PassCostToy(vocab=48, seed=1, pass_s=0.004)
    drafter = ToyModel(vocab=48, seed=1, noise=1.0, noise_seed=3)
    with CloudServerThread(target, ServerConfig(port=0)) as srv:
        runs = {mode: run_edge(drafter, [1, 2, 3], EdgeConfig(mode=mode, rule="greedy", k=3, max_tokens=30,
                                                              connect=ConnectConfig(port=srv.port)),
                               model_id="toy:vocab=48").stats for mode in ("sync", "cloud-led")}
    sync = runs["sync"]
    assert len(sync.passes) == sync.rounds and {k for k, _ in sync.passes} <= {0, 1, 2, 3}
    assert sum(s for _, s in sync.passes) == pytest.approx(sync.verify_s)
    assert sync.rejections <= sync.rounds and (sync.accepted + sync.rejections) > 0
    assert runs["cloud-led"].passes  # the cloud-led steps' figures (TOKENS with HAS_STEP) count too
    cal = calibrate(runs.values())
    assert cal is not None and cal.pass_c0_s > 0.002 and 0 <= cal.accept <= 1  # the fixed 4 ms found


def test_passes_at_one_depth_price_that_depth_only():
    # every pass verified 4 drafts: the run says nothing about a plain step, nor about deeper blocks
    edge = _stats([(4, 0.3)] * 6, accepted=20, rejections=2, drafted=24, draft_s=0.24)
    cal = calibrate([edge])
    assert cal.seen == (4,) and cal.pass_s(4) == pytest.approx(0.3)
    assert ceiling("cloud-only", cal) == (0.0, 0)  # unknown, printed as such, not 1 / 0.3
    rate, k = ceiling("pipelined", cal)
    assert k == 4 and rate == pytest.approx(expected_tokens(4, 20 / 22) / max(0.3, 5 * 0.01))
    both = calibrate([edge, _stats([(0, 0.1)] * 6, accepted=0, rejections=0, drafted=0, draft_s=0.0)])
    assert ceiling("cloud-only", both)[0] == pytest.approx(10.0)
    assert ceiling("pipelined", both)[1] == 3  # with two depths the line prices every k, and 3 beats the 4 the run drafted


def test_each_run_is_held_to_its_own_acceptance_and_round_trip():
    from acespec.sim.ceiling import for_run

    cal = Calibration(pass_c0_s=0.1, pass_c1_s=0.0, draft_s=0.001, rtt_s=0.1, accept=0.5)
    good = _stats([], accepted=9, rejections=1, drafted=10, draft_s=0.01, rtt_ms=20.0)
    own = for_run(cal, good)
    assert own.accept == pytest.approx(0.9) and own.rtt_s == pytest.approx(0.02) and own.pass_c0_s == 0.1
    assert ceiling("pipelined", own)[0] > ceiling("pipelined", cal)[0]
    assert for_run(cal, RunStats()) == cal  # nothing judged, no link measured: the pooled figures


def test_bench_acespec_checks_each_mode_against_its_ceiling():
    from acespec.bench.acespec_bench import check_bars

    def m(tps, frac, top):
        return {"tokens_per_s": tps, "of_ceiling": frac, "ceiling_tokens_per_s": top, "target_passes_per_token": 0.2}

    result = {"summary": {"100": {"acespec": m(7.2, 0.57, 12.6), "cloud-only": m(5.9, 0.95, 6.2)}}}
    bars = {b: (got, ok) for b, got, ok in check_bars(result, 1 << 20)}
    assert bars["acespec steady tokens/s >= 0.8 of its ceiling at RTT 100 ms"] == ("0.57 of 12.60 tok/s", False)
    assert bars["cloud-only steady tokens/s >= 0.9 of its ceiling at RTT 100 ms"] == ("0.95 of 6.20 tok/s", True)


def test_a_k_with_passes_enough_is_priced_at_its_own_median_not_the_line():
    # a CPU's cost curve: a plain step far cheaper than the line through the deeper passes says (the
    # line's intercept, the median of the medians' offsets from its slope, is 0.125 here, and it puts a
    # k = 4 pass at 0.385). Four k, not three: with three the median offset was the plain step's own
    # 0.10 give or take rounding, and `> 0.10` failed on an AMD CPU whose LAPACK rounds the other way.
    r = _stats([(0, 0.10)] * 6 + [(2, 0.30)] * 6 + [(4, 0.40)] * 6 + [(6, 0.50)] * 6,
               accepted=8, rejections=2, drafted=20, draft_s=0.02)
    cal = calibrate([r])
    assert cal.pass_s(0) == pytest.approx(0.10) and cal.pass_s(4) == pytest.approx(0.40)
    assert cal.pass_c0_s == pytest.approx(0.125)  # the line would have priced a plain step 25% dearer
    assert ceiling("cloud-only", cal)[0] == pytest.approx(10.0)


def test_against_ceiling_sums_the_ceilings_time_as_the_runs_own_is_summed():
    from acespec.sim.ceiling import against_ceiling

    cal = Calibration(pass_c0_s=0.1, pass_c1_s=0.0, draft_s=0.0, rtt_s=0.0, accept=0.0)  # cloud-only: 10 tok/s
    runs = []
    for n, step in ((10, 0.2), (30, 0.1)):  # 10 tokens at 5 tok/s, 30 at 10 tok/s, one token per commit
        r = RunStats()
        r.emitted, r.token_times = n, [step * i for i in range(n)]
        runs.append(r)
    top, share, k = against_ceiling(runs, "cloud-only", cal)
    assert top == pytest.approx(10.0) and k == 0
    assert share == pytest.approx((9 + 29) / (9 * 0.2 + 29 * 0.1) / 10.0)  # steady tokens over steady time, not a mean of rates
