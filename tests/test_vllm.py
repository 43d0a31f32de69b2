"""The vLLM verify engine against the transformers one, on a tiny random-weight Qwen2 built here.

Runs in the vLLM profile (`scripts/setup.sh vllm`; `scripts/test.sh` runs `-m vllm` there, with
ACESPEC_REQUIRE_VLLM=1 so a missing vLLM fails instead of skipping). The reference is the same
checkpoint on transformers behind the serial engine, which computes full rows: greedy verdicts must
be identical; sampled coupled verdicts identical wherever the top K covers the full-vocabulary draw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

if os.environ.get("ACESPEC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup.sh vllm makes .venv-vllm)")
pytest.importorskip("transformers")

from acespec import wire  # noqa: E402
from acespec.cloud.engine import EngineRefused, SerialEngine, SessionSpec, make_engine  # noqa: E402
from acespec.models.hf import HFModel  # noqa: E402
from acespec.models.synthetic import random_qwen2, save_random_qwen2  # noqa: E402
from acespec.verify import RuleSpec, SamplingParams, coupled_sample  # noqa: E402
from raw_wire import open_session, read_until_error  # noqa: E402
from relaxed_laws import CASES, rand_dist  # noqa: E402

pytestmark = pytest.mark.vllm

K = 20  # the engine's top-K
LEAD_K = 4  # edge-draft tokens vLLM's own speculative decoding verifies a step (native cloud-led)
BLOCK = 32  # vLLM's KV block on CPU


class LoopThread:
    """One event loop in a thread for the whole module: vLLM's AsyncLLM binds to the loop it first runs on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_random_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2-tiny")


@pytest.fixture(scope="module")
def engines(tiny):
    lt = LoopThread()
    # lead_k: the engine runs vLLM's speculative decoding with AceSpec's proposer, so every test here also
    # shows that edge-led verify requests and cloud-only streams are unchanged beside it (they get no
    # proposals); unpriced, so the native cloud-led tests know what is proposed
    vl = make_engine("vllm", str(tiny), n_ctx=1024, logprobs=K, lead_k=LEAD_K, lead_price=False)
    lt.run(vl.start())
    hf = SerialEngine(HFModel.load(str(tiny), device="cpu"))
    yield lt, vl, hf
    lt.run(vl.stop())
    lt.close()


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(0, 512, n))


async def _reference(hf, prompt, n: int) -> list[int]:
    """The target's greedy continuation on transformers (cloud-only steps)."""
    s = await hf.open(SessionSpec(prompt, max_tokens=n, rule=RuleSpec.parse("greedy")))
    while not s.verifier.finished:
        await hf.step(s)
    return s.verifier.generated


def _drafts(ref: list[int], rng: np.random.Generator):
    """Draft blocks that follow the reference for a random number of tokens, then go wrong: every
    acceptance length 0..4 shows up, as with a real drafter."""
    def block(committed_out: int) -> list[int]:
        k = 4
        right = int(rng.integers(0, k + 1))
        out = []
        for i in range(k):
            j = committed_out + i
            t = ref[j] if j < len(ref) else 0
            out.append(t if i < right else (t + 1 + int(rng.integers(0, 500))) % 512)
        return out
    return block


async def _run_blocks(engine, s, block, max_blocks: int = 200):
    verdicts = []
    seq = 0
    while not s.verifier.finished and seq < max_blocks:
        C = s.verifier.committed
        v = await engine.verify(s, seq, C, block(C - s.verifier.prompt_len), None)
        verdicts.append((v.accepted, v.next_token, v.committed, v.finished))
        seq += 1
    return verdicts


@pytest.mark.parametrize("n_prompt", [7, BLOCK, 2 * BLOCK + 5])
def test_greedy_verdicts_identical_to_transformers(engines, n_prompt):
    lt, vl, hf = engines

    async def go():
        prompt = _prompt(n_prompt, n_prompt)
        ref = await _reference(hf, prompt, 48)
        spec = SessionSpec(prompt, max_tokens=48, rule=RuleSpec.parse("greedy"))
        a, b = await hf.open(spec), await vl.open(spec)
        va = await _run_blocks(hf, a, _drafts(ref, np.random.default_rng(n_prompt)))
        vb = await _run_blocks(vl, b, _drafts(ref, np.random.default_rng(n_prompt)))
        vl.close(b)
        return ref, va, vb, b.verifier.generated

    ref, va, vb, out = lt.run(go())
    assert va == vb
    assert out == ref  # and both equal the target's own greedy text
    accepted = [a for a, *_ in va]
    assert 0 in accepted and max(accepted) == 4  # the blocks exercised rejections and full accepts


def test_coupled_identical_where_the_top_k_covers(engines):
    """Temperature 1, no top_k: the vLLM engine draws over the top K only. Where the transformers
    engine's full-row draw lies inside that top K for every row a verdict used, the verdicts must be
    the same; the first block where they differ must be one it did not cover."""
    lt, vl, hf = engines
    sp = SamplingParams(temperature=1.0)

    async def go():
        results = []
        for seed in range(4):
            prompt = _prompt(100 + seed, 40)
            spec = SessionSpec(prompt, sampling=sp, rule=RuleSpec.parse("coupled"), seed=seed, max_tokens=40)
            a, b = await hf.open(spec), await vl.open(spec)
            rng = np.random.default_rng(seed)
            seq = 0
            while not a.verifier.finished and not b.verifier.finished:
                C = a.verifier.committed
                draft = [int(t) for t in rng.integers(0, 512, 3)]
                va = await hf.verify(a, seq, C, draft, None)
                p = a.verifier.last_p  # [k+1, V] full rows after temperature
                used = va.accepted + 1
                covered = all(coupled_sample(p[i], seed, C + i) in set(np.argsort(-p[i])[:K].tolist()) for i in range(used))
                vb = await vl.verify(b, seq, C, draft, None)
                same = (va.accepted, va.next_token) == (vb.accepted, vb.next_token)
                results.append((covered, same))
                seq += 1
                if not same:
                    break
            results.append(("report", vl.session_report(b)))
            vl.close(b)
        return results

    results = lt.run(go())
    blocks = [r for r in results if r[0] != "report"]
    reports = [r[1] for r in results if r[0] == "report"]
    assert all(same for covered, same in blocks if covered)
    assert sum(covered for covered, _ in blocks) >= 0.8 * len(blocks)  # the test has power: most blocks are covered
    assert all(r["exactness"] == "bounded" and r["rows"] > 0 for r in reports)
    # the reported bound is a probability, and the random model leaves a few percent outside its top 20
    assert all(0.0 < r["tail_mass_mean"] <= r["tail_mass_max"] < 1.0 for r in reports)
    m = vl.metrics()  # and the engine's histogram (acespec:topk_tail_mass) counted every one of those rows
    assert sum(n for _, n in m["tail_buckets"]) >= sum(r["rows"] for r in reports)
    assert m["tail_mass_max"] >= max(r["tail_mass_max"] for r in reports)


def test_coupled_with_top_k_inside_k_is_exact(engines):
    lt, vl, hf = engines
    sp = SamplingParams(temperature=0.8, top_k=K)

    async def go():
        prompt = _prompt(7, 33)
        spec = SessionSpec(prompt, sampling=sp, rule=RuleSpec.parse("coupled"), seed=5, max_tokens=40)
        a, b = await hf.open(spec), await vl.open(spec)
        rng = np.random.default_rng(1)
        block = lambda _c: [int(t) for t in rng.integers(0, 512, 2)]  # noqa: E731
        va = await _run_blocks(hf, a, block)
        rng = np.random.default_rng(1)
        vb = await _run_blocks(vl, b, block)
        rep = vl.session_report(b)
        vl.close(b)
        return va, vb, rep

    va, vb, rep = lt.run(go())
    assert va == vb and rep["exactness"] == "exact"


def test_concurrent_sessions_each_get_their_own_verdicts(engines):
    lt, vl, hf = engines

    async def one(engine, i, ref):
        spec = SessionSpec(_prompt(200 + i, 20 + 3 * i), max_tokens=32, rule=RuleSpec.parse("greedy"))
        s = await engine.open(spec)
        v = await _run_blocks(engine, s, _drafts(ref, np.random.default_rng(i)))
        if engine is vl:
            engine.close(s)
        return v

    async def go():
        refs = [await _reference(hf, _prompt(200 + i, 20 + 3 * i), 32) for i in range(8)]
        alone = [await one(hf, i, refs[i]) for i in range(8)]
        before = vl.metrics()["requests"]
        t0 = time.perf_counter()
        together = await asyncio.gather(*(one(vl, i, refs[i]) for i in range(8)))
        return alone, together, vl.metrics()["requests"] - before, time.perf_counter() - t0

    alone, together, requests, _ = lt.run(go())
    assert list(together) == alone
    assert requests >= sum(len(v) for v in alone)


def test_prefix_cache_boundary_resubmits_and_stays_exact(engines):
    """A prompt of exactly two KV blocks, then a draft rejected at its first token, twice over: the
    second session finds the first one's blocks cached up to and past the row it needs, so the
    engine must notice (num_cached_tokens) and compute that row again; verdicts stay the same."""
    lt, vl, hf = engines

    async def go():
        prompt = _prompt(300, 2 * BLOCK)
        ref = await _reference(hf, prompt, 16)
        spec = SessionSpec(prompt, max_tokens=16, rule=RuleSpec.parse("greedy"))
        wrong_first = lambda c: [(ref[c] + 7) % 512 if c < len(ref) else 1] + ref[c + 1 : c + 4]  # noqa: E731
        out = []
        for _ in range(2):
            s = await vl.open(spec)
            before = vl.metrics()["resubmits"]
            v = await _run_blocks(vl, s, wrong_first)
            out.append((v, s.verifier.generated, vl.metrics()["resubmits"] - before))
            vl.close(s)
        return ref, out

    ref, out = lt.run(go())
    (v1, g1, r1), (v2, g2, r2) = out
    assert g1 == ref and g2 == ref and v1 == v2
    assert all(acc == 0 for acc, *_ in v1)  # every block was rejected at its first token
    assert r2 > 0  # the second session hit the cached rows, and the engine recomputed them


def test_refuses_rules_that_need_the_full_distribution(engines):
    lt, vl, _ = engines
    for rule, sp in (("strict", SamplingParams(temperature=1.0)), ("cactus", SamplingParams(temperature=0.7)),
                     ("coupled", SamplingParams(temperature=1.0, top_p=0.9))):
        with pytest.raises(EngineRefused, match="top 20"):
            lt.run(vl.open(SessionSpec(_prompt(1, 8), sampling=sp, rule=RuleSpec.parse(rule))))
    # at temperature 0 every rule is exact (p is one-hot on the argmax, which the top K holds)
    s = lt.run(vl.open(SessionSpec(_prompt(1, 8), rule=RuleSpec.parse("strict"))))
    vl.close(s)


# -- native cloud-led: the edge's drafts inside vLLM's own speculative decoding ---------------------
async def _native_run(vl, spec: SessionSpec, draft_at) -> tuple[list[int], dict]:
    """One native cloud-led session to its end; after every step the 'edge' uploads `draft_at(tokens)`
    (a (base, tokens) draft, or None), as a real edge's chain would follow the stream."""
    from acespec.loop.board import BoardDraft, DraftBoard

    s = await vl.open(spec)
    assert vl.leads_natively(s)
    board = DraftBoard()
    before = vl.metrics()
    try:
        while not s.verifier.finished:
            d = draft_at(s.verifier.tokens)
            drafts = [] if d is None else d if isinstance(d, list) else [d]
            if sum(board.put(BoardDraft(*x), s.verifier.committed) for x in drafts):
                vl.lead_publish(s, board)
            await vl.lead_step(s, board)
        after = vl.metrics()
        return s.verifier.generated, {k: after[k] - before[k] for k in ("lead_proposed", "lead_accepted", "lead_tokens")}
    finally:
        vl.close(s)


async def _lead_to_end(vl, spec: SessionSpec, board) -> list[int]:
    """One native cloud-led session whose drafts were all uploaded before its stream began: publish the
    board, step to the end; its generated tokens."""
    s = await vl.open(spec)
    assert vl.leads_natively(s)
    vl.lead_publish(s, board)
    try:
        while not s.verifier.finished:
            await vl.lead_step(s, board)
        return s.verifier.generated
    finally:
        vl.close(s)


def test_native_cloud_led_greedy_equals_cloud_only_with_right_and_wrong_drafts(engines):
    """Greedy cloud-led sessions whose drafts vLLM's speculative decoding verifies: the text is the one
    cloud-only gives on the same engine, whether the drafts are right (the reference itself) or right
    for a while and then wrong; vLLM kept the right ones and refused the wrong ones."""
    lt, vl, hf = engines

    async def go():
        out = []
        for n_prompt in (9, BLOCK + 3):
            prompt = _prompt(500 + n_prompt, n_prompt)
            spec = SessionSpec(prompt, max_tokens=48, rule=RuleSpec.parse("greedy"))
            c = await vl.open(spec)
            while not c.verifier.finished:
                await vl.step(c)
            ref = c.verifier.generated
            vl.close(c)
            lead = SessionSpec(prompt, max_tokens=48, rule=RuleSpec.parse("greedy"), cloud_led=True)
            P = len(prompt)
            right = await _native_run(vl, lead, lambda t: (len(t), tuple(ref[len(t) - P : len(t) - P + 8])) if len(t) - P < 48 else None)
            rng = np.random.default_rng(n_prompt)

            def noisy(t):
                j = len(t) - P
                good = int(rng.integers(0, 4))
                toks = [ref[j + i] if i < good and j + i < 48 else int(rng.integers(0, 512)) for i in range(6)]
                return (len(t), tuple(toks)) if j < 48 else None
            wrong = await _native_run(vl, lead, noisy)
            out.append((ref, right, wrong))
        return out

    for ref, (text_r, m_r), (text_w, m_w) in lt.run(go()):
        assert text_r == ref and text_w == ref
        assert m_r["lead_accepted"] == m_r["lead_proposed"] > 0  # the reference itself: every proposal kept
        assert 0 < m_w["lead_accepted"] < m_w["lead_proposed"]  # a real mix of kept and refused drafts
        assert m_r["lead_tokens"] == m_w["lead_tokens"] == 48


def test_the_proposer_repairs_vllms_cpu_expand_kernel_before_sampling():
    """vLLM 0.32's CPU expand kernel (per-request temperatures spread over draft tokens, before its
    rejection sampler scales the target's rows) writes into an int64 copy and leaves the float output
    uninitialised; the proposer's check finds that in the worker and installs a torch version. Done
    here in the test process after the same kernel set-up a CPU worker does."""
    from vllm.platforms import current_platform

    from acespec.cloud.vllm_proposer import ensure_expand_is_right, expand_is_right

    if not current_platform.is_cpu():
        pytest.skip("the broken kernel is the CPU build's")
    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    broken = not expand_is_right()
    assert ensure_expand_is_right() == broken
    assert expand_is_right() and not ensure_expand_is_right()  # fixed, and a second check installs nothing


def _chi2_sf(stat: float, df: int) -> float:
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))


def _pooled_chisquare(counts: dict, exact: dict, n: int, min_expected: float = 5.0) -> float:
    """As tests/test_lossless.py: cells with expected count < min_expected pooled into one; the p-value."""
    cells = sorted((p, c) for c, p in exact.items() if p > 0.0)
    small = [c for p, c in cells if n * p < min_expected]
    bins = [[c] for p, c in cells if n * p >= min_expected]
    if small:
        pool = small
        while bins and n * sum(exact[c] for c in pool) < min_expected:
            pool = pool + bins.pop(0)
        bins.insert(0, pool)
    stat = sum((sum(counts.get(c, 0) for c in b) - n * sum(exact[c] for c in b)) ** 2 / (n * sum(exact[c] for c in b)) for b in bins)
    assert len(bins) >= 10, "too few cells for the test to mean much"
    return _chi2_sf(stat, len(bins) - 1)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_native_cloud_led_strict_keeps_the_targets_law(engines, temperature):
    """Strict at temperature > 0, natively: the law of the first two tokens, where the second is drafted
    (for each likely first token, a draft of its second most likely successor, so both the accept and the
    residual path of vLLM's rejection sampler matter), against the exact law from the same weights in
    transformers. The same chi-square rejects the law a sampler that always kept the draft would give."""
    import torch

    from acespec.loop.board import BoardDraft, DraftBoard
    from acespec.verify import softmax

    lt, vl, hf = engines
    prompt = _prompt(77, 12)
    P, V, N = len(prompt), 512, 2400
    m = random_qwen2("tiny", seed=0)  # the weights save_random_qwen2 wrote for vLLM
    with torch.no_grad():
        p1 = softmax(m(torch.tensor([list(prompt)])).logits[0, -1].double().numpy() / temperature)
        rows = m(torch.tensor([list(prompt) + [a] for a in range(V)])).logits[:, -1].double().numpy()
    p2 = np.stack([softmax(r / temperature) for r in rows])  # [V, V]: p(b | a)
    exact = {(a, b): p1[a] * p2[a, b] for a in range(V) for b in range(V) if p1[a] * p2[a, b] > 1e-12}
    firsts = [int(a) for a in np.argsort(-p1)[:8]]
    drafts = {a: int(np.argsort(-p2[a])[1]) for a in firsts}  # each likely first token's second-choice successor

    async def one(seed: int):
        spec = SessionSpec(prompt, sampling=SamplingParams(temperature=temperature), rule=RuleSpec.parse("strict"),
                           seed=seed, max_tokens=2, cloud_led=True)
        board = DraftBoard()
        for a in firsts:
            board.put(BoardDraft(P, (a, drafts[a])), P)
        return tuple(await _lead_to_end(vl, spec, board))

    async def go():
        before = vl.metrics()
        seqs = []
        for wave in range(0, N, 48):
            seqs += await asyncio.gather(*(one(10_000 * int(temperature * 10) + wave + i) for i in range(48)))
        after = vl.metrics()
        return seqs, after["lead_proposed"] - before["lead_proposed"], after["lead_accepted"] - before["lead_accepted"]

    seqs, proposed, accepted = lt.run(go(), timeout=900)
    n = len(seqs)
    counts: dict = {}
    for sq in seqs:
        counts[sq] = counts.get(sq, 0) + 1
    assert sum(p1[a] for a in firsts) > 0.5 and proposed > 0.4 * n  # most sessions had their second token drafted
    assert 0 < accepted < proposed  # both of the rejection sampler's paths were taken
    assert _pooled_chisquare(counts, exact, n) > 1e-3
    # power: the law of a sampler that kept every drafted token, sampled here, fails the same test
    rng = np.random.default_rng(0)
    lossy: dict = {}
    for _ in range(n):
        a = int(rng.choice(V, p=p1 / p1.sum()))
        b = drafts[a] if a in drafts else int(rng.choice(V, p=p2[a] / p2[a].sum()))
        lossy[a, b] = lossy.get((a, b), 0) + 1
    assert _pooled_chisquare(lossy, exact, n) < 1e-6


def test_native_cloud_led_cactus_decides_with_the_q_rows_the_edge_sent(engines):
    """A rule that needs the drafter's q, cloud-led on vLLM at T = 1: the session runs natively (before,
    only strict and typical did), its drafts' sparse q rows cross the board to the worker, and the
    plugin decides the drafted steps with them (the board counts each such step)."""
    import torch

    from acespec.loop.board import BoardDraft, DraftBoard
    from acespec.verify import softmax

    lt, vl, _ = engines
    prompt = _prompt(78, 12)
    P, V = len(prompt), 512
    m = random_qwen2("tiny", seed=0)
    with torch.no_grad():
        p1 = softmax(m(torch.tensor([list(prompt)])).logits[0, -1].double().numpy())
    firsts = [int(a) for a in np.argsort(-p1)[:16]]
    assert sum(p1[a] for a in firsts) > 0.3

    async def one(seed: int):
        spec = SessionSpec(prompt, sampling=SamplingParams(temperature=1.0), rule=RuleSpec.parse("cactus"),
                           seed=seed, max_tokens=3, cloud_led=True)
        board = DraftBoard(max_drafts=16)
        for a in firsts:  # after each likely first token, a draft of two tokens with the edge's sparse rows
            b, c = (a * 7 + 1) % V, (a * 13 + 5) % V
            board.put(BoardDraft(P, (a, b, c), q=(((a, 1.0),), ((b, 0.6), ((b + 1) % V, 0.4)), ((c, 0.5), ((c + 2) % V, 0.5)))), P)
        return len(await _lead_to_end(vl, spec, board))

    async def go():
        before = vl.metrics()
        lens = await asyncio.gather(*(one(500 + i) for i in range(32)))
        after = vl.metrics()
        return lens, {k: after[k] - before[k] for k in ("lead_proposed", "lead_q_used")}

    lens, m_ = lt.run(go(), timeout=600)
    assert lens == [3] * 32
    assert m_["lead_proposed"] > 0 and m_["lead_q_used"] > 0


# -- the whole system: `acespec serve --engine vllm` and a real edge ------------------------------
def _noisy_drafter(seed: int = 0):
    """The target's weights with noise on the output head: agrees with the target often, not always."""
    import torch

    m = random_qwen2("tiny", seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        m.lm_head.weight.add_(torch.randn(m.lm_head.weight.shape, generator=g) * 0.6 * m.lm_head.weight.std())
    return HFModel(m, None, name="tiny-drafter", device="cpu")


def _over_long_q_row(port: int, model_id: str, prompt: list[int]):
    """Open a cloud-led cactus session at T = 1 on raw frames and send one DRAFT whose q row has 33
    entries: the ERROR frame the server answers with."""
    hello = wire.Hello(model_id=model_id, max_tokens=64, prompt=tuple(prompt), temperature=1.0, rule="cactus",
                       mode=wire.Mode.CLOUD_LED)
    s, dec, welcome = open_session(port, hello, timeout=60)
    with s:
        row = tuple((t, 1.0 / 33) for t in range(33))
        s.sendall(wire.encode(wire.Draft(session=welcome.session, seq=1, base=welcome.committed, tokens=(0,), q=(row,))))
        return read_until_error(s, dec)


def test_edge_through_acespec_serve_vllm_equals_cloud_only(tiny, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from acespec.edge.client import ConnectConfig
    from acespec.edge.runtime import EdgeConfig, run_edge

    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "acespec"), "serve", "--engine", "vllm", "--target", str(tiny), "--port", "0",
         "--n-ctx", "1024", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = mport = None
        t0 = time.time()
        lines = []
        while (port is None or mport is None) and time.time() - t0 < 240:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"listening on [\d.]+:(\d+)", line):
                port = int(m.group(1))
            if m := re.search(r"metrics at http://[\d.]+:(\d+)/metrics", line):
                mport = int(m.group(1))
        assert port and mport, "".join(lines[-20:])
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
        drafter = _noisy_drafter()
        prompt = list(_prompt(400, 24))
        out = {}
        # cloud-led greedy and strict run inside vLLM's speculative decoding (serve's default --lead-k 8);
        # cloud-led coupled at temperature 1 runs as verify requests beside them
        for rule, sp in (("greedy", {}), ("coupled", {"temperature": 1.0, "top_k": K})):
            for mode in ("pipelined", "sync", "cloud-only", "cloud-led"):
                cfg = EdgeConfig(mode=mode, rule=rule, k=3, max_tokens=40, seed=11, connect=ConnectConfig(port=port), **sp)
                res = run_edge(drafter if mode != "cloud-only" else None, prompt, cfg, model_id=drafter.tokenizer.fingerprint)
                out[rule, mode] = (res.tokens, res.stats)
        # a cloud-led cactus session whose q row is longer than the board keeps (serve's --lead-q-topn 32):
        # refused with OVER_LIMIT and a message that says what to send, and the server goes on serving
        err = _over_long_q_row(port, drafter.tokenizer.fingerprint, prompt)
        assert err.code == wire.ErrorCode.OVER_LIMIT and "top 32" in err.message, err
        cfg = EdgeConfig(mode="cloud-led", rule="strict", temperature=1.0, max_tokens=40, seed=11, connect=ConnectConfig(port=port))
        strict = run_edge(drafter, prompt, cfg, model_id=drafter.tokenizer.fingerprint)
        for rule in ("greedy", "coupled"):
            assert out[rule, "pipelined"][0] == out[rule, "cloud-only"][0]
            assert out[rule, "sync"][0] == out[rule, "cloud-only"][0]
            assert out[rule, "cloud-led"][0] == out[rule, "cloud-only"][0]
            assert len(out[rule, "cloud-only"][0]) == 40
        assert len(strict.tokens) == 40  # sampled strict, refused on this engine before: its law is vLLM's sampler's
        st = out["greedy", "sync"][1]
        assert 0 < st.accepted < st.drafted  # the noisy drafter was partly right: a real speculative run
        def metrics():
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
            return {f.name: f for f in text_string_to_metric_families(text)}

        fams = metrics()
        # a cloud-led edge's drafts race the stream, which never waits for them: on a loaded machine
        # (CI, after the main suite) a session's drafts can all come too late; more sessions, then
        for _ in range(3):
            if fams["acespec:lead_native_accepted"].samples[0].value > 0:
                break
            cfg = EdgeConfig(mode="cloud-led", rule="greedy", k=3, max_tokens=40, seed=11, connect=ConnectConfig(port=port))
            again = run_edge(drafter, prompt, cfg, model_id=drafter.tokenizer.fingerprint)
            assert again.tokens == out["greedy", "cloud-only"][0]
            fams = metrics()
        # the cloud-led sessions' drafts went through vLLM's rejection sampler, and some were kept
        assert fams["acespec:lead_native_tokens"].samples[0].value >= 80
        assert 0 < fams["acespec:lead_native_accepted"].samples[0].value <= fams["acespec:lead_native_proposed"].samples[0].value
        requests = fams["acespec:engine_requests"].samples[0].value
        assert requests > sum(len(t) for t, _ in out.values()) / 5  # one request per block, not per run
        assert fams["acespec:verdicts"].samples[0].value > 0
        # every session here was exact (greedy, or top_k <= K): no row needed a tail bound
        tail = {s.name: s.value for s in fams["acespec:topk_tail_mass"].samples}
        assert tail["acespec:topk_tail_mass_count"] == 0 and fams["acespec:topk_tail_mass_max"].samples[0].value == 0.0
    finally:
        proc.terminate()
        proc.wait(60)


# -- AceSpec's rules inside vLLM's rejection sampler (acespec/cloud/vllm_plugin.py) -------------------
def _plugin_sampler():
    from acespec.cloud import vllm_plugin

    rs = vllm_plugin.cpu_sampler()
    assert rs.rejection_sample is vllm_plugin.rejection_sample
    return rs


def _metadata(B: int, rules: dict, seeds: list[int] | None = None, support: dict | None = None):
    from acespec.cloud.vllm_plugin import sampling_metadata

    return sampling_metadata(B, rules, seeds, support=support)


def _one_step(rs, q: np.ndarray, p: np.ndarray, meta, B: int, seed: int):
    """One rejection-sampler step over B requests with one draft token each, x ~ q: the emitted first tokens."""
    import torch

    rng = np.random.default_rng(seed)
    V = len(p)
    draft = torch.tensor(rng.choice(V, size=B, p=q), dtype=torch.int32)
    bonus = torch.tensor(rng.choice(V, size=(B, 1), p=p), dtype=torch.int64)
    logits = torch.tensor(np.log(np.maximum(p, 1e-30)), dtype=torch.float32).repeat(B, 1)
    out = rs.rejection_sample(draft, [1] * B, 1, torch.arange(1, B + 1, dtype=torch.int32),
                              torch.tensor(q, dtype=torch.float32).repeat(B, 1), logits, bonus, meta)
    return out[:, 0].numpy()


@pytest.mark.parametrize("rule", ["strict", "typical", "cactus", "mentored", "fuzzy", "r_fuzzy", "casc_opt", "casc_tok"])
def test_plugin_rules_in_vllms_sampler_give_the_rules_law(rule):
    """Each rule, inside vLLM's rejection sampler: over 40,000 one-token steps (x ~ q), the first token's
    law is within total variation 0.01 of the law the rule's definition gives (tests/relaxed_laws.py),
    on the hand-built case where that law is furthest from the target's (so a sampler that ignored the
    rule would fail by far more than 0.01)."""
    from relaxed_laws import analytic_first_token

    rs = _plugin_sampler()
    B = 40_000
    spec = RuleSpec.parse(rule)
    law_of = (lambda q, p: p) if rule == "strict" else (lambda q, p: analytic_first_token(rule, q, p, spec.kwargs()))
    name, q, p = max(CASES, key=lambda c: 0.5 * np.abs(law_of(c[1], c[2]) - c[2]).sum())
    expected = law_of(q, p)
    if rule != "strict":
        assert 0.5 * np.abs(expected - p).sum() > 0.03  # the rule relaxes here: vLLM's own strict would fail
    rules = {} if rule == "strict" else {i: spec for i in range(B)}  # strict is vLLM's own sampler
    first = _one_step(rs, q, p, _metadata(B, rules), B, seed=len(name))
    law = np.bincount(first, minlength=len(p)) / B
    tv = 0.5 * np.abs(law - expected).sum()
    assert tv <= 0.01, (rule, name, tv)


def _step(rs, draft, counts, P, bonus, meta, draft_probs=None):
    """One rejection-sampler step: draft ids int[N], counts per request, target rows P [N, V] (as logits
    log P), bonus int[B]; returns the output [B, max(counts) + 1] as numpy."""
    import torch

    K = max(max(counts), 1)
    logits = torch.tensor(np.log(np.maximum(P, 1e-30)), dtype=torch.float32)
    out = rs.rejection_sample(torch.tensor(draft, dtype=torch.int32), list(counts), K,
                              torch.tensor(np.cumsum(counts), dtype=torch.int32),
                              None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float32), logits,
                              torch.tensor(np.asarray(bonus)[:, None], dtype=torch.int64), meta)
    return out.numpy()


def _blocks(seed: int, B: int, V: int, scale: float):
    """(rng, drafts per request [B], N, target rows [N, V]): float32 softmax rows renormalised as the
    plugin sees them, `scale` setting how peaked they are."""
    import torch

    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, B)
    N = int(counts.sum())
    P = torch.softmax(torch.tensor(rng.normal(size=(N, V)) * scale, dtype=torch.float32), -1).numpy()
    P = torch.softmax(torch.tensor(np.log(np.maximum(P, 1e-30)), dtype=torch.float32), -1).double().numpy()
    return rng, counts, N, P


def test_plugin_net_win_guard_picks_each_requests_arm_and_learns_from_its_finished_requests():
    """Requests asking for cactus under the net-win guard (extra_args acespec_net_win = a task type), fed through
    the tracker as vLLM's batch updates and decided by the plugin's sampler: the worker's guard alternates
    cactus and strict while it warms up; a request vLLM takes out of the batch unfinished and puts back keeps
    its arm; once finished requests show cactus making the model write 4x as many tokens (more than its
    gain in drafts kept per round can repay), new requests of that task type run strict; another task type
    warms up on its own; and a guard over strict itself is refused."""
    import torch
    from vllm import SamplingParams as VSP
    from vllm.v1.sample.logits_processor import BatchUpdate

    from acespec.cloud import vllm_guard as vg
    from acespec.cloud import vllm_plugin as vp

    rs = _plugin_sampler()
    vg.GUARDS.clear()
    meta = _metadata(1, {})
    tracker = vp._tracker(meta)
    V, stop = 16, 7
    P = np.full((2, V), 0.2 / (V - 1))
    P[:, 3] = 0.8
    before = dict(vg.GUARD_COUNTS)

    def join(task: str, out: list, params=None):
        params = params or VSP(temperature=1.0, max_tokens=100, stop_token_ids=[stop],
                               extra_args={"acespec_rule": "cactus", "acespec_net_win": task})
        tracker.update_state(BatchUpdate(1, removed=[], added=[(0, params, [1, 2, 3], out)], moved=[]))
        return params, tracker.rows[0].name

    def leave():
        tracker.update_state(BatchUpdate(0, removed=[0], added=[], moved=[]))

    arms = []
    for _ in range(26):
        out: list[int] = []
        _, arm = join("code", out)
        _step(rs, [3, 3], [2], P, [5], meta)  # one verify step of two drafts, decided under the request's arm
        assert tracker.guard.rows[0].rounds == 1 and 0 <= tracker.guard.rows[0].accepted <= 2
        out.extend([5] * (39 if arm == "cactus" else 9) + [stop])  # cactus's texts 40 tokens, strict's 10
        leave()
        arms.append(arm)
    assert arms[:16] == ["cactus", "strict"] * 8  # warm-up: each arm n_min = 8 times, relaxed first
    assert arms[16:].count("strict") >= 8  # lambda 4 > gain (at most 3 with two drafts): strict from then on
    assert vg.GUARD_COUNTS["observed"] - before["observed"] == 26
    est = vg.net_win_guard(RuleSpec.parse("cactus")).estimate("code")
    assert est.lam == pytest.approx(4.0) and not est.net_win

    # taken out unfinished and put back: the same arm, and no new decision
    out = []
    params, arm = join("chat", out)
    assert arm == "cactus"  # a new task type warms up on its own, relaxed first
    out.extend([5, 5])
    leave()
    chosen = vg.GUARD_COUNTS["relaxed"] + vg.GUARD_COUNTS["strict"]
    assert join("chat", out, params)[1] == "cactus"
    assert vg.GUARD_COUNTS["relaxed"] + vg.GUARD_COUNTS["strict"] == chosen
    leave()
    assert join("chat", [])[1] == "strict"  # the next chat request: the warm-up's second arm

    with pytest.raises(ValueError, match="acespec_net_win"):
        vp.AceSpecRules.validate_params(VSP(temperature=1.0, extra_args={"acespec_rule": "strict", "acespec_net_win": "code"}))
    with pytest.raises(ValueError, match="acespec_net_win"):
        vp.AceSpecRules.validate_params(VSP(temperature=1.0, extra_args={"acespec_net_win": "code"}))
    vp.AceSpecRules.validate_params(VSP(temperature=1.0, extra_args={"acespec_rule": "cactus", "acespec_net_win": "code"}))


def test_plugin_decides_each_block_as_the_rules_numpy_definition_does():
    """typical (deterministic: no u drawn) on blocks of 0-3 drafts, every other request with no rule: each
    rule request's output row is exactly what `verify_block` gives on the same rows (the target's float32
    probabilities, vLLM's bonus token), so the plugin's batched first-rejection and emission match the
    per-block definition; the other requests keep vLLM's strict sampler."""
    from acespec.verify import verify_block

    rs = _plugin_sampler()
    B, V = 40, 64
    rng, counts, N, P = _blocks(21, B, V, 2.5)
    # half the drafts the target's favourite (accepted), half anything (mostly rejected)
    draft = np.where(rng.random(N) < 0.6, P.argmax(-1), rng.integers(0, V, N))
    bonus = rng.integers(0, V, B)
    spec = RuleSpec.parse("typical:eps=0.05,delta=0.3")
    rules = {i: spec for i in range(0, B, 2)}
    out = _step(rs, draft, counts, P, bonus, _metadata(B, rules))
    starts = np.cumsum(counts) - counts
    accepted = []
    for i in range(B):
        n, s = int(counts[i]), int(starts[i])
        if i not in rules:
            m = int((out[i] != -1).sum()) - 1  # vLLM's own: m <= n drafts kept, then one token
            assert 0 <= m <= n and list(out[i, :m]) == list(draft[s : s + m]) and (out[i, m + 1 :] == -1).all()
            continue
        a, nxt = verify_block(spec, draft[s : s + n], None, np.vstack([P[s : s + n], np.eye(V)[bonus[i]]]), np.random.default_rng(0))
        assert list(out[i]) == [*draft[s : s + a], nxt] + [-1] * (out.shape[1] - a - 1), (i, n, a, nxt)
        accepted.append((a, n))
    assert any(a == n > 0 for a, n in accepted) and any(a < n for a, n in accepted) and any(n == 0 for _, n in accepted)


def test_plugin_leaves_other_requests_to_vllm_and_seeds_decide_the_rule_requests():
    """A step where half the (seeded) requests ask for cactus: the others' rows are what vLLM's own sampler
    gives them on the whole step, bit for bit; the rule requests' rows depend only on their seeds."""
    import vllm.v1.sample.rejection_sampler as rs0

    from acespec.cloud import vllm_plugin

    rs = _plugin_sampler()
    rng = np.random.default_rng(5)
    B, V, k = 64, 48, 2
    counts = [k] * B
    P = np.stack([rand_dist(rng, V, conc=0.5) for _ in range(B * k)])
    Q = np.stack([rand_dist(rng, V, conc=0.5) for _ in range(B * k)])
    draft = np.array([rng.choice(V, p=q) for q in Q])
    bonus = rng.integers(0, V, B)
    spec = RuleSpec.parse("cactus")
    rules = {i: spec for i in range(B // 2)}

    def run(seeds, with_rules=True):
        return _step(rs, draft, counts, P, bonus, _metadata(B, rules if with_rules else {}, seeds=seeds), draft_probs=Q)

    a = run(list(range(B)))
    b = run(list(range(B)))
    c = run(list(range(1000, 1000 + B // 2)) + list(range(B // 2, B)))
    original = vllm_plugin._state["original"]
    rs0.rejection_sample = original
    try:
        own = run(list(range(B)), with_rules=False)
    finally:
        rs0.rejection_sample = vllm_plugin.rejection_sample
    assert np.array_equal(a[B // 2 :], own[B // 2 :])  # the requests without a rule: vLLM's, bit for bit
    assert np.array_equal(a, b)  # same seeds, same step
    assert np.array_equal(a[B // 2 :], c[B // 2 :]) and not np.array_equal(a[: B // 2], c[: B // 2])  # other seeds


@pytest.mark.parametrize("token_only", [False, True])
def test_plugin_two_draft_blocks_follow_the_rules_law(token_only):
    """cactus on 40,000 requests of the same two drafts: the number accepted is distributed as the rule's
    acceptance probabilities at the two positions say (1 - a0, a0 (1 - a1), a0 a1), and a token recovered
    at the first position follows the rule's recovered law there (ROW_LAWS, numpy), within total
    variation 0.01 and 0.02; with draft probabilities, and with token-only drafts (one-hot q)."""
    from acespec.verify.relaxed import ROW_LAWS

    rs = _plugin_sampler()
    _, _, p0 = CASES[0]
    V = len(p0)
    x = np.array([1, 6])  # drafts the rule accepts only in part, at each position
    q = 0.9 * np.eye(V)[x] + 0.1 / V if not token_only else np.eye(V)[x]  # a confident drafter: q(x) > the rule's target
    p = np.stack([p0, p0])
    law, kw = ROW_LAWS["cactus"], RuleSpec.parse("cactus").kwargs()
    a0, a1 = law.accept(x, q, p, **kw)
    assert 0.1 < a0 < 0.9 and 0.1 < a1 < 0.9, (a0, a1)
    B = 40_000
    out = _step(rs, np.tile(x, B), [2] * B, np.tile(p, (B, 1)), np.zeros(B, dtype=np.int64),
                _metadata(B, {i: RuleSpec.parse("cactus") for i in range(B)}), draft_probs=None if token_only else np.tile(q, (B, 1)))
    n_acc = (out != -1).sum(axis=1) - 1  # a block emits its accepted drafts and one more token
    assert (out[n_acc >= 1, 0] == x[0]).all() and (out[n_acc == 2, 1] == x[1]).all() and (out[n_acc == 2, 2] == 0).all()
    want = np.array([1 - a0, a0 * (1 - a1), a0 * a1])
    assert 0.5 * np.abs(np.bincount(n_acc, minlength=3) / B - want).sum() <= 0.01
    rec = law.recovered(x[:1], q[:1], p[:1], **kw)[0]
    first = np.bincount(out[n_acc == 0, 0], minlength=V) / (n_acc == 0).sum()
    assert 0.5 * np.abs(first - rec / rec.sum()).sum() <= 0.02


def test_plugin_decides_token_only_drafts_with_the_q_rows_the_edge_sent():
    """Cloud-led on vLLM: the proposer's drafts reach the sampler as token ids only, and the plugin takes
    their q from the rows the edge sent (left by the proposer, `vllm_proposer.edge_q`, for requests whose
    prompt is that session's). cactus on 40,000 requests of the same two drafts with the edge's sparse q
    (q(x) = 0.3): the number accepted and the token recovered at the second position follow the rule's
    law on those rows, within total variation 0.01 and 0.02; a request whose drafts are not the ones the
    edge's rows were sent with keeps one-hot q, and the two laws are far apart (so the test can fail)."""
    from acespec.cloud import vllm_plugin, vllm_proposer
    from acespec.cloud.vllm_board import prompt_key
    from acespec.verify.relaxed import ROW_LAWS

    rs = _plugin_sampler()
    _, _, p0 = CASES[0]
    V = len(p0)
    x = np.array([1, 6])
    sent = [((1, 0.3), (2, 0.7)), ((6, 0.3), (3, 0.7))]  # the edge's sparse rows for its two drafts
    q = np.zeros((2, V))
    for j, row in enumerate(sent):
        for t, w in row:
            q[j, t] = w
    p = np.stack([p0, p0])
    law, kw = ROW_LAWS["cactus"], RuleSpec.parse("cactus").kwargs()
    want = lambda a0, a1: np.array([1 - a0, a0 * (1 - a1), a0 * a1])  # noqa: E731
    edge, one_hot = want(*law.accept(x, q, p, **kw)), want(*law.accept(x, np.eye(V)[x], p, **kw))
    assert 0.5 * np.abs(edge - one_hot).sum() > 0.3
    B = 40_000
    key = prompt_key((1, 2, 3))
    meta = _metadata(B, {i: RuleSpec.parse("cactus") for i in range(B)})
    (tracker,) = [lp for lp in meta.logitsprocs.all if hasattr(lp, "prompts")]
    tracker.prompts = {i: (1, 2, 3, 4) for i in range(B)}  # a reopened request: the prompt and a committed token
    M = 8000  # requests of the same session whose drafts are not those the rows were sent with
    meta_m = _metadata(M, {i: RuleSpec.parse("cactus") for i in range(M)})
    (tracker_m,) = [lp for lp in meta_m.logitsprocs.all if hasattr(lp, "prompts")]
    tracker_m.prompts = {i: (1, 2, 3) for i in range(M)}
    vllm_proposer.edge_q = {(key, 3): ((1, 6), sent, 0)}
    before = dict(vllm_plugin.EDGE_Q)
    try:
        out = _step(rs, np.tile(x, B), [2] * B, np.tile(p, (B, 1)), np.zeros(B, dtype=np.int64), meta)
        other = _step(rs, np.tile([1, 5], M), [2] * M, np.tile(p, (M, 1)), np.zeros(M, dtype=np.int64), meta_m)
    finally:
        vllm_proposer.edge_q = {}
    assert vllm_plugin.EDGE_Q["sent"] - before["sent"] == B and vllm_plugin.EDGE_Q["one_hot"] - before["one_hot"] == M
    n_acc = (out != -1).sum(axis=1) - 1
    assert 0.5 * np.abs(np.bincount(n_acc, minlength=3) / B - edge).sum() <= 0.01
    rec = law.recovered(x[1:], q[1:], p[1:], **kw)[0]
    second = np.bincount(out[n_acc == 1, 1], minlength=V) / (n_acc == 1).sum()
    assert 0.5 * np.abs(second - rec / rec.sum()).sum() <= 0.02
    y = np.array([1, 5])
    n_other = (other != -1).sum(axis=1) - 1
    assert 0.5 * np.abs(np.bincount(n_other, minlength=3) / M - want(*law.accept(y, np.eye(V)[y], p, **kw))).sum() <= 0.02


def test_plugin_support_filter_decides_each_block_as_the_numpy_definition_does():
    """typical under the support filter (min_p 0.01, max_rank 3) on blocks of 0-3 drafts, every other
    request with no filter: each filtered request's accepted count is exactly what
    `verify_with_support_filter` gives on the same rows (typical and the filter are deterministic), and
    its emitted token too, except at a cut, where it is drawn from the filter's support (checked to lie
    in it); the unfiltered rule requests are the plain rule's."""
    from acespec.verify import verify_block
    from acespec.verify.guards import first_filtered, support_mask, verify_with_support_filter

    rs = _plugin_sampler()
    B, V = 96, 64
    rng, counts, N, P = _blocks(22, B, V, 4.0)
    # drafts among the target's top 5: some pass the filter, some fail its rank test or its min_p
    draft = np.argsort(-P, axis=-1)[np.arange(N), rng.integers(0, 5, N)]
    bonus = rng.integers(0, V, B)
    spec = RuleSpec.parse("typical:eps=0.15,delta=0.5")
    rules = {i: spec for i in range(B)}
    support = {i: (0.01, 3) for i in range(0, B, 2)}
    out = _step(rs, draft, counts, P, bonus, _metadata(B, rules, support=support))
    starts = np.cumsum(counts) - counts
    seen = set()
    for i in range(B):
        n, s = int(counts[i]), int(starts[i])
        rows = np.vstack([P[s : s + n], np.eye(V)[bonus[i]]])
        if i not in support:
            a, nxt = verify_block(spec, draft[s : s + n], None, rows, np.random.default_rng(0))
            assert list(out[i]) == [*draft[s : s + a], nxt] + [-1] * (out.shape[1] - a - 1)
            continue
        a, nxt = verify_with_support_filter(spec, draft[s : s + n], None, rows, np.random.default_rng(0), min_p=0.01, max_rank=3)
        f = first_filtered(draft[s : s + n], rows, min_p=0.01, max_rank=3)
        got = int((out[i] != -1).sum()) - 1
        assert got == a and list(out[i, :a]) == list(draft[s : s + a]) and (out[i, a + 1 :] == -1).all(), (i, n, a)
        if a == f < n:  # cut by the filter: any token of its support
            assert support_mask(rows[f], min_p=0.01, max_rank=3)[out[i, a]], (i, f)
            seen.add("cut")
        else:
            assert out[i, a] == nxt, (i, n, a)
            seen.add("rule" if a < n else "all")
    assert seen == {"cut", "rule", "all"}


def test_plugin_support_filter_follows_verify_with_support_filters_law():
    """cactus under the support filter (min_p 0.1, max_rank 2) on 40,000 requests of the same three
    drafts, the first passing the filter and the second failing it (p = 0.02): the law of (accepted
    count, emitted token) is, within total variation 0.02, the law `verify_with_support_filter` gives on
    the same rows (20,000 draws of it): the rule's recovered law after a rejection at the first draft,
    and the target's row restricted to its two likeliest tokens at the cut. A sampler that let the
    filtered draft through, or drew the cut's token from the whole row, would be far off."""
    from acespec.verify.guards import verify_with_support_filter

    rs = _plugin_sampler()
    _, _, p0 = CASES[0]
    V = len(p0)
    x = np.array([1, 6, 3])
    q = 0.9 * np.eye(V)[x] + 0.1 / V
    p = np.stack([p0, p0, p0])
    spec = RuleSpec.parse("cactus")
    B = 40_000
    out = _step(rs, np.tile(x, B), [3] * B, np.tile(p, (B, 1)), np.zeros(B, dtype=np.int64),
                _metadata(B, {i: spec for i in range(B)}, support={i: (0.1, 2) for i in range(B)}), draft_probs=np.tile(q, (B, 1)))
    n_acc = (out != -1).sum(axis=1) - 1
    plugin = np.zeros((4, V))
    np.add.at(plugin, (n_acc, out[np.arange(B), n_acc]), 1.0 / B)
    rng = np.random.default_rng(3)
    M = 20_000
    numpy_law = np.zeros((4, V))
    rows = np.vstack([p, np.eye(V)[0]])
    for _ in range(M):
        a, t = verify_with_support_filter(spec, x, q, rows, rng, min_p=0.1, max_rank=2)
        numpy_law[a, t] += 1.0 / M
    assert plugin[2:].sum() == 0 and numpy_law[2:].sum() == 0  # the filtered draft is never kept
    assert 0.2 < plugin[0].sum() < 0.8  # the rule rejects the first draft part of the time
    assert set(np.flatnonzero(plugin[1])) == {0, 1}  # the cut draws from the two likeliest tokens only
    assert 0.5 * np.abs(plugin - numpy_law).sum() <= 0.02


def test_plugin_changes_nothing_when_no_rule_is_asked_for():
    """Installed and patched, with no request asking for a rule: the step is vLLM's own, bit for bit
    (seeded requests, same generators)."""
    from relaxed_laws import CASES

    import vllm.v1.sample.rejection_sampler as rs0

    rs = _plugin_sampler()
    from acespec.cloud import vllm_plugin

    _, q, p = CASES[0]
    B = 512
    a = _one_step(rs, q, p, _metadata(B, {}, seeds=list(range(B))), B, seed=3)
    original = vllm_plugin._state["original"]
    rs0.rejection_sample = original
    try:
        b = _one_step(rs0, q, p, _metadata(B, {}, seeds=list(range(B))), B, seed=3)
    finally:
        rs0.rejection_sample = vllm_plugin.rejection_sample
    assert np.array_equal(a, b)


def test_plugin_refuses_a_rule_it_cannot_run():
    from vllm import SamplingParams as VSP

    from acespec.cloud.vllm_plugin import AceSpecRules

    AceSpecRules.validate_params(VSP(temperature=1.0, extra_args={"acespec_rule": "cactus:delta=0.3"}))
    AceSpecRules.validate_params(VSP(temperature=1.0))
    for bad, why in (("nope", "unknown rule"), ("cactus:delta=-1", "delta"), ("coupled", "not a rejection rule")):
        with pytest.raises(ValueError, match=why):
            AceSpecRules.validate_params(VSP(temperature=1.0, extra_args={"acespec_rule": bad}))
    AceSpecRules.validate_params(VSP(temperature=1.0, extra_args={"acespec_rule": "strict", "acespec_support": "min_p=0.1,max_rank=10"}))
    for extra, why in (({"acespec_support": "min_p=0.1"}, "name the rule"),
                       ({"acespec_rule": "cactus", "acespec_support": "min_p=2"}, "min_p in"),
                       ({"acespec_rule": "cactus", "acespec_support": "top=3"}, "only min_p")):
        with pytest.raises(ValueError, match=why):
            AceSpecRules.validate_params(VSP(temperature=1.0, extra_args=extra))


def test_plugin_rule_asked_for_per_request_decides_inside_a_running_engine(engines):
    """Through the entry points, in vLLM's own worker: requests drafted by the proposer (a board slot for
    their prompt) that ask for `mentored` with alpha near 1 keep nearly every draft; the same requests
    without a rule (vLLM's strict sampler) keep a second-choice draft only about as often as the target
    gives it; the same requests under the net-win guard keep fewer than under mentored alone (the guard
    ran some of them strict) and far more than without a rule; and a malformed rule is refused at
    submission."""
    from vllm import SamplingParams as VSP

    from acespec.loop.board import BoardDraft

    lt, vl, hf = engines
    prompt = list(_prompt(91, 10))
    P = len(prompt)
    m = random_qwen2("tiny", seed=0)
    import torch

    from acespec.verify import softmax

    with torch.no_grad():
        p1 = softmax(m(torch.tensor([prompt])).logits[0, -1].double().numpy())
        rows = m(torch.tensor([prompt + [a] for a in range(512)])).logits[:, -1].double().numpy()
    firsts = [int(a) for a in np.argsort(-p1)[:8]]
    second = {a: int(np.argsort(-softmax(rows[a]))[1]) for a in firsts}
    slot = vl._board.assign(prompt, LEAD_K)
    vl._board.publish(slot, [BoardDraft(P, (a, second[a])) for a in firsts])

    async def kept(extra: dict | None, n: int = 160) -> float:
        async def one(i):
            sp = VSP(temperature=1.0, max_tokens=2, seed=7000 + i, detokenize=False, ignore_eos=True, extra_args=extra)
            out = None
            async for o in vl._llm.generate({"prompt_token_ids": prompt}, sp, request_id=f"plugin-{extra}-{i}"):
                out = o
            return [int(t) for t in out.outputs[0].token_ids]
        outs = await asyncio.gather(*(one(i) for i in range(n)))
        drafted = [o for o in outs if o[0] in second]
        return sum(o[1] == second[o[0]] for o in drafted) / len(drafted)

    try:
        relaxed = lt.run(kept({"acespec_rule": "mentored:alpha=0.999999"}))
        plain = lt.run(kept(None))
        # under the net-win guard, in the engine's worker: it decides each request's arm
        guarded = lt.run(kept({"acespec_rule": "mentored:alpha=0.999999", "acespec_net_win": "engine-test"}))
        with pytest.raises(Exception, match="unknown rule"):
            lt.run(kept({"acespec_rule": "nope"}, n=1))
    finally:
        vl._board.release(slot)
    assert relaxed > 0.95
    assert plain < 0.6
    # the guard's warm-up ran some requests strict (its 8 of the first 16, and its explorations), which
    # reject most drafts; the rest ran mentored, which kept them (read 1.000 / 0.098 / 0.895 here)
    assert plain + 0.3 < guarded < relaxed


def test_typical_cloud_led_runs_natively_with_the_plugin(engines):
    """A rule that needs no drafter rows (typical) at temperature 0.5: a native cloud-led session, its
    drafts decided by AceSpec's rule inside vLLM's sampler (before the plugin, refused on this engine);
    a rule that needs q rows runs natively too (the edge's rows cross the board), and on an engine whose
    board keeps no q rows it goes through verify requests."""
    lt, vl, hf = engines
    prompt = _prompt(93, 16)
    spec = SessionSpec(prompt, sampling=SamplingParams(temperature=0.5), rule=RuleSpec.parse("typical"), seed=5,
                       max_tokens=24, cloud_led=True)
    import torch

    from acespec.verify import softmax

    P = len(prompt)
    with torch.no_grad():
        p1 = softmax(random_qwen2("tiny", seed=0)(torch.tensor([list(prompt)])).logits[0, -1].double().numpy() / 0.5)
    firsts = [int(a) for a in np.argsort(-p1)[:8]]
    assert p1[firsts].sum() > 0.95  # and the session is seeded: vLLM draws the same first token every run
    # before the stream starts: a chain after each likely first token, so the second step has a draft
    # to verify (a draft made after the stream has begun is behind it: the stream does not wait)
    tree = [(P, (a, (a + 1) % 512, (a + 2) % 512)) for a in firsts]
    text, m = lt.run(_native_run(vl, spec, lambda t: tree if len(t) == P else None))
    assert len(text) == 24 and m["lead_tokens"] == 24 and m["lead_proposed"] > 0

    async def opened():
        s = await vl.open(SessionSpec(prompt, sampling=SamplingParams(temperature=1.0, top_k=K), rule=RuleSpec.parse("cactus"),
                                      max_tokens=8, cloud_led=True))
        native = vl.leads_natively(s)
        vl.close(s)
        return native
    assert lt.run(opened()) is True
    room, vl._board.shape = vl._board.shape, dataclasses.replace(vl._board.shape, q_topn=0)
    try:
        assert lt.run(opened()) is False
    finally:
        vl._board.shape = room


def test_bench_plugin_cost_prints_each_rule_against_strict():
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "acespec"), "bench", "plugin-cost", "--batch", "4",
                          "--k", "2", "--vocab", "64", "--reps", "2", "--rules", "cactus"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"^strict .* 1\.00x vLLM's strict$", out.stdout, re.M) and re.search(r"^cactus .*x vLLM's strict$", out.stdout, re.M)


def test_bench_tenants_on_vllm_runs_the_never_slower_grid_through_the_wan_emulator(tmp_path):
    """`bench tenants --engine vllm --rtt 0,100`: each cell at each RTT (the second through the WAN
    emulator), cloud-led beside cloud-only, the never-slower grid printed, and every cloud-led text the
    engine's own cloud-only text."""
    out = tmp_path / "t.json"
    run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "acespec"), "bench", "tenants", "--engine", "vllm",
                          "--n", "1", "--rtt", "0,100", "--modes", "cloud-led,cloud-only", "--max-tokens", "12",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    doc = json.loads(out.read_text())
    assert doc["rtts_ms"] == [0.0, 100.0]
    cells = {(r["rtt_ms"], r["mode"]) for r in doc["rows"]}
    assert cells == {(rtt, m) for rtt in (0.0, 100.0) for m in ("cloud-led", "cloud-only")}
    assert all(r["tokens"] == 12 and r["tokens_differ"] == 0 and not r["errors"] for r in doc["rows"])
    slow, fast = (next(r for r in doc["rows"] if r["rtt_ms"] == rtt and r["mode"] == "cloud-only") for rtt in (100.0, 0.0))
    # the hello and the first token crossed the emulated 100 ms link (jitter 20 ms a crossing: a fixed
    # 0.1 s floor failed once at 0.0996 s)
    assert slow["first_p50_s"] > fast["first_p50_s"] + 0.05
    assert re.search(r"vllm\s+RTT\s+100 ms\s+N=1 .*x", run.stdout) and "worst cell" in run.stdout
