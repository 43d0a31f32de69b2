"""The cloud server under abuse, and its session lifecycle (idle expiry, RESUME), over real sockets.

Every hostile input (random bytes, truncated frames, oversize length prefixes, wrong protocol
versions, wrong auth, unknown sessions, a DRAFT naming another session, a model mismatch, a bad rule,
over-limit requests, HELLO floods) must get its typed ERROR frame, then CLOSE(ERROR), then the
connection closed, and never disturb anyone else: a well-behaved session started before the abuse
finishes with the correct output. The abuse speaks raw sockets; the well-behaved session is the real
edge runtime. Everything runs on 127.0.0.1 with hard time limits.
"""

from __future__ import annotations

import random
import struct
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig, EdgeError
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop import SpecConfig, generate
from acespec.models.toy import ToyModel
from acespec.net import WanProfile, WanProxyThread
from acespec.wire import ErrorCode

HOST = "127.0.0.1"
TOKEN = b"s3cret-token"
V = 64
MODEL_ID = f"toy:vocab={V}"
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
P = len(PROMPT)
SEED = 5
TEMP = 0.8
MAX_NEW = 100  # the server's max_new_tokens
IO_TIMEOUT_S = 5.0


def toy_target() -> ToyModel:
    return ToyModel(vocab=V, seed=1)


def toy_drafter() -> ToyModel:
    return ToyModel(vocab=V, seed=1, noise=0.7, noise_seed=3)


def reference(max_tokens: int) -> list[int]:
    cfg = SpecConfig(rule="coupled", temperature=TEMP, seed=SEED, max_tokens=max_tokens, spec=False)
    return generate(toy_target(), list(PROMPT), cfg).tokens


def server_config(**kw) -> ServerConfig:
    base = dict(port=0, token=TOKEN, max_sessions=32, max_new_tokens=MAX_NEW, handshake_timeout_s=1.0,
                auth_failures_per_min=0,  # the abuse below fails auth on purpose, many times; one test turns it on
                max_connections_per_addr=64)  # all 39 abuse cases at once come from 127.0.0.1; one test sets a cap
    base.update(kw)
    return ServerConfig(**base)


# ------------------------------------------------------------------------------------------ raw client


def hello(**kw) -> wire.Hello:
    base = dict(model_id=MODEL_ID, max_tokens=20, prompt=PROMPT, auth=TOKEN, temperature=TEMP, rule="coupled",
                seed=SEED)
    base.update(kw)
    return wire.Hello(**base)


def connect(port: int) -> socket.socket:
    s = socket.create_connection((HOST, port), timeout=IO_TIMEOUT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_one(sock: socket.socket, dec: wire.FrameDecoder | None = None):
    """The next frame (blocking, bounded by the socket timeout); None at a clean end of stream."""
    return wire.recv_frame(sock, dec or wire.DEFAULT_LIMITS)


def drain(sock: socket.socket) -> tuple[list, str]:
    """Every frame until the server ends the connection, and how it ended ("eof" or "reset")."""
    dec = wire.FrameDecoder()
    frames: list = []
    deadline = time.monotonic() + IO_TIMEOUT_S
    try:
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"the server kept the connection open; got {frames}")
            data = sock.recv(65536)
            if not data:
                return frames, "eof"
            frames += dec.feed(data)
    except (ConnectionResetError, BrokenPipeError):
        return frames, "reset"
    except socket.timeout:
        raise AssertionError(f"the server neither answered nor closed within {IO_TIMEOUT_S} s; got {frames}")
    finally:
        sock.close()


def assert_refused(sock: socket.socket, *codes: ErrorCode) -> wire.Error:
    """The connection gets ERROR (one of `codes`), then CLOSE(ERROR), then is closed."""
    frames, _ = drain(sock)
    assert len(frames) >= 2, frames
    err, close = frames[-2], frames[-1]
    assert isinstance(err, wire.Error), frames
    assert err.code in codes, f"expected {[c.name for c in codes]}, got {err.code.name}: {err.message}"
    assert close == wire.Close(reason=wire.CloseReason.ERROR)
    return err


def open_session(port: int, **kw) -> tuple[socket.socket, wire.Welcome]:
    s = connect(port)
    wire.send_frame(s, hello(**kw))
    w = recv_one(s)
    assert isinstance(w, wire.Welcome), w
    return s, w


def step(sock: socket.socket, sid: int, seq: int, base: int, tokens=()) -> wire.Verdict:
    wire.send_frame(sock, wire.Draft(session=sid, seq=seq, base=base, tokens=tuple(tokens)))
    v = recv_one(sock)
    assert isinstance(v, wire.Verdict), v
    return v


# ------------------------------------------------------------------------------------------ abuse cases
# Each case: (id, function(port) -> socket with the abuse sent, accepted error codes).


def _send(port: int, data: bytes, *, shut: bool = False) -> socket.socket:
    s = connect(port)
    s.sendall(data)
    if shut:
        s.shutdown(socket.SHUT_WR)
    return s


def _patched_version(frame, version: int) -> bytes:
    data = bytearray(wire.encode(frame))
    data[2] = version  # length prefix (1 byte here), type, then the version byte
    return bytes(data)


def _in_session(port: int, make_bytes) -> socket.socket:
    """Open a session properly, then send make_bytes(welcome)."""
    s, w = open_session(port)
    s.sendall(make_bytes(w))
    return s


HELLO_BYTES = wire.encode(hello())
BIG_LIMITS = wire.Limits(max_draft_tokens=1000)

ABUSE = [
    ("random-frame-unknown-type", lambda p: _send(p, bytes([5, 0xEE, 1, 2, 3, 4])), (ErrorCode.BAD_FRAME,)),
    ("random-bytes-then-eof", lambda p: _send(p, random.Random(1).randbytes(40), shut=True),
     tuple(ErrorCode)),
    ("zero-length-frame", lambda p: _send(p, b"\x00"), (ErrorCode.BAD_FRAME,)),
    ("truncated-hello-then-eof", lambda p: _send(p, HELLO_BYTES[:-3], shut=True), (ErrorCode.BAD_FRAME,)),
    ("truncated-hello-then-silence", lambda p: _send(p, HELLO_BYTES[:-3]), (ErrorCode.BAD_REQUEST,)),
    ("nothing-then-silence", lambda p: _send(p, b""), (ErrorCode.BAD_REQUEST,)),
    ("oversize-length-prefix-4GB", lambda p: _send(p, wire.encode_uvarint(1 << 32) + b"\x01" * 64),
     (ErrorCode.OVER_LIMIT,)),
    ("length-prefix-one-over-the-limit",
     lambda p: _send(p, wire.encode_uvarint(wire.DEFAULT_LIMITS.max_frame_bytes + 1) + b"\x01"),
     (ErrorCode.OVER_LIMIT,)),
    ("non-minimal-length-prefix", lambda p: _send(p, b"\x85\x00" + HELLO_BYTES[1:]), (ErrorCode.BAD_FRAME,)),
    ("hello-protocol-version-1", lambda p: _send(p, _patched_version(hello(), 1)), (ErrorCode.BAD_VERSION,)),
    ("hello-protocol-version-2", lambda p: _send(p, _patched_version(hello(), 2)), (ErrorCode.BAD_VERSION,)),
    ("hello-protocol-version-4", lambda p: _send(p, _patched_version(hello(), 4)), (ErrorCode.BAD_VERSION,)),
    ("hello-protocol-version-0", lambda p: _send(p, _patched_version(hello(), 0)), (ErrorCode.BAD_VERSION,)),
    ("resume-protocol-version-9",
     lambda p: _send(p, _patched_version(wire.Resume(session=1, committed=P, auth=TOKEN), 9)),
     (ErrorCode.BAD_VERSION,)),
    ("hello-wrong-auth", lambda p: _send(p, wire.encode(hello(auth=b"guess"))), (ErrorCode.BAD_AUTH,)),
    ("hello-no-auth", lambda p: _send(p, wire.encode(hello(auth=b""))), (ErrorCode.BAD_AUTH,)),
    ("resume-wrong-auth",
     lambda p: _send(p, wire.encode(wire.Resume(session=1, committed=P, auth=b"guess"))), (ErrorCode.BAD_AUTH,)),
    ("resume-unknown-session",
     lambda p: _send(p, wire.encode(wire.Resume(session=987654, committed=P, auth=TOKEN))),
     (ErrorCode.UNKNOWN_SESSION,)),
    ("draft-naming-another-session",
     lambda p: _in_session(p, lambda w: wire.encode(wire.Draft(session=w.session + 1000, seq=0, base=P, tokens=(1,)))),
     (ErrorCode.UNKNOWN_SESSION,)),
    ("hello-model-mismatch", lambda p: _send(p, wire.encode(hello(model_id="toy:vocab=65"))),
     (ErrorCode.MODEL_MISMATCH,)),
    ("hello-unknown-rule", lambda p: _send(p, wire.encode(hello(rule="no-such-rule"))), (ErrorCode.BAD_REQUEST,)),
    ("hello-bad-rule-parameter", lambda p: _send(p, wire.encode(hello(rule="cactus:delta=banana"))),
     (ErrorCode.BAD_REQUEST,)),
    ("hello-bad-top-p", lambda p: _send(p, wire.encode(hello(top_p=0.0))), (ErrorCode.BAD_REQUEST,)),
    ("hello-over-limit-max-tokens", lambda p: _send(p, wire.encode(hello(max_tokens=MAX_NEW + 1))),
     (ErrorCode.OVER_LIMIT,)),
    ("hello-prompt-outside-vocab", lambda p: _send(p, wire.encode(hello(prompt=(1, V + 5)))),
     (ErrorCode.OVER_LIMIT,)),
    ("hello-empty-prompt", lambda p: _send(p, wire.encode(hello(prompt=()))), (ErrorCode.BAD_REQUEST,)),
    ("first-frame-is-a-draft",
     lambda p: _send(p, wire.encode(wire.Draft(session=1, seq=0, base=P, tokens=(1,)))), (ErrorCode.BAD_REQUEST,)),
    ("first-frame-is-a-ping", lambda p: _send(p, wire.encode(wire.Ping(nonce=1, sent_us=2))),
     (ErrorCode.BAD_REQUEST,)),
    ("draft-before-welcome",
     lambda p: _send(p, HELLO_BYTES + wire.encode(wire.Draft(session=1, seq=0, base=P, tokens=(1,)))),
     (ErrorCode.BAD_REQUEST,)),
    ("strict-draft-without-q",
     lambda p: _in_session_with(p, dict(rule="strict"),
                                lambda w: wire.encode(wire.Draft(session=w.session, seq=0, base=P, tokens=(1, 2)))),
     (ErrorCode.BAD_REQUEST,)),
    ("draft-token-outside-vocab",
     lambda p: _in_session(p, lambda w: wire.encode(wire.Draft(session=w.session, seq=0, base=P, tokens=(V,)))),
     (ErrorCode.OVER_LIMIT,)),
    ("draft-over-max-draft-tokens",
     lambda p: _in_session(p, lambda w: wire.encode(
         wire.Draft(session=w.session, seq=0, base=P, tokens=(1,) * 65), BIG_LIMITS)),
     (ErrorCode.OVER_LIMIT,)),
    ("garbage-mid-session", lambda p: _in_session(p, lambda w: bytes([3, 0x7F, 0, 0])), (ErrorCode.BAD_FRAME,)),
    ("q-row-token-outside-vocab",
     lambda p: _in_session_with(p, dict(rule="strict"), lambda w: wire.encode(
         wire.Draft(session=w.session, seq=0, base=P, tokens=(1,), q=(((1, 0.5), (V, 0.5)),)))),
     (ErrorCode.OVER_LIMIT,)),
    ("draft-with-a-tree",
     lambda p: _in_session(p, lambda w: wire.encode(
         wire.Draft(session=w.session, seq=0, base=P, tokens=(1, 2, 3), parents=(0, 0, 1)))),
     (ErrorCode.BAD_REQUEST,)),
    ("hello-rule-delta-nan", lambda p: _send(p, wire.encode(hello(rule="cactus:delta=nan"))), (ErrorCode.BAD_REQUEST,)),
    ("hello-rule-delta-inf", lambda p: _send(p, wire.encode(hello(rule="cactus:delta=inf"))), (ErrorCode.BAD_REQUEST,)),
    ("hello-rule-typical-negative", lambda p: _send(p, wire.encode(hello(rule="typical:eps=-5,delta=-1"))),
     (ErrorCode.BAD_REQUEST,)),
    ("resume-v1-layout", lambda p: _send(p, bytes([5, 5, 1, 0]) + wire.encode_uvarint(1) + wire.encode_uvarint(P)),
     (ErrorCode.BAD_VERSION,)),
    ("welcome-sent-to-the-server",
     lambda p: _in_session(p, lambda w: wire.encode(wire.Welcome(session=w.session, committed=P, max_draft_tokens=4))),
     (ErrorCode.BAD_REQUEST,)),
]


def _in_session_with(port: int, hello_kw: dict, make_bytes) -> socket.socket:
    s, w = open_session(port, **hello_kw)
    s.sendall(make_bytes(w))
    return s


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cloud():
    with CloudServerThread(toy_target(), server_config()) as srv:
        yield srv


def check_alive(srv: CloudServerThread) -> None:
    """A fresh, honest session still works end to end."""
    s, w = open_session(srv.port)
    v = step(s, w.session, 0, w.committed)
    assert v.committed == P + 1 and not v.dropped
    wire.send_frame(s, wire.Close())
    s.close()


# ------------------------------------------------------------------------------------------ abuse


@pytest.mark.parametrize("make,codes", [pytest.param(m, c, id=i) for i, m, c in ABUSE])
def test_each_abuse_gets_its_typed_error_and_a_close(cloud, make, codes):
    before = sum(cloud.server.errors_sent.values())
    err = assert_refused(make(cloud.port), *codes)
    assert err.message  # says what was wrong
    assert cloud.server.errors_sent.get(err.code.name, 0) >= 1
    assert sum(cloud.server.errors_sent.values()) == before + 1
    check_alive(cloud)


def test_random_garbage_never_takes_the_server_down(cloud):
    rng = random.Random(7)
    for i in range(40):
        data = rng.randbytes(rng.randrange(1, 300))
        s = _send(cloud.port, data, shut=True)
        frames, _ = drain(s)
        # junk is never a valid HELLO or RESUME: it always ends in ERROR + CLOSE
        assert len(frames) == 2, (i, frames)
        assert isinstance(frames[0], wire.Error) and frames[1] == wire.Close(reason=wire.CloseReason.ERROR), (i, frames)
    check_alive(cloud)


def test_well_behaved_session_survives_all_the_abuse(cloud):
    """An edge session started before the abuse, slowed by an 80 ms RTT so it spans all of it, finishes
    with exactly the reference output while every abuse case, all at once, is refused around it."""
    n = 60
    with WanProxyThread(HOST, 0, HOST, cloud.port, WanProfile(rtt_ms=80, seed=1)) as proxy:
        cfg = EdgeConfig(mode="sync", rule="coupled", k=1, temperature=TEMP, seed=SEED, max_tokens=n,
                         connect=ConnectConfig(host=HOST, port=proxy.port, token=TOKEN, reply_timeout_s=10.0))
        streamed: list[int] = []
        out: dict = {}

        def body():
            try:
                out["res"] = run_edge(toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID, on_tokens=streamed.extend)
            except BaseException as e:  # noqa: BLE001
                out["error"] = e

        t = threading.Thread(target=body, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not streamed and time.monotonic() < deadline:
            time.sleep(0.005)
        assert streamed, "the well-behaved session never started"
        with ThreadPoolExecutor(max_workers=len(ABUSE)) as pool:
            refusals = [pool.submit(lambda m=make, c=codes: assert_refused(m(cloud.port), *c)) for _, make, codes in ABUSE]
            for f in refusals:
                f.result(timeout=10)
        during = t.is_alive()
        t.join(30)
        assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    assert during, "the session should still have been running when the last refusal came back"
    res = out["res"]
    assert res.tokens == reference(n)
    assert streamed == res.tokens
    assert res.stats.link["reconnects"] == 0
    check_alive(cloud)


def test_hello_flood_gets_busy_and_the_running_session_completes():
    n = 30
    with CloudServerThread(toy_target(), server_config(max_sessions=4, resume_grace_s=60.0)) as srv:
        with WanProxyThread(HOST, 0, HOST, srv.port, WanProfile(rtt_ms=40, seed=2)) as proxy:
            cfg = EdgeConfig(mode="pipelined", rule="coupled", k=2, temperature=TEMP, seed=SEED, max_tokens=n,
                             connect=ConnectConfig(host=HOST, port=proxy.port, token=TOKEN, reply_timeout_s=10.0))
            out: dict = {}
            started = threading.Event()
            t = threading.Thread(
                target=lambda: out.setdefault("res", run_edge(
                    toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID, on_tokens=lambda _: started.set())),
                daemon=True,
            )
            t.start()
            assert started.wait(10)
            held, busy = [], 0
            for _ in range(12):  # 3 more sessions fit next to the running one; the rest are refused
                s = connect(srv.port)
                wire.send_frame(s, hello())
                f = recv_one(s)
                if isinstance(f, wire.Welcome):
                    held.append(s)
                else:
                    assert isinstance(f, wire.Error) and f.code == ErrorCode.BUSY, f
                    assert recv_one(s) == wire.Close(reason=wire.CloseReason.ERROR)
                    assert recv_one(s) is None  # closed
                    s.close()
                    busy += 1
            assert len(held) == 3 and busy == 9
            assert srv.server.errors_sent.get("BUSY") == 9
            t.join(30)
            assert not t.is_alive()
        assert out["res"].tokens == reference(n)
        # a session that ends with CLOSE frees its slot at once
        wire.send_frame(held[0], wire.Close())
        assert recv_one(held[0]) is None
        deadline = time.monotonic() + 5
        while len(srv.server.sessions) > 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        s, _ = open_session(srv.port)
        for h in held + [s]:
            h.close()


# ------------------------------------------------------------------------------------------ lifecycle


def test_idle_sessions_expire():
    with CloudServerThread(toy_target(), server_config(idle_timeout_s=0.4, resume_grace_s=0.8)) as srv:
        # connected but silent: CLOSE(IDLE), the connection closed, the session gone
        s, w = open_session(srv.port)
        t0 = time.monotonic()
        assert recv_one(s) == wire.Close(reason=wire.CloseReason.IDLE)
        assert recv_one(s) is None
        assert 0.2 <= time.monotonic() - t0 < 3.0
        s.close()
        assert w.session not in srv.server.sessions
        assert_refused(_send(srv.port, wire.encode(resume_frame(w, PROMPT))),
                       ErrorCode.UNKNOWN_SESSION)

        # disconnected without CLOSE: RESUME works within the grace period...
        s, w = open_session(srv.port)
        v = step(s, w.session, 0, P)
        s.close()
        time.sleep(0.05)
        r, w2 = _resume(srv.port, w, PROMPT + (v.next_token,))
        assert w2.committed == v.committed
        r.close()
        # ...and not after it
        time.sleep(2.0)
        assert w.session not in srv.server.sessions
        assert_refused(_send(srv.port, wire.encode(resume_frame(w, PROMPT))),
                       ErrorCode.UNKNOWN_SESSION)

        # a session with traffic does not expire
        s, w = open_session(srv.port)
        for i in range(10):
            wire.send_frame(s, wire.Ping(nonce=i, sent_us=i))
            assert recv_one(s) == wire.Pong(nonce=i, sent_us=i)
            time.sleep(0.1)
        v = step(s, w.session, 0, P)
        assert v.committed == P + 1
        s.close()


def resume_frame(w: wire.Welcome, tokens, **kw) -> wire.Resume:
    """The RESUME an honest edge sends: the WELCOME's session and secret, and its committed tokens."""
    base = dict(session=w.session, committed=len(tokens), auth=TOKEN, secret=w.secret,
                digest=wire.committed_digest(tokens))
    base.update(kw)
    return wire.Resume(**base)


def _resume(port: int, w: wire.Welcome, tokens, **kw) -> tuple[socket.socket, wire.Welcome]:
    s = connect(port)
    wire.send_frame(s, resume_frame(w, tokens, **kw))
    w2 = recv_one(s)
    assert isinstance(w2, wire.Welcome), w2
    assert w2.session == w.session and w2.secret == w.secret
    return s, w2


def test_resume_after_disconnect_continues_the_same_session(cloud):
    n = 12
    ref = reference(n)
    s, w = open_session(cloud.port, max_tokens=n)
    sid = w.session
    got: list[int] = []
    seq = 0
    # three plain target steps (empty drafts), then the connection dies without a CLOSE
    for _ in range(3):
        v = step(s, sid, seq, P + len(got))
        got.append(v.next_token)
        seq += 1
    s.close()

    # the edge saw all three verdicts: resume where it is
    s, w2 = _resume(cloud.port, w, PROMPT + tuple(got))
    assert w2.committed == P + 3
    v = step(s, sid, seq, P + 3, [ref[3], ref[4]])  # drafts the right tokens: both accepted
    assert (v.accepted, v.dropped) == (2, False)
    got += [ref[3], ref[4], v.next_token]
    seq += 1
    s.close()

    # the edge lost the last verdict: resume from what it saw; the cloud rolls back and, with
    # coupled sampling, regenerates the same tokens
    s, w3 = _resume(cloud.port, w, PROMPT + tuple(got[:5]))
    assert w3.committed == P + 5
    got = got[:5]
    while True:
        v = step(s, sid, seq, P + len(got))
        seq += 1
        got.append(v.next_token)
        if v.finished:
            break
    assert got == ref
    s.close()

    # RESUME past what the cloud committed is refused; the session survives it
    assert_refused(_send(cloud.port, wire.encode(resume_frame(w, PROMPT + tuple(got) + (1,)))), ErrorCode.BAD_REQUEST)
    # so is a RESUME whose tokens differ from the session's, at a length the session has
    assert_refused(_send(cloud.port, wire.encode(resume_frame(w, PROMPT + tuple(got[:-1]) + ((got[-1] + 1) % V,)))),
                   ErrorCode.BAD_REQUEST)
    s, w4 = _resume(cloud.port, w, PROMPT + tuple(got))
    assert w4.committed == P + n
    # CLOSE ends the session for good
    wire.send_frame(s, wire.Close())
    assert recv_one(s) is None
    s.close()
    deadline = time.monotonic() + 5
    while sid in cloud.server.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_refused(_send(cloud.port, wire.encode(resume_frame(w, PROMPT))),
                   ErrorCode.UNKNOWN_SESSION)


def test_resume_takes_over_a_connection_the_server_still_thinks_alive(cloud):
    """An edge that reconnects before the cloud noticed its old connection die (a silent path) is
    not refused: the old connection is closed and the session continues on the new one."""
    s_old, w = open_session(cloud.port)
    v = step(s_old, w.session, 0, P)
    s_new, w2 = _resume(cloud.port, w, PROMPT + (v.next_token,))  # s_old is still open
    assert w2.committed == v.committed
    frames, _ = drain(s_old)  # the server dropped the old connection
    assert not any(isinstance(f, wire.Verdict) for f in frames)
    v2 = step(s_new, w.session, 1, v.committed)
    assert v2.committed == v.committed + 1
    wire.send_frame(s_new, wire.Close())
    s_new.close()


def test_edge_reports_refusals_as_typed_errors(cloud):
    """The edge runtime surfaces a refusal as EdgeError with the cloud's ErrorCode."""
    cfg = EdgeConfig(mode="sync", rule="coupled", k=2, temperature=TEMP, seed=SEED, max_tokens=5,
                     connect=ConnectConfig(host=HOST, port=cloud.port, token=b"wrong"))
    with pytest.raises(EdgeError) as e:
        run_edge(toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID)
    assert e.value.code == ErrorCode.BAD_AUTH
    cfg.connect.token = TOKEN
    with pytest.raises(EdgeError) as e:
        run_edge(toy_drafter(), list(PROMPT), cfg, model_id="toy:vocab=65")
    assert e.value.code == ErrorCode.MODEL_MISMATCH


@pytest.mark.parametrize("mode", ["cloud-only", "sync", "pipelined"])
def test_finished_sessions_free_their_slots(mode):
    """A session that ran to the end and was closed by the edge no longer holds a slot: many sessions
    one after another fit a server with room for two."""
    with CloudServerThread(toy_target(), server_config(max_sessions=2)) as srv:
        cfg = EdgeConfig(mode=mode, rule="coupled", k=3, temperature=TEMP, seed=SEED, max_tokens=8,
                         connect=ConnectConfig(host=HOST, port=srv.port, token=TOKEN, reply_timeout_s=10.0))
        for _ in range(6):
            res = run_edge(None if mode == "cloud-only" else toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID)
            assert res.tokens == reference(8)
        deadline = time.monotonic() + 5
        while srv.server.sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not srv.server.sessions


def test_prompt_is_prefilled_when_the_session_opens():
    """The cloud prefills the prompt on HELLO, before any DRAFT, so its prefill overlaps the edge's
    drafter prefill; the first verify then evaluates only the last prompt token and the block, and
    the output is unchanged."""
    target = toy_target()
    with CloudServerThread(target, server_config()) as srv:
        s, w = open_session(srv.port, max_tokens=6)
        deadline = time.monotonic() + IO_TIMEOUT_S
        while target.tokens != list(PROMPT[:-1]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert target.tokens == list(PROMPT[:-1]), "no prefill before the first DRAFT"
        calls = target.eval_calls
        ref = reference(6)
        v = step(s, w.session, 0, P, ref[:3])
        assert (v.accepted, v.next_token) == (3, ref[3])
        assert target.eval_calls == calls + 1  # one pass: the prompt was already in place
        wire.send_frame(s, wire.Close())
        s.close()


def test_drafter_prefill_failure_during_the_handshake_is_reported(cloud):
    """The edge prefills its drafter while HELLO is in flight; a drafter that cannot hold the prompt
    fails with its own typed error (not a hang), and the server keeps serving."""
    from acespec.models.base import ContextOverflowError

    small = ToyModel(vocab=V, seed=1, noise=0.7, noise_seed=3, n_ctx=P - 2)
    cfg = EdgeConfig(mode="pipelined", rule="coupled", temperature=TEMP, seed=SEED, max_tokens=8,
                     connect=ConnectConfig(port=cloud.port, token=TOKEN))
    with pytest.raises(ContextOverflowError):
        run_edge(small, list(PROMPT), cfg, model_id=MODEL_ID)
    check_alive(cloud)


# ------------------------------------------------------------------------------------------ no stuck slots


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), the way a crashed or cut-off client goes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_after_8_abandoned_hellos_a_new_client_is_served_within_the_resume_grace():
    """8 clients take every slot with HELLO and vanish with a reset. A new edge gets BUSY, backs off
    and retries, and is served once the resume grace that was set (0.5 s here, `--resume-grace`) has
    freed the slots; its text is the reference text."""
    with CloudServerThread(toy_target(), server_config(max_sessions=8, resume_grace_s=0.5)) as srv:
        for _ in range(8):
            s, _w = open_session(srv.port)
            _reset(s)
        assert len(srv.server.sessions) == 8  # every slot held, waiting for a RESUME
        s = connect(srv.port)
        wire.send_frame(s, hello())
        f = recv_one(s)
        assert isinstance(f, wire.Error) and f.code == ErrorCode.BUSY, f
        s.close()
        cfg = EdgeConfig(mode="pipelined", rule="coupled", k=3, temperature=TEMP, seed=SEED, max_tokens=20,
                         connect=ConnectConfig(host=HOST, port=srv.port, token=TOKEN, busy_retry_s=30.0, backoff_max_s=0.2))
        res = run_edge(toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID)
        assert res.tokens == reference(20)
        assert res.stats.link["busy_waits"] >= 1  # it was refused BUSY first and waited, not failed


def test_hellos_reset_before_their_welcome_leave_no_session_behind():
    """8 clients send HELLO and reset at once, before their WELCOME can be written. A session whose
    WELCOME never went out must not stay "connected" (it would hold its slot until the idle timeout,
    300 s here): none is, and a newcomer is served. (Where the event loop reports the failed WELCOME
    write only after it returned, the session is parked for a RESUME like any other whose edge went
    away: it holds its slot for the resume grace, 1 s here, and the newcomer's BUSY retries wait it out.)"""
    with CloudServerThread(toy_target(), server_config(max_sessions=8, idle_timeout_s=300.0, resume_grace_s=1.0)) as srv:
        for _ in range(8):
            s = connect(srv.port)
            s.sendall(wire.encode(hello()))
            _reset(s)
        deadline = time.monotonic() + IO_TIMEOUT_S
        while (srv.server.sessions or srv.server._conns) and time.monotonic() < deadline:
            time.sleep(0.01)
        stuck = [x for x in srv.server.sessions.values() if x.connected]
        assert not stuck, f"{len(stuck)} sessions still count as connected with no connection"
        # (a HELLO read after its RST may also have been dropped unread; either way no slot is held)
        cfg = EdgeConfig(mode="sync", rule="coupled", k=3, temperature=TEMP, seed=SEED, max_tokens=10,
                         connect=ConnectConfig(host=HOST, port=srv.port, token=TOKEN, busy_retry_s=15.0, backoff_max_s=0.2))
        assert run_edge(toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID).tokens == reference(10)


def test_the_edge_gives_up_on_busy_after_busy_retry_s():
    with CloudServerThread(toy_target(), server_config(max_sessions=1)) as srv:
        held, _w = open_session(srv.port)
        cfg = EdgeConfig(mode="sync", rule="coupled", k=2, temperature=TEMP, seed=SEED, max_tokens=5,
                         connect=ConnectConfig(host=HOST, port=srv.port, token=TOKEN, busy_retry_s=0.3, backoff_s=0.05))
        with pytest.raises(EdgeError) as e:
            run_edge(toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID)
        assert e.value.code == ErrorCode.BUSY
        assert srv.server.errors_sent["BUSY"] >= 2  # retried before giving up
        held.close()


def test_a_replica_going_away_answers_a_hello_busy_so_the_edge_opens_elsewhere():
    """A HELLO that reaches a replica after its stop began (draining), or after its engine stopped,
    is refused BUSY, which sends a fleet edge to another replica; never INTERNAL, which ends the run."""
    import asyncio

    with CloudServerThread(toy_target(), server_config()) as srv:
        srv.server.draining = True
        s = connect(srv.port)
        wire.send_frame(s, hello())
        f = recv_one(s)
        assert isinstance(f, wire.Error) and f.code == ErrorCode.BUSY and "draining" in f.message, f
        s.close()
        srv.server.draining = False
        asyncio.run_coroutine_threadsafe(srv.server.engine.stop(), srv._loop).result(10)
        s = connect(srv.port)
        wire.send_frame(s, hello())
        f = recv_one(s)
        assert isinstance(f, wire.Error) and f.code == ErrorCode.BUSY, f
        s.close()
        assert srv.server.errors_sent["BUSY"] == 2 and not srv.server.errors_sent.get("INTERNAL")


def test_a_replica_going_away_answers_a_resume_busy_and_a_stream_going_away():
    """An edge whose connection dropped as its replica drained RESUMEs: the session dies with the
    replica, so the answer is BUSY (the edge carries its text to another) whether the drain has begun
    or the engine has already stopped; a cloud-only stream whose engine stops under it is told
    GOING_AWAY. INTERNAL, which ends the edge's run, was the answer to both (CI, fleet bench)."""
    import asyncio

    from paced_toy import PassCostToy

    # each pass takes 20 ms, so the stream below is still going when the engine stops
    with CloudServerThread(PassCostToy(vocab=V, seed=1, pass_s=0.02), server_config()) as srv:
        s, w = open_session(srv.port)
        v = step(s, w.session, 0, P)
        s.close()
        toks = list(PROMPT) + [v.next_token]
        deadline = time.monotonic() + IO_TIMEOUT_S
        while srv.server.sessions[w.session].connected and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.server.draining = True
        r = connect(srv.port)
        wire.send_frame(r, resume_frame(w, toks))
        f = recv_one(r)
        assert isinstance(f, wire.Error) and f.code == ErrorCode.BUSY and "draining" in f.message, f
        r.close()
        srv.server.draining = False
        stream, _ = open_session(srv.port, mode=wire.Mode.CLOUD_ONLY, max_tokens=MAX_NEW)
        assert isinstance(recv_one(stream), wire.Tokens)
        asyncio.run_coroutine_threadsafe(srv.server.engine.stop(), srv._loop).result(10)
        r = connect(srv.port)
        wire.send_frame(r, resume_frame(w, toks))
        f = recv_one(r)
        assert isinstance(f, wire.Error) and f.code == ErrorCode.BUSY and "stopping" in f.message, f
        r.close()
        frames, _how = drain(stream)
        assert frames and frames[-1] == wire.Close(reason=wire.CloseReason.GOING_AWAY), frames[-3:]
        assert not any(isinstance(x, wire.Error) for x in frames), frames[-3:]
        assert not srv.server.errors_sent.get("INTERNAL"), srv.server.errors_sent


def test_a_half_frame_after_the_handshake_is_dropped_at_the_frame_deadline():
    """Mid-session, a peer that starts a frame and stalls is refused once `frame_timeout_s` passes,
    not left to the (here 300 s) idle sweep, and its session waits for a RESUME as after any drop."""
    with CloudServerThread(toy_target(), server_config(frame_timeout_s=0.3, idle_timeout_s=300.0)) as srv:
        s, w = open_session(srv.port)
        data = wire.encode(wire.Draft(session=w.session, seq=0, base=P, tokens=(1, 2, 3)))
        s.sendall(data[:-2])
        err = assert_refused(s, ErrorCode.BAD_FRAME)
        assert "not completed" in err.message
        deadline = time.monotonic() + IO_TIMEOUT_S
        while srv.server.sessions[w.session].connected and time.monotonic() < deadline:
            time.sleep(0.01)
        r, w2 = _resume(srv.port, w, PROMPT)
        assert w2.committed == P
        r.close()


def test_connection_limits_per_address_and_in_total():
    with CloudServerThread(toy_target(), server_config(max_connections_per_addr=2, max_connections=3,
                                                       handshake_timeout_s=10.0)) as srv:
        a, b = connect(srv.port), connect(srv.port)
        assert_refused(connect(srv.port), ErrorCode.BUSY)  # a third from 127.0.0.1
        other = socket.socket()
        other.bind(("127.0.0.2", 0))  # another address (all of 127/8 is loopback on Linux)
        other.settimeout(IO_TIMEOUT_S)
        other.connect((HOST, srv.port))
        c = socket.socket()
        c.bind(("127.0.0.3", 0))
        c.settimeout(IO_TIMEOUT_S)
        c.connect((HOST, srv.port))
        assert_refused(c, ErrorCode.BUSY)  # the fourth in total
        # the held connections still work, and a slot frees when one closes
        wire.send_frame(other, hello())
        assert isinstance(recv_one(other), wire.Welcome)
        a.close()
        deadline = time.monotonic() + IO_TIMEOUT_S
        while len(srv.server._conns) > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        s, _w = open_session(srv.port)
        for x in (b, other, s):
            x.close()


def test_two_concurrent_resumes_of_one_session_the_loser_gets_an_error():
    """The first RESUME is held up in the engine (its rollback queues behind a pass that waits on a
    gate); a second RESUME of the same session meanwhile is refused with an ERROR instead of also
    being told a committed length the first may roll back. The winner then continues."""
    gate = threading.Event()
    gate.set()

    class GatedToy(ToyModel):
        def _eval(self, new, want):
            assert gate.wait(30), "the gate never opened"
            return super()._eval(new, want)

    with CloudServerThread(GatedToy(vocab=V, seed=1), server_config()) as srv:
        s, w = open_session(srv.port)
        v = step(s, w.session, 0, P)
        tokens = PROMPT + (v.next_token,)
        gate.clear()
        wire.send_frame(s, wire.Draft(session=w.session, seq=1, base=v.committed, tokens=()))  # stuck at the gate
        first = connect(srv.port)
        wire.send_frame(first, resume_frame(w, tokens))
        deadline = time.monotonic() + IO_TIMEOUT_S
        while not srv.server.sessions[w.session].in_handshake and time.monotonic() < deadline:
            time.sleep(0.005)
        assert srv.server.sessions[w.session].in_handshake
        second = connect(srv.port)
        wire.send_frame(second, resume_frame(w, tokens))
        err = assert_refused(second, ErrorCode.BUSY)
        assert "being resumed" in err.message
        gate.set()
        w2 = recv_one(first)
        assert isinstance(w2, wire.Welcome) and w2.committed == len(tokens)
        v2 = step(first, w.session, 2, len(tokens))
        assert v2.committed == len(tokens) + 1
        s.close()
        first.close()


# ------------------------------------------------------------------------------------------ credentials


def _tenant_server(**kw):
    return CloudServerThread(toy_target(), server_config(token=None, tenants={"alice": b"alice-key", "bob": b"bob-key"}, **kw))


def test_a_session_cannot_be_read_or_rolled_back_without_its_secret():
    """Alice's session, a few tokens in. Every RESUME that lacks its secret (no secret, a guessed one,
    the right secret with another tenant's token, or Alice's own token with a wrong secret) gets the
    same UNKNOWN_SESSION as a session that does not exist: it learns no committed length, no token,
    and rolls nothing back. A DRAFT naming her session from another session's connection is refused
    too. Alice's session goes on untouched to the reference text."""
    n = 12
    with _tenant_server() as srv:
        s, w = open_session(srv.port, auth=b"alice-key", max_tokens=n)
        got: list[int] = []
        for seq in range(4):
            v = step(s, w.session, seq, P + len(got))
            got.append(v.next_token)
        tokens = PROMPT + tuple(got)
        attempts = [
            dict(auth=b"alice-key", secret=b""),
            dict(auth=b"alice-key", secret=bytes(32)),
            dict(auth=b"alice-key", secret=w.secret[:-1] + bytes([w.secret[-1] ^ 1])),
            dict(auth=b"bob-key", secret=w.secret),  # a stolen secret, but another tenant
            dict(auth=b"alice-key", secret=w.secret[:16]),
        ]
        unknown = assert_refused(_send(srv.port, wire.encode(resume_frame(w, PROMPT, session=w.session ^ 1, auth=b"alice-key"))),
                                 ErrorCode.UNKNOWN_SESSION)
        for kw in attempts:
            for committed in (PROMPT, tokens):  # rolling back to the prompt, or reading where it is
                err = assert_refused(_send(srv.port, wire.encode(resume_frame(w, committed, **kw))), ErrorCode.UNKNOWN_SESSION)
                assert err.message.replace(str(w.session), "#") == unknown.message.replace(str(w.session ^ 1), "#")
        assert srv.server.sessions[w.session].verifier.committed == len(tokens)
        assert srv.server.sessions[w.session].connected
        # bob's own session cannot drive alice's
        b, wb = open_session(srv.port, auth=b"bob-key")
        b.sendall(wire.encode(wire.Draft(session=w.session, seq=0, base=len(tokens), tokens=())))
        assert_refused(b, ErrorCode.UNKNOWN_SESSION)
        seq = 4
        while True:
            v = step(s, w.session, seq, P + len(got))
            seq += 1
            got.append(v.next_token)
            if v.finished:
                break
        assert got == reference(n)
        # and with the secret (and her own token) alice can resume
        s.close()
        r, w2 = _resume(srv.port, w, PROMPT + tuple(got), auth=b"alice-key")
        assert w2.committed == P + n
        r.close()


def test_tenant_tokens_open_sessions_and_others_are_refused():
    with _tenant_server() as srv:
        a, wa = open_session(srv.port, auth=b"alice-key")
        b, wb = open_session(srv.port, auth=b"bob-key")
        assert srv.server.sessions[wa.session].tenant == "alice" and srv.server.sessions[wb.session].tenant == "bob"
        assert_refused(_send(srv.port, wire.encode(hello(auth=b"mallory"))), ErrorCode.BAD_AUTH)
        assert_refused(_send(srv.port, wire.encode(hello(auth=TOKEN))), ErrorCode.BAD_AUTH)
        a.close()
        b.close()


def test_session_ids_are_not_sequential_and_secrets_differ():
    with CloudServerThread(toy_target(), server_config()) as srv:
        welcomes = []
        for _ in range(12):
            s, w = open_session(srv.port)
            welcomes.append(w)
            wire.send_frame(s, wire.Close())
            s.close()
    ids = [w.session for w in welcomes]
    assert not all(b == a + 1 for a, b in zip(ids, ids[1:]))
    assert all(0 < i < 1 << 21 for i in ids)
    assert len({w.secret for w in welcomes}) == 12 and all(len(w.secret) == 32 for w in welcomes)


def test_failed_auth_is_rate_limited_per_address():
    """After `auth_failures_per_min` failures, that address is refused even with the right token;
    another address is not."""
    with CloudServerThread(toy_target(), server_config(auth_failures_per_min=3)) as srv:
        for _ in range(2):
            assert_refused(_send(srv.port, wire.encode(hello(auth=b"guess"))), ErrorCode.BAD_AUTH)
        # a RESUME of an id this server does not hold is what honest edges send after a restart or
        # through a balancer: the same answer, but no failure counted
        for _ in range(5):
            assert_refused(_send(srv.port, wire.encode(wire.Resume(session=1 << 22, committed=P, auth=TOKEN, secret=b"x"))),
                           ErrorCode.UNKNOWN_SESSION)
        s0, _ = open_session(srv.port)  # not refused: those five counted nothing
        s0.close()
        live, w = open_session(srv.port)
        assert_refused(_send(srv.port, wire.encode(wire.Resume(session=w.session, committed=P, auth=TOKEN, secret=b"x"))),
                       ErrorCode.UNKNOWN_SESSION)  # a wrong secret for a live session counts as a failure
        err = assert_refused(_send(srv.port, wire.encode(hello())), ErrorCode.BAD_AUTH)
        assert "too many" in err.message
        other = socket.socket()
        other.bind(("127.0.0.2", 0))
        other.settimeout(IO_TIMEOUT_S)
        other.connect((HOST, srv.port))
        wire.send_frame(other, hello())
        assert isinstance(recv_one(other), wire.Welcome)
        other.close()
        live.close()


# ------------------------------------------------------------------------------------------ restarts


class SlowToy(ToyModel):
    """~10 ms per target pass, so a generation lasts long enough to interrupt."""

    def _eval(self, new, want):
        time.sleep(0.01)
        return super()._eval(new, want)


def reference_for(rule: str, temperature: float, max_tokens: int) -> list[int]:
    cfg = SpecConfig(rule=rule, temperature=temperature, seed=SEED, max_tokens=max_tokens, spec=False)
    return generate(toy_target(), list(PROMPT), cfg).tokens


@pytest.mark.parametrize("mode,rule,temperature", [
    ("pipelined", "coupled", TEMP), ("sync", "greedy", 0.0), ("pipelined", "greedy", 0.0), ("cloud-only", "coupled", TEMP),
])
def test_the_edge_recovers_from_a_cloud_restart_with_the_identical_text(mode, rule, temperature):
    """Mid-generation the cloud stops (CLOSE(GOING_AWAY) after the verdicts it owes) and a new one starts
    on the same port, knowing nothing of the session. The edge's RESUME gets UNKNOWN_SESSION, so it
    opens a new session whose prompt is its prompt plus everything committed, with the budget that is
    left, and carries on: greedy and coupled give exactly the undisturbed text, streamed once."""
    n = 80
    first = CloudServerThread(SlowToy(vocab=V, seed=1), server_config()).start()
    port = first.port
    second = None
    try:
        cfg = EdgeConfig(mode=mode, rule=rule, k=3, temperature=temperature, seed=SEED, max_tokens=n,
                         connect=ConnectConfig(host=HOST, port=port, token=TOKEN, reply_timeout_s=10.0, backoff_max_s=0.5))
        streamed: list[int] = []
        some = threading.Event()
        out: dict = {}

        def on_tokens(toks):
            streamed.extend(toks)
            if len(streamed) >= 5:
                some.set()

        def body():
            try:
                out["res"] = run_edge(None if mode == "cloud-only" else toy_drafter(), list(PROMPT), cfg,
                                      model_id=MODEL_ID, on_tokens=on_tokens)
            except BaseException as e:  # noqa: BLE001
                out["error"] = e

        t = threading.Thread(target=body, daemon=True)
        t.start()
        assert some.wait(10)
        first.stop()
        assert len(streamed) < n, "the generation ended before the restart; nothing was tested"
        second = CloudServerThread(SlowToy(vocab=V, seed=1), server_config(port=port)).start()
        t.join(60)
        assert not t.is_alive()
        if "error" in out:
            raise out["error"]
        res = out["res"]
        assert res.tokens == reference_for(rule, temperature, n)
        assert streamed == res.tokens
        assert res.stats.link["recoveries"] == 1
        assert len(second.server.errors_sent) == 1 and second.server.errors_sent["UNKNOWN_SESSION"] == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_reset_during_the_first_handshake_is_retried():
    """The first connection is reset right after its HELLO arrives (the cloud was not there yet: a
    bare listener), then the real cloud comes up on that port: the edge retries the whole handshake
    and produces the reference text."""
    lst = socket.create_server((HOST, 0))
    port = lst.getsockname()[1]
    cfg = EdgeConfig(mode="pipelined", rule="coupled", k=3, temperature=TEMP, seed=SEED, max_tokens=20,
                     connect=ConnectConfig(host=HOST, port=port, token=TOKEN, backoff_max_s=0.3))
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("res", run_edge(toy_drafter(), list(PROMPT), cfg, model_id=MODEL_ID)),
                         daemon=True)
    t.start()
    lst.settimeout(IO_TIMEOUT_S)
    conn, _ = lst.accept()
    conn.settimeout(IO_TIMEOUT_S)
    assert isinstance(recv_one(conn), wire.Hello)
    _reset(conn)
    lst.close()
    with CloudServerThread(toy_target(), server_config(port=port)):
        t.join(30)
    assert not t.is_alive()
    assert out["res"].tokens == reference(20)


def test_edge_json_reports_the_text_so_far_on_failure(capsys):
    """`acespec edge --json` prints the committed text even when the run fails: here the cloud goes
    away mid-generation and never comes back."""
    import json

    from acespec.cli import main

    srv = CloudServerThread(SlowToy(vocab=V, seed=1), server_config()).start()
    port = srv.port
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", main([
        "edge", "--draft", f"toy:vocab={V},seed=1", "--cloud", f"{HOST}:{port}", "--prompt", "hello", "--json",
        "--rule", "greedy", "--max-tokens", str(MAX_NEW), "--mode", "sync", "--k", "2"] + ["--token-file", _token_file()])),
        daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 10
        while not any(s.verifier.generated for s in list(srv.server.sessions.values())) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        srv.stop()
    t.join(60)
    assert not t.is_alive()
    assert result["rc"] == 2
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["error"]["type"] == "EdgeError" and obj["tokens"] and obj["text"], obj
    assert len(obj["tokens"]) < MAX_NEW


def _token_file() -> str:
    import tempfile

    f = tempfile.NamedTemporaryFile("wb", suffix=".token", delete=False)
    f.write(TOKEN + b"\n")
    f.close()
    return f.name


def test_an_edge_keeps_bounded_state_over_a_long_generation():
    """Hundreds of rounds through a real cloud: the transport keeps only its recent round-trip samples
    and the loop's set of cache-planned blocks holds blocks in flight only (both grew by one per
    round before)."""
    from acespec.control.depth import FixedDepth
    from acespec.draft.cache import CacheConfig, StateCache
    from acespec.draft.chain import ChainDrafter
    from acespec.edge.client import CloudSession
    from acespec.edge.transports import TcpTransport
    from acespec.loop.transport import RTT_SAMPLES_KEPT
    from acespec.loop.loop import LoopConfig, SpecLoop
    from acespec.verify import RuleSpec, SamplingParams

    n = 400
    with CloudServerThread(toy_target(), server_config(max_new_tokens=n)) as srv:
        sp = SamplingParams(TEMP, 0, 1.0)
        drafter = ChainDrafter(toy_drafter(), sampling=sp, rule=RuleSpec.parse("coupled"), seed=SEED)
        session = CloudSession(ConnectConfig(host=HOST, port=srv.port, token=TOKEN),
                               hello(max_tokens=n))
        transport = TcpTransport(session, send_q=False)
        cache = StateCache(drafter, CacheConfig(), coupled=True)
        loop = SpecLoop(transport, PROMPT, drafter=drafter, policy=FixedDepth(1), cache=cache,
                        config=LoopConfig(mode="pipelined", window=2, max_tokens=n))
        drafter.prefill(list(PROMPT))
        res = loop.run()
        session.close()
    assert res.tokens == reference_for("coupled", TEMP, n)
    assert transport.rtt_count > RTT_SAMPLES_KEPT  # more rounds than samples kept
    assert len(transport.rtt_samples) == RTT_SAMPLES_KEPT
    assert len(loop.planner.planned) <= 4
    assert not transport.sent_at or len(transport.sent_at) <= 4


def test_stop_sends_the_verdicts_owed_then_going_away():
    """A block is being verified when the server is told to stop: its verdict still goes out, then
    CLOSE(GOING_AWAY), then the connection ends."""
    gate, entered = threading.Event(), threading.Event()
    gate.set()

    class GatedToy(ToyModel):
        def _eval(self, new, want):
            if not gate.is_set():
                entered.set()
            assert gate.wait(30), "the gate never opened"
            return super()._eval(new, want)

    srv = CloudServerThread(GatedToy(vocab=V, seed=1), server_config()).start()
    try:
        s, w = open_session(srv.port)
        step(s, w.session, 0, P)
        gate.clear()
        wire.send_frame(s, wire.Draft(session=w.session, seq=1, base=P + 1, tokens=()))
        assert entered.wait(IO_TIMEOUT_S)  # the block is being verified
        stopper = threading.Thread(target=srv.stop, daemon=True)
        stopper.start()
        deadline = time.monotonic() + IO_TIMEOUT_S
        while not srv.server._stopping and time.monotonic() < deadline:
            time.sleep(0.005)
        gate.set()
        frames, _ = drain(s)
        assert [type(f) for f in frames] == [wire.Verdict, wire.Close], frames
        assert frames[0].seq == 1 and not frames[0].dropped and frames[0].committed == P + 2
        assert frames[1] == wire.Close(reason=wire.CloseReason.GOING_AWAY)
        stopper.join(30)
    finally:
        gate.set()
        srv.stop()
