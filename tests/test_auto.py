"""The default mode, `auto`: cloud-led on the wire, and nothing on the edge ever holds the stream back.

- Same text as cloud-only (greedy and coupled), with drafts used, over real sockets.
- The drafter's prefill starts only once the first token is here; a drafter may join late, or never,
  and the text is the same.
- The cloud operator's pass budget (`ServerConfig.lead_pass_budget`): with one, a step waits for the
  edge's draft and verifies enough of it to stay within budget; with none, the cloud never waits.
- The edge's drafter pool lends a drafter without waiting, or not at all (`DrafterPool.try_acquire`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading

import pytest

from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.edge.service import ApiError, DrafterPool
from acespec.models.toy import ToyModel

from paced_toy import PassCostToy

V = 64
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


def drafter_model(noise: float = 0.3) -> ToyModel:
    return ToyModel(vocab=V, seed=1, noise=noise, noise_seed=4)


@pytest.fixture(scope="module")
def cloud():
    # a pass takes 2 ms, as a real target's takes time: drafts can arrive while the stream runs
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.002), ServerConfig(port=0, max_sessions=8)) as srv:
        yield srv


@pytest.fixture(scope="module")
def waiting_cloud():
    """A cloud with a pass budget: each step after the first waits (up to 0.2 s) for the edge's draft,
    so the tests that check drafts were used do not depend on how fast a loaded machine drafts."""
    cfg = ServerConfig(port=0, max_sessions=8, lead_pass_budget=0.9, lead_max_wait_s=0.2)
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.002), cfg) as srv:
        yield srv


def run(port: int, mode: str, drafter=None, source=None, on_tokens=None, **kw):
    """One generation. The contention guard is off: these tests are about the stream and the drafts, and
    on a loaded machine the guard would rightly rest a drafter whose cores other processes keep busy
    (tests/test_contention.py tests the guard)."""
    cfg = EdgeConfig(mode=mode, connect=ConnectConfig(port=port), max_tokens=kw.pop("max_tokens", 96),
                     contention_guard=kw.pop("contention_guard", False), **kw)
    fp = drafter_model().tokenizer.fingerprint
    return run_edge(drafter, PROMPT, cfg, model_id=fp, drafter_source=source, on_tokens=on_tokens)


@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("coupled", 0.9)])
def test_auto_gives_cloud_only_text_with_drafts_used(cloud, waiting_cloud, rule, temperature):
    ref = run(cloud.port, "cloud-only", rule=rule, temperature=temperature, seed=3)
    res = run(waiting_cloud.port, "auto", drafter_model(), rule=rule, temperature=temperature, seed=3)
    assert res.tokens == ref.tokens and len(res.tokens) == 96 and res.finished
    assert res.stats.drafted > 0 and res.stats.accepted > 0
    assert res.stats.rounds < res.stats.emitted  # fewer target passes than tokens


def test_auto_is_the_default_mode_of_the_edge():
    assert EdgeConfig().mode == "auto"


def test_the_drafter_joins_only_after_the_first_token(cloud):
    m = drafter_model()
    seen_at_first: list[int] = []
    cfg = EdgeConfig(mode="auto", connect=ConnectConfig(port=cloud.port), max_tokens=48, contention_guard=False)
    res = run_edge(m, PROMPT, cfg, model_id=m.tokenizer.fingerprint,
                   on_tokens=lambda t: seen_at_first.append(len(m.tokens)) if not seen_at_first else None)
    assert seen_at_first == [0]  # the drafter had not touched the prompt when the first token reached the user
    assert res.stats.lead["drafter_joined_at"] >= 1


def test_auto_without_any_drafter_streams_cloud_only_text(cloud):
    ref = run(cloud.port, "cloud-only", max_tokens=40)
    res = run(cloud.port, "auto", None, max_tokens=40, contention_guard=True)
    assert res.tokens == ref.tokens and res.stats.drafted == 0
    assert res.stats.lead["drafter_joined_at"] is None


def test_a_drafter_that_becomes_free_mid_stream_joins_it_and_the_text_stays_exact(cloud, waiting_cloud):
    streamed: list[int] = []
    m = drafter_model()

    def source():  # busy until 20 tokens have streamed, as a drafter another request holds would be
        return m if len(streamed) >= 20 else None

    ref = run(cloud.port, "cloud-only", max_tokens=160)
    res = run(waiting_cloud.port, "auto", None, source=source, on_tokens=streamed.extend, max_tokens=160)
    assert res.tokens == ref.tokens
    assert res.stats.lead["drafter_joined_at"] >= 20 and res.stats.drafted > 0


def test_while_the_edge_rests_its_drafter_only_a_probe_session_asks_for_it_and_every_text_is_exact(cloud):
    """Over sockets: an edge whose BackoffMemory rests (the cloud passed its drafts over) streams the
    next session as a cloud-only one, never asking for a drafter, and the session after it as a
    probe that does; texts are cloud-only's. A request with a prediction drafts whatever the memory
    says (its drafts cost no drafter) and leaves the memory's schedule as it was."""
    from acespec.loop.backoff import BackoffMemory

    asked: list[int] = []

    def source():
        asked.append(1)
        return None  # no drafter to lend: the session streams on

    memory = BackoffMemory()
    memory.rest()
    ref = run(cloud.port, "cloud-only", max_tokens=40)
    cfg = EdgeConfig(mode="auto", connect=ConnectConfig(port=cloud.port), max_tokens=40, contention_guard=False)
    fp = drafter_model().tokenizer.fingerprint

    def auto(**kw):
        return run_edge(None, PROMPT, dataclasses.replace(cfg, **kw), model_id=fp, drafter_source=source,
                        backoff=memory)

    res = auto()
    assert res.tokens == ref.tokens and res.stats.lead["plain_because"] == "backoff" and not asked
    res = auto(prediction=list(ref.tokens[:8]))
    assert res.tokens == ref.tokens and "streamed_plain" not in res.stats.lead and memory.skipped == 1 and asked
    asked.clear()
    res = auto()  # the probe: cloud-led, and the drafter is asked for
    assert res.tokens == ref.tokens and "streamed_plain" not in res.stats.lead and asked


def test_a_pass_budget_keeps_a_session_within_it_when_the_drafts_are_good():
    """An exact drafter (the target itself): every draft is kept, so a budget of 0.3 passes per token is
    within reach once the edge's first drafts are in, and the server's steps wait for them."""
    cfg = ServerConfig(port=0, max_sessions=4, lead_pass_budget=0.3, lead_max_wait_s=2.0)
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.002), cfg) as srv:
        exact = ToyModel(vocab=V, seed=1)
        ref = run(srv.port, "cloud-only", max_tokens=120)
        res = run(srv.port, "auto", exact, max_tokens=120)
    assert res.tokens == ref.tokens
    s = res.stats
    assert s.rounds / s.emitted <= 0.3 + 1e-9, (s.rounds, s.emitted)


def test_with_no_budget_the_cloud_never_waits_for_a_draft():
    """An edge with no drafter at all: with no budget no step waits; with a budget and a short wait cap,
    each step but the first (the prompt's, which never waits) waits out the cap, and still streams."""
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.001), ServerConfig(port=0)) as srv:
        assert math.isinf(srv.server.cfg.lead_pass_budget)
        res = run(srv.port, "auto", None, max_tokens=30)
        assert res.stats.rounds == 30 and srv.server.lead_holds == 0
    cfg = ServerConfig(port=0, lead_pass_budget=0.5, lead_max_wait_s=0.02)
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.001), cfg) as srv:
        res = run(srv.port, "auto", None, max_tokens=30)
        assert len(res.tokens) == 30 and res.stats.rounds == 30
        assert srv.server.lead_holds == 28  # steps 2..29 (the last has nothing left to draft for)
        assert srv.server.lead_held_s >= 28 * 0.02  # each waited out the whole cap


# ------------------------------------------------------------------------------------------ drafter pool
def test_the_pool_lends_a_free_drafter_at_once_and_none_when_all_are_out():
    pool = DrafterPool(["d1"], max_waiting=2)
    assert pool.try_acquire() == "d1" and pool.busy == 1
    assert pool.try_acquire() is None
    pool.release(None, "d1")
    assert pool.busy == 0 and pool.try_acquire() == "d1"


def test_a_released_drafter_goes_to_the_request_waiting_in_line_before_a_borrower():
    async def scenario():
        pool = DrafterPool(["d1"], max_waiting=1)
        d = await pool.acquire()
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        assert pool.waiting == 1
        with pytest.raises(ApiError) as e:  # the line is full
            await pool.acquire()
        assert e.value.status == 503
        threading.Thread(target=pool.release, args=(None, d)).start()  # from a worker thread
        got = await asyncio.wait_for(waiter, 5)
        assert got == "d1" and pool.try_acquire() is None  # the borrower did not jump the line
        pool.release(None, got)
        assert pool.try_acquire() == "d1"

    asyncio.run(scenario())


def test_a_waiter_that_leaves_does_not_lose_the_drafter():
    async def scenario():
        pool = DrafterPool(["d1"], max_waiting=4)
        d = await pool.acquire()
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        pool.release(None, d)
        await asyncio.sleep(0.01)
        assert pool.try_acquire() == "d1" and pool.waiting == 0

    asyncio.run(scenario())


def test_no_drafter_is_lent_while_another_stream_waits_for_its_first_token():
    from acespec.edge.service import FirstTokens

    board = FirstTokens()
    a, b = object(), object()
    mark_a, mark_b = board.waiting(a), board.waiting(b)
    assert board.others_waiting(a) and board.others_waiting(b)
    mark_b.done()  # b has its first token
    assert not board.others_waiting(a) and board.others_waiting(b)  # a still waits: b borrows nothing yet
    mark_a.done()
    mark_a.done()  # a finished stream marks itself done again: harmless
    assert not board.others_waiting(b)
