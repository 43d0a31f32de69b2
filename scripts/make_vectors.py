"""Regenerate the wire protocol's language-neutral test vectors in spec/vectors/ (docs/reference/wire.md).

    PYTHONPATH=. .venv/bin/python scripts/make_vectors.py [--out spec/vectors]

- frames.json: frames as hex with their decoded fields (every type, edge cases, maximum values), the
  malformed frames with the error each must produce, and the committed digest and vocabulary
  fingerprint of a few inputs.
- sessions.json: whole sessions recorded against a real `CloudServerThread` serving a toy target on
  127.0.0.1 (cloud-only, cloud-led, sync, pipelined, RESUME, BUSY, auth, refusals).
- coupled.json: the coupled sampler's noise: every intermediate value of its RNG (SeedSequence, PCG64),
  Gumbel noise, and sampled tokens, for seeds and positions that exercise every branch.

Everything except the recorded sessions' random ids, secrets and timings is deterministic: rerunning
the script rewrites the same files up to those fields (and, in cloud-led sessions, to how the stream
splits into steps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from acespec import wire
from acespec.cloud.server import CloudServerThread, ServerConfig
from acespec.loop import SpecConfig, generate
from acespec.models.base import vocab_fingerprint
from acespec.models.toy import ToyModel
from acespec.verify import coupled_sample, gumbel_noise
from acespec.verify.sampling import SamplingParams, probs_from_logits

HOST = "127.0.0.1"
V = 64
MODEL_ID = f"toy:vocab={V}"
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
P = len(PROMPT)
IO_TIMEOUT_S = 10.0

# ------------------------------------------------------------------------------------------ frames <-> JSON


def f32(x: float) -> float:
    """The value an f32 field really carries (what decode returns)."""
    return struct.unpack(">f", struct.pack(">f", x))[0]


def frame_json(f) -> dict[str, Any]:
    """A frame's fields as JSON: bytes as hex, token lists as lists, rows as [[id, prob], ...], enums as
    their numbers, and the flags byte of DRAFT, VERDICT and TOKENS spelled out."""
    t = f.TYPE
    out: dict[str, Any] = {"type": t.name}
    if isinstance(f, wire.Hello):
        out.update(version=f.version, auth=f.auth.hex(), model_id=f.model_id, temperature=f.temperature, top_k=f.top_k,
                   top_p=f.top_p, rule=f.rule, seed=str(f.seed), mode=int(f.mode), max_tokens=f.max_tokens,
                   logprobs=f.logprobs, prompt=list(f.prompt))
    elif isinstance(f, wire.Welcome):
        out.update(session=f.session, committed=f.committed, max_draft_tokens=f.max_draft_tokens, secret=f.secret.hex())
    elif isinstance(f, wire.Draft):
        flags = (1 if f.q is not None else 0) | (2 if f.parents is not None else 0)
        out.update(session=f.session, seq=f.seq, base=f.base, flags=flags, tokens=list(f.tokens),
                   q=None if f.q is None else [[list(pair) for pair in row] for row in f.q],
                   parents=None if f.parents is None else list(f.parents))
    elif isinstance(f, wire.Verdict):
        flags = (1 if f.dropped else 0) | (2 if f.p is not None else 0) | (4 if f.path is not None else 0) | (
            8 if f.finished else 0)
        out.update(seq=f.seq, flags=flags, accepted=f.accepted, next_token=f.next_token, verify_us=f.verify_us,
                   committed=f.committed, p=None if f.p is None else [list(pair) for pair in f.p],
                   path=None if f.path is None else list(f.path))
    elif isinstance(f, wire.Resume):
        out.update(version=f.version, auth=f.auth.hex(), session=f.session, secret=f.secret.hex(),
                   committed=f.committed,
                   digest=f.digest.hex())
    elif isinstance(f, (wire.Ping, wire.Pong)):
        out.update(nonce=str(f.nonce), sent_us=str(f.sent_us))
    elif isinstance(f, wire.Error):
        out.update(code=int(f.code), message=f.message)
    elif isinstance(f, wire.Close):
        out.update(reason=int(f.reason))
    elif isinstance(f, wire.Tokens):
        flags = (1 if f.finished else 0) | (2 if f.drafted is not None else 0) | (4 if f.logprobs is not None else 0)
        out.update(start=f.start, tokens=list(f.tokens), flags=flags)
        if f.drafted is not None:
            out.update(drafted=f.drafted, accepted=f.accepted, verify_us=f.verify_us)
        if f.logprobs is not None:
            out.update(logprobs=[[lp, [list(pair) for pair in top]] for lp, top in f.logprobs])
    return out


# ------------------------------------------------------------------------------------------ frames.json


def valid_frames() -> list[tuple[str, Any]]:
    big = (1 << 64) - 1
    vocab_max = wire.Limits().max_vocab - 1
    return [
        ("hello-greedy-cloud-led", wire.Hello(model_id=MODEL_ID, max_tokens=64, prompt=PROMPT, temperature=0.0,
                                              rule="greedy", seed=0, mode=wire.Mode.CLOUD_LED)),
        ("hello-sampling-strict-with-auth", wire.Hello(model_id="vocab:151936:0123456789abcdef", max_tokens=256,
                                                       prompt=(151643, 872, 198), auth=b"alice-token",
                                                       temperature=f32(0.8), top_k=40, top_p=f32(0.95),
                                                       rule="strict", seed=42)),
        ("hello-cloud-only-max-tokens-0", wire.Hello(model_id=MODEL_ID, max_tokens=0, prompt=(7,), temperature=0.0,
                                                     rule="greedy", mode=wire.Mode.CLOUD_ONLY)),
        ("hello-relaxed-rule-max-seed", wire.Hello(model_id="toy:vocab=64", max_tokens=300, prompt=(0, 127, 128, 16383,
                                                   16384), temperature=1.0, rule="cactus:delta=0.35", seed=big)),
        ("hello-empty-prompt-decodes", wire.Hello(model_id=MODEL_ID, max_tokens=1, prompt=())),
        ("welcome", wire.Welcome(session=1234567, committed=8, max_draft_tokens=64, secret=bytes(range(32)))),
        ("welcome-largest-session-id", wire.Welcome(session=(1 << 21) - 1, committed=300, max_draft_tokens=64,
                                                    secret=b"\xff" * 32)),
        ("draft-plain-k4", wire.Draft(session=1234567, seq=0, base=8, tokens=(17, 42, 5, 63))),
        ("draft-empty", wire.Draft(session=5, seq=3, base=15, tokens=())),
        ("draft-with-q", wire.Draft(session=5, seq=1, base=12, tokens=(9, 33),
                                    q=(((9, f32(0.75)), (2, f32(0.25))), ((33, 1.0),)))),
        ("draft-with-empty-q-row", wire.Draft(session=5, seq=2, base=12, tokens=(9,), q=((),))),
        ("draft-tree", wire.Draft(session=5, seq=4, base=20, tokens=(1, 2, 3, 7, 8), parents=(0, 1, 2, 1, 4))),
        ("draft-q-and-tree", wire.Draft(session=5, seq=5, base=20, tokens=(1, 7), q=(((1, 0.5),), ((7, 1.0),)),
                                        parents=(0, 0))),
        ("draft-64-tokens-max-ids", wire.Draft(session=(1 << 21) - 1, seq=big, base=1 << 40,
                                               tokens=(vocab_max,) * 64)),
        ("verdict-accept-all", wire.Verdict(seq=0, accepted=4, next_token=11, verify_us=2500, committed=13)),
        ("verdict-reject", wire.Verdict(seq=1, accepted=1, next_token=20, verify_us=1800, committed=15)),
        ("verdict-dropped", wire.Verdict(seq=2, accepted=0, next_token=0, verify_us=0, committed=15, dropped=True)),
        ("verdict-finished", wire.Verdict(seq=4, accepted=1, next_token=29, verify_us=900, committed=18,
                                          finished=True)),
        ("verdict-dropped-finished", wire.Verdict(seq=5, accepted=0, next_token=0, verify_us=0, committed=18,
                                                  dropped=True, finished=True)),
        ("verdict-with-p-and-path", wire.Verdict(seq=9, accepted=2, next_token=4, verify_us=1, committed=30,
                                                 p=((4, 0.5), (6, f32(0.3))), path=(0, 3))),
        ("verdict-empty-path", wire.Verdict(seq=9, accepted=0, next_token=4, verify_us=1, committed=30, path=())),
        ("resume", wire.Resume(session=1234567, committed=13, auth=b"", secret=bytes(range(32)),
                               digest=wire.committed_digest(list(PROMPT) + [1, 2, 3, 4, 5]))),
        ("ping", wire.Ping(nonce=1, sent_us=1_700_000_000_000_000)),
        ("pong-max", wire.Pong(nonce=big, sent_us=big)),
        ("error-busy", wire.Error(code=wire.ErrorCode.BUSY, message="the server holds 8 sessions; retry later")),
        ("error-empty-message", wire.Error(code=wire.ErrorCode.INTERNAL, message="")),
        ("error-512-byte-message", wire.Error(code=wire.ErrorCode.BAD_REQUEST, message="é" * 256)),
        ("close-normal", wire.Close(reason=wire.CloseReason.NORMAL)),
        ("close-going-away", wire.Close(reason=wire.CloseReason.GOING_AWAY)),
        ("close-error", wire.Close(reason=wire.CloseReason.ERROR)),
        ("close-idle", wire.Close(reason=wire.CloseReason.IDLE)),
        ("tokens-cloud-only", wire.Tokens(start=8, tokens=(42,))),
        ("tokens-cloud-only-finished", wire.Tokens(start=13, tokens=(7,), finished=True)),
        ("tokens-empty-finished", wire.Tokens(start=8, tokens=(), finished=True)),
        ("tokens-cloud-led-step", wire.Tokens(start=20, tokens=(1, 2, 3, 9), drafted=4, accepted=3, verify_us=31000)),
        ("tokens-cloud-led-plain-step-finished", wire.Tokens(start=24, tokens=(5,), finished=True, drafted=0,
                                                             accepted=0, verify_us=12000)),
        ("tokens-cloud-led-empty-finished", wire.Tokens(start=8, tokens=(), finished=True, drafted=0)),
        ("hello-cloud-only-logprobs-top-3", wire.Hello(model_id=MODEL_ID, max_tokens=4, prompt=PROMPT, temperature=0.0,
                                                       rule="greedy", mode=wire.Mode.CLOUD_ONLY, logprobs=4)),
        ("tokens-with-logprobs", wire.Tokens(start=8, tokens=(42, 7), logprobs=(
            (-0.125, ((42, -0.125), (3, -2.5))), (-3.25, ((5, -0.5), (9, -1.5)))))),
        ("tokens-cloud-led-step-with-logprobs-only-the-token", wire.Tokens(
            start=20, tokens=(1, 9), drafted=2, accepted=1, verify_us=31000, logprobs=((-0.0, ()), (-9999.0, ())))),
        ("tokens-empty-finished-with-logprobs", wire.Tokens(start=12, tokens=(), finished=True, logprobs=())),
    ]


def _payload(kind: int, body: bytes) -> bytes:
    """A frame around any payload, its length prefix computed (for malformed payloads)."""
    return wire.encode_uvarint(1 + len(body)) + bytes([kind]) + body


def _v(n: int) -> bytes:
    return wire.encode_uvarint(n)


def _blob(b: bytes) -> bytes:
    return _v(len(b)) + b


def _hello_body(version=3, auth=b"", model=b"toy:vocab=64", temp=b"\x00\x00\x00\x00", top_k=b"\x00",
                top_p=b"\x3f\x80\x00\x00", rule=b"greedy", seed=b"\x00" * 8, mode=b"\x00", max_tokens=b"\x05",
                logprobs=b"\x00", prompt=b"\x01\x03") -> bytes:
    return (bytes([version]) + _blob(auth) + _blob(model) + temp + top_k + top_p + _blob(rule) + seed + mode
            + max_tokens + logprobs + prompt)


def malformed_frames() -> list[tuple[str, bytes, str, str]]:
    """(name, bytes, expected error, where: 'prefix' breaks the stream, 'payload' is consumed)."""
    BF, OL, BV = "BAD_FRAME", "OVER_LIMIT", "BAD_VERSION"
    draft = lambda flags, rest: _payload(3, _v(5) + _v(0) + _v(8) + bytes([flags]) + rest)  # noqa: E731
    tokens = lambda rest: _payload(10, _v(8) + rest)  # noqa: E731
    verdict = lambda flags, accepted, rest=b"": _payload(  # noqa: E731
        4, _v(1) + bytes([flags]) + _v(accepted) + _v(3) + _v(0) + _v(9) + rest)
    half = b"\x3f\x00\x00\x00"  # f32 0.5
    return [
        ("empty-input", b"", BF, "incomplete"),
        ("length-zero", b"\x00", BF, "prefix"),
        ("length-prefix-not-minimal", b"\x81\x00\x06", BF, "prefix"),
        ("length-over-max-frame-bytes", _v(262145) + b"\x06", OL, "prefix"),
        ("length-prefix-longer-than-3-bytes", b"\x80\x80\x80\x01", OL, "prefix"),
        ("truncated-length-prefix", b"\x80", BF, "incomplete"),
        ("truncated-frame", bytes.fromhex("110601"), BF, "incomplete"),
        ("trailing-bytes-after-frame", wire.encode(wire.Close()) + b"\x00", BF, "prefix"),
        ("unknown-frame-type-0", _payload(0, b""), BF, "payload"),
        ("unknown-frame-type-11", _payload(11, b""), BF, "payload"),
        ("trailing-byte-inside-payload", _payload(9, b"\x00\x00"), BF, "payload"),
        ("close-unknown-reason", _payload(9, b"\x04"), BF, "payload"),
        ("error-unknown-code-0", _payload(8, b"\x00\x00" + _blob(b"")), BF, "payload"),
        ("error-unknown-code-10", _payload(8, b"\x00\x0a" + _blob(b"")), BF, "payload"),
        ("error-message-513-bytes", _payload(8, b"\x00\x01" + _blob(b"x" * 513)), OL, "payload"),
        ("error-message-bad-utf8", _payload(8, b"\x00\x01" + _blob(b"\xc3\x28")), BF, "payload"),
        ("error-message-utf8-surrogate", _payload(8, b"\x00\x01" + _blob(b"\xed\xa0\x80")), BF, "payload"),
        ("hello-version-1", _payload(1, _hello_body(version=1)), BV, "payload"),
        ("hello-version-2-its-layout", _payload(1, _hello_body(version=2, logprobs=b"")), BV, "payload"),
        ("hello-version-4-any-layout", _payload(1, b"\x04\xff\xff"), BV, "payload"),
        ("hello-logprobs-22", _payload(1, _hello_body(logprobs=b"\x16")), BF, "payload"),
        ("hello-mode-3", _payload(1, _hello_body(mode=b"\x03")), BF, "payload"),
        ("hello-temperature-nan", _payload(1, _hello_body(temp=b"\x7f\xc0\x00\x00")), BF, "payload"),
        ("hello-temperature-infinite", _payload(1, _hello_body(temp=b"\x7f\x80\x00\x00")), BF, "payload"),
        ("hello-temperature-negative", _payload(1, _hello_body(temp=b"\xbf\x80\x00\x00")), BF, "payload"),
        ("hello-temperature-negative-zero", _payload(1, _hello_body(temp=b"\x80\x00\x00\x00")), None, "payload"),
        ("hello-top-p-over-1", _payload(1, _hello_body(top_p=b"\x3f\x80\x00\x01")), BF, "payload"),
        ("hello-model-id-4097-bytes", _payload(1, _hello_body(model=b"m" * 4097)), OL, "payload"),
        ("hello-prompt-token-at-max-vocab", _payload(1, _hello_body(prompt=b"\x01" + _v(1 << 22))), OL, "payload"),
        ("hello-prompt-32769-tokens", _payload(1, _hello_body(prompt=_v(32769) + b"\x01" * 32769)), OL, "payload"),
        ("hello-truncated-seed", _payload(1, _hello_body()[:-8]), BF, "payload"),
        ("varint-not-minimal", _payload(3, b"\x85\x00" + _v(0) + _v(8) + b"\x00\x00"), BF, "payload"),
        ("varint-11-bytes", _payload(3, b"\x80" * 10 + b"\x01" + _v(0) + _v(8) + b"\x00\x00"), BF, "payload"),
        ("varint-over-64-bits", _payload(3, b"\xff" * 9 + b"\x02" + _v(0) + _v(8) + b"\x00\x00"), BF, "payload"),
        ("varint-truncated-in-payload", _payload(3, b"\x85"), BF, "payload"),
        ("draft-reserved-flag-bit", draft(0x04, b"\x00"), BF, "payload"),
        ("draft-65-tokens", draft(0, _v(65) + b"\x01" * 65), OL, "payload"),
        ("draft-token-at-max-vocab", draft(0, b"\x01" + _v(1 << 22)), OL, "payload"),
        ("draft-q-row-duplicate-id", draft(1, b"\x01\x02" + b"\x02" + b"\x02" + half + b"\x02" + half), BF, "payload"),
        ("draft-q-prob-over-1", draft(1, b"\x01\x02" + b"\x01" + b"\x02\x3f\x80\x00\x01"), BF, "payload"),
        ("draft-q-prob-negative", draft(1, b"\x01\x02" + b"\x01" + b"\x02\xbe\x80\x00\x00"), BF, "payload"),
        ("draft-q-row-257-entries", draft(1, b"\x01\x02" + _v(257) + b"".join(_v(i) + half for i in range(257))), OL,
         "payload"),
        ("draft-q-row-missing", draft(1, b"\x02\x02\x03" + b"\x00"), BF, "payload"),
        ("draft-parent-points-forward", draft(2, b"\x02\x02\x03" + b"\x00\x02"), BF, "payload"),
        ("draft-first-parent-not-base", draft(2, b"\x01\x02" + b"\x01"), BF, "payload"),
        ("verdict-reserved-flag-bit", verdict(0x10, 0), BF, "payload"),
        ("verdict-accepted-65", verdict(0, 65), OL, "payload"),
        ("verdict-path-length-not-accepted", verdict(4, 2, b"\x01\x00"), BF, "payload"),
        ("verdict-path-not-increasing", verdict(4, 2, b"\x02\x01\x01"), BF, "payload"),
        ("verdict-path-index-64", verdict(4, 1, b"\x01\x40"), OL, "payload"),
        ("verdict-next-token-at-max-vocab", _payload(4, _v(1) + b"\x00" + _v(0) + _v(1 << 22) + _v(0) + _v(9)), OL,
         "payload"),
        ("welcome-secret-65-bytes", _payload(2, _v(1) + _v(8) + _v(64) + _blob(b"s" * 65)), OL, "payload"),
        ("resume-version-1", _payload(5, b"\x01" + _blob(b"") + _v(1) + _v(8)), BV, "payload"),
        ("resume-digest-65-bytes", _payload(5, b"\x03" + _blob(b"") + _v(1) + _blob(b"") + _v(8) + _blob(b"d" * 65)),
         OL, "payload"),
        ("ping-truncated", _payload(6, b"\x00" * 15), BF, "payload"),
        ("tokens-reserved-flag-bit", tokens(b"\x00\x08"), BF, "payload"),
        ("tokens-logprobs-missing", tokens(b"\x01\x05\x04"), BF, "payload"),
        ("tokens-logprob-above-0", tokens(b"\x01\x05\x04" + half + b"\x00"), BF, "payload"),
        ("tokens-logprob-below-the-floor", tokens(b"\x01\x05\x04" + b"\xc6\x1c\x40\x00" + b"\x00"), BF, "payload"),
        ("tokens-logprob-minus-infinity", tokens(b"\x01\x05\x04" + b"\xff\x80\x00\x00" + b"\x00"), BF, "payload"),
        ("tokens-logprobs-21-alternatives", tokens(b"\x01\x05\x04" + b"\x00" * 4 + _v(21)
                                                  + b"".join(_v(i) + b"\xbf\x80\x00\x00" for i in range(21))), OL, "payload"),
        ("tokens-logprobs-alternative-twice", tokens(b"\x01\x05\x04" + b"\x00" * 4 + _v(2)
                                                    + (_v(5) + b"\xbf\x80\x00\x00") * 2), BF, "payload"),
        ("tokens-accepted-over-drafted", tokens(b"\x00\x02" + _v(1) + _v(2) + _v(0)), BF, "payload"),
        ("tokens-drafted-65", tokens(b"\x00\x02" + _v(65) + _v(0) + _v(0)), OL, "payload"),
        ("tokens-32769", tokens(_v(32769) + b"\x01" * 32769 + b"\x00"), OL, "payload"),
    ]


def stream_behaviour(data: bytes) -> str:
    """What the same bytes do to a byte stream's decoder: 'incomplete' (it waits for more), 'payload' (the
    frame is consumed and refused, the stream stays in step) or 'prefix' (a bad length prefix: the stream is
    broken for good)."""
    dec = wire.FrameDecoder()
    try:
        frames = dec.feed(data)
    except wire.WireError:
        return "prefix" if dec.broken else "payload"
    assert not frames
    return "incomplete"


def frames_doc() -> dict[str, Any]:
    limits = wire.Limits()
    valid = []
    for name, f in valid_frames():
        data = wire.encode(f)
        assert wire.decode(data) == f, name
        valid.append({"name": name, "hex": data.hex(), "frame": frame_json(f)})
    bad = []
    for name, data, code, where in malformed_frames():
        try:
            got = wire.decode(data)
        except wire.WireError as e:
            assert code is not None and e.code.name == code, (name, e)
            assert stream_behaviour(data) == where, (name, stream_behaviour(data), where)
            bad.append({"name": name, "hex": data.hex(), "error": code, "code": int(wire.ErrorCode[code]),
                        "stream": where})
            continue
        # a frame that looks odd but is legal (negative zero is >= 0): listed with the valid ones
        assert code is None, (name, got)
        valid.append({"name": name, "hex": data.hex(), "frame": frame_json(got)})
    digests = [{"tokens": t, "digest": wire.committed_digest(t).hex()}
               for t in ([], [0], list(PROMPT), list(PROMPT) + [1, 2, 3, 4, 5], [127, 128, 16384, (1 << 22) - 1])]
    pieces = [[], [b"a"], [b"", b"<|im_end|>", "é".encode(), b"\x00\xff"], [b"ab", b"c"], [b"a", b"bc"]]
    prints = [{"pieces_hex": [p.hex() for p in ps], "fingerprint": vocab_fingerprint(len(ps), ps)} for ps in pieces]
    return {
        "about": "AceSpec wire protocol version 3 frame vectors; the format is docs/reference/wire.md. "
                 "`valid`: encode(frame) must give exactly `hex`, and decoding `hex` must give `frame` "
                 "(floats are the exact value of the f32 on the wire; u64 fields seed, nonce and sent_us are "
                 "decimal strings; bytes fields are hex). `malformed`: decoding `hex` as one whole frame must fail "
                 "with `error` (its ErrorCode number is `code`); `stream` = 'prefix' means the length prefix "
                 "itself is bad, which leaves a byte stream unusable, 'payload' that the frame's bytes are "
                 "consumed and the stream stays in step, 'incomplete' that a stream decoder simply waits for more "
                 "bytes. `committed_digest` and `vocab_fingerprint`: see wire.md.",
        "protocol_version": wire.PROTOCOL_VERSION,
        "limits": {"max_frame_bytes": limits.max_frame_bytes, "max_draft_tokens": limits.max_draft_tokens,
                   "max_prompt_tokens": limits.max_prompt_tokens, "max_sparse_k": limits.max_sparse_k,
                   "max_str_bytes": limits.max_str_bytes, "max_vocab": limits.max_vocab,
                   "max_secret_bytes": wire.MAX_SECRET_BYTES, "max_error_message_bytes": wire.MAX_ERROR_MESSAGE_BYTES,
                   "max_top_logprobs": wire.MAX_TOP_LOGPROBS, "logprob_floor": wire.LOGPROB_FLOOR},
        "valid": valid,
        "malformed": bad,
        "committed_digest": digests,
        "vocab_fingerprint": prints,
    }


# ------------------------------------------------------------------------------------------ sessions.json


class PacedToy(ToyModel):
    """A toy target whose every batched pass takes `pass_s`, as a real target's does: a cloud-led
    cloud then has steps left to verify an edge's DRAFT in (a bare toy streams a text in milliseconds)."""

    def __init__(self, *args, pass_s: float = 0.02, **kw) -> None:
        super().__init__(*args, **kw)
        self.pass_s = pass_s

    def _eval_batch(self, items):
        time.sleep(self.pass_s)
        return super()._eval_batch(items)


def greedy_text(n: int, eos: int = -1) -> list[int]:
    cfg = SpecConfig(rule="greedy", temperature=0.0, seed=0, max_tokens=n, spec=False)
    return list(generate(ToyModel(vocab=V, seed=1, eos=eos), list(PROMPT), cfg).tokens)


class Recorder:
    """Raw-frame client connections that log every frame both ways, in the order this script saw them."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.steps: list[dict] = []
        self.socks: dict[int, socket.socket] = {}
        self.decs: dict[int, wire.FrameDecoder] = {}

    def _sock(self, conn: int) -> socket.socket:
        if conn not in self.socks:
            s = socket.create_connection((HOST, self.port), timeout=IO_TIMEOUT_S)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks[conn], self.decs[conn] = s, wire.FrameDecoder()
        return self.socks[conn]

    def send(self, conn: int, f, vary: tuple[str, ...] = ()) -> None:
        data = wire.encode(f)
        self._sock(conn).sendall(data)
        step = {"conn": conn, "dir": "edge->cloud", "hex": data.hex(), "frame": frame_json(wire.decode(data))}
        if vary:
            step["vary"] = list(vary)
        self.steps.append(step)

    def send_raw(self, conn: int, data: bytes, note: str) -> None:
        self._sock(conn).sendall(data)
        self.steps.append({"conn": conn, "dir": "edge->cloud", "hex": data.hex(), "frame": None, "note": note})

    def recv(self, conn: int, vary: tuple[str, ...] = ()):
        f = wire.recv_frame(self._sock(conn), self.decs[conn])
        assert f is not None, "the cloud closed the connection"
        step = {"conn": conn, "dir": "cloud->edge", "hex": wire.encode(f).hex(), "frame": frame_json(f)}
        if isinstance(f, wire.Error):
            vary = (*vary, "message")
        if vary:
            step["vary"] = list(vary)
        self.steps.append(step)
        return f

    def eof(self, conn: int) -> None:
        """The cloud closes the connection now (nothing more comes)."""
        assert wire.recv_frame(self._sock(conn), self.decs[conn]) is None
        self.socks.pop(conn).close()
        self.steps.append({"conn": conn, "dir": "cloud->edge", "eof": True})

    def hang_up(self, conn: int) -> None:
        """The edge drops the TCP connection without a CLOSE (a reset link, say)."""
        self.socks.pop(conn).close()
        self.steps.append({"conn": conn, "dir": "edge->cloud", "disconnect": True})
        time.sleep(0.2)  # the cloud notices, and parks the session for its RESUME


WELCOME_VARY = ("session", "secret")


def hello(**kw) -> wire.Hello:
    base = dict(model_id=MODEL_ID, max_tokens=6, prompt=PROMPT, temperature=0.0, rule="greedy", seed=0)
    base.update(kw)
    return wire.Hello(**base)


def record(name: str, about: str, target: dict, config: dict, script, check: str = "exact") -> dict:
    paced = target.pop("pass_s", None)
    model = PacedToy(pass_s=paced, **target) if paced else ToyModel(**target)
    cfg = {k: (v if k != "tenants" else {n: t.encode() for n, t in v.items()}) for k, v in config.items()}
    with CloudServerThread(model, ServerConfig(port=0, **cfg)) as srv:
        rec = Recorder(srv.port)
        script(rec)
        for s in rec.socks.values():
            s.close()
    toy = dict(target, **({"pass_s": paced} if paced else {}))
    return {"name": name, "about": about, "check": check, "target": {"toy": toy},
            "server": config, "steps": rec.steps}


def sessions_doc() -> dict[str, Any]:
    text = greedy_text(20)
    out = []

    def cloud_only(r: Recorder) -> None:
        r.send(0, hello(mode=wire.Mode.CLOUD_ONLY, max_tokens=4))
        r.recv(0, WELCOME_VARY)
        while not r.recv(0).finished:
            pass
        r.send(0, wire.Ping(nonce=7, sent_us=123456789))
        r.recv(0)
        r.send(0, wire.Close(reason=wire.CloseReason.NORMAL))
        r.eof(0)

    out.append(record("cloud-only", "A greedy cloud-only session: one TOKENS frame per step, the last FINISHED at "
                      "max_tokens; a PING after it is answered; the edge closes.", {"vocab": V, "seed": 1}, {},
                      cloud_only))

    def cloud_only_logprobs(r: Recorder) -> None:
        r.send(0, hello(mode=wire.Mode.CLOUD_ONLY, max_tokens=3, logprobs=1 + 2))
        r.recv(0, WELCOME_VARY)
        while not r.recv(0).finished:
            pass
        r.send(0, wire.Close(reason=wire.CloseReason.NORMAL))
        r.eof(0)
        r.send(1, hello(mode=wire.Mode.SPECULATIVE, max_tokens=3, logprobs=1))
        r.recv(1)
        r.recv(1)
        r.eof(1)

    out.append(record("cloud-only-logprobs", "A greedy cloud-only session that asks for logprobs with 2 alternatives "
                      "(HELLO.logprobs = 3): every TOKENS frame carries HAS_LOGPROBS, each token's log-probability "
                      "under the toy target and its 2 likeliest tokens. The same HELLO in edge-led mode is refused "
                      "(BAD_REQUEST).", {"vocab": V, "seed": 1}, {}, cloud_only_logprobs))

    eos = next(t for i, t in enumerate(text) if i >= 2 and t not in text[:i])
    n_eos = greedy_text(20, eos=eos).index(eos) + 1

    def cloud_only_eos(r: Recorder) -> None:
        r.send(0, hello(mode=wire.Mode.CLOUD_ONLY, max_tokens=20))
        r.recv(0, WELCOME_VARY)
        while not r.recv(0).finished:
            pass
        r.send(0, wire.Close())
        r.eof(0)

    out.append(record("cloud-only-eos", f"The target's end-of-sequence token ({eos}) ends the generation after "
                      f"{n_eos} of 20 tokens: it is the last token streamed, in the FINISHED frame.",
                      {"vocab": V, "seed": 1, "eos": eos}, {}, cloud_only_eos))

    def max_tokens_0(mode):
        def script(r: Recorder) -> None:
            r.send(0, hello(mode=mode, max_tokens=0))
            r.recv(0, WELCOME_VARY)
            r.recv(0)  # the empty FINISHED TOKENS
            r.send(0, wire.Close())
            r.eof(0)
        return script

    out.append(record("cloud-only-max-tokens-0", "max_tokens 0: WELCOME, then at once an empty TOKENS frame with "
                      "FINISHED.", {"vocab": V, "seed": 1}, {}, max_tokens_0(wire.Mode.CLOUD_ONLY)))
    out.append(record("cloud-led-max-tokens-0", "max_tokens 0 in cloud-led mode: the empty FINISHED TOKENS frame "
                      "carries HAS_STEP (drafted 0).", {"vocab": V, "seed": 1}, {}, max_tokens_0(wire.Mode.CLOUD_LED)))

    def cloud_led(r: Recorder) -> None:
        r.send(0, hello(mode=wire.Mode.CLOUD_LED, max_tokens=12))
        w = r.recv(0, WELCOME_VARY)
        # a chain that agrees with the stream from the prompt on: the cloud verifies it if it arrives in time
        r.send(0, wire.Draft(session=w.session, seq=1, base=P, tokens=tuple(text[:8])), ("session",))
        while not r.recv(0, ("verify_us",)).finished:
            pass
        r.send(0, wire.Close())
        r.eof(0)

    out.append(record("cloud-led", "A greedy cloud-led session (what the `auto` mode sends): the stream starts "
                      "unasked after WELCOME, one TOKENS frame with HAS_STEP per target step; the edge's DRAFT "
                      "(a chain from the prompt on) is verified by the steps it reaches in time. How the text splits "
                      "into steps, and drafted/accepted/verify_us, depend on timing: check the stream, not the frames.",
                      {"vocab": V, "seed": 1, "pass_s": 0.02}, {}, cloud_led, check="stream"))

    def sync(r: Recorder) -> None:
        r.send(0, hello(max_tokens=10))
        w = r.recv(0, WELCOME_VARY)
        sid = w.session
        d = lambda seq, base, toks: r.send(  # noqa: E731
            0, wire.Draft(session=sid, seq=seq, base=base, tokens=tuple(toks)), ("session",))
        d(0, P, text[0:4])  # all four right: accepted 4 + the bonus
        r.recv(0, ("verify_us",))
        wrong = (text[6] + 1) % V
        d(1, P + 5, [text[5], wrong, 0, 0])  # the second is wrong: accepted 1 + the recovered token
        r.recv(0, ("verify_us",))
        d(2, P + 5, [text[5], wrong])  # built on a prefix that never happened: dropped
        r.recv(0, ("verify_us",))
        r.send(0, wire.Ping(nonce=1, sent_us=5))
        r.recv(0)
        d(3, P + 7, [])  # no draft: one plain target step
        r.recv(0, ("verify_us",))
        d(4, P + 8, text[8:12])  # 4 right, but only 2 tokens of the budget are left: cut, FINISHED
        r.recv(0, ("verify_us",))
        d(5, P + 10, [])  # after FINISHED: dropped, FINISHED
        r.recv(0, ("verify_us",))
        r.send(0, wire.Close())
        r.eof(0)

    out.append(record("sync", "An edge-led (speculative) greedy session, one block at a time: a full accept, a "
                      "rejection, a stale block dropped, a PING, an empty block, a block cut to the token budget "
                      "(FINISHED; next_token is then the last kept draft token), a block after FINISHED.",
                      {"vocab": V, "seed": 1}, {}, sync))

    def pipelined(r: Recorder) -> None:
        r.send(0, hello(max_tokens=16))
        sid = r.recv(0, WELCOME_VARY).session
        d = lambda seq, base, toks: r.send(  # noqa: E731
            0, wire.Draft(session=sid, seq=seq, base=base, tokens=tuple(toks)), ("session",))
        d(0, P, text[0:3])
        d(1, P + 3, text[3:7])  # starts with the guessed bonus of block 0 (right): verified after the overlap
        d(2, P + 7, [(text[7] + 1) % V, 1, 2])  # its guessed bonus of block 1 is wrong: dropped
        for _ in range(3):
            r.recv(0, ("verify_us",))
        r.send(0, wire.Close())
        r.eof(0)

    out.append(record("pipelined", "Edge-led, pipelined: three blocks sent before any VERDICT. Each later block "
                      "begins with the edge's guess of the previous block's bonus token (the overlap): block 1's "
                      "guess is right and its other tokens are verified, block 2's is wrong and it is dropped. "
                      "VERDICTs come in DRAFT order.", {"vocab": V, "seed": 1}, {}, pipelined))

    def strict(r: Recorder) -> None:
        r.send(0, hello(max_tokens=8, temperature=0.8, rule="strict", seed=7))
        sid = r.recv(0, WELCOME_VARY).session
        q = (((text[0], 0.75), ((text[0] + 1) % V, 0.25)), ((text[1], 1.0),))
        r.send(0, wire.Draft(session=sid, seq=0, base=P, tokens=(text[0], text[1]), q=q), ("session",))
        r.recv(0, ("verify_us",))
        r.send(0, wire.Close())
        r.eof(0)

    out.append(record("strict-with-q", "A `strict` session at temperature 0.8: every DRAFT carries the drafter's "
                      "sparse q rows (HAS_Q). The cloud's accept/reject draws come from its own RNG seeded by "
                      "HELLO.seed, so the same frames give the same VERDICT.", {"vocab": V, "seed": 1}, {}, strict))

    def resume(r: Recorder) -> None:
        r.send(0, hello(max_tokens=12))
        w = r.recv(0, WELCOME_VARY)
        sid, secret = w.session, w.secret
        r.send(0, wire.Draft(session=sid, seq=0, base=P, tokens=tuple(text[:4])), ("session",))
        v = r.recv(0, ("verify_us",))
        r.hang_up(0)
        held = list(PROMPT) + text[: v.committed - P]
        r.send(1, wire.Resume(session=sid, committed=v.committed, secret=secret,
                              digest=wire.committed_digest(held[:-1] + [(held[-1] + 1) % V])), WELCOME_VARY)
        r.recv(1)  # the tokens differ: BAD_REQUEST
        r.recv(1)
        r.eof(1)
        back = P + 2  # the edge saw only two tokens: the cloud rolls back to them
        r.send(2, wire.Resume(session=sid, committed=back, secret=secret, digest=wire.committed_digest(held[:back])),
               WELCOME_VARY)
        r.recv(2, WELCOME_VARY)
        r.send(2, wire.Draft(session=sid, seq=0, base=back, tokens=tuple(text[2:5])), ("session",))
        r.recv(2, ("verify_us",))
        r.send(2, wire.Close())
        r.eof(2)
        r.send(3, wire.Resume(session=sid, committed=back, secret=secret, digest=wire.committed_digest(held[:back])),
               WELCOME_VARY)
        r.recv(3)  # closed by the edge's CLOSE: gone
        r.recv(3)
        r.eof(3)

    out.append(record("resume", "RESUME: the edge's connection drops after a VERDICT; a RESUME whose digest does not "
                      "match the cloud's tokens is refused (BAD_REQUEST); one at a shorter committed length the edge "
                      "holds rolls the cloud back there and the session goes on; after the edge's CLOSE the session "
                      "is gone (UNKNOWN_SESSION).", {"vocab": V, "seed": 1}, {}, resume))

    def resume_finished(r: Recorder) -> None:
        r.send(0, hello(mode=wire.Mode.CLOUD_ONLY, max_tokens=3))
        w = r.recv(0, WELCOME_VARY)
        while not r.recv(0).finished:
            pass
        r.hang_up(0)
        held = list(PROMPT) + text[:3]
        r.send(1, wire.Resume(session=w.session, committed=len(held), secret=w.secret,
                              digest=wire.committed_digest(held)), WELCOME_VARY)
        r.recv(1, WELCOME_VARY)
        r.recv(1)  # nothing left to generate: the empty FINISHED TOKENS
        r.send(1, wire.Close())
        r.eof(1)

    out.append(record("resume-after-finished", "A cloud-only session resumed at its very end (the edge lost the "
                      "connection before its CLOSE): WELCOME, then at once an empty FINISHED TOKENS frame.",
                      {"vocab": V, "seed": 1}, {}, resume_finished))

    def busy(r: Recorder) -> None:
        r.send(0, hello())
        r.recv(0, WELCOME_VARY)
        r.send(1, hello())
        r.recv(1)  # BUSY
        r.recv(1)  # CLOSE(ERROR)
        r.eof(1)
        r.send(0, wire.Close())
        r.eof(0)

    out.append(record("busy", "A server that holds max_sessions = 1 session answers a second HELLO with "
                      "ERROR(BUSY) and CLOSE(ERROR), then closes that connection; the first session is untouched.",
                      {"vocab": V, "seed": 1}, {"max_sessions": 1}, busy))

    def auth(r: Recorder) -> None:
        r.send(0, hello(auth=b"mallory-guess"))
        r.recv(0)
        r.recv(0)
        r.eof(0)
        r.send(1, hello(auth=b"alice-token", mode=wire.Mode.CLOUD_ONLY, max_tokens=1))
        r.recv(1, WELCOME_VARY)
        r.recv(1)
        r.send(1, wire.Close())
        r.eof(1)

    out.append(record("auth", "A server with a token file (tenant alice): a wrong token gets BAD_AUTH; alice's "
                      "token opens a session.", {"vocab": V, "seed": 1}, {"tenants": {"alice": "alice-token"}}, auth))

    def refusals(r: Recorder) -> None:
        r.send(0, hello(model_id="toy:vocab=65"))
        r.recv(0)
        r.recv(0)
        r.eof(0)
        r.send(1, hello(rule="cactus:delta=-1"))
        r.recv(1)
        r.recv(1)
        r.eof(1)
        r.send_raw(2, _payload(1, _hello_body(version=2, logprobs=b"")), "a HELLO of protocol version 2")
        r.recv(2)
        r.recv(2)
        r.eof(2)
        r.send(3, hello(max_tokens=5000))
        r.recv(3)
        r.recv(3)
        r.eof(3)
        r.send(4, hello())
        w = r.recv(4, WELCOME_VARY)
        r.send(4, wire.Draft(session=0, seq=0, base=P, tokens=(1,)))  # 0 is never a session id
        r.recv(4)
        r.recv(4)
        r.eof(4)
        r.send(5, wire.Ping(nonce=1, sent_us=1))
        r.recv(5)
        r.recv(5)
        r.eof(5)

    out.append(record("refusals", "Refusals, each ERROR followed by CLOSE(ERROR) and the end of the connection: a "
                      "model_id that is not the target's tokenizer fingerprint (MODEL_MISMATCH), a rule parameter "
                      "out of range (BAD_REQUEST), a protocol version the cloud does not speak (BAD_VERSION), "
                      "max_tokens over the server's cap (OVER_LIMIT), a DRAFT naming another session "
                      "(UNKNOWN_SESSION), a first frame that is neither HELLO nor RESUME (BAD_REQUEST).",
                      {"vocab": V, "seed": 1}, {"max_new_tokens": 4096}, refusals))
    return {
        "about": "Whole sessions recorded against a real AceSpec cloud (acespec.cloud.server) serving the toy target "
                 "`toy` (acespec/models/toy.py; its tokenizer fingerprint is 'toy:vocab=64') with ServerConfig "
                 "`server` on 127.0.0.1. Each step is one frame on connection `conn` (a new number = a new TCP "
                 "connection), in `dir`; `hex` is the frame, `frame` its fields (as in frames.json). `vary` lists "
                 "fields that differ from run to run (session ids and secrets are random, verify_us is a timing, "
                 "ERROR messages are free text): an edge replaying a session substitutes the live session and "
                 "secret, and compares every other field. {'eof': true} is the cloud closing the connection; "
                 "{'disconnect': true} the edge dropping it without a CLOSE. check = 'exact': the cloud's frames are "
                 "exactly these; 'stream': consecutive cloud TOKENS frames may split the same tokens differently, "
                 "with other step counts.",
        "protocol_version": wire.PROTOCOL_VERSION,
        "model_id": MODEL_ID,
        "sessions": out,
    }


# ------------------------------------------------------------------------------------------ coupled.json


def _hex(x: int, bits: int) -> str:
    return f"{x:0{bits // 4}x}"


def coupled_doc() -> dict[str, Any]:
    rngs = []
    for seed, pos in ((0, 0), (0, 8), (7, 12), (42, 100), ((1 << 32) + 5, 3), ((1 << 64) - 1, (1 << 32) + 1)):
        ss = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, pos])
        words = ss.generate_state(8, np.uint32)
        g = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, pos])
        st = g.bit_generator.state["state"]
        raw = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, pos]).bit_generator.random_raw(3)
        rngs.append({
            "seed": str(seed), "pos": str(pos),
            "entropy_words": [int(x) for x in np.concatenate([_words(seed), _words(pos)])],
            "pool": [int(x) for x in ss.pool],
            "state_words": [int(x) for x in words],
            "pcg64_state": _hex(st["state"], 128), "pcg64_inc": _hex(st["inc"], 128),
            "first_uint64": [_hex(int(x), 64) for x in raw],
            "first_doubles": [float(x) for x in np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, pos]).random(3)],
        })
    noise = []
    for seed, pos, vocab in ((0, 0, 8), (7, 12, 8), ((1 << 64) - 1, (1 << 32) + 1, 8), (42, 100, 64)):
        g = gumbel_noise(seed, pos, vocab)
        noise.append({"seed": str(seed), "pos": str(pos), "vocab": vocab, "gumbel": [float(x) for x in g]})
    big = gumbel_noise(5, 1000, 151936)
    noise.append({"seed": "5", "pos": "1000", "vocab": 151936,
                  "gumbel_at": {str(i): float(big[i]) for i in (0, 1, 2, 75967, 151935)}})
    samples = []
    rng = np.random.default_rng(2024)
    cases = [
        ("uniform-8", 0, 8, np.full(8, 1 / 8)),
        ("peaked-8", 7, 12, np.array([0.05, 0.6, 0.05, 0.1, 0.05, 0.05, 0.05, 0.05])),
        ("with-zeros-8", 7, 13, np.array([0.0, 0.5, 0.0, 0.25, 0.0, 0.25, 0.0, 0.0])),
        ("point-mass-8", 3, 9, np.array([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])),
    ]
    for i in range(6):
        d = rng.dirichlet(np.full(16, 0.5))
        cases.append((f"dirichlet-16-{i}", 11, 20 + i, d))
    for name, seed, pos, dist in cases:
        samples.append({"name": name, "seed": str(seed), "pos": str(pos), "dist": [float(x) for x in dist],
                        "token": coupled_sample(np.asarray(dist, dtype=np.float64), seed, pos)})
    # one text: the same seed at consecutive positions, one distribution per position
    seq = []
    for k in range(8):
        d = np.random.default_rng([99, k]).dirichlet(np.full(8, 1.0))
        seq.append({"pos": str(P + k), "dist": [float(x) for x in d], "token": coupled_sample(d, 3, P + k)})
    # a drafter that gets only the softmax row (temperature 1) makes its q from it as the cloud makes p
    p1 = np.random.default_rng(5).dirichlet(np.full(12, 0.7))
    p1[3] = p1[7]  # a tie at the cuts, broken by id
    p1 /= p1.sum()
    tempered = [
        {"temperature": t, "top_k": k, "top_p": tp,
         "q": [float(x) for x in probs_from_logits(np.log(p1), SamplingParams(temperature=t, top_k=k, top_p=tp))]}
        for t, k, tp in ((1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 4, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 5, 0.8))
    ]
    return {
        "about": "The coupled sampler (docs/reference/wire.md, 'Coupled sampling'): noise for (seed, position) is "
                 "numpy's default_rng([seed, position]).gumbel(size=vocab), i.e. SeedSequence over the uint32 words "
                 "of seed then of position, PCG64, and per element loc - scale*log(-log(1 - next_double)). `rng`: "
                 "every intermediate value (the entropy words, SeedSequence's pool and generated state, PCG64's "
                 "seeded 128-bit state and increment, its first outputs). `noise`: the Gumbel values. `samples`: "
                 "token = argmax(log dist + noise), lowest id on a tie, log 0 = -inf, and a point mass is its own "
                 "token. `text`: one seed (3), consecutive positions. 64/128-bit values are hex strings, seed and "
                 "position decimal strings. `tempered`: q after temperature, top-k and top-p from a softmax row `p1` "
                 "(logits = log p1), ties at a cut broken by id, as both sides compute their rows.",
        "rng": rngs,
        "noise": noise,
        "samples": samples,
        "text": {"seed": "3", "steps": seq},
        "tempered": {"p1": [float(x) for x in p1], "cases": tempered},
    }


def _words(n: int) -> np.ndarray:
    """numpy's SeedSequence entropy words of one non-negative int: 32-bit words, least significant first."""
    out = [n & 0xFFFFFFFF]
    n >>= 32
    while n:
        out.append(n & 0xFFFFFFFF)
        n >>= 32
    return np.array(out, dtype=np.uint64)


def write(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes, sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:12]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="spec/vectors")
    ap.add_argument("--only", choices=("frames", "sessions", "coupled"), help="write one file only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "frames"):
        write(out / "frames.json", frames_doc())
    if args.only in (None, "coupled"):
        write(out / "coupled.json", coupled_doc())
    if args.only in (None, "sessions"):
        write(out / "sessions.json", sessions_doc())


if __name__ == "__main__":
    main()
