"""The cloud does what docs/reference/wire.md says where a client could otherwise only guess.

Over real sockets on 127.0.0.1, against a toy target: a generation with nothing left to generate
(max_tokens 0, or a RESUME at its very end) is answered at once in every mode, rather than leaving the
edge to wait for its own timeout.
"""

from __future__ import annotations

import socket
import threading

import pytest

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.models.toy import ToyModel

V = 64
MODEL_ID = f"toy:vocab={V}"
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
IO_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def cloud():
    with CloudServerThread(ToyModel(vocab=V, seed=1), ServerConfig(port=0)) as srv:
        yield srv


def open_raw(port: int, **hello) -> tuple[socket.socket, wire.FrameDecoder, wire.Welcome]:
    s = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
    dec = wire.FrameDecoder()
    wire.send_frame(s, wire.Hello(model_id=MODEL_ID, prompt=PROMPT, temperature=0.0, rule="greedy", **hello))
    welcome = wire.recv_frame(s, dec)
    assert isinstance(welcome, wire.Welcome), welcome
    return s, dec, welcome


@pytest.mark.parametrize("mode", ["cloud-only", "cloud-led", "sync", "pipelined"])
def test_an_edge_that_asks_for_0_tokens_is_done_at_once_in_every_mode(cloud, mode):
    drafter = None if mode == "cloud-only" else ToyModel(vocab=V, seed=1, noise=0.5, noise_seed=3)
    cfg = EdgeConfig(mode=mode, rule="greedy", max_tokens=0,
                     connect=ConnectConfig(port=cloud.port, reply_timeout_s=10.0, reconnect_attempts=1))
    out: dict = {}
    # in a thread with a deadline: an edge waiting for a FINISHED that never comes times out, RESUMEs, and
    # waits again, for ever
    run = threading.Thread(target=lambda: out.update(res=run_edge(drafter, list(PROMPT), cfg, model_id=MODEL_ID)),
                           daemon=True)
    run.start()
    run.join(3.0)
    assert not run.is_alive(), "the edge waited for a frame the cloud never sent"
    assert out["res"].tokens == []


@pytest.mark.parametrize("mode", [wire.Mode.CLOUD_ONLY, wire.Mode.CLOUD_LED], ids=["cloud-only", "cloud-led"])
def test_a_stream_with_max_tokens_0_gets_an_empty_finished_tokens_frame_right_after_welcome(cloud, mode):
    s, dec, w = open_raw(cloud.port, max_tokens=0, mode=mode)
    with s:
        f = wire.recv_frame(s, dec)
        step = {"drafted": 0} if mode == wire.Mode.CLOUD_LED else {}  # every cloud-led TOKENS frame is a step
        assert f == wire.Tokens(start=len(PROMPT), tokens=(), finished=True, **step)
        wire.send_frame(s, wire.Close())
        assert wire.recv_frame(s, dec) is None  # the edge's CLOSE ends the session; the cloud hangs up


def test_an_edge_led_session_with_max_tokens_0_answers_every_draft_dropped_and_finished(cloud):
    s, dec, w = open_raw(cloud.port, max_tokens=0)
    with s:
        for seq, tokens in enumerate(((), (5, 6))):
            wire.send_frame(s, wire.Draft(session=w.session, seq=seq, base=len(PROMPT), tokens=tokens))
            v = wire.recv_frame(s, dec)
            assert v == wire.Verdict(seq=seq, accepted=0, next_token=0, verify_us=0, committed=len(PROMPT),
                                     dropped=True, finished=True)
        wire.send_frame(s, wire.Close())


@pytest.mark.parametrize("mode", [wire.Mode.CLOUD_ONLY, wire.Mode.CLOUD_LED], ids=["cloud-only", "cloud-led"])
def test_a_stream_resumed_at_its_end_gets_its_finished_frame_again(cloud, mode):
    s, dec, w = open_raw(cloud.port, max_tokens=3, mode=mode)
    committed = list(PROMPT)
    with s:
        while True:
            f = wire.recv_frame(s, dec)
            assert isinstance(f, wire.Tokens) and f.start == len(committed)
            committed += f.tokens
            if f.finished:
                break
    # the connection dropped before the edge's CLOSE: it reconnects at its full length
    s2 = socket.create_connection(("127.0.0.1", cloud.port), timeout=IO_TIMEOUT_S)
    with s2:
        dec2 = wire.FrameDecoder()
        wire.send_frame(s2, wire.Resume(session=w.session, committed=len(committed), secret=w.secret,
                                        digest=wire.committed_digest(committed)))
        again = wire.recv_frame(s2, dec2)
        assert isinstance(again, wire.Welcome) and again.committed == len(committed)
        f = wire.recv_frame(s2, dec2)
        assert isinstance(f, wire.Tokens) and f.tokens == () and f.finished and f.start == len(committed)
        wire.send_frame(s2, wire.Close())
