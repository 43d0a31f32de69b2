"""The edge-cloud protocol end to end, over real sockets (127.0.0.1 only) through the WAN emulator.

What is pinned here:

- **Network invariance** (coupled and greedy): the committed output is the same for `cloud-only`,
  `sync` and `pipelined` (window 2 and 3), draft depths 1, 3 and 6, an ideal link, 40 ms +- 20 ms of
  jitter, and a lossy, rate-limited link, and it equals the single-process `generate(spec=False)`.
- **Faults**: connection resets and a drop-mode blackhole in the middle of a run (every mode) lose and
  duplicate nothing, in the result or in the stream the edge emits, and the session reconnects.
- **Bytes**: in greedy/coupled modes a DRAFT costs at most 16 bytes of framing plus 4 bytes per token
  and a VERDICT at most 16 bytes, measured on the frames the edge really sent and received, and the
  edge's byte counters add up to exactly those frames.
- **strict over the network**: the q the cloud verifies against is bit for bit the q the drafter
  sampled from (sparse top-n, float32 on the wire); the network path equals the in-process path
  given the same seeds; and a chi-square test over 2000 sessions on one persistent server checks that
  the first two emitted tokens follow the target distribution.
- **Real pair** (`-m real`): a short greedy generation in each mode through the emulator.
- **bench smoke**: `acespec bench wan`'s engine (`run_wan_bench`) on toy models, in a few seconds.

Every run has a hard time limit (`bounded`), so a protocol bug fails a test instead of hanging it.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import types

import numpy as np
from scipy.stats import chi2
import pytest

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.control.depth import FixedDepth
from acespec.draft.chain import ChainDrafter
from acespec.edge import client as edge_client
from acespec.edge.client import ConnectConfig
from acespec.edge.transports import TcpTransport
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop import SpecConfig, generate
from acespec.loop.loop import LocalTransport, LoopConfig, SpecLoop
from acespec.loop.verifier import TargetVerifier
from acespec.models.toy import ToyModel
from acespec.net import WanProfile, WanProxyThread
from acespec.verify import RuleSpec, SamplingParams, probs_from_logits
from acespec.verify.sampling import dense_row

HOST = "127.0.0.1"
V = 64
SEED = 11
TEMP = 0.8
N = 40  # tokens per generation: keeps a 40 ms RTT run near one second
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
RUN_TIMEOUT_S = 30.0


def toy_target(vocab: int = V, **kw) -> ToyModel:
    return ToyModel(vocab=vocab, seed=1, **kw)


def toy_drafter(vocab: int = V, **kw) -> ToyModel:
    return ToyModel(vocab=vocab, seed=1, noise=0.7, noise_seed=3, **kw)


@functools.lru_cache(maxsize=None)
def reference(rule: str = "coupled", temperature: float = TEMP, max_tokens: int = N) -> tuple[int, ...]:
    """Plain autoregressive decoding with the target, in one process: what every network run must emit."""
    cfg = SpecConfig(rule=rule, temperature=temperature, seed=SEED, max_tokens=max_tokens, spec=False)
    return tuple(generate(toy_target(), PROMPT, cfg).tokens)


class Background:
    """fn() running in a daemon thread; `result(timeout)` fails the test instead of hanging it."""

    def __init__(self, fn) -> None:
        self._out: dict = {}
        self.thread = threading.Thread(target=self._body, args=(fn,), daemon=True)
        self.thread.start()

    def _body(self, fn) -> None:
        try:
            self._out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            self._out["error"] = e

    def alive(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout: float = RUN_TIMEOUT_S):
        self.thread.join(timeout)
        if self.thread.is_alive():
            pytest.fail(f"run did not finish within {timeout} s")
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def bounded(fn, timeout: float = RUN_TIMEOUT_S):
    """Run fn() with a hard time limit."""
    return Background(fn).result(timeout)


def edge_cfg(port: int, mode: str, *, k: int = 3, window: int = 2, rule: str = "coupled", temperature: float = TEMP,
             seed: int = SEED, max_tokens: int = N, q_topn: int = 32, **connect) -> EdgeConfig:
    connect.setdefault("reply_timeout_s", 10.0)
    return EdgeConfig(
        mode=mode, rule=rule, k=k, window=window, temperature=temperature, seed=seed, max_tokens=max_tokens,
        q_topn=q_topn, connect=ConnectConfig(host=HOST, port=port, **connect),
    )


def run(port: int, mode: str, *, drafter=None, vocab: int = V, on_tokens=None, prompt=PROMPT, **kw):
    cfg = edge_cfg(port, mode, **kw)
    d = None if mode == "cloud-only" else (drafter or toy_drafter(vocab))
    return bounded(lambda: run_edge(d, prompt, cfg, model_id=f"toy:vocab={vocab}", on_tokens=on_tokens))


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cloud():
    """One cloud server (toy target) for the whole module; sessions take turns on the model."""
    with CloudServerThread(toy_target(), ServerConfig(port=0, max_sessions=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def slow_cloud():
    """A cloud whose target takes ~12 ms per pass, so a cloud-only stream lasts long enough to break."""

    class SlowToy(ToyModel):
        def _eval(self, new, want):
            time.sleep(0.012)
            return super()._eval(new, want)

    with CloudServerThread(SlowToy(vocab=V, seed=1), ServerConfig(port=0, max_sessions=16)) as srv:
        yield srv


@pytest.fixture
def wan():
    """make(upstream_port, profile) -> a started WanProxyThread; all are stopped after the test."""
    proxies: list[WanProxyThread] = []

    def make(upstream_port: int, profile: WanProfile | None = None) -> WanProxyThread:
        p = WanProxyThread(HOST, 0, HOST, upstream_port, profile or WanProfile()).start()
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.stop()


NETS = {
    "ideal": WanProfile(),
    "rtt40-jitter20": WanProfile(rtt_ms=40, jitter_ms=20, seed=1),
    # 5% per-segment loss stalls a chunk (and what is queued behind it) for 200 ms; asymmetric rates
    "lossy": WanProfile(rtt_ms=10, jitter_ms=5, up_bps=2e6, down_bps=8e6, loss_pct=5, seed=2),
}
MODES = [("cloud-only", 1), ("sync", 1), ("pipelined", 2), ("pipelined", 3)]
MATRIX = [
    pytest.param(net, mode, window, k, id=f"{net}-{mode}{window if mode == 'pipelined' else ''}-k{k}")
    for net in NETS
    for mode, window in MODES
    for k in ((3,) if mode == "cloud-only" else (1, 3, 6))
]


# ------------------------------------------------------------------------------------------ invariance


@pytest.mark.parametrize("net,mode,window,k", MATRIX)
def test_coupled_output_is_network_invariant(cloud, wan, net, mode, window, k):
    proxy = wan(cloud.port, NETS[net])
    streamed: list[int] = []
    res = run(proxy.port, mode, k=k, window=window, on_tokens=streamed.extend)
    ref = list(reference())
    assert res.tokens == ref
    assert streamed == ref  # what the edge streamed out, in order: nothing lost, nothing twice
    assert res.finished
    s = res.stats
    assert s.emitted == N and len(s.token_times) == N
    assert 0 < s.ttft_s <= s.wall_s
    assert s.bytes_up > 0 and s.bytes_down > 0
    assert s.link.get("reconnects", 0) == 0
    if mode == "cloud-only":
        assert s.rounds == N and s.target_passes_per_token == 1.0
    else:
        assert 0 < s.accepted <= s.drafted
        assert s.rounds <= N  # every verified round emits at least one token
        assert s.target_passes_per_token <= 1.0
        assert max(s.k_chosen) <= k
        if mode == "sync":
            assert s.dropped == 0  # one block in flight: nothing can go stale
    if net == "ideal":
        assert proxy.counters.resets == 0


@pytest.mark.parametrize("mode,window", MODES, ids=lambda v: str(v))
def test_greedy_output_is_network_invariant(cloud, wan, mode, window):
    proxy = wan(cloud.port, NETS["rtt40-jitter20"])
    res = run(proxy.port, mode, k=4, window=window, rule="greedy", temperature=0.0)
    assert res.tokens == list(reference("greedy", 0.0))


@pytest.mark.parametrize("mode,window", MODES, ids=lambda v: str(v))
def test_time_to_first_token_counts_from_the_request(cloud, wan, mode, window):
    """TTFT counts from the request, handshake included: a speculative edge's first token needs
    HELLO/WELCOME and then DRAFT/VERDICT to cross the link (two round trips); cloud-only streams
    right after WELCOME (one)."""
    rtt = 0.2
    proxy = wan(cloud.port, WanProfile(rtt_ms=rtt * 1e3))
    res = run(proxy.port, mode, k=3, window=window, max_tokens=4)
    assert res.stats.ttft_s >= 0.95 * rtt * (1 if mode == "cloud-only" else 2)
    assert res.stats.ttft_s <= res.stats.wall_s


def test_heavy_loss_stalls_but_does_not_change_the_output(cloud, wan):
    proxy = wan(cloud.port, WanProfile(rtt_ms=0, loss_pct=25, seed=5))
    res = run(proxy.port, "pipelined", k=3, max_tokens=16)
    assert res.tokens == list(reference(max_tokens=16))
    c = proxy.counters
    assert c.up_stalls + c.down_stalls > 0  # the loss really happened
    assert res.stats.link.get("reconnects", 0) == 0  # TCP retransmits: a stall is not a disconnect


# ------------------------------------------------------------------------------------------ faults


@pytest.mark.parametrize("mode", ["sync", "pipelined", "cloud-only"])
def test_forced_disconnects_lose_and_duplicate_nothing(cloud, slow_cloud, wan, mode):
    server = slow_cloud if mode == "cloud-only" else cloud
    proxy = wan(server.port, WanProfile(rtt_ms=40, jitter_ms=10, seed=3))
    before = set(server.server.sessions)  # left by earlier tests whose proxy died before their CLOSE
    streamed: list[int] = []
    cfg = edge_cfg(proxy.port, mode, k=3, backoff_s=0.02)
    drafter = None if mode == "cloud-only" else toy_drafter()
    job = Background(lambda: run_edge(drafter, PROMPT, cfg, model_id=f"toy:vocab={V}", on_tokens=streamed.extend))
    resets = 0
    # two resets and a 0.25 s dead path (bytes dropped, then every connection reset), each mid-run
    wait_until(lambda: len(streamed) >= 6 or not job.alive(), what="first tokens")
    resets += proxy.reset_connections()
    wait_until(lambda: len(streamed) >= 14 or not job.alive(), what="tokens after the first reset")
    resets += proxy.reset_connections()
    wait_until(lambda: len(streamed) >= 22 or not job.alive(), what="tokens after the second reset")
    proxy.blackhole(0.25, drop=True)
    res = job.result()
    ref = list(reference())
    assert res.tokens == ref
    assert streamed == ref  # the stream the user saw: no token lost, none emitted twice
    assert resets >= 2  # both resets hit a live connection
    assert res.stats.link["reconnects"] >= 2
    # the session ended cleanly on the cloud: nothing left to hold a slot
    wait_until(lambda: set(server.server.sessions) <= before, timeout=5.0, what="the session to close")


def test_stall_blackhole_delays_without_reconnecting(cloud, wan):
    proxy = wan(cloud.port, WanProfile(rtt_ms=20))
    streamed: list[int] = []
    cfg = edge_cfg(proxy.port, "pipelined", k=3)
    t0 = time.monotonic()
    job = Background(lambda: run_edge(toy_drafter(), PROMPT, cfg, model_id=f"toy:vocab={V}", on_tokens=streamed.extend))
    wait_until(lambda: len(streamed) >= 8 or not job.alive(), what="first tokens")
    proxy.blackhole(0.4)  # a stall: bytes are held, then delivered in order
    res = job.result()
    assert res.tokens == list(reference())
    assert res.stats.link["reconnects"] == 0
    assert time.monotonic() - t0 >= 0.4


# ------------------------------------------------------------------------------------------ bytes

BIG_V = 20_000  # token ids up to 3-byte varints, like a real vocabulary


@pytest.fixture(scope="module")
def big_cloud():
    with CloudServerThread(toy_target(BIG_V), ServerConfig(port=0, max_sessions=8)) as srv:
        yield srv


@pytest.fixture
def frame_log(monkeypatch):
    """Record every frame the edge encodes (uplink) and decodes (downlink), with its size on the wire.

    The edge's `wire` module is swapped for a copy whose `encode` and `FrameDecoder` record; the cloud
    (same process) keeps the real one. Encoding is canonical, so a decoded frame re-encodes to the
    bytes that arrived."""
    log = {"up": [], "down": []}
    real = wire

    class RecordingDecoder(real.FrameDecoder):
        def feed(self, data):
            frames = super().feed(data)
            log["down"].extend((f, len(real.encode(f, self.limits))) for f in frames)
            return frames

    def recording_encode(frame, limits=real.DEFAULT_LIMITS):
        data = real.encode(frame, limits)
        log["up"].append((frame, len(data)))
        return data

    shim = types.ModuleType("acespec.wire.recording")
    shim.__dict__.update({k: v for k, v in real.__dict__.items() if not k.startswith("__")})
    shim.encode, shim.FrameDecoder = recording_encode, RecordingDecoder
    monkeypatch.setattr(edge_client, "wire", shim)
    return log


@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("coupled", TEMP)])
@pytest.mark.parametrize("mode,k", [("sync", 4), ("pipelined", 4), ("pipelined", 8)])
def test_bytes_per_block_and_verdict(big_cloud, frame_log, rule, temperature, mode, k):
    res = run(big_cloud.port, mode, vocab=BIG_V, k=k, rule=rule, temperature=temperature)
    s = res.stats
    up, down = frame_log["up"], frame_log["down"]
    # the edge's counters are exactly the frames it sent and received before the run ended (its
    # CLOSE, and in pipelined mode verdicts for blocks still in flight, come after the snapshot)
    assert s.bytes_up == sum(n for f, n in up if not isinstance(f, wire.Close))
    if mode == "sync":
        assert s.bytes_down == sum(n for _, n in down)
    else:
        assert s.bytes_down <= sum(n for _, n in down)

    hello = [n for f, n in up if isinstance(f, wire.Hello)]
    drafts = [(f, n) for f, n in up if isinstance(f, wire.Draft)]
    closes = [n for f, n in up if isinstance(f, wire.Close)]
    assert len(hello) == 1 and len(closes) <= 1 and len(drafts) + 1 + len(closes) == len(up)
    welcome = [n for f, n in down if isinstance(f, wire.Welcome)]
    verdicts = [(f, n) for f, n in down if isinstance(f, wire.Verdict)]
    assert len(welcome) == 1 and len(welcome) + len(verdicts) == len(down)

    assert any(t >= 1 << 14 for f, _ in drafts for t in f.tokens)  # 3-byte varints were exercised
    for f, n in drafts:
        assert f.q is None and f.parents is None  # greedy/coupled: token ids only
        assert n <= 16 + 4 * len(f.tokens), (f, n)
    for f, n in verdicts:
        assert f.p is None and n <= 16, (f, n)
    assert s.bytes_up <= hello[0] + sum(16 + 4 * len(f.tokens) for f, _ in drafts) + sum(closes)
    assert s.bytes_down <= welcome[0] + 16 * len(drafts)
    assert len(verdicts) <= len(drafts)
    assert s.emitted == N


# ------------------------------------------------------------------------------------------ strict


@pytest.mark.parametrize("mode,q_topn", [("sync", 8), ("pipelined", 8), ("sync", V)])
def test_strict_q_on_the_wire_is_the_q_sampled_from(monkeypatch, mode, q_topn):
    """Every q row the cloud verifies against equals, bit for bit, the row the drafter sampled from.

    The spies are patched on the classes, so they see every session in this process (a shared
    module cloud may still be verifying an earlier test's blocks). This test therefore runs its own
    server and records only what belongs to it: blocks sent to its port and verified against its own
    target instance."""
    sent: dict[int, np.ndarray] = {}
    verified: dict[int, np.ndarray] = {}
    real_send, real_prepare = TcpTransport.send, TargetVerifier.prepare
    target = toy_target()
    with CloudServerThread(target, ServerConfig(port=0, max_sessions=4)) as own:

        def send(self, block):
            if self.s.cfg.port == own.port:
                sent[block.seq] = None if block.q is None else block.q.copy()
            return real_send(self, block)

        def prepare(self, seq, base, x, q=None):  # every engine hands each block to the verifier here
            if self.target is target and len(x):
                verified[seq] = None if q is None else np.array(q, copy=True)
            return real_prepare(self, seq, base, x, q)

        monkeypatch.setattr(TcpTransport, "send", send)
        monkeypatch.setattr(TargetVerifier, "prepare", prepare)
        res = run(own.port, mode, k=4, rule="strict", temperature=TEMP, q_topn=q_topn)
    assert len(res.tokens) == N
    assert verified and set(verified) <= set(sent)
    for seq, q in verified.items():
        assert q is not None and sent[seq] is not None
        assert q.shape == sent[seq].shape
        assert np.array_equal(q, sent[seq]), f"block {seq}: the cloud's q differs from the drafter's"
        assert ((q > 0).sum(axis=1) <= q_topn).all()  # the sparse top-n is what was sampled from


@pytest.mark.parametrize("q_topn", [4, 16, V])
def test_strict_network_path_equals_local_path(cloud, q_topn):
    """Same seeds, same q truncation: the network (sync) and the in-process loop emit the same tokens
    and see the same acceptances, so the wire adds nothing to what strict rejection sampling sees."""
    k = 3
    net = run(cloud.port, "sync", k=k, rule="strict", temperature=TEMP, q_topn=q_topn)

    rule, sp = RuleSpec.parse("strict"), SamplingParams(TEMP)
    verifier = TargetVerifier(toy_target(), PROMPT, sampling=sp, rule=rule, seed=SEED, max_tokens=N)
    drafter = ChainDrafter(toy_drafter(), sampling=sp, rule=rule, seed=SEED, q_topn=q_topn)
    loop = SpecLoop(LocalTransport(verifier), PROMPT, drafter=drafter, policy=FixedDepth(k),
                    config=LoopConfig(mode="sync", max_tokens=N))
    local = loop.run()
    assert net.tokens == local.tokens
    assert (net.stats.rounds, net.stats.drafted, net.stats.accepted) == (
        local.stats.rounds, local.stats.drafted, local.stats.accepted)
    assert 0 < net.stats.accepted < net.stats.drafted  # both accepts and rejections happened


@pytest.fixture(scope="module")
def tiny_cloud():
    with CloudServerThread(ToyModel(vocab=8, seed=5, scale=1.0), ServerConfig(port=0, max_sessions=4)) as srv:
        yield srv


@pytest.mark.parametrize("mode,runs", [("sync", 2000), ("pipelined", 1000)])
def test_strict_over_the_network_samples_the_target_distribution(tiny_cloud, mode, runs):
    """The first two emitted tokens of `runs` sessions (one seed each) over one persistent server, no
    WAN, against the exact target joint p(t1) p(t2 | t1). The drafter is a noisy copy sampling from
    its top-4 only, so there are rejections, recoveries and bonus tokens to get right."""
    v, prompt, temp = 8, [1, 2], 1.0
    target = ToyModel(vocab=v, seed=5, scale=1.0)
    drafter = ToyModel(vocab=v, seed=5, scale=1.0, noise=1.0, noise_seed=2)
    sp = SamplingParams(temp)
    p1 = probs_from_logits(target.logits_for_context(prompt), sp)
    expected = np.array([[p1[a] * probs_from_logits(target.logits_for_context(prompt + [a]), sp)[b]
                          for b in range(v)] for a in range(v)]).ravel() * runs

    counts = np.zeros(v * v)
    accepted = drafted = 0

    def many() -> None:
        nonlocal accepted, drafted
        for seed in range(runs):
            cfg = edge_cfg(tiny_cloud.port, mode, k=2, rule="strict", temperature=temp, seed=seed, max_tokens=2,
                           q_topn=4)
            res = run_edge(drafter, prompt, cfg, model_id=f"toy:vocab={v}")
            a, b = res.tokens
            counts[a * v + b] += 1
            accepted += res.stats.accepted
            drafted += res.stats.drafted

    bounded(many, timeout=60.0)
    assert 0 < accepted < drafted
    # pool the cells too rare for the chi-square approximation into one
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    pval = float(chi2.sf(stat, len(exp) - 1))
    assert pval > 1e-3, f"chi2 = {stat:.1f} on {len(exp) - 1} dof, p = {pval:.2e}"


def test_dense_row_survives_the_wire_bit_for_bit():
    """The float32 round trip of a sparse row (edge -> wire -> cloud) is exact, whatever the row."""
    from acespec.edge.transports import sparse_rows
    from acespec.verify.sampling import sparse_top

    rng = np.random.default_rng(0)
    for _ in range(3000):
        q = probs_from_logits(rng.standard_normal(V) * 3, SamplingParams(0.7))
        edge_row = dense_row(*sparse_top(q, int(rng.integers(1, V + 1))), V)
        (row,) = sparse_rows(edge_row[None])
        wire_row = wire.decode(wire.encode(wire.Draft(session=1, seq=0, base=0, tokens=(0,), q=(row,)))).q[0]
        cloud_row = dense_row([i for i, _ in wire_row], [p for _, p in wire_row], V)
        assert np.array_equal(edge_row, cloud_row)


# ------------------------------------------------------------------------------------------ real pair

REAL_PROMPT = "Write a Python function that returns the square of a number."


@pytest.mark.real
@pytest.mark.parametrize("mode", ["cloud-only", "sync", "pipelined"])
def test_real_pair_end_to_end_through_the_wan(real_cloud, real_draft, wan, mode):
    proxy = wan(real_cloud.port, WanProfile(rtt_ms=50, jitter_ms=10, up_bps=5e6, down_bps=20e6, seed=4))
    tok = real_draft.tokenizer
    ids = tok.chat_prompt([{"role": "user", "content": REAL_PROMPT}])
    cfg = edge_cfg(proxy.port, mode, k=4, rule="greedy", temperature=0.0, max_tokens=12, reply_timeout_s=60.0)
    res = bounded(lambda: run_edge(None if mode == "cloud-only" else real_draft, ids, cfg,
                                   model_id=tok.fingerprint), timeout=180.0)
    text = tok.decode(res.tokens)
    assert text.strip(), res.tokens
    s = res.stats
    assert 1 <= s.emitted == len(res.tokens) <= 12
    assert 0 < s.ttft_s <= s.wall_s and s.tokens_per_s > 0
    assert 0 < s.target_passes_per_token <= 1.0
    assert s.bytes_up > 0 and s.bytes_down > 0
    if mode != "cloud-only":
        assert 0 <= s.accepted <= s.drafted and s.rounds >= 1
        assert s.bytes_up / s.emitted < 64  # token ids only, never distributions
    assert s.link.get("reconnects", 0) == 0


@pytest.fixture(scope="module")
def real_cloud(real_target):
    real_target.reset()
    with CloudServerThread(real_target, ServerConfig(port=0, max_sessions=4)) as srv:
        yield srv


# ------------------------------------------------------------------------------------------ bench smoke


def test_bench_summary_says_where_the_time_goes():
    """Each share is that activity's seconds summed over the runs, over their summed wall time."""
    from acespec.bench.wan import RunRecord, summarize

    runs = [RunRecord(rtt_ms=0, mode="sync", prompt_id=p, prompt_tokens=3, emitted=10, wall_s=w, draft_s=d, wait_s=x,
                      verify_s=v, cache={"predraft_s": c}) for p, w, d, x, v, c in
            (("a", 2.0, 0.5, 1.0, 0.4, 0.2), ("b", 3.0, 1.0, 0.5, 1.6, 0.0))]
    t = summarize(runs, [0], ["sync"])["by_rtt"]["0"]["sync"]["time"]
    assert t == {"draft": 0.3, "predraft": 0.04, "wait": 0.3, "verify": 0.4}


def test_bench_wan_runs_side_by_side_with_toy_models():
    """`acespec bench wan`'s engine on toy models: every mode runs at every RTT, greedy outputs agree,
    and the summary's ratios are against cloud-only at the same RTT."""
    from acespec.bench.wan import BenchConfig, format_table, run_wan_bench

    cfg = BenchConfig(rtts=[0.0, 30.0], profile="lan", k=3, max_tokens=12, warmup_tokens=2)
    from paced_toy import PassCostToy

    # a target whose pass takes 2 ms, as a real one takes time: a bare toy's passes report 0 us, and
    # a ceiling on free passes is no ceiling
    target = PassCostToy(vocab=V, seed=1, pass_s=0.002)
    res = bounded(lambda: run_wan_bench(toy_drafter(), target, [("p0", PROMPT), ("p1", [7, 7, 1])], cfg,
                                        progress=False))
    assert res["outputs_agree"] == "4/4"
    assert len(res["runs"]) == 2 * 2 * 3 and not any(r["error"] for r in res["runs"])
    for row in res["summary"].values():
        assert row["cloud-only"]["vs_cloud_only"] == 1.0
        assert row["cloud-only"]["target_passes_per_token"] == 1.0
        for m in row.values():
            assert m["emitted"] == 24 and m["tokens_per_s"] > 0 and m["runs"] == 2
            assert m["decode_tokens_per_s"] > 0  # the rate after the first token, prefill excluded
        assert row["sync"]["target_passes_per_token"] < 1.0
        for m in row.values():  # every mode beside its ceiling, calibrated on the same runs' passes
            assert m["ceiling_tokens_per_s"] > 0 and "of_ceiling" in m
    # a sync block waits for its round trip, so at 30 ms no schedule of it passes (k_max + 1) / 30 ms
    # whatever the passes cost (a plain step's cost here is the line's intercept through the blocks'
    # passes, since no mode in this run steps plainly: one CI run under load read 0.6 ms for it)
    assert 0 < res["summary"]["30"]["sync"]["ceiling_tokens_per_s"] <= 17 / 0.025
    assert set(res["sensitivity"]) == {"cloud-only", "sync", "pipelined"}
    table = format_table(res)
    assert "RTT sensitivity" in table and "pipelined" in table and "dec tok/s" in table and "steady/ceil" in table


def test_bench_wan_at_a_temperature_runs_coupled_one_seed_per_prompt():
    """`bench acespec --temperature 1`: every mode samples coupled, prompt i at seed i, so the modes of
    a prompt write one text (coupled is lossless to the token) while the same prompt at another seed
    writes another, and the greedy-only passes bar is left out."""
    from acespec.bench.acespec_bench import check_bars
    from acespec.bench.wan import BenchConfig, format_table, run_wan_bench

    from paced_toy import PassCostToy

    cfg = BenchConfig(rtts=[0.0], profile="lan", modes=["cloud-only", "sync", "cloud-led"], k=3, max_tokens=16,
                      warmup_tokens=0, temperature=1.0)
    target = PassCostToy(vocab=V, seed=1, pass_s=0.002)
    res = bounded(lambda: run_wan_bench(toy_drafter(), target, [("p0", PROMPT), ("p1", PROMPT)], cfg, progress=False))
    assert not any(r["error"] for r in res["runs"])
    assert res["outputs_agree"] == "2/2"
    texts = {r["prompt_id"]: tuple(r["tokens"]) for r in res["runs"] if r["mode"] == "cloud-only"}
    assert texts["p0"] != texts["p1"], "the second prompt ran at the same seed as the first"
    assert "coupled, T = 1" in format_table(res)
    row = res["summary"]["0"]
    assert 0.0 <= row["cloud-led"]["timeliness"] <= 1.0 and row["sync"]["timeliness"] is None
    assert "cloud-led draft timeliness" in format_table(res)
    assert not any("greedy" in bar for bar, _, _ in check_bars(res, 1 << 20))


def test_bench_cores_split_gives_each_side_its_own_cores():
    import os

    from acespec.bench.wan import caveat, load_pair
    from acespec.models.llama import split_threads

    assert split_threads("shared") == (None, None)
    n = os.cpu_count() or 1
    if n >= 2:
        assert split_threads("split") == (1, n - 1)
        assert "cores split" in caveat("split") and "1 llama.cpp thread" in caveat("split")
    else:
        with pytest.raises(ValueError, match="at least 2"):
            split_threads("split")
    # toy models take no thread options; the pair still loads
    d, t = load_pair("toy:vocab=32,seed=1,noise=0.3", "toy:vocab=32,seed=1", n_ctx=256, cores="shared", draft_slots=8)
    assert d.vocab_size == t.vocab_size == 32



@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_split_cores_pin_the_clouds_threads_and_processes_and_the_edge_keeps_its_own():
    """--cores split places each side on its own CPUs: a thread or process started on the cloud's CPUs
    stays there (so the edge's drafting cannot take the cloud's core), and the caller gets its CPUs back."""
    import subprocess
    import sys

    from acespec.models.llama import on_cpus, split_cpus

    before = os.sched_getaffinity(0)
    assert split_cpus("shared") == (None, None)
    edge, cloud = split_cpus("split")
    assert edge and cloud and not edge & cloud and edge | cloud == before
    seen = {}
    with on_cpus(cloud):
        t = threading.Thread(target=lambda: seen.setdefault("thread", os.sched_getaffinity(0)))
        t.start()
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
    t.join()
    assert os.sched_getaffinity(0) == before
    assert seen["thread"] == cloud and child.stdout.strip() == str(sorted(cloud))
    with on_cpus(None):
        assert os.sched_getaffinity(0) == before
