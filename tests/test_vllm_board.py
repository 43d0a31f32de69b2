"""The shared draft board and the `custom_class` proposer, driven here as vLLM's worker drives them.

The proposer needs nothing of vLLM but its config's three fields and the arrays vLLM passes to
`propose` (each running request's sampled tokens, token counts, and the token-id matrix), so these
tests build those arrays by hand and check what a session gets proposed; `tests/test_vllm.py` runs the
same proposer inside a real vLLM."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import numpy as np
import pytest

from acespec.cloud.vllm_board import CONFIG_KEY, BoardReader, BoardShape, SharedBoard, prompt_key
from acespec.cloud.vllm_proposer import EdgeDraftProposer
from acespec.loop.board import BoardDraft

PROMPT = tuple(range(100, 120))
OTHER = tuple(range(200, 213))


@pytest.fixture
def board():
    b = SharedBoard(BoardShape(slots=4, max_drafts=3, draft_len=8))
    yield b
    b.destroy()


def proposer(board: SharedBoard, k: int = 4, price: bool = False) -> EdgeDraftProposer:
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                          model_config=SimpleNamespace(max_model_len=256),
                          additional_config={CONFIG_KEY: {**board.shape.as_config(board.name), "price": price}})
    return EdgeDraftProposer(cfg, check_kernels=False)


class Batch:
    """vLLM's view of the running requests: token rows, counts, and what each step sampled."""

    def __init__(self, *prompts: tuple[int, ...]) -> None:
        self.ids = np.zeros((8, 256), dtype=np.int32)  # vLLM's token_ids_cpu is int32
        self.n = np.zeros(8, dtype=np.int32)
        for i, p in enumerate(prompts):
            self.ids[i, : len(p)] = p
            self.n[i] = len(p)
        self.rows = len(prompts)

    def step(self, *sampled: list[int]) -> list[list[int]]:
        for i, toks in enumerate(sampled):
            self.ids[i, self.n[i] : self.n[i] + len(toks)] = toks
            self.n[i] += len(toks)
        return [list(s) for s in sampled]


def test_prompt_key_tells_length_and_tokens_apart():
    assert prompt_key(PROMPT) == prompt_key(list(PROMPT)) == prompt_key(np.array(PROMPT, dtype=np.int32))
    assert prompt_key(PROMPT) != prompt_key(PROMPT[:-1])
    assert prompt_key((1, 2)) != prompt_key((2, 1))
    assert prompt_key(()) > 0


def test_a_reader_sees_what_was_published_and_nothing_after_release(board):
    r = BoardReader(board.shape.as_config(board.name))
    try:
        i = board.assign(PROMPT, k_cap=5)
        board.publish(i, [BoardDraft(20, (1, 2, 3)), BoardDraft(21, (7, 8, 9), (0, 1, 1))])
        (v,) = r.snapshot()
        assert (v.slot, v.key, v.prompt_len, v.k_cap) == (i, prompt_key(PROMPT), len(PROMPT), 5)
        assert [(d.base, d.tokens, d.parents) for d in v.drafts] == [(20, (1, 2, 3), None), (21, (7, 8, 9), (0, 1, 1))]
        board.release(i)
        assert r.snapshot() == []
    finally:
        r.close()


def test_a_long_draft_is_cut_to_the_slot_and_only_the_newest_drafts_are_kept(board):
    i = board.assign(PROMPT, k_cap=4)
    board.publish(i, [BoardDraft(20 + j, (j,) * 12) for j in range(5)])
    r = BoardReader(board.shape.as_config(board.name))
    try:
        (v,) = r.snapshot()
        assert [d.base for d in v.drafts] == [22, 23, 24]  # max_drafts 3: the newest
        assert all(len(d.tokens) == 8 for d in v.drafts)  # draft_len 8
    finally:
        r.close()


def test_a_slot_torn_by_a_writer_is_skipped_not_misread(board):
    i = board.assign(PROMPT, k_cap=4)
    board.publish(i, [BoardDraft(20, (1, 2, 3))])
    board.rows[i, 0] += 1  # a writer stopped halfway (odd sequence number)
    r = BoardReader(board.shape.as_config(board.name))
    try:
        assert r.snapshot() == []
        board.rows[i, 0] += 1
        assert len(r.snapshot()) == 1
    finally:
        r.close()


def _write_drafts(name: str, shape: tuple, rounds: int) -> None:
    b = SharedBoard.__new__(SharedBoard)
    from multiprocessing import shared_memory

    from acespec.cloud.vllm_board import _Segment

    _Segment.__init__(b, shared_memory.SharedMemory(name=name), BoardShape(*shape))
    for j in range(rounds):  # every draft's tokens are all equal to its base: a torn read would mix them
        b.publish(0, [BoardDraft(j % 50, (j % 50,) * (1 + j % 8))])
    b.close()


def test_reads_racing_a_writer_in_another_process_are_never_torn(board):
    i = board.assign(PROMPT, k_cap=4)
    assert i == 0
    board.publish(i, [BoardDraft(0, (0,))])
    p = mp.get_context("spawn").Process(target=_write_drafts, args=(board.name, (4, 3, 8), 200_000))
    p.start()
    r = BoardReader(board.shape.as_config(board.name))
    reads = 0
    try:
        while p.is_alive() or reads == 0:
            for v in r.snapshot():
                for d in v.drafts:
                    assert set(d.tokens) == {d.base}, d
                reads += 1
    finally:
        p.join(60)
        r.close()
    assert reads > 10


def test_the_proposer_gives_each_request_its_sessions_agreeing_draft(board):
    prop = proposer(board)
    a = board.assign(PROMPT, k_cap=8)
    board.publish(a, [BoardDraft(20, (5, 6, 7, 8, 9, 10))])
    b = board.assign(OTHER, k_cap=2)
    board.publish(b, [BoardDraft(13, (40, 41, 42))])
    batch = Batch(PROMPT, OTHER, tuple(range(300, 320)))
    props = prop.propose(batch.step([5], [40], [1]), batch.n, batch.ids)
    assert props == [[6, 7, 8, 9], [41, 42], []]  # K 4; the second session's cap is 2; no slot: no proposal
    # vLLM kept 6, 7 and sampled 1 (not 8): the draft disagrees from there; the second took all of its own
    props = prop.propose(batch.step([6, 7, 1], [41, 42, 43], [2]), batch.n, batch.ids)
    assert props == [[], [], []]
    c = board.counters(a)
    assert (c["proposed"], c["accepted"], c["draft_steps"]) == (4, 2, 1)
    assert (board.counters(b)["proposed"], board.counters(b)["accepted"]) == (2, 2)


def test_two_sessions_with_one_prompt_share_their_drafts_harmlessly(board):
    prop = proposer(board)
    a, b = board.assign(PROMPT, 4), board.assign(PROMPT, 4)
    board.publish(a, [BoardDraft(20, (5, 6, 7))])
    board.publish(b, [BoardDraft(20, (9, 8, 7))])
    batch = Batch(PROMPT, PROMPT)
    assert prop.propose(batch.step([5], [9]), batch.n, batch.ids) == [[6, 7], [8, 7]]  # each row walks its own tokens


def test_a_prefill_in_chunks_and_a_full_context_get_no_proposal(board):
    prop = proposer(board)
    board.publish(board.assign(PROMPT, 4), [BoardDraft(20, (5, 6, 7))])
    batch = Batch(PROMPT)
    assert prop.propose([[]], batch.n, batch.ids) == [[]]
    batch.n[0] = 256
    assert prop.propose([[5]], batch.n, batch.ids) == [[]]


def test_the_pricer_starts_at_no_draft_and_learns_what_drafts_earn(board):
    prop = proposer(board, k=4, price=True)
    i = board.assign(PROMPT, 4)
    ref = list(range(1, 60))
    board.publish(i, [BoardDraft(20, tuple(ref))])
    batch = Batch(PROMPT)
    sampled, ks = [ref[0]], []
    at = 1
    for _ in range(12):
        (p,) = prop.propose(batch.step(sampled), batch.n, batch.ids)
        ks.append(len(p))
        assert p == ref[at : at + len(p)]
        sampled = ref[at : at + len(p) + 1]  # vLLM accepts all of it, plus its bonus token
        at += len(sampled)
    assert ks[0] == 0  # a plain step is measured before any draft is priced against it
    assert max(ks) > 0 and board.counters(i)["accepted"] == board.counters(i)["proposed"] > 0


def test_the_proposer_refuses_to_start_without_the_servers_board():
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                          model_config=SimpleNamespace(max_model_len=256), additional_config={})
    with pytest.raises(RuntimeError, match="acespec serve --engine vllm"):
        EdgeDraftProposer(cfg, check_kernels=False)


# -- q rows, for rules that need the drafter's q ----------------------------------------------------
def test_q_rows_ride_the_board_and_reach_the_sampler_with_the_proposal():
    """A draft's sparse q rows go through shared memory with it; the proposer leaves, for the plugin in
    the same worker, exactly the rows of the tokens it proposed, keyed by the session's prompt."""
    from acespec.cloud import vllm_proposer

    b = SharedBoard(BoardShape(slots=2, max_drafts=2, draft_len=8, q_topn=3))
    try:
        prop = proposer(b)
        i = b.assign(PROMPT, k_cap=8)
        q = (((5, 0.5), (9, 0.25), (1, 0.25)), ((6, 1.0),), ((7, 0.75), (2, 0.25)), ((8, 0.6), (3, 0.4)))
        b.publish(i, [BoardDraft(20, (5, 6, 7, 8), q=q)])
        batch = Batch(PROMPT)
        assert prop.propose(batch.step([5]), batch.n, batch.ids) == [[6, 7, 8]]
        toks, rows, slot = vllm_proposer.edge_q[(prompt_key(PROMPT), len(PROMPT))]
        assert toks == (6, 7, 8) and slot == i
        assert [tuple((t, pytest.approx(w)) for t, w in r) for r in rows] == list(q[1:])
        vllm_proposer.q_used(slot)  # the plugin decided that step with them
        assert b.counters(i)["q_used"] == b.counters()["q_used"] == 1
        # a row longer than the board keeps is refused before a word is written: the slot still reads
        with pytest.raises(ValueError, match="keeps 3"):
            b.publish(i, [BoardDraft(20, (5, 6), q=(((5, 0.25), (1, 0.25), (2, 0.25), (3, 0.25)), ((6, 1.0),)))])
        assert BoardReader(b.shape.as_config(b.name)).snapshot()[0].drafts[0].tokens == (5, 6, 7, 8)
        # the next call's proposals replace the last ones (each is verified by the step right after it)
        prop.propose(batch.step([6, 7, 8, 1]), batch.n, batch.ids)
        assert vllm_proposer.edge_q == {}
    finally:
        vllm_proposer._reader = None
        b.destroy()


def test_q_rows_torn_by_a_write_give_no_proposal(monkeypatch):
    """If the server rewrites the slot between the proposer's copy and its read of the q rows, the rows
    may belong to another draft: the proposer proposes nothing that step rather than feed a rule wrong q."""
    from acespec.cloud import vllm_proposer

    b = SharedBoard(BoardShape(slots=2, max_drafts=2, draft_len=8, q_topn=2))
    try:
        prop = proposer(b)
        i = b.assign(PROMPT, k_cap=8)
        b.publish(i, [BoardDraft(20, (5, 6, 7), q=(((5, 1.0),), ((6, 1.0),), ((7, 1.0),)))])
        monkeypatch.setattr(prop.reader, "still", lambda view: False)
        batch = Batch(PROMPT)
        assert prop.propose(batch.step([5]), batch.n, batch.ids) == [[]]
        assert vllm_proposer.edge_q == {}
    finally:
        vllm_proposer._reader = None
        b.destroy()
