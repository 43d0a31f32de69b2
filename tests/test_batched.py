"""The batching verify engine: many sessions share one model, and none can tell.

- Batched verdicts equal solo verdicts, block for block: exact toy models (any rule) and the real
  target (greedy and coupled), where llama.cpp must compute a row the same whatever shares its batch.
- No cross-talk: 16 concurrent edges over real sockets each produce their solo output.
- KV memory is bounded: a newcomer with no slot gets BUSY and a later retry works; a swapped-out
  session rebuilds its KV and carries on exactly; an edge that disconnects frees its slot and can
  still RESUME.
- Chunked prefill: a 2,000-token prompt never holds another session's block back by more than one
  tick's token budget (counted in tokens the model evaluated, not in seconds).
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import numpy as np
import pytest

from acespec import wire
from acespec.cloud.batched import BatchConfig, BatchedEngine
from acespec.cloud.engine import EngineBusy, SessionSpec
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop.verifier import TargetVerifier
from acespec.models.toy import ToyModel

from paced_toy import PassCostToy
from acespec.verify import RuleSpec, SamplingParams

V = 48
HOST = "127.0.0.1"


def toy_target(**kw) -> ToyModel:
    return ToyModel(vocab=V, seed=1, **kw)


def spec(prompt, rule="coupled", temperature=0.8, seed=0, max_tokens=40) -> SessionSpec:
    return SessionSpec(tuple(prompt), SamplingParams(temperature), RuleSpec.parse(rule), seed, max_tokens)


def make_draft(seed: int):
    """A deterministic 'drafter' for engine-level tests: the block drafted at a committed prefix is a
    function of that prefix only, sometimes the target's continuation (so blocks get accepted),
    sometimes noise (so they get rejected), and sometimes a block on a stale base."""
    oracle = ToyModel(vocab=V, seed=1, noise=0.6, noise_seed=seed)

    def draft(tokens: list[int], k: int) -> list[int]:
        ctx = list(tokens)
        out = []
        for _ in range(k):
            t = int(np.argmax(oracle.logits_for_context(ctx)))
            out.append(t)
            ctx.append(t)
        return out

    return draft


def drive(verify, committed, done, draft, k: int, rounds: int, q_for=None):
    """The session loop shared by the solo and the batched side: returns every verdict's fields."""
    out = []
    for r in range(rounds):
        if done():
            break
        toks = committed()
        x = draft(toks, k)
        q = q_for(toks, x) if q_for else None
        base = len(toks)
        if r % 7 == 5:  # now and then a block built on a prefix that never happened: dropped
            base += 1
        out.append((yield verify(r, base, x, q)))
    return out


def solo_run(target, s: SessionSpec, draft, k, rounds, q_for=None):
    v = TargetVerifier(target, list(s.prompt), sampling=s.sampling, rule=s.rule, seed=s.seed, max_tokens=s.max_tokens)
    gen = drive(lambda *a: v.verify(*a), lambda: list(v.tokens), lambda: v.finished, draft, k, rounds, q_for)
    verdicts = []
    try:
        res = next(gen)
        while True:
            verdicts.append(strip(res))
            res = gen.send(res)
    except StopIteration:
        pass
    return verdicts, v.generated


def strip(v):
    return (v.seq, v.accepted, v.next_token, v.committed, v.dropped, v.finished)


async def engine_run(engine, s: SessionSpec, draft, k, rounds, q_for=None):
    h = await engine.open(s)
    # the generator yields the verify arguments through a tiny trampoline
    verdicts = []
    gen = drive(lambda *a: a, lambda: list(h.verifier.tokens), lambda: h.verifier.finished, draft, k, rounds, q_for)
    try:
        args = next(gen)
        while True:
            v = await engine.verify(h, *args)
            verdicts.append(strip(v))
            args = gen.send(v)
    except StopIteration:
        pass
    out = h.verifier.generated
    engine.close(h)
    return verdicts, out


def q_rows(tokens, x):
    """Dense drafter rows for rules that need q: a fixed noisy table, so the test is exact."""
    d = ToyModel(vocab=V, seed=1, noise=0.5, noise_seed=11)
    rows = []
    ctx = list(tokens)
    for t in x:
        z = d.logits_for_context(ctx)
        p = np.exp(z - z.max())
        rows.append(p / p.sum())
        ctx.append(t)
    return np.asarray(rows)


async def with_engine(engine, coro):
    await engine.start()
    try:
        return await coro
    finally:
        await engine.stop()


@pytest.mark.parametrize("rule,temperature,needs_q", [("greedy", 0.0, False), ("coupled", 0.8, False), ("strict", 0.8, True),
                                                      ("cactus:delta=0.3", 0.8, True)])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_toy_batched_verdicts_equal_solo_verdicts(rule, temperature, needs_q, n):
    rng = random.Random(n)
    specs = [spec([rng.randrange(V) for _ in range(rng.randint(1, 30))], rule, temperature, seed=i, max_tokens=rng.randint(5, 40))
             for i in range(n)]
    ks = [rng.randint(0, 6) for _ in range(n)]
    q_for = q_rows if needs_q else None
    solo = [solo_run(toy_target(), s, make_draft(i), ks[i], 30, q_for) for i, s in enumerate(specs)]
    engine = BatchedEngine(toy_target(), BatchConfig(tick_tokens=64))

    async def all_at_once():
        return await asyncio.gather(*(engine_run(engine, s, make_draft(i), ks[i], 30, q_for) for i, s in enumerate(specs)))

    batched = asyncio.run(with_engine(engine, all_at_once()))
    for i in range(n):
        assert batched[i] == solo[i], f"session {i}: batched verdicts differ from solo"
    if n > 1:
        assert engine.max_batch_sessions > 1, "the sessions never shared a batch"


def test_engine_rejects_bad_configs():
    with pytest.raises(ValueError, match="KV sequences"):
        BatchedEngine(ToyModel(vocab=V, n_slots=2), BatchConfig(slots=3))
    for bad in (dict(slots=0), dict(tick_tokens=1), dict(swap_idle_s=-1), dict(swap_idle_s=float("nan"))):
        with pytest.raises(ValueError):
            BatchConfig(**bad)


# ----------------------------------------------------------------------------------------- KV budget


def test_kv_budget_busy_then_swap_out_and_exact_resume():
    """Two slots. Two active sessions hold them: a third gets EngineBusy. Once they idle past
    swap_idle_s, the third takes the older one's slot (its KV dropped); that session then comes back,
    rebuilds its KV by prefill, and every session's verdicts equal its solo verdicts."""
    engine = BatchedEngine(toy_target(n_slots=2), BatchConfig(slots=2, tick_tokens=16, swap_idle_s=0.3))
    specs = [spec(list(range(1 + i, 30 + i)), seed=i, max_tokens=30) for i in range(3)]
    solo = [solo_run(toy_target(), s, make_draft(i), 3, 12) for i, s in enumerate(specs)]

    async def scenario():
        a = await engine.open(specs[0])
        b = await engine.open(specs[1])
        with pytest.raises(EngineBusy):
            await engine.open(specs[2])
        assert engine.refused == 1
        va, vb = [], []
        drafts = [make_draft(0), make_draft(1)]

        async def half(h, vs, draft, rounds):
            for r in range(rounds):
                if h.verifier.finished:
                    return
                toks = list(h.verifier.tokens)
                base = len(toks) + (1 if r % 7 == 5 else 0)
                vs.append(strip(await engine.verify(h, r, base, draft(toks, 3), None)))

        await half(a, va, drafts[0], 6)
        await half(b, vb, drafts[1], 6)
        await asyncio.sleep(0.4)  # both idle past swap_idle_s
        c_verdicts = await engine_run(engine, specs[2], make_draft(2), 3, 12)
        assert engine.swaps >= 1, "the newcomer did not take an idle session's slot"
        # a (the least recently used) lost its KV; it now rebuilds it and must carry on exactly
        async def rest(h, vs, draft, start):
            for r in range(start, 12):
                if h.verifier.finished:
                    return
                toks = list(h.verifier.tokens)
                base = len(toks) + (1 if r % 7 == 5 else 0)
                vs.append(strip(await engine.verify(h, r, base, draft(toks, 3), None)))

        await asyncio.gather(rest(a, va, drafts[0], 6), rest(b, vb, drafts[1], 6))
        return va, vb, c_verdicts[0]

    va, vb, vc = asyncio.run(with_engine(engine, scenario()))
    assert va == solo[0][0]
    assert vb == solo[1][0]
    assert vc == solo[2][0]


# ----------------------------------------------------------------------------------- chunked prefill


def test_a_long_prompt_never_holds_back_another_sessions_block_by_more_than_one_tick():
    budget = 64
    engine = BatchedEngine(PassCostToy(vocab=V, seed=1, pass_s=0.0, token_s=0.0004), BatchConfig(tick_tokens=budget))
    s_a = spec(list(range(20)), rule="greedy", temperature=0.0, max_tokens=400)
    s_b = spec([i % V for i in range(2000)], rule="greedy", temperature=0.0, max_tokens=4)

    async def scenario():
        a = await engine.open(s_a)
        await engine.step(a)
        before = engine.evaluated
        b = await engine.open(s_b)  # 2,000 prompt tokens to prefill, in chunks
        verdicts = 0
        while engine.evaluated - before < 1999 and verdicts < 400:
            await engine.step(a)  # a keeps asking for tokens all along the prefill
            verdicts += 1
        vb = await engine.step(b)
        return verdicts, vb

    verdicts, vb = asyncio.run(with_engine(engine, scenario()))
    assert verdicts >= 10, "the prefill finished before the other session got going: the test proves nothing"
    assert engine.max_wait_tokens <= budget, f"a block waited behind {engine.max_wait_tokens} tokens of other work"
    ref = TargetVerifier(toy_target(), list(s_b.prompt), rule="greedy", max_tokens=4).step()
    assert (vb.accepted, vb.next_token) == (ref.accepted, ref.next_token)


# ------------------------------------------------------------------------------ over real sockets


def _edge(port: int, prompt, seed: int, mode: str, rule="coupled", temperature=0.8, max_tokens=30, k=3):
    cfg = EdgeConfig(mode=mode, rule=rule, temperature=temperature, seed=seed, max_tokens=max_tokens, k=k,
                     connect=ConnectConfig(host=HOST, port=port, reply_timeout_s=20.0))
    drafter = None if mode == "cloud-only" else ToyModel(vocab=V, seed=1, noise=0.7, noise_seed=seed)
    return run_edge(drafter, prompt, cfg, model_id=f"toy:vocab={V}").tokens


def _solo(prompt, seed, max_tokens=30, rule="coupled", temperature=0.8):
    v = TargetVerifier(toy_target(), prompt, sampling=SamplingParams(temperature), rule=rule, seed=seed, max_tokens=max_tokens)
    while not v.finished:
        v.step()
    return v.generated


def test_sixteen_concurrent_edges_each_get_their_solo_output():
    rng = random.Random(7)
    jobs = [([rng.randrange(V) for _ in range(rng.randint(2, 40))], 100 + i, ("pipelined", "sync", "cloud-only")[i % 3])
            for i in range(16)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with CloudServerThread(toy_target(), ServerConfig(port=0, max_sessions=16)) as srv:
        def one(i):
            try:
                prompt, seed, mode = jobs[i]
                results[i] = _edge(srv.port, prompt, seed, mode)
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        engine = srv.server.engine
    assert not errors, errors
    for i, (prompt, seed, _) in enumerate(jobs):
        assert results[i] == _solo(prompt, seed), f"edge {i} got another output than alone"
    assert engine.max_batch_sessions > 1


def test_serial_and_batched_engines_give_the_same_text():
    prompt = [5, 7, 11, 13]
    outs = []
    for kind in ("serial", "batched"):
        with CloudServerThread(toy_target(), ServerConfig(port=0, engine=kind)) as srv:
            outs.append(_edge(srv.port, prompt, 3, "pipelined"))
    assert outs[0] == outs[1] == _solo(prompt, 3)


def _hello(prompt, max_tokens=20) -> wire.Hello:
    return wire.Hello(model_id=f"toy:vocab={V}", max_tokens=max_tokens, prompt=tuple(prompt), auth=b"", temperature=0.0,
                      top_k=0, top_p=1.0, rule="greedy", seed=0, mode=wire.Mode.SPECULATIVE)


def _recv(sock, dec):
    sock.settimeout(10)
    while True:
        frames = dec.feed(sock.recv(65536))
        if frames:
            return frames[0]


def test_a_client_that_disconnects_mid_batch_frees_its_slot_and_can_still_resume():
    """One KV slot. Edge A opens and verifies a block, then its connection dies with a block in flight.
    A newcomer B is then admitted at once (A's slot is reclaimed, not held for the resume grace), runs
    to the end, and A RESUMEs and finishes with exactly its solo output."""
    prompt_a, prompt_b = [1, 2, 3, 4], [9, 8, 7]
    with CloudServerThread(toy_target(n_slots=1), ServerConfig(port=0, engine="batched")) as srv:
        sock = socket.create_connection((HOST, srv.port))
        dec = wire.FrameDecoder()
        sock.sendall(wire.encode(_hello(prompt_a)))
        w = _recv(sock, dec)
        assert isinstance(w, wire.Welcome)
        sock.sendall(wire.encode(wire.Draft(session=w.session, seq=0, base=w.committed, tokens=(1, 2, 3))))
        v = _recv(sock, dec)
        committed = v.committed
        seen = list(prompt_a) + [1, 2, 3][: v.accepted] + [v.next_token]  # what this edge has committed
        sock.sendall(wire.encode(wire.Draft(session=w.session, seq=1, base=committed, tokens=(4, 5))))
        sock.close()  # gone with a block in flight
        deadline = time.monotonic() + 5
        while srv.server.sessions[w.session].connected and time.monotonic() < deadline:
            time.sleep(0.01)
        out_b = _edge(srv.port, prompt_b, 0, "sync", rule="greedy", temperature=0.0, max_tokens=20)
        assert out_b == _solo(prompt_b, 0, 20, "greedy", 0.0)
        assert srv.server.engine.swaps >= 1
        # A comes back where it left off and finishes with plain steps
        sock = socket.create_connection((HOST, srv.port))
        dec = wire.FrameDecoder()
        sock.sendall(wire.encode(wire.Resume(session=w.session, committed=committed, auth=b"", secret=w.secret,
                                             digest=wire.committed_digest(seen))))
        w2 = _recv(sock, dec)
        assert isinstance(w2, wire.Welcome) and w2.committed == committed
        c, seq, finished = committed, 10, False
        while not finished:
            sock.sendall(wire.encode(wire.Draft(session=w.session, seq=seq, base=c, tokens=())))
            v = _recv(sock, dec)
            c, finished, seq = v.committed, v.finished, seq + 1
        sock.close()
        tokens = srv.server.sessions[w.session].verifier.generated
    assert tokens == _solo(prompt_a, 0, 20, "greedy", 0.0)


# -------------------------------------------------------------------------------------- real target


@pytest.fixture
def row_log(monkeypatch):
    """Every target row each session's rule is applied to, as a digest, per session (keyed by prompt):
    verdicts alone are a weak witness (a changed row flips a verdict only at a near-tie); rows are exact."""
    import hashlib

    log: dict[tuple, list[str]] = {}
    real_finish = TargetVerifier.finish

    def finish(self, job, logits, seconds):
        key = tuple(self.tokens[: self.prompt_len])
        log.setdefault(key, []).append(hashlib.sha1(np.ascontiguousarray(logits, dtype=np.float32).tobytes()).hexdigest())
        return real_finish(self, job, logits, seconds)

    monkeypatch.setattr(TargetVerifier, "finish", finish)
    return log


def _real_target(n_slots: int):
    """The default GGUF target with one exact KV stream per slot, as the batched engine runs it (or a skip)."""
    from acespec.models.llama import LlamaCppModel
    from acespec.models.registry import DEFAULT_TARGET, installed_path

    path = installed_path(DEFAULT_TARGET)
    if path is None:
        pytest.skip("the default target is not installed")
    return LlamaCppModel(path, n_ctx=256, n_slots=n_slots, batch_invariant=True, name=DEFAULT_TARGET)


@pytest.mark.real
def test_real_batched_verdicts_equal_solo_verdicts_and_survive_a_swap(row_log):
    """The real target in one llama.cpp context with one KV stream per session, greedy and coupled:
    (1) three sessions at once get every verdict they get alone; (2) with a single KV slot, a session
    whose KV is swapped out for another's and rebuilt still gets exactly its solo verdicts."""
    m = _real_target(n_slots=3)
    try:
        tok = m.tokenizer
        prompts = [tok.encode(t) for t in ("def fib(n):", "import numpy as np\n# mean of a list", "class Stack:")]
        rules = (("greedy", 0.0), ("coupled", 0.9), ("greedy", 0.0))
        specs = [spec(p, *rules[i], seed=i, max_tokens=20) for i, p in enumerate(prompts)]
        plain: dict[int, list[int]] = {}

        def draft_for(i):
            r = random.Random(i)

            def draft(tokens, k):  # right drafts (the plain output) with a wrong token now and then
                n = len(tokens) - len(specs[i].prompt)
                out = list(plain[i][n : n + k])
                if out and r.random() < 0.4:
                    out[r.randrange(len(out))] = 17
                return out
            return draft

        async def alone(engine):
            for i, s in enumerate(specs):  # the plain output first: the drafts are built from it
                plain[i] = (await engine_run(engine, s, lambda t, k: [], 0, 20))[1]
            return [await engine_run(engine, s, draft_for(i), 4, 20) for i, s in enumerate(specs)]

        solo = asyncio.run(with_engine(e := BatchedEngine(m, BatchConfig(slots=3)), alone(e)))
        solo_rows = {k: list(v) for k, v in row_log.items()}
        row_log.clear()

        async def together(engine):
            return await asyncio.gather(*(engine_run(engine, s, draft_for(i), 4, 20) for i, s in enumerate(specs)))

        batched = asyncio.run(with_engine(engine := BatchedEngine(m, BatchConfig(slots=3)), together(engine)))
        assert engine.max_batch_sessions > 1
        for i in range(len(specs)):
            assert batched[i] == solo[i], f"session {i} ({specs[i].rule}): batched verdicts differ from solo"
        for key, rows in row_log.items():  # and every row the rules saw was the same bits
            assert rows == solo_rows[key][-len(rows):], "a session's target rows changed when it shared the batch"
        row_log.clear()

        async def swapping(engine):
            a = await engine.open(specs[1])
            va = []

            async def rounds(h, out, draft, r0, r1):
                for r in range(r0, r1):
                    if h.verifier.finished:
                        return
                    toks = list(h.verifier.tokens)
                    base = len(toks) + (1 if r % 7 == 5 else 0)
                    out.append(strip(await engine.verify(h, r, base, draft(toks, 4), None)))

            da = draft_for(1)
            await rounds(a, va, da, 0, 2)
            b = await engine.open(specs[0])  # takes a's slot: a's KV is dropped
            await rounds(b, [], draft_for(0), 0, 2)
            await rounds(a, va, da, 2, 20)  # a comes back: its KV is rebuilt by replaying its passes
            return va

        va = asyncio.run(with_engine(one := BatchedEngine(m, BatchConfig(slots=1, swap_idle_s=0)), swapping(one)))
        assert one.swaps >= 2
        assert va == solo[1][0], "the swapped-out session's verdicts changed"
        key = tuple(specs[1].prompt)
        assert row_log[key] == solo_rows[key][-len(row_log[key]):], "the swapped-out session's target rows changed"
    finally:
        m.close()


def test_a_closed_sessions_slot_is_kept_for_a_newcomer_with_its_prefix_and_goes_first_when_room_is_needed():
    """Toy target, one slot, prefill chunks of 8. A closed session's slot stays (retained): a newcomer with
    the same prompt keeps every prompt chunk (all but the last prompt token, which its first verify
    evaluates), one sharing 12 tokens keeps the one chunk inside them (not the 4 shared tokens of the
    next), one sharing none gets the slot emptied (no BUSY, no swap: a retained slot goes before any live
    session's), and every verdict equals its solo verdict."""
    engine = BatchedEngine(toy_target(n_slots=1), BatchConfig(slots=1, tick_tokens=16, prefill_chunk=8))
    base = list(range(1, 22))  # 21 tokens: prefill chunks [0, 8), [8, 16), [16, 20); its first verify evaluates 20 on
    specs = [spec(base, seed=0, max_tokens=10), spec(base, seed=1, max_tokens=10),
             spec(base[:12] + [40, 41, 42, 43, 44], seed=2, max_tokens=10), spec([30, 31, 32], seed=3, max_tokens=10)]
    solo = [solo_run(toy_target(), s, make_draft(i), 3, 8) for i, s in enumerate(specs)]
    reused = []

    async def one_by_one():
        out = []
        for i, s in enumerate(specs):
            before = engine.prefix_reused_tokens
            out.append(await engine_run(engine, s, make_draft(i), 3, 8))
            reused.append(engine.prefix_reused_tokens - before)
            await asyncio.sleep(0.05)  # the CLOSE is served
        return out

    got = asyncio.run(with_engine(engine, one_by_one()))
    assert got == solo
    assert reused == [0, 20, 8, 0]
    m = engine.metrics()
    assert (m["prefix_reuses"], m["prefix_reused_tokens"], m["swaps"], m["refused"]) == (2, 28, 0, 0)
    assert m["retained"] == 1 and m["retained_kv_tokens"] == 2  # the last session's prompt chunk, trimmed to it


def test_with_prefix_reuse_off_every_session_prefills_its_whole_prompt():
    """`reuse_prefixes=False` (`serve --no-prefix-reuse`, the benches that compare modes on one prompt):
    a closed session's slot is freed, so the same prompt again prefills from nothing, and the text is
    the same."""
    engine = BatchedEngine(toy_target(n_slots=1), BatchConfig(slots=1, tick_tokens=16, prefill_chunk=8, reuse_prefixes=False))
    base = list(range(1, 22))
    specs = [spec(base, seed=0, max_tokens=10), spec(base, seed=1, max_tokens=10)]
    solo = [solo_run(toy_target(), s, make_draft(i), 3, 8) for i, s in enumerate(specs)]

    async def one_by_one():
        out = []
        for i, s in enumerate(specs):
            out.append(await engine_run(engine, s, make_draft(i), 3, 8))
            await asyncio.sleep(0.05)  # the CLOSE is served
        return out

    got = asyncio.run(with_engine(engine, one_by_one()))
    assert got == solo
    m = engine.metrics()
    assert (m["prefix_reuses"], m["prefix_reused_tokens"], m["retained"], m["refused"]) == (0, 0, 0, 0)
    assert engine.evaluated >= 2 * 20  # both prompts' prefills ran in full


@pytest.mark.real
def test_real_prefix_reuse_across_sessions_is_bit_identical(row_log):
    """The real target, one KV stream per slot: a session whose prompt a closed session's slot already
    prefilled keeps that slot's prompt chunks (`prefix_reused_tokens`): the same prompt again all of them,
    a prompt sharing its first 130 tokens the two whole 64-token chunks. Its tokens and every target row
    its rule sees are the same bits as with a fresh slot (rows, not only tokens: a changed row flips a
    token only at a near-tie)."""
    m = _real_target(n_slots=2)
    try:
        tok = m.tokenizer
        head = tok.encode("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(12)))[:130]
        a = head + tok.encode("def g(x):\n    return")
        b = head + tok.encode("class Point:\n    def __init__(self")
        assert len(a) > 129 and len(b) > 129 and a[:130] == b[:130] and a[130] != b[130]
        specs = [spec(a, "greedy", 0.0, max_tokens=8), spec(b, "greedy", 0.0, max_tokens=8)]

        def run(engine, s):
            row_log.clear()
            out = asyncio.run(with_engine(engine, engine_run(engine, s, lambda t, k: [], 0, 8)))
            return out, dict(row_log)

        fresh = [run(BatchedEngine(m, BatchConfig(slots=2)), s) for s in specs]  # a new engine: every slot empty
        engine = BatchedEngine(m, BatchConfig(slots=2))

        async def in_turn():
            res = []
            for s in [specs[0], specs[0], specs[1]]:
                row_log.clear()
                before = engine.prefix_reused_tokens
                out = await engine_run(engine, s, lambda t, k: [], 0, 8)
                await asyncio.sleep(0.05)  # the CLOSE is served: its slot is retained
                res.append((out, dict(row_log), engine.prefix_reused_tokens - before))
            return res

        (a1, rows_a1, r1), (a2, rows_a2, r2), (b2, rows_b2, r3) = asyncio.run(with_engine(engine, in_turn()))
        assert a1 == a2 == fresh[0][0], "the same prompt on a reused slot gave other tokens"
        assert b2 == fresh[1][0], "a prompt sharing the prefix gave other tokens on a reused slot"
        assert rows_a1 == rows_a2 == fresh[0][1], "the same prompt on a reused slot saw other target rows"
        assert rows_b2 == fresh[1][1], "a prompt sharing the prefix saw other target rows on a reused slot"
        assert (r1, r2, r3) == (0, len(a) - 1, 128), "the prefix was not reused as expected"
        assert engine.metrics()["prefix_reused_tokens"] == len(a) - 1 + 128
    finally:
        m.close()


# ---------------------------------------------------------------------------------- bench tenants


@pytest.fixture(scope="module")
def toy_traces():
    from acespec.sim.trace import record_prompt

    rng = random.Random(2)
    out = []
    for i in range(6):
        prompt = [rng.randrange(V) for _ in range(rng.randint(3, 20))]
        tr, _ = record_prompt(toy_target(), ToyModel(vocab=V, seed=1, noise=0.4, noise_seed=i), prompt, max_tokens=40, pid=f"toy/{i}")
        out.append(tr)
    return out


@pytest.mark.parametrize("mode", ["acespec", "cloud-led", "sync", "cloud-only"])
@pytest.mark.parametrize("kind", ["batched", "serial"])
def test_bench_tenants_replay_edges_commit_the_targets_text(toy_traces, mode, kind):
    """The replay edges speak the real protocol: every session commits exactly the target's greedy
    output from its trace, speculative modes need fewer target passes than tokens, and the engine
    really shared its ticks between the edges."""
    from acespec.bench.tenants import run_cell
    from acespec.cloud.engine import make_engine

    # cloud-led prices each step's depth from what passes cost: a toy pass costs microseconds, and
    # almost nothing of it is fixed, so no draft would pay; this one has a GPU's shape (a fixed 3 ms)
    target = PassCostToy(vocab=V, seed=1) if mode == "cloud-led" else toy_target()
    r = run_cell(make_engine(kind, target), toy_traces, mode, 6, max_tokens=40, draft_s=0.001, cap_s=30)
    assert not r["errors"] and r["capped"] == 0
    for tr in toy_traces:
        assert r["outputs"][tr.id] == tr.tokens
    assert r["tokens"] == sum(len(t.tokens) for t in toy_traces)
    if mode == "cloud-only":
        assert r["passes_per_token"] == 1.0
    elif mode == "cloud-led":  # a step takes about as long as the replayed drafter's 1 ms a token, so only
        # some steps find a draft (under CI's load on the serial engine, 2 in 100): they still count
        assert r["passes_per_token"] < 1.0
        # timeliness, the share of steps that verified a draft: a pass verifying d drafts commits up to
        # d + 1 tokens, so steps with a draft are the passes the stream saved tokens on
        assert 0.0 < r["timeliness"] <= 1.0
    else:
        assert r["passes_per_token"] < 0.5  # blocks of 4 with a close drafter
    if kind == "batched":
        assert r["engine_metrics"]["max_batch_sessions"] > 1
    # each cell beside its ceiling, on the passes its sessions reported (a cloud-only stream reports none)
    if mode == "cloud-only":
        assert r["ceiling_tok_s"] is None and r["of_ceiling"] is None
    else:
        assert r["ceiling_tok_s"] > 0
    if mode != "cloud-led":
        assert r["timeliness"] is None  # a figure of the stream's steps: edge-led blocks all carry drafts


def test_draft_timeliness_is_the_share_of_reported_passes_that_verified_a_draft():
    from acespec.bench.tenants_report import never_slower
    from acespec.loop.stats import RunStats, draft_timeliness

    a, b = RunStats(), RunStats()
    for d in (0, 3, 0, 2):
        a.observe_pass(d, 0.01)
    b.observe_pass(1, 0.01)
    assert draft_timeliness([a, b]) == 3 / 5
    assert draft_timeliness([RunStats()]) is None  # no pass reported: no figure, not 0
    row = dict(engine="batched", rtt_ms=0.0, n=1, per_session_tok_s=2.0, passes_per_token=0.5, outputs={"p": [1, 2]})
    lines = never_slower([{**row, "mode": "cloud-led", "timeliness": 0.6}, {**row, "mode": "cloud-only", "timeliness": None}])
    assert "drafts on time at 0.60 of steps" in lines[1]


def test_bench_tenants_cells_over_the_wan_emulator_and_sampled_keep_cloud_only_text(toy_traces):
    """The never-slower grid's cells: through the WAN emulator at an RTT, greedy, a cloud-led session
    commits the target's text; at T > 0 (coupled) cloud-led and cloud-only give the same text."""
    from acespec.bench.tenants import run_cell
    from acespec.cloud.engine import make_engine

    r = run_cell(make_engine("batched", toy_target()), toy_traces, "cloud-led", 3, max_tokens=40, draft_s=0.001, cap_s=30, rtt_ms=40)
    assert not r["errors"] and r["rtt_ms"] == 40 and all(r["outputs"][tr.id] == tr.tokens for tr in toy_traces[:3])
    assert r["first_p50_s"] >= 0.02  # HELLO -> first token crossed the emulated path (40 ms, the profile's +-20 ms jitter)
    kw = dict(max_tokens=30, draft_s=0.001, cap_s=30, rule="coupled", temperature=0.9)
    led, plain = (run_cell(make_engine("batched", toy_target()), toy_traces, m, 4, **kw) for m in ("cloud-led", "cloud-only"))
    assert not led["errors"] and not plain["errors"] and led["outputs"] == plain["outputs"]
    assert any(plain["outputs"][tr.id] != tr.tokens[:30] for tr in toy_traces[:4])  # sampled: not the greedy text


@pytest.mark.parametrize("mode", ["acespec", "cloud-led"])
def test_bench_tenants_replays_coupled_traces_at_their_seeds_with_the_coupled_drafters_acceptance(mode):
    """Traces recorded coupled (`bench sim --record --temperature T`): each edge runs its trace's seed,
    so every session commits the trace's sampled text, which is cloud-only's, and the replayed chains
    are the coupled drafter's, which the target accepts (greedy chains along a sampled stream mostly
    are not); edge-led modes replay exactly too."""
    from acespec.bench.tenants import run_cell
    from acespec.cloud.engine import make_engine
    from acespec.sim.trace import record_prompt

    rng = random.Random(3)
    traces = []
    for i in range(3):
        prompt = [rng.randrange(V) for _ in range(rng.randint(3, 12))]
        tr, _ = record_prompt(toy_target(), ToyModel(vocab=V, seed=1, noise=0.4, noise_seed=i), prompt, max_tokens=30,
                              pid=f"toy/{i}", temperature=1.0, seed=10 + i)
        traces.append(tr)
    kw = dict(max_tokens=30, draft_s=0.001, cap_s=30, rule="coupled", temperature=1.0)
    target = PassCostToy(vocab=V, seed=1) if mode == "cloud-led" else toy_target()  # a pass with a GPU's fixed cost
    r = run_cell(make_engine("batched", target), traces, mode, 3, **kw)
    plain = run_cell(make_engine("batched", toy_target()), traces, "cloud-only", 3, **kw)
    assert not r["errors"] and not plain["errors"]
    assert r["outputs"] == plain["outputs"] == {tr.id: tr.tokens for tr in traces}
    assert r["passes_per_token"] < (0.8 if mode == "acespec" else 1.0)


def _row(mode, n, rtt, per_s, outputs, passes=1.0):
    return {"engine": "batched", "mode": mode, "n": n, "rtt_ms": rtt, "per_session_tok_s": per_s, "passes_per_token": passes,
            "outputs": outputs}


def test_the_never_slower_grid_names_the_worst_cell_and_counts_tokens_that_differ():
    from acespec.bench.tenants_report import never_slower

    rows = [_row("cloud-only", 1, 0, 5.0, {"a": [1, 2, 3]}), _row("cloud-led", 1, 0, 6.0, {"a": [1, 2, 3]}, 0.3),
            _row("cloud-only", 4, 100, 2.0, {"a": [1, 2, 3], "b": [4, 5]}),
            _row("cloud-led", 4, 100, 1.9, {"a": [1, 2, 3], "b": [4, 6, 7]}, 0.9),
            _row("acespec", 4, 100, 9.0, {})]
    text = "\n".join(never_slower(rows))
    assert "1.20x at 0.30 passes/token, 0 texts differ (0 of 3 tokens from the first difference on)" in text
    assert "0.95x at 0.90 passes/token, 1 texts differ (1 of 5 tokens from the first difference on)  <- slower" in text
    assert "worst cell 0.95x (RTT 100 ms, N = 4): SLOWER than cloud-only" in text
    assert "1 of 3 texts differ from cloud-only's (1 of 8 tokens from the first difference on)" in text
    assert never_slower([_row("cloud-led", 1, 0, 6.0, {})]) == []  # no cloud-only cell to compare with
    # repeated runs: the means decide, and the spread of the runs' own ratios is shown
    rows = [_row("cloud-only", 1, 0, 5.0, {"a": [1]}), _row("cloud-led", 1, 0, 4.5, {"a": [1]}),
            _row("cloud-only", 1, 0, 4.0, {"a": [1]}), _row("cloud-led", 1, 0, 5.5, {"a": [2]})]
    text = "\n".join(never_slower(rows))
    assert "means over 2 interleaved runs" in text and "1.11x (runs 0.90-1.38x)" in text and "1 of 2 texts differ" in text


def test_bench_tenants_cli_refuses_bad_arguments(tmp_path, capsys):
    from acespec.cli import main
    from acespec.sim.trace import TraceSet, record_prompt

    tr, _ = record_prompt(toy_target(), toy_target(noise=0.4, noise_seed=1), [1, 2, 3], max_tokens=8, temperature=1.0, seed=0)
    coupled = TraceSet([tr], rule="coupled", temperature=1.0).save(tmp_path / "coupled.json")

    for argv, msg in ((["--n", "0"], ">= 1"), (["--n", "x"], "integers"), (["--modes", "warp"], "unknown mode"),
                      (["--traces", str(tmp_path / "none.json")], "no trace file"), (["--cap", "0"], "--cap"),
                      (["--rtt", "fast"], "--rtt"), (["--temperature", "-1"], "--temperature"),
                      (["--temperature", "0.8"], "cloud-led and cloud-only modes only"),
                      (["--temperature", "0.5", "--traces", str(coupled)], "replay it with --temperature 1"),
                      (["--traces", str(coupled)], "replay it with --temperature 1"),
                      (["--engine", "vllm", "--temperature", "0.8"], "not yet available with --engine vllm"),
                      (["--engine", "vllm", "--rtt", "slow"], "--rtt")):
        rc = main(["bench", "tenants", *argv])
        assert rc == 2
        assert msg in capsys.readouterr().err


class PoisonToy(ToyModel):
    """A toy target whose runtime fails any pass holding the tokens 47, 46 in a row: a model error."""

    def _eval_batch(self, items):
        if any((47, 46) in zip(toks, toks[1:]) for _, toks, _ in items):
            from acespec.models.base import ModelError

            raise ModelError("poisoned pass")
        return super()._eval_batch(items)


def test_a_failing_model_pass_fails_only_its_requests_and_the_engine_carries_on():
    engine = BatchedEngine(PoisonToy(vocab=V, seed=1), BatchConfig(tick_tokens=64))
    good, bad = spec([5, 6, 7], rule="greedy", temperature=0.0), spec([1, 2, 3], rule="greedy", temperature=0.0)

    async def scenario():
        g, b = await engine.open(good), await engine.open(bad)
        with pytest.raises(Exception, match="poisoned"):
            await engine.verify(b, 0, b.verifier.committed, [47, 46], None)  # a block the model refuses
        out = [await engine.step(g) for _ in range(5)]  # the other session is unharmed
        again = await engine.verify(b, 1, b.verifier.committed, [4], None)  # and the failed one can go on
        return out, again

    out, again = asyncio.run(with_engine(engine, scenario()))
    assert [v.committed for v in out] == [4, 5, 6, 7, 8]
    assert not again.dropped and again.committed == 4 + again.accepted
    assert engine.ticks < 50  # no spinning on the failure


# ------------------------------------------------------------------------------------------- metrics


def test_cloud_metrics_parse_and_move_by_what_happened():
    """The cloud's /metrics (prometheus_client) parses with prometheus_client's own parser, and its
    counters move by exactly what a run did: the verdicts the edge received, the session it opened."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from acespec.cloud.metrics import start_metrics_server

    def scrape(port):
        text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10).read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
        return out

    with CloudServerThread(toy_target(), ServerConfig(port=0)) as srv:
        httpd, _ = start_metrics_server(srv.server, 0, HOST)
        try:
            before = scrape(httpd.server_port)
            cfg = EdgeConfig(mode="sync", rule="greedy", k=3, max_tokens=20, connect=ConnectConfig(host=HOST, port=srv.port))
            res = run_edge(ToyModel(vocab=V, seed=1, noise=0.7, noise_seed=1), [1, 2, 3], cfg, model_id=f"toy:vocab={V}")
            time.sleep(0.2)  # the CLOSE reaches the server
            after = scrape(httpd.server_port)
        finally:
            httpd.shutdown()
    assert after[("acespec:verdicts_total", ())] - before[("acespec:verdicts_total", ())] == res.stats.rounds + res.stats.dropped
    assert after[("acespec:sessions_started_total", (("how", "opened"),))] == before[("acespec:sessions_started_total", (("how", "opened"),))] + 1
    assert after[("acespec:engine_evaluated_tokens_total", ())] > before[("acespec:engine_evaluated_tokens_total", ())]
    assert 0.0 <= after[("acespec:kv_cache_usage_perc", ())] <= 1.0


def test_the_serial_engine_stops_without_prefilling_queued_sessions_and_no_pass_runs_after():
    """Stopping the serial engine with eight prompts queued to prefill returns after the one prefill in
    flight, not after all eight, and no model call is running when it returns: the caller may close the
    model (waiting for every queued prefill outlasted the server thread's patience, and `bench tenants`
    then closed the model under a running pass, a segfault)."""
    from acespec.cloud.engine import SerialEngine

    class Watched(ToyModel):
        running = calls = 0

        def _eval(self, new, want):  # the serial engine's passes: 10 ms a token, as a slow target's
            Watched.running += 1
            Watched.calls += 1
            try:
                time.sleep(0.01 * len(new))
                return super()._eval(new, want)
            finally:
                Watched.running -= 1

    engine = SerialEngine(Watched(vocab=V, seed=1))

    async def go():
        for i in range(8):
            await engine.open(spec([1 + i] * 30, rule="greedy", temperature=0.0))
        await asyncio.sleep(0.05)  # the first prefill (0.3 s) is under way
        await engine.stop()
        return Watched.calls, Watched.running

    calls, running = asyncio.run(go())
    assert running == 0
    assert 1 <= calls <= 2  # the prefill in flight (and at most one that began with it), not all eight
