"""The trace-driven simulator (acespec.sim): protocol properties on synthetic traces, exact trace recording
on toy models, wire sizes, the report and the `bench sim` command. Fast; no real models."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from acespec.net.profile import WanProfile
from acespec.sim.model import FrameSizer, SimConfig, parse_mode, simulate
from acespec.sim.profiles import DEVICE_PROFILES, DeviceProfile, device_profile
from acespec.sim.report import aggregate, parse_live, run_grid, validation_rows
from acespec.sim.trace import PromptTrace, TraceSet, acceptance_from_logits, predicted_rounds, record_prompt


# ------------------------------------------------------------------------------------------ helpers
def trace_from_ranks(rank, top_q=(0.6, 0.2, 0.1, 0.05), prompt_len=50, pid="synth") -> PromptTrace:
    rank = [int(r) for r in rank]
    n = len(rank)
    acc, run = [0] * n, 0
    for j in range(n - 1, -1, -1):
        run = run + 1 if rank[j] == 0 else 0
        acc[j] = run
    return PromptTrace(pid, prompt_len, [1000 + (j % 5000) for j in range(n)], acc, rank, [list(top_q)] * n)


def random_trace(n: int, p: float, seed: int = 0) -> PromptTrace:
    rng = np.random.default_rng(seed)
    match = rng.random(n) < p
    alt = rng.choice([1, 2, 3, 7], size=n, p=[0.5, 0.25, 0.15, 0.10])
    return trace_from_ranks(np.where(match, 0, alt))


def device(**kw) -> DeviceProfile:
    d = dict(name="test", draft_s_per_token=0.01, draft_prefill_s_per_token=0.0, verify_c0_s=0.02, verify_c1_s=0.0,
             target_prefill_s_per_token=0.0, edge_overhead_s=0.0)
    d.update(kw)
    return DeviceProfile(**d)


def rate_after_ttft(r) -> float:
    return (r.n - 1) / (r.wall_s - r.ttft_s)


NPU = DEVICE_PROFILES["edge-npu+h200"]


# ------------------------------------------------------------------------------------------ protocol properties
@pytest.mark.parametrize("window", [2, 3])
def test_pipelined_full_accept_approaches_window_blocks_per_rtt(window):
    """a_j >= K+1 everywhere: every guess is right, W blocks of K+1 tokens per round-trip cycle."""
    K, rtt = 4, 0.2
    dev = device(draft_s_per_token=0.0005, verify_c0_s=0.005)
    tr = trace_from_ranks([0] * 3000)
    r = simulate(tr, dev, WanProfile(rtt_ms=rtt * 1e3), SimConfig(mode="pipelined", k=K, window=window))
    cycle = rtt + dev.verify_s(K) + (K + 1) * dev.draft_s_per_token  # the next block is drafted after a verdict
    expect = window * (K + 1) / cycle
    assert rate_after_ttft(r) == pytest.approx(expect, rel=0.03)
    assert rate_after_ttft(r) >= 0.9 * window * (K + 1) / rtt
    assert r.passes_per_token == pytest.approx(1 / (K + 1), rel=0.01)
    assert r.dropped == 0
    # and stop-and-wait gets one block (K accepted + the bonus) per cycle
    s = simulate(tr, dev, WanProfile(rtt_ms=rtt * 1e3), SimConfig(mode="sync", k=K))
    assert rate_after_ttft(r) > 0.95 * window * rate_after_ttft(s)


def test_pipelined_full_accept_bounded_by_drafting():
    K = 4
    dev = device(draft_s_per_token=0.03, verify_c0_s=0.005)
    tr = trace_from_ranks([0] * 1500)
    r = simulate(tr, dev, WanProfile(rtt_ms=50), SimConfig(mode="pipelined", k=K, window=2))
    assert rate_after_ttft(r) <= 1 / dev.draft_s_per_token * 1.01
    assert rate_after_ttft(r) == pytest.approx(1 / dev.draft_s_per_token, rel=0.03)


@pytest.mark.parametrize("mode", ["sync", "pipelined", "sync+cache", "pipelined+cache", "sync+branches",
                                  "pipelined+branches", "pipelined+branches+ideal", "pipelined+adaptive"])
@pytest.mark.parametrize("rtt", [0, 100])
def test_no_acceptance_means_one_pass_per_token(mode, rtt):
    tr = trace_from_ranks([1, 2, 3, 1, 5] * 40)
    r = simulate(tr, NPU, WanProfile(rtt_ms=rtt), parse_mode(mode))
    assert r.n == 200
    assert r.passes == r.n
    assert r.rounds_accepted == 0


def test_sync_throughput_decreases_with_rtt():
    tr = random_trace(300, 0.7, seed=1)
    rates = [simulate(tr, NPU, WanProfile(rtt_ms=rtt, up_bps=5e6, down_bps=20e6), SimConfig(mode="sync")).tokens_per_s
             for rtt in range(0, 301, 25)]
    assert all(a > b for a, b in zip(rates, rates[1:])), rates


def test_sync_matches_closed_form():
    """Stop and wait on an ideal link: every round is K t_d + RTT + t_v(K) + edge overhead, in series."""
    K, rtt, P = 4, 0.08, 40
    dev = device(draft_s_per_token=0.012, verify_c0_s=0.018, verify_c1_s=0.0004, draft_prefill_s_per_token=0.001,
                 target_prefill_s_per_token=0.0001, edge_overhead_s=0.0005)
    tr = random_trace(200, 0.75, seed=3)
    tr.prompt_len = P
    r = simulate(tr, dev, WanProfile(rtt_ms=rtt * 1e3), SimConfig(mode="sync", k=K))
    rounds = predicted_rounds(tr.accept, tr.n, [K] * 1000)
    expect = rtt + P * (dev.draft_prefill_s_per_token + dev.target_prefill_s_per_token)
    expect += len(rounds) * (K * dev.draft_s_per_token + rtt + dev.verify_s(K) + dev.edge_overhead_s)
    assert r.passes == len(rounds)
    assert r.wall_s == pytest.approx(expect, rel=1e-9)


@pytest.mark.parametrize("net", [WanProfile(), WanProfile(up_bps=5e6, down_bps=2e6)])
def test_cloud_only_is_rtt_insensitive_after_ttft(net):
    tr = random_trace(200, 0.7)
    runs = {}
    for rtt in (0, 50, 100, 250):
        n = WanProfile(rtt_ms=rtt, up_bps=net.up_bps, down_bps=net.down_bps)
        runs[rtt] = simulate(tr, NPU, n, SimConfig(mode="cloud-only"))
    base = runs[0]
    assert rate_after_ttft(base) == pytest.approx(1 / NPU.cloud_step_s, rel=0.01)
    for rtt, r in runs.items():
        assert r.passes == r.n
        assert rate_after_ttft(r) == pytest.approx(rate_after_ttft(base), rel=1e-9)
        assert r.ttft_s - base.ttft_s == pytest.approx(rtt / 1e3, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("mode", ["sync+cache", "pipelined+cache", "sync+cache+ideal", "pipelined+cache+ideal"])
@pytest.mark.parametrize("rtt", [0, 50, 150])
@pytest.mark.parametrize("p", [0.5, 0.8])
def test_cache_hits_never_slow_things_down(mode, rtt, p):
    """The same run with every lookup forced to miss (all the cache's costs kept) is never faster."""
    tr = random_trace(250, p, seed=int(p * 10) + rtt)
    for dev in (NPU, DEVICE_PROFILES["edge-cpu+gpu"]):
        net = WanProfile(rtt_ms=rtt, up_bps=5e6, down_bps=20e6)
        with_hits = simulate(tr, dev, net, parse_mode(mode))
        cfg = parse_mode(mode)
        cfg.cache_hits = False
        without = simulate(tr, dev, net, cfg)
        assert with_hits.wall_s <= without.wall_s * (1 + 1e-9), (dev.name, with_hits.hits)
        assert with_hits.passes == without.passes or with_hits.n == without.n


def test_cache_hits_happen_and_help_at_high_rtt():
    tr = random_trace(300, 0.7, seed=5)
    net = WanProfile(rtt_ms=150)
    base = simulate(tr, NPU, net, parse_mode("sync"))
    cached = simulate(tr, NPU, net, parse_mode("sync+cache+ideal"))
    assert cached.hits > 0 and cached.lookups > cached.hits
    assert cached.tokens_per_s > base.tokens_per_s


@pytest.mark.parametrize("base", ["sync", "pipelined"])
def test_branches_help_only_when_there_is_a_round_trip(base):
    """With the edge reacting at once (+ideal) and an unlimited link, a branch saves a round trip: nothing at
    RTT 0, more the longer the round trip (pipelined sends its branches later, after the next block)."""
    tr = random_trace(300, 0.7, seed=7)
    cache, branches = parse_mode(f"{base}+cache+ideal"), parse_mode(f"{base}+branches+ideal")
    at0 = [simulate(tr, NPU, WanProfile(rtt_ms=0), c).tokens_per_s for c in (cache, branches)]
    assert at0[1] == pytest.approx(at0[0], rel=0.01)
    gains = []
    for rtt in (100, 200, 300):
        r_cache = simulate(tr, NPU, WanProfile(rtt_ms=rtt), cache)
        r_br = simulate(tr, NPU, WanProfile(rtt_ms=rtt), branches)
        assert r_br.branch_hits > 0
        assert r_br.bytes_up > r_cache.bytes_up  # branches cost uplink bytes
        gains.append(r_br.tokens_per_s / r_cache.tokens_per_s)
    assert min(gains) >= 1.0
    assert gains[1] > 1.02 and gains[2] > 1.05


def test_shared_cpu_contention_only_matters_when_both_sides_compute():
    tr = random_trace(200, 0.7, seed=2)
    solo = device(draft_s_per_token=0.03, verify_c0_s=0.08, verify_c1_s=0.02)
    shared = solo.replace(shared_cpu=True, contention_draft=2.0, contention_verify=2.0)
    net = WanProfile(rtt_ms=20)
    # stop and wait never overlaps drafting and verifying
    a = simulate(tr, solo, net, SimConfig(mode="sync"))
    b = simulate(tr, shared, net, SimConfig(mode="sync"))
    assert b.wall_s == pytest.approx(a.wall_s, rel=1e-9)
    # pipelining does, and pays for it
    c = simulate(tr, solo, net, SimConfig(mode="pipelined"))
    d = simulate(tr, shared, net, SimConfig(mode="pipelined"))
    assert d.wall_s > c.wall_s


def test_jitter_is_seeded_and_does_not_reorder():
    tr = random_trace(200, 0.7, seed=4)
    n1 = WanProfile(rtt_ms=100, jitter_ms=40, seed=3)
    a = simulate(tr, NPU, n1, parse_mode("pipelined+branches"))
    b = simulate(tr, NPU, n1, parse_mode("pipelined+branches"))
    c = simulate(tr, NPU, WanProfile(rtt_ms=100, jitter_ms=40, seed=4), parse_mode("pipelined+branches"))
    assert a.wall_s == b.wall_s and a.passes == b.passes
    assert a.wall_s != c.wall_s
    assert a.n == c.n == tr.n


def test_adaptive_policies_plug_in():
    tr = random_trace(300, 0.85, seed=6)
    net = WanProfile(rtt_ms=100)
    fixed = simulate(tr, NPU, net, parse_mode("pipelined"))
    for mode in ("pipelined+adaptive", "pipelined+ctrl", "sync+ctrl"):
        r = simulate(tr, NPU, net, parse_mode(mode))
        assert r.n == tr.n and r.passes > 0
    assert simulate(tr, NPU, net, parse_mode("pipelined+adaptive")).mean_k != fixed.mean_k


def test_parse_mode():
    c = parse_mode("pipelined+branches+ctrl", k=6, window=3)
    assert (c.mode, c.k, c.window, c.cache, c.branches, c.policy) == ("pipelined", 6, 3, True, True, "controller")
    assert parse_mode("sync").cache is False
    with pytest.raises(ValueError):
        parse_mode("sync+turbo")
    with pytest.raises(ValueError):
        parse_mode("async")


# ------------------------------------------------------------------------------------------ wire sizes
def test_frame_sizes_match_the_wire_format():
    """DRAFT = 13 bytes of framing (a random session id, seq and base < 2**21) + ~3 bytes per token; VERDICT ~15."""
    fs = FrameSizer()
    toks = (100000, 100001, 100002, 100003)
    assert fs.draft(20000, 1 << 20, ()) == 13
    assert fs.draft(20000, 1 << 20, toks) == 13 + 4 * 3
    assert fs.draft(5, 300, toks) - fs.draft(5, 300, ()) == 12
    assert fs.verdict(5000, 3, 100000, 20000, 1 << 20, False, False) == 15


# ------------------------------------------------------------------------------------------ traces
def test_acceptance_from_logits():
    y = [2, 0, 1, 1]
    logits = np.array([[0, 0, 5.0], [5.0, 0, 0], [0, 1.0, 3.0], [0, 5.0, 0]])
    a, rank, top_q = acceptance_from_logits(y, logits)
    assert a == [2, 1, 0, 1]
    assert rank == [0, 0, 1, 0]
    assert len(top_q[0]) == 3 and top_q[0][0] > top_q[0][1] >= top_q[0][2]


@pytest.mark.parametrize("noise,k", [(0.7, 4), (1.5, 4), (1.0, 3), (1.0, 6)])
def test_recorded_trace_matches_what_the_engine_accepts(noise, k):
    """Toy models are batch-invariant, so the trace is exact: the engine accepts min(a_j, K) every round,
    for the K it recorded with and for any other K."""
    from acespec.engine import SpecConfig, generate
    from acespec.models.toy import ToyModel

    target = ToyModel(vocab=64, seed=1)
    drafter = ToyModel(vocab=64, seed=1, noise=noise, noise_seed=9)
    prompt = [3, 1, 4, 1, 5]
    tr, _ = record_prompt(target, drafter, prompt, max_tokens=80, k=4)
    assert tr.n == 80 and tr.engine_agreement() == 1.0
    assert [a for _, a in tr.engine_rounds] == predicted_rounds(tr.accept, tr.n, [d for d, _ in tr.engine_rounds])

    class Rec:
        min_conf = None

        def __init__(self):
            self.rounds = []

        def next_k(self):
            return k

        def update(self, drafted, accepted, **obs):
            self.rounds.append(accepted)

    rec = Rec()
    res = generate(ToyModel(vocab=64, seed=1), prompt, SpecConfig(rule="greedy", k=k, max_tokens=80),
                   draft=ToyModel(vocab=64, seed=1, noise=noise, noise_seed=9), policy=rec)
    assert list(res.tokens) == tr.tokens
    assert rec.rounds == predicted_rounds(tr.accept, tr.n, [k] * len(rec.rounds))
    assert 0 < sum(rec.rounds) < tr.n  # some rejections, some acceptance

    # and the simulator replays that run round by round: same passes in sync mode
    sim = simulate(tr, NPU, WanProfile(), SimConfig(mode="sync", k=k))
    assert sim.passes == len(rec.rounds)
    assert sim.rounds_accepted == sum(rec.rounds)


def test_trace_file_roundtrip(tmp_path):
    tr = random_trace(50, 0.6)
    ts = TraceSet([tr], "d", "t", timings={"draft_s_per_token": 0.03, "verify_s": [0.08, 0.09, 0.1],
                                           "contention_draft": 1.7, "contention_verify": 1.9})
    path = ts.save(tmp_path / "t.json")
    back = TraceSet.load(path)
    assert back.prompts[0].accept == tr.accept and back.timings == ts.timings
    dev = device_profile("cpu-here", back.timings)
    assert dev.shared_cpu and dev.contention_draft == 1.7
    assert dev.verify_s(1) == pytest.approx(0.09 + dev.cloud_overhead_s)
    assert dev.verify_s(4) > dev.verify_s(2)  # extrapolated past the table
    noisy = device_profile("cpu-here", {"draft_s_per_token": 0.02, "verify_s": [0.03, 0.07, 0.3, 0.1, 0.3]})
    table = [noisy.verify_s(k) for k in range(5)]
    assert table == sorted(table)  # t_v(K) never falls with K (isotonic fit of the measurements)
    bad = ts.to_json()
    bad["prompts"][0]["accept"][0] += 1
    with pytest.raises(ValueError):
        TraceSet.from_json(bad)
    with pytest.raises(ValueError):
        device_profile("cpu-here", {})
    with pytest.raises(ValueError):
        device_profile("quantum-edge")


# ------------------------------------------------------------------------------------------ report and CLI
def test_grid_ratios_and_sensitivity():
    trs = [random_trace(150, 0.75, seed=s) for s in range(2)]
    res = run_grid(trs, [NPU], [0, 100, 200], ["cloud-only", "sync", "pipelined"])
    rows = {(r["rtt_ms"], r["mode"]): r for r in res["rows"]}
    assert rows[(100.0, "sync")]["x_sync"] == 1.0 and rows[(100.0, "cloud-only")]["x_cloud_only"] == 1.0
    s = res["sensitivity"]["edge-npu+h200"]
    assert s["sync"]["ratio"] < s["cloud-only"]["ratio"] <= 1.0
    agg = aggregate([simulate(trs[0], NPU, WanProfile(), SimConfig(mode="sync"))])
    assert 0 < agg["passes_per_token"] < 1 and agg["up_bytes_per_token"] > 0


def test_validation_reads_bench_wan_json():
    live = {"config": {"k": 4, "window": 2, "profile": "wan", "max_tokens": 64},
            "summary": {"0": {"sync": {"tokens_per_s": 5.0, "ttft_s": 1.0, "target_passes_per_token": 0.4},
                              "cloud-only": {"tokens_per_s": 8.0, "ttft_s": 0.5, "target_passes_per_token": 1.0}}}}
    rows, cfg = parse_live(live)
    assert cfg["profile"] == "wan" and {r["mode"] for r in rows} == {"sync", "cloud-only"}
    sim = [{"mode": "sync", "rtt_ms": 0.0, "tok_s": 6.0, "ttft_s": 1.2, "passes_per_token": 0.4, "up_bytes_per_token": 9}]
    v = validation_rows(sim, rows)
    assert v[0]["ratio_tok_s"] == pytest.approx(1.2) and v[0]["live_passes_per_token"] == 0.4
    # `bench acespec` variant names map to simulator modes
    rows, _ = parse_live({"summary": {"200": {"acespec": {"tokens_per_s": 3.0}, "acespec:k=8": {"tokens_per_s": 2.0},
                                               "+cache": {"tokens_per_s": 2.5}}}})
    assert {r["mode"] for r in rows} == {"pipelined+branches+ctrl", "pipelined+branches:k=8", "pipelined+cache"}
    c = parse_mode("pipelined+branches:k=8", k=4)
    assert c.k == 8 and c.branches


def test_bench_sim_command(tmp_path, capsys):
    from acespec.bench.sim import add_parser

    ts = TraceSet([random_trace(80, 0.7, seed=s) for s in range(2)], "d", "t",
                  timings={"draft_s_per_token": 0.03, "verify_s": [0.08, 0.09, 0.1, 0.11, 0.12]})
    path = ts.save(tmp_path / "tr.json")
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="bench"))
    out = tmp_path / "out.json"
    args = ap.parse_args(["sim", "--traces", str(path), "--profile", "all", "--rtt", "0,100",
                          "--modes", "cloud-only,sync,pipelined+branches", "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "edge-npu+h200" in text and "cpu-here" in text and "RTT sensitivity" in text
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 3 * 2 * 3
    live = tmp_path / "live.json"
    live.write_text(json.dumps({"config": {"k": 4, "window": 2, "profile": "wan"},
                                "summary": {"0": {"sync": {"tokens_per_s": 5.0}}, "100": {"sync": {"tokens_per_s": 3.0}}}}))
    args = ap.parse_args(["sim", "--validate", "--traces", str(path), "--live", str(live)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "sim/live" in text and "sync" in text
