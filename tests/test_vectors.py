"""The language-neutral wire vectors in spec/vectors/ hold for this implementation (docs/reference/wire.md).

The files are what another implementation (a TypeScript edge, say) tests itself against, so here they
are read as such a client would read them, with none of the generator's code (scripts/make_vectors.py):

- frames.json: every valid frame encodes to its hex and decodes to its fields; every malformed one is
  refused with its error code, and does to a byte stream what the vector says;
- sessions.json: every recorded session is replayed on raw sockets against a live toy cloud on
  127.0.0.1, which must answer frame for frame as recorded (save the fields marked `vary`);
- coupled.json: the coupled sampler's noise and tokens, from numpy and from a pure-Python port of the
  spec's RNG description (SeedSequence, PCG64, Gumbel), which must agree with each other and the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
from pathlib import Path

import numpy as np
import pytest

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.models.base import vocab_fingerprint
from acespec.models.toy import ToyModel
from acespec.verify import coupled_sample, gumbel_noise

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
FRAMES = json.loads((VECTORS / "frames.json").read_text())
SESSIONS = json.loads((VECTORS / "sessions.json").read_text())
COUPLED = json.loads((VECTORS / "coupled.json").read_text())
IO_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------------------------ JSON -> frame


def _row(pairs) -> tuple:
    return tuple((int(t), float(p)) for t, p in pairs)


def frame_of(d: dict):
    """The frame that a vector's `frame` fields describe."""
    t = d["type"]
    if t == "HELLO":
        return wire.Hello(version=d["version"], auth=bytes.fromhex(d["auth"]), model_id=d["model_id"],
                          temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"], rule=d["rule"],
                          seed=int(d["seed"]), mode=wire.Mode(d["mode"]), max_tokens=d["max_tokens"],
                          logprobs=d["logprobs"], prompt=tuple(d["prompt"]))
    if t == "WELCOME":
        return wire.Welcome(session=d["session"], committed=d["committed"], max_draft_tokens=d["max_draft_tokens"],
                            secret=bytes.fromhex(d["secret"]))
    if t == "DRAFT":
        assert d["flags"] == (d["q"] is not None) | (d["parents"] is not None) << 1
        return wire.Draft(session=d["session"], seq=d["seq"], base=d["base"], tokens=tuple(d["tokens"]),
                          q=None if d["q"] is None else tuple(_row(r) for r in d["q"]),
                          parents=None if d["parents"] is None else tuple(d["parents"]))
    if t == "VERDICT":
        flags = d["flags"]
        assert (flags & 2 != 0) == (d["p"] is not None) and (flags & 4 != 0) == (d["path"] is not None)
        return wire.Verdict(seq=d["seq"], accepted=d["accepted"], next_token=d["next_token"], verify_us=d["verify_us"],
                            committed=d["committed"], dropped=bool(flags & 1), finished=bool(flags & 8),
                            p=None if d["p"] is None else _row(d["p"]),
                            path=None if d["path"] is None else tuple(d["path"]))
    if t == "RESUME":
        return wire.Resume(version=d["version"], auth=bytes.fromhex(d["auth"]), session=d["session"],
                           secret=bytes.fromhex(d["secret"]), committed=d["committed"],
                           digest=bytes.fromhex(d["digest"]))
    if t in ("PING", "PONG"):
        cls = wire.Ping if t == "PING" else wire.Pong
        return cls(nonce=int(d["nonce"]), sent_us=int(d["sent_us"]))
    if t == "ERROR":
        return wire.Error(code=wire.ErrorCode(d["code"]), message=d["message"])
    if t == "CLOSE":
        return wire.Close(reason=wire.CloseReason(d["reason"]))
    if t == "TOKENS":
        step, lps = d["flags"] & 2, d["flags"] & 4
        assert bool(step) == ("drafted" in d) and bool(lps) == ("logprobs" in d)
        return wire.Tokens(start=d["start"], tokens=tuple(d["tokens"]), finished=bool(d["flags"] & 1),
                           drafted=d["drafted"] if step else None, accepted=d.get("accepted", 0),
                           verify_us=d.get("verify_us", 0),
                           logprobs=tuple((float(lp), _row(top)) for lp, top in d["logprobs"]) if lps else None)
    raise AssertionError(f"unknown frame type {t}")


# ------------------------------------------------------------------------------------------ frames.json


@pytest.mark.parametrize("vec", FRAMES["valid"], ids=[v["name"] for v in FRAMES["valid"]])
def test_every_valid_frame_vector_encodes_to_its_hex_and_decodes_to_its_fields(vec):
    frame = frame_of(vec["frame"])
    assert wire.encode(frame).hex() == vec["hex"]
    decoded = wire.decode(bytes.fromhex(vec["hex"]))
    assert decoded == frame
    if vec["frame"]["type"] == "HELLO":  # == treats 0.0 and -0.0 as equal; the wire does not
        assert math.copysign(1.0, decoded.temperature) == math.copysign(1.0, vec["frame"]["temperature"])


@pytest.mark.parametrize("vec", FRAMES["malformed"], ids=[v["name"] for v in FRAMES["malformed"]])
def test_every_malformed_frame_vector_is_refused_with_its_error_code(vec):
    data = bytes.fromhex(vec["hex"])
    with pytest.raises(wire.WireError) as err:
        wire.decode(data)
    assert err.value.code.name == vec["error"] and int(err.value.code) == vec["code"]
    dec = wire.FrameDecoder()
    if vec["stream"] == "incomplete":
        assert dec.feed(data) == [] and not dec.broken
        return
    with pytest.raises(wire.WireError):
        dec.feed(data)
    assert dec.broken == (vec["stream"] == "prefix")
    if not dec.broken:  # the bad frame was consumed: the next one decodes
        assert dec.feed(wire.encode(wire.Close())) == [wire.Close()]


def test_the_vectors_cover_every_frame_type_and_every_error_the_codec_raises():
    types = {v["frame"]["type"] for v in FRAMES["valid"]}
    assert types == {t.name for t in wire.FrameType}
    assert {v["error"] for v in FRAMES["malformed"]} == {"BAD_FRAME", "OVER_LIMIT", "BAD_VERSION"}


def test_the_limits_in_the_vectors_are_the_codecs():
    limits = wire.Limits()
    got = {f.name: getattr(limits, f.name) for f in dataclasses.fields(limits)}
    got.update(max_secret_bytes=wire.MAX_SECRET_BYTES, max_error_message_bytes=wire.MAX_ERROR_MESSAGE_BYTES,
               max_top_logprobs=wire.MAX_TOP_LOGPROBS, logprob_floor=wire.LOGPROB_FLOOR)
    assert FRAMES["limits"] == got
    assert FRAMES["protocol_version"] == wire.PROTOCOL_VERSION == SESSIONS["protocol_version"]


def test_committed_digest_vectors():
    for v in FRAMES["committed_digest"]:
        assert wire.committed_digest(v["tokens"]).hex() == v["digest"]


def test_vocab_fingerprint_vectors():
    for v in FRAMES["vocab_fingerprint"]:
        pieces = [bytes.fromhex(p) for p in v["pieces_hex"]]
        assert vocab_fingerprint(len(pieces), pieces) == v["fingerprint"]


# ------------------------------------------------------------------------------------------ sessions.json


class Replay:
    """The edge side of a recorded session, on raw sockets: sends its frames (with the live session id
    and secret where the recording marks them `vary`) and checks the cloud's against the recording."""

    def __init__(self, port: int, check: str) -> None:
        self.port = port
        self.check = check
        self.socks: dict[int, socket.socket] = {}
        self.decs: dict[int, wire.FrameDecoder] = {}
        self.live: dict[str, object] = {}  # the session and secret of the latest WELCOME

    def sock(self, conn: int) -> socket.socket:
        if conn not in self.socks:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=IO_TIMEOUT_S)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks[conn], self.decs[conn] = s, wire.FrameDecoder()
        return self.socks[conn]

    def recv(self, conn: int):
        return wire.recv_frame(self.sock(conn), self.decs[conn])

    def send(self, step: dict) -> None:
        if step["frame"] is None:  # bytes no encoder would produce (an unknown protocol version)
            self.sock(step["conn"]).sendall(bytes.fromhex(step["hex"]))
            return
        frame = frame_of(step["frame"])
        assert wire.encode(frame).hex() == step["hex"]
        subs = {name: self.live[name] for name in step.get("vary", ())}
        self.sock(step["conn"]).sendall(wire.encode(dataclasses.replace(frame, **subs)))

    def expect(self, step: dict) -> None:
        got = self.recv(step["conn"])
        assert got is not None, f"the cloud closed the connection where the recording has {step['frame']}"
        want = frame_of(step["frame"])
        vary = step.get("vary", ())
        assert got == dataclasses.replace(want, **{name: getattr(got, name) for name in vary})
        if isinstance(got, wire.Welcome):
            self.live.update(session=got.session, secret=got.secret)
            assert 0 < got.session < 1 << 21 and len(got.secret) == 32

    def expect_stream(self, steps: list[dict]) -> None:
        """Recorded TOKENS frames that may split differently live: the same tokens from the same start,
        each frame a step (HAS_STEP) following the one before, FINISHED on the last only."""
        want = [t for s in steps for t in s["frame"]["tokens"]]
        got: list[int] = []
        start = steps[0]["frame"]["start"]
        while True:
            f = self.recv(steps[0]["conn"])
            assert isinstance(f, wire.Tokens), f
            assert f.start == start + len(got) and f.drafted is not None and f.accepted <= f.drafted
            got.extend(f.tokens)
            if f.finished:
                break
        assert got == want

    def run(self, steps: list[dict]) -> None:
        i = 0
        while i < len(steps):
            step = steps[i]
            conn = step["conn"]
            if step["dir"] == "edge->cloud":
                if step.get("disconnect"):
                    self.socks.pop(conn).close()
                else:
                    self.send(step)
            elif step.get("eof"):
                assert self.recv(conn) is None, "the cloud should close the connection here"
                self.socks.pop(conn).close()
            elif self.check == "stream" and step["frame"]["type"] == "TOKENS":
                j = i
                while j < len(steps) and (steps[j].get("frame") or {}).get("type") == "TOKENS":
                    j += 1
                self.expect_stream(steps[i:j])
                i = j
                continue
            else:
                self.expect(step)
            i += 1

    def close(self) -> None:
        for s in self.socks.values():
            s.close()


@pytest.mark.parametrize("session", SESSIONS["sessions"], ids=[s["name"] for s in SESSIONS["sessions"]])
def test_every_recorded_session_replays_against_a_live_cloud(session):
    toy = {k: v for k, v in session["target"]["toy"].items() if k != "pass_s"}  # pacing only shaped the recording
    config = dict(session["server"])
    if "tenants" in config:
        config["tenants"] = {name: token.encode() for name, token in config["tenants"].items()}
    target = ToyModel(**toy)
    assert target.tokenizer.fingerprint == SESSIONS["model_id"]
    with CloudServerThread(target, ServerConfig(port=0, **config)) as srv:
        replay = Replay(srv.port, session["check"])
        try:
            replay.run(session["steps"])
        finally:
            replay.close()


def test_the_recorded_sessions_show_every_mode_and_end_as_the_spec_says():
    modes = {s["frame"]["mode"] for x in SESSIONS["sessions"] for s in x["steps"]
             if s.get("frame") and s["frame"]["type"] == "HELLO"}
    assert modes == {int(m) for m in wire.Mode}
    for x in SESSIONS["sessions"]:
        tokens = [s["frame"] for s in x["steps"] if s.get("frame") and s["frame"]["type"] == "TOKENS"]
        if tokens:  # a stream ends in exactly one FINISHED frame
            assert [t["flags"] & 1 for t in tokens].count(1) >= 1 and tokens[-1]["flags"] & 1


# ------------------------------------------------------------------------------------------ coupled.json
# A port of the spec's description of the coupled sampler's RNG, in plain Python integers: what another
# language implements. It must reproduce numpy (which the product uses) and the file.

M32, M64, M128 = (1 << 32) - 1, (1 << 64) - 1, (1 << 128) - 1
PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645


def entropy_words(*values: int) -> list[int]:
    out = []
    for n in values:
        words = [n & M32]
        n >>= 32
        while n:
            words.append(n & M32)
            n >>= 32
        out += words
    return out


def seed_sequence(entropy: list[int], n_words: int = 8) -> tuple[list[int], list[int]]:
    """(pool, generated words) of numpy's SeedSequence (pool size 4) over 32-bit `entropy` words."""
    hc = 0x43B0D7E5

    def hashmix(v: int) -> int:
        nonlocal hc
        v ^= hc
        hc = (hc * 0x931E8875) & M32
        v = (v * hc) & M32
        return v ^ (v >> 16)

    def mix(x: int, y: int) -> int:
        r = (0xCA01F9DD * x - 0x4973F715 * y) & M32
        return r ^ (r >> 16)

    pool = [hashmix(entropy[i] if i < len(entropy) else 0) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    hc, out = 0x8B51F9DD, []
    for i in range(n_words):
        v = pool[i % 4] ^ hc
        hc = (hc * 0x58F38DED) & M32
        v = (v * hc) & M32
        out.append(v ^ (v >> 16))
    return pool, out


class Pcg64:
    def __init__(self, words: list[int]) -> None:
        s = [words[2 * i] | words[2 * i + 1] << 32 for i in range(4)]
        init_state, init_seq = s[0] << 64 | s[1], s[2] << 64 | s[3]
        self.inc = (init_seq << 1 | 1) & M128
        self.state = 0
        self._step()
        self.state = (self.state + init_state) & M128
        self._step()

    def _step(self) -> None:
        self.state = (self.state * PCG_MULT + self.inc) & M128

    def next64(self) -> int:
        self._step()
        x = ((self.state >> 64) ^ self.state) & M64
        rot = self.state >> 122
        return ((x >> rot) | (x << (64 - rot))) & M64

    def next_double(self) -> float:
        return (self.next64() >> 11) * (1.0 / 9007199254740992.0)

    def gumbel(self) -> float:
        while True:
            u = 1.0 - self.next_double()
            if u < 1.0:
                return -math.log(-math.log(u))


def port_noise(seed: int, pos: int, vocab: int) -> list[float]:
    rng = Pcg64(seed_sequence(entropy_words(seed, pos))[1])
    return [rng.gumbel() for _ in range(vocab)]


def port_sample(dist: list[float], seed: int, pos: int) -> int:
    live = [i for i, p in enumerate(dist) if p > 0]
    if len(live) == 1:
        return live[0]
    g = port_noise(seed, pos, len(dist))
    scores = [math.log(p) + g[i] if p > 0 else -math.inf for i, p in enumerate(dist)]
    return max(range(len(dist)), key=lambda i: (scores[i], -i))  # the lowest id on a tie


@pytest.mark.parametrize("vec", COUPLED["rng"], ids=lambda v: f"seed{v['seed']}-pos{v['pos']}")
def test_the_coupled_rngs_intermediate_values_match_a_port_of_the_spec(vec):
    seed, pos = int(vec["seed"]), int(vec["pos"])
    assert entropy_words(seed, pos) == vec["entropy_words"]
    pool, words = seed_sequence(vec["entropy_words"])
    assert pool == vec["pool"] and words == vec["state_words"]
    rng = Pcg64(words)
    assert f"{rng.state:032x}" == vec["pcg64_state"] and f"{rng.inc:032x}" == vec["pcg64_inc"]
    assert [f"{rng.next64():016x}" for _ in range(3)] == vec["first_uint64"]
    again = Pcg64(words)
    assert [again.next_double() for _ in range(3)] == vec["first_doubles"]


@pytest.mark.parametrize("vec", COUPLED["noise"], ids=lambda v: f"seed{v['seed']}-pos{v['pos']}-V{v['vocab']}")
def test_coupled_noise_from_numpy_and_from_the_port_is_the_recorded_noise(vec):
    seed, pos, vocab = int(vec["seed"]), int(vec["pos"]), vec["vocab"]
    g = gumbel_noise(seed, pos, vocab)
    if "gumbel" in vec:
        assert [float(x) for x in g] == vec["gumbel"]
        assert port_noise(seed, pos, vocab) == pytest.approx(vec["gumbel"], rel=1e-12, abs=1e-12)
    else:
        port = port_noise(seed, pos, vocab)
        for i, value in vec["gumbel_at"].items():
            assert float(g[int(i)]) == value
            assert port[int(i)] == pytest.approx(value, rel=1e-12, abs=1e-12)


def test_coupled_samples_are_the_recorded_tokens_from_numpy_and_from_the_port():
    cases = [(int(s["seed"]), int(s["pos"]), s["dist"], s["token"]) for s in COUPLED["samples"]]
    text = COUPLED["text"]
    cases += [(int(text["seed"]), int(s["pos"]), s["dist"], s["token"]) for s in text["steps"]]
    for seed, pos, dist, token in cases:
        assert coupled_sample(np.asarray(dist, dtype=np.float64), seed, pos) == token
        assert port_sample(dist, seed, pos) == token
