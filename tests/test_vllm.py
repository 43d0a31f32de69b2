"""The vLLM verify engine against the transformers one, on a tiny random-weight Qwen2 built here.

Runs in the vLLM profile (`scripts/setup.sh vllm`; `scripts/test.sh` runs `-m vllm` there, with
ACESPEC_REQUIRE_VLLM=1 so a missing vLLM fails instead of skipping). The reference is the same
checkpoint on transformers behind the serial engine, which computes full rows: greedy verdicts must
be identical; sampled coupled verdicts identical wherever the top K covers the full-vocabulary draw.
"""

from __future__ import annotations

import asyncio
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

from acespec.cloud.engine import EngineRefused, SerialEngine, SessionSpec, make_engine  # noqa: E402
from acespec.models.hf import HFModel  # noqa: E402
from acespec.models.synthetic import random_qwen2, save_random_qwen2  # noqa: E402
from acespec.verify import RuleSpec, SamplingParams, coupled_sample  # noqa: E402

pytestmark = pytest.mark.vllm

K = 20  # the engine's top-K
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
    vl = make_engine("vllm", str(tiny), n_ctx=1024, logprobs=K)
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


# -- the whole system: `acespec serve --engine vllm` and a real edge ------------------------------
def _noisy_drafter(seed: int = 0):
    """The target's weights with noise on the output head: agrees with the target often, not always."""
    import torch

    m = random_qwen2("tiny", seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        m.lm_head.weight.add_(torch.randn(m.lm_head.weight.shape, generator=g) * 0.6 * m.lm_head.weight.std())
    return HFModel(m, None, name="tiny-drafter", device="cpu")


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
        for rule, sp in (("greedy", {}), ("coupled", {"temperature": 1.0, "top_k": K})):
            for mode in ("pipelined", "sync", "cloud-only"):
                cfg = EdgeConfig(mode=mode, rule=rule, k=3, max_tokens=40, seed=11, connect=ConnectConfig(port=port), **sp)
                res = run_edge(drafter if mode != "cloud-only" else None, prompt, cfg, model_id=drafter.tokenizer.fingerprint)
                out[rule, mode] = (res.tokens, res.stats)
        for rule in ("greedy", "coupled"):
            assert out[rule, "pipelined"][0] == out[rule, "cloud-only"][0]
            assert out[rule, "sync"][0] == out[rule, "cloud-only"][0]
            assert len(out[rule, "cloud-only"][0]) == 40
        st = out["greedy", "sync"][1]
        assert 0 < st.accepted < st.drafted  # the noisy drafter was partly right: a real speculative run
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        requests = fams["acespec:engine_requests"].samples[0].value
        assert requests > sum(len(t) for t, _ in out.values()) / 5  # one request per block, not per run
        assert fams["acespec:verdicts"].samples[0].value > 0
        # every session here was exact (greedy, or top_k <= K): no row needed a tail bound
        tail = {s.name: s.value for s in fams["acespec:topk_tail_mass"].samples}
        assert tail["acespec:topk_tail_mass_count"] == 0 and fams["acespec:topk_tail_mass_max"].samples[0].value == 0.0
    finally:
        proc.terminate()
        proc.wait(60)
