"""The cloud's WebSocket port (`acespec serve --ws-port`), over real loopback sockets with a Python
WebSocket client sending the same binary frames as the TCP edge, one frame per message:

- cloud-only streams the same tokens as over TCP; a cloud-led session streams them too, taking DRAFTs;
  an edge-led (sync) session gets its VERDICTs;
- auth, malformed and oversized frames get the very ERROR frame the TCP port gives for the same bytes;
  a text message, an empty one and one holding other than one frame are refused clearly;
- RESUME on a new WebSocket continues a session whose first WebSocket dropped;
- the drain tells a WebSocket edge GOING_AWAY (close code 1001) as it tells a TCP one, and takes no
  new connection; an idle session is told IDLE (close 1000); wss with a test certificate; `acespec serve
  --ws-port 0` prints the port it bound.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.edge.client import ConnectConfig
from acespec.edge.runtime import EdgeConfig, run_edge
from acespec.loop import SpecConfig, generate
from acespec.models.toy import ToyModel
from acespec.wire import ErrorCode

HOST = "127.0.0.1"
V = 64
MODEL_ID = f"toy:vocab={V}"
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
P = len(PROMPT)
SEED = 11
TEMP = 0.8
N = 24
TOKEN = b"ws-secret"
IO_TIMEOUT_S = 10.0


def reference(n: int = N) -> list[int]:
    """What the target alone decodes for PROMPT: every transport must stream exactly this."""
    cfg = SpecConfig(rule="coupled", temperature=TEMP, seed=SEED, max_tokens=n, spec=False)
    return list(generate(ToyModel(vocab=V, seed=1), list(PROMPT), cfg).tokens)


def hello(**kw) -> wire.Hello:
    base = dict(model_id=MODEL_ID, max_tokens=N, prompt=PROMPT, auth=TOKEN, temperature=TEMP, rule="coupled",
                seed=SEED, mode=wire.Mode.CLOUD_ONLY)
    base.update(kw)
    return wire.Hello(**base)


def config(**kw) -> ServerConfig:
    base = dict(host=HOST, port=0, ws_port=0, token=TOKEN, max_sessions=8, resume_grace_s=30.0)
    base.update(kw)
    return ServerConfig(**base)


@pytest.fixture(scope="module")
def cloud():
    with CloudServerThread(ToyModel(vocab=V, seed=1), config()) as srv:
        yield srv


def ws_open(port: int, scheme: str = "ws", **kw) -> ClientConnection:
    return connect(f"{scheme}://{HOST}:{port}/", open_timeout=IO_TIMEOUT_S, max_size=None, compression=None, proxy=None,
                   legacy=True, **kw)  # legacy: the connection itself, closed by each test


def send(ws: ClientConnection, frame) -> None:
    ws.send(wire.encode(frame))


def recv(ws: ClientConnection):
    """The next frame: each binary message holds exactly one."""
    msg = ws.recv(timeout=IO_TIMEOUT_S)
    assert isinstance(msg, bytes), f"a text message from the cloud: {msg!r}"
    frames = wire.FrameDecoder().feed(msg)
    assert len(frames) == 1, f"a message of {len(frames)} frames"
    return frames[0]


def until_closed(ws: ClientConnection) -> tuple[list, int | None]:
    """Every frame until the cloud closes the WebSocket, and the close code it sent."""
    frames: list = []
    try:
        while True:
            frames.append(recv(ws))
    except ConnectionClosed:
        pass
    return frames, ws.close_code


def ws_session(port: int, **kw) -> tuple[ClientConnection, wire.Welcome]:
    ws = ws_open(port)
    send(ws, hello(**kw))
    w = recv(ws)
    assert isinstance(w, wire.Welcome), w
    return ws, w


def stream(ws: ClientConnection) -> list[wire.Tokens]:
    """TOKENS frames until the one marked finished; each starts where the last ended."""
    chunks: list[wire.Tokens] = []
    while not (chunks and chunks[-1].finished):
        f = recv(ws)
        assert isinstance(f, wire.Tokens), f
        chunks.append(f)
    return chunks


def wss_cloud_only(port: int, ctx, **kw) -> list[int]:
    """A cloud-only session over wss, on websockets' asyncio client: one thread reads and writes the TLS
    connection. The sync client used elsewhere reads in a thread of its own while the caller writes, and an
    OpenSSL connection may not be driven by two threads at once: when a TLS 1.3 session ticket came in as
    the upgrade request went out, the request went unanswered (7 handshakes in 4,000 against websockets'
    own server, none in 6,000 from one thread, none with the server's tickets off: scripts/wss-client-stall.py
    counts them). The edge's client
    holds one lock over its TLS object for the same reason (`acespec.edge.client._Link`)."""

    async def run() -> list[wire.Tokens]:
        async with aconnect(f"wss://{HOST}:{port}/", ssl=ctx, open_timeout=IO_TIMEOUT_S, max_size=None,
                            compression=None, proxy=None) as ws:
            await ws.send(wire.encode(hello(**kw)))
            frames: list = []
            while not (frames and isinstance(frames[-1], wire.Tokens) and frames[-1].finished):
                msg = await asyncio.wait_for(ws.recv(), IO_TIMEOUT_S)
                assert isinstance(msg, bytes), f"a text message from the cloud: {msg!r}"
                frames += wire.FrameDecoder().feed(msg)
            assert isinstance(frames[0], wire.Welcome), frames[0]
            assert all(isinstance(f, wire.Tokens) for f in frames[1:]), frames
            await ws.send(wire.encode(wire.Close(reason=wire.CloseReason.NORMAL)))  # as the edge ends one
            return frames[1:]

    return tokens_of(asyncio.run(run()))


def tokens_of(chunks: list[wire.Tokens]) -> list[int]:
    out: list[int] = []
    for c in chunks:
        assert c.start == P + len(out), (c.start, P + len(out))
        out += c.tokens
    return out


def tcp_cloud_only(port: int, n: int = N) -> list[int]:
    cfg = EdgeConfig(mode="cloud-only", rule="coupled", temperature=TEMP, seed=SEED, max_tokens=n,
                     connect=ConnectConfig(host=HOST, port=port, token=TOKEN, reply_timeout_s=IO_TIMEOUT_S))
    return list(run_edge(None, list(PROMPT), cfg, model_id=MODEL_ID).tokens)


def tcp_refusal(port: int, data: bytes) -> tuple[wire.Error, wire.Close]:
    """What the TCP port answers `data` with: its ERROR and CLOSE."""
    with socket.create_connection((HOST, port), timeout=IO_TIMEOUT_S) as s:
        s.sendall(data)
        dec, frames = wire.FrameDecoder(), []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            frames += dec.feed(chunk)
    assert len(frames) >= 2 and isinstance(frames[-2], wire.Error), frames
    return frames[-2], frames[-1]


def ws_refusal(port: int, message: bytes | str) -> tuple[wire.Error, wire.Close, int | None]:
    ws = ws_open(port)
    ws.send(message)
    frames, code = until_closed(ws)
    assert len(frames) >= 2 and isinstance(frames[-2], wire.Error), frames
    return frames[-2], frames[-1], code


# ------------------------------------------------------------------------------------------ sessions


def test_cloud_only_over_websocket_streams_the_tokens_tcp_streams(cloud):
    ws, w = ws_session(cloud.server.ws_port)
    assert w.committed == P and len(w.secret) == 32
    got = tokens_of(stream(ws))
    send(ws, wire.Close())
    ws.close()
    assert got == tcp_cloud_only(cloud.port) == reference()


def test_a_cloud_led_session_over_websocket_streams_the_reference_and_takes_drafts(cloud):
    ref = reference()
    ws, w = ws_session(cloud.server.ws_port, mode=wire.Mode.CLOUD_LED)
    # the edge's draft: the right text from the prompt on. The cloud never waits for it, and any part
    # it verifies must agree with what it would have decoded anyway
    send(ws, wire.Draft(session=w.session, seq=0, base=P, tokens=tuple(ref[:12])))
    chunks = stream(ws)
    assert all(c.drafted is not None for c in chunks), "cloud-led TOKENS carry each step's account"
    assert tokens_of(chunks) == ref
    # PING is answered between steps and after the end alike
    send(ws, wire.Ping(nonce=7, sent_us=123))
    assert recv(ws) == wire.Pong(nonce=7, sent_us=123)
    send(ws, wire.Close())
    ws.close()


def test_an_edge_led_session_over_websocket_gets_its_verdicts(cloud):
    ref = reference()
    ws, w = ws_session(cloud.server.ws_port, mode=wire.Mode.SPECULATIVE)
    send(ws, wire.Draft(session=w.session, seq=0, base=P, tokens=tuple(ref[:3])))  # right: all kept
    v = recv(ws)
    assert (v.seq, v.accepted, v.next_token, v.committed) == (0, 3, ref[3], P + 4)
    wrong = (ref[4] + 1) % V
    send(ws, wire.Draft(session=w.session, seq=1, base=P + 4, tokens=(wrong, 0)))  # wrong first token
    v = recv(ws)
    assert (v.accepted, v.next_token, v.committed) == (0, ref[4], P + 5)
    got = ref[:5]
    seq = 2
    while not v.finished:
        send(ws, wire.Draft(session=w.session, seq=seq, base=P + len(got), tokens=()))
        v = recv(ws)
        got.append(v.next_token)
        seq += 1
    assert got == ref
    send(ws, wire.Close())
    ws.close()


def test_resume_on_a_new_websocket_continues_the_session_the_first_dropped(cloud):
    ref = reference()
    ws, w = ws_session(cloud.server.ws_port, mode=wire.Mode.SPECULATIVE)
    got: list[int] = []
    for seq in range(3):
        send(ws, wire.Draft(session=w.session, seq=seq, base=P + len(got), tokens=()))
        got.append(recv(ws).next_token)
    ws.socket.shutdown(socket.SHUT_RDWR)  # the connection dies: no CLOSE frame, no WebSocket close
    ws.close()
    committed = PROMPT + tuple(got)
    ws2 = ws_open(cloud.server.ws_port)
    send(ws2, wire.Resume(session=w.session, committed=len(committed), auth=TOKEN, secret=w.secret,
                          digest=wire.committed_digest(committed)))
    w2 = recv(ws2)
    assert isinstance(w2, wire.Welcome) and (w2.session, w2.committed) == (w.session, P + 3)
    seq, v = 3, None
    while v is None or not v.finished:
        send(ws2, wire.Draft(session=w.session, seq=seq, base=P + len(got), tokens=()))
        v = recv(ws2)
        got.append(v.next_token)
        seq += 1
    assert got == ref
    send(ws2, wire.Close())
    ws2.close()


# ------------------------------------------------------------------------------------------ refusals


def test_a_bad_token_is_refused_with_the_error_tcp_gives_and_a_good_one_is_served(cloud):
    bad = wire.encode(hello(auth=b"guess"))
    err, close, code = ws_refusal(cloud.server.ws_port, bad)
    assert err.code == ErrorCode.BAD_AUTH and close == wire.Close(reason=wire.CloseReason.ERROR)
    assert code == 1008
    assert (err, close) == tcp_refusal(cloud.port, bad)
    ws, _ = ws_session(cloud.server.ws_port)
    assert tokens_of(stream(ws)) == reference()
    ws.close()


def _bad_version() -> bytes:
    b = bytearray(wire.encode(hello()))
    b[2] = 1  # HELLO's version byte follows the length prefix (1 byte here) and the type byte
    return bytes(b)


def _over_limit() -> bytes:
    n = wire.DEFAULT_LIMITS.max_frame_bytes + 1  # one byte more than a frame may be
    return wire.encode_uvarint(n) + bytes([wire.FrameType.PING]) + bytes(n - 1)


_MALFORMED = [
    ("an unknown frame type", b"\x01\x63", ErrorCode.BAD_FRAME),
    ("a frame of length zero", b"\x00", ErrorCode.BAD_FRAME),
    ("a HELLO of another protocol version", _bad_version(), ErrorCode.BAD_VERSION),
    ("a frame longer than the frame limit", _over_limit(), ErrorCode.OVER_LIMIT),
    ("a VERDICT sent to the cloud",
     wire.encode(wire.Verdict(seq=0, accepted=0, next_token=0, verify_us=0, committed=0)), ErrorCode.BAD_REQUEST),
]


@pytest.mark.parametrize("name,data,code", _MALFORMED, ids=[m[0] for m in _MALFORMED])
def test_a_malformed_or_oversized_frame_gets_the_error_tcp_gives(cloud, name, data, code):
    err, close, ws_code = ws_refusal(cloud.server.ws_port, data)
    assert err.code == code, (name, err)
    assert close == wire.Close(reason=wire.CloseReason.ERROR) and ws_code == 1008
    assert (err, close) == tcp_refusal(cloud.port, data), name


def test_a_text_message_is_refused_clearly(cloud):
    err, close, code = ws_refusal(cloud.server.ws_port, "HELLO")
    assert err.code == ErrorCode.BAD_FRAME and "text message" in err.message and "binary" in err.message
    assert close == wire.Close(reason=wire.CloseReason.ERROR) and code == 1008


_NOT_ONE_FRAME = [
    ("an empty message", b"", "empty message"),
    ("half a frame", wire.encode(hello())[:10], "part of a frame"),
    ("two frames in one message", wire.encode(hello()) + wire.encode(wire.Ping(nonce=1, sent_us=1)),
     "more than one frame"),
    ("a message cut inside its length prefix", b"\x80", "inside a length prefix"),
]


def test_a_text_message_in_the_middle_of_a_session_ends_it_with_the_same_refusal(cloud):
    ws, _ = ws_session(cloud.server.ws_port, mode=wire.Mode.CLOUD_LED, max_tokens=500)
    ws.send("DRAFT 1 2 3")
    frames, code = until_closed(ws)
    err, close = frames[-2:]
    assert all(isinstance(f, wire.Tokens) for f in frames[:-2]), frames[-4:]
    assert err.code == ErrorCode.BAD_FRAME and "text message" in err.message
    assert close == wire.Close(reason=wire.CloseReason.ERROR) and code == 1008


@pytest.mark.parametrize("name,data,needle", _NOT_ONE_FRAME, ids=[m[0] for m in _NOT_ONE_FRAME])
def test_a_message_that_is_not_exactly_one_frame_is_refused(cloud, name, data, needle):
    err, close, code = ws_refusal(cloud.server.ws_port, data)
    assert err.code == ErrorCode.BAD_FRAME and needle in err.message, (name, err)
    assert "one binary message" in err.message or "one frame" in err.message
    assert close == wire.Close(reason=wire.CloseReason.ERROR) and code == 1008


def test_a_message_too_large_to_be_one_frame_is_closed_by_the_websocket_layer_and_the_server_carries_on(cloud):
    ws = ws_open(cloud.server.ws_port)
    ws.send(bytes(wire.DEFAULT_LIMITS.max_frame_bytes + 64))
    frames, code = until_closed(ws)
    assert frames == [] and code == 1009  # message too big: refused before it was buffered
    ws2, _ = ws_session(cloud.server.ws_port)
    assert tokens_of(stream(ws2)) == reference()
    ws2.close()


def test_the_port_serves_the_browser_edge_and_its_info(cloud):
    base = f"http://{HOST}:{cloud.server.ws_port}"
    with urllib.request.urlopen(base + "/", timeout=IO_TIMEOUT_S) as r:
        assert r.headers["Content-Type"].startswith("text/html") and b"ws-edge.js" in r.read()
    with urllib.request.urlopen(base + "/ws-edge.js", timeout=IO_TIMEOUT_S) as r:
        assert r.headers["Content-Type"].startswith("text/javascript") and b"export" in r.read()
    with urllib.request.urlopen(base + "/info", timeout=IO_TIMEOUT_S) as r:
        assert json.loads(r.read())["model_id"] == MODEL_ID
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/elsewhere", timeout=IO_TIMEOUT_S)
    assert e.value.code == 426  # not a page, and not a WebSocket upgrade
    for path in ("/", "/info", "/elsewhere"):  # the port answers GET only
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(base + path, method="POST"), timeout=IO_TIMEOUT_S)
        assert e.value.code == 405 and "GET only" in json.loads(e.value.read())["error"]


def test_the_port_tokenizes_and_detokenizes_with_the_targets_tokenizer(cloud):
    base = f"http://{HOST}:{cloud.server.ws_port}"
    tok = ToyModel(vocab=V, seed=1).tokenizer

    def get(path: str) -> dict:
        with urllib.request.urlopen(base + path, timeout=IO_TIMEOUT_S) as r:
            return json.loads(r.read())

    assert get("/tokenize?text=" + urllib.parse.quote("héllo")) == {"ids": tok.encode("héllo")}
    chat = [{"role": "user", "content": "héllo"}]
    assert get("/tokenize?chat=1&text=" + urllib.parse.quote("héllo")) == {"ids": tok.chat_prompt(chat)}
    out = get("/detokenize?ids=1,2,63")
    assert out["text"] == tok.decode([1, 2, 63]) and base64.b64decode(out["bytes_b64"]) == tok.decode_bytes([1, 2, 63])
    for bad in ("/detokenize?ids=1,x", f"/detokenize?ids={V}", "/tokenize?chat=yes&text=a"):  # not ids; out of vocab
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + bad, timeout=IO_TIMEOUT_S)
        assert e.value.code == 400 and "error" in json.loads(e.value.read())


# ------------------------------------------------------------------------------------------ drain and TLS


class GatedToy(ToyModel):
    """A toy whose passes wait while the gate is shut, so a session is mid-stream when the drain begins."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def _eval(self, new, want):
        if not self.gate.is_set():
            self.entered.set()
        assert self.gate.wait(30), "the gate never opened"
        return super()._eval(new, want)


def test_the_drain_tells_a_websocket_edge_going_away_and_takes_no_new_connection():
    model = GatedToy(vocab=V, seed=1)
    srv = CloudServerThread(model, config()).start()
    try:
        ws_port = srv.server.ws_port
        ws, _ = ws_session(ws_port, max_tokens=200)
        model.gate.clear()  # the prompt is in (before WELCOME): the steps wait
        assert model.entered.wait(IO_TIMEOUT_S)  # a step is under way
        stopper = threading.Thread(target=srv.stop, daemon=True)
        stopper.start()
        deadline = time.monotonic() + IO_TIMEOUT_S
        while not srv.server._stopping and time.monotonic() < deadline:
            time.sleep(0.005)
        model.gate.set()
        frames, code = until_closed(ws)
        assert frames and frames[-1] == wire.Close(reason=wire.CloseReason.GOING_AWAY), frames[-3:]
        assert all(isinstance(f, wire.Tokens) for f in frames[:-1]) and code == 1001
        stopper.join(30)
        assert not stopper.is_alive()
        with pytest.raises((OSError, InvalidStatus, InvalidMessage)):
            ws_open(ws_port).close()
    finally:
        model.gate.set()
        srv.stop()


def test_an_idle_session_is_told_idle_and_its_websocket_closed_normally():
    with CloudServerThread(ToyModel(vocab=V, seed=1), config(idle_timeout_s=0.4)) as srv:
        ws, _ = ws_session(srv.server.ws_port)
        assert tokens_of(stream(ws)) == reference()  # then the edge says nothing
        frames, code = until_closed(ws)
        assert frames == [wire.Close(reason=wire.CloseReason.IDLE)] and code == 1000


def test_wss_with_a_test_certificate_streams_the_reference_and_plain_ws_gets_nothing(tmp_path):
    trustme = pytest.importorskip("trustme")
    import ssl

    from acespec.tls import server_context

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    tls = server_context(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), None)
    with CloudServerThread(ToyModel(vocab=V, seed=1), config(tls=tls)) as srv:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        assert wss_cloud_only(srv.server.ws_port, ctx) == reference()
        with pytest.raises((OSError, InvalidMessage, TimeoutError)):
            ws_open(srv.server.ws_port).close()  # the port speaks TLS only


def test_serve_prints_the_websocket_port_it_bound_and_drains_on_sigterm():
    root = Path(__file__).resolve().parent.parent
    srv = subprocess.Popen([sys.executable, "-m", "acespec.cli", "serve", "--target", "toy:vocab=64,seed=1",
                            "--port", "0", "--ws-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=root)
    try:
        assert "listening on" in srv.stdout.readline()
        line = srv.stdout.readline()
        assert line.startswith("acespec serve: WebSocket listening on 127.0.0.1:"), line
        port = int(line.split("listening on ")[1].split()[0].split(":")[1])
        assert f"ws://127.0.0.1:{port}/" in line
        ws, w = ws_session(port, auth=b"", max_tokens=500)
        assert isinstance(recv(ws), wire.Tokens)
        srv.send_signal(signal.SIGTERM)
        frames, code = until_closed(ws)
        assert frames[-1] == wire.Close(reason=wire.CloseReason.GOING_AWAY) and code == 1001
        assert srv.wait(30) == 0
    finally:
        if srv.poll() is None:
            srv.terminate()
            srv.wait(30)


def test_serve_refuses_a_websocket_port_out_of_range():
    p = subprocess.run([sys.executable, "-m", "acespec.cli", "serve", "--target", "toy:vocab=64,seed=1", "--port", "0",
                        "--ws-port", "70000"], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parent.parent)
    assert p.returncode == 2 and p.stderr.strip() == "acespec: error: --ws-port must be in 0..65535, got 70000", p.stderr


def test_serve_with_tls_prints_a_wss_port_that_streams(tmp_path):
    """`acespec serve --tls-cert/--tls-key --ws-port 0` (on uvloop where it is installed, as `serve` runs)."""
    trustme = pytest.importorskip("trustme")
    import ssl

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    srv = subprocess.Popen([sys.executable, "-m", "acespec.cli", "serve", "--target", "toy:vocab=64,seed=1",
                            "--port", "0", "--ws-port", "0", "--tls-cert", str(tmp_path / "cert.pem"),
                            "--tls-key", str(tmp_path / "key.pem")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert "(TLS)" in srv.stdout.readline()
        line = srv.stdout.readline()
        port = int(line.split("listening on ")[1].split()[0].split(":")[1])
        assert f"wss://127.0.0.1:{port}/" in line and f"https://127.0.0.1:{port}/" in line, line
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        assert wss_cloud_only(port, ctx, auth=b"") == reference()
    finally:
        srv.terminate()
        srv.wait(30)
