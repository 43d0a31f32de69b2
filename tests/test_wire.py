"""Tests of the wire format (acespec.wire): layout, budgets, round trips, streaming and hostile input.

The byte layouts here are built with small reference encoders written independently of the module,
so a change to the format has to change this file too.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import socket
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acespec.wire import (
    DEFAULT_LIMITS,
    MAX_ERROR_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Close,
    CloseReason,
    Draft,
    Error,
    ErrorCode,
    FrameDecoder,
    FrameType,
    Hello,
    Limits,
    Mode,
    Ping,
    Pong,
    Resume,
    Tokens,
    Verdict,
    Welcome,
    WireError,
    committed_digest,
    decode,
    decode_uvarint,
    encode,
    encode_uvarint,
    read_frame,
    recv_frame,
    send_frame,
    write_frame,
    zigzag_decode,
    zigzag_encode,
)

BAD_FRAME = ErrorCode.BAD_FRAME
OVER_LIMIT = ErrorCode.OVER_LIMIT
BAD_VERSION = ErrorCode.BAD_VERSION

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Reference encoders, independent of the module under test.


def uv(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def f32(x: float) -> bytes:
    return struct.pack(">f", x)


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def blob(b: bytes) -> bytes:
    return uv(len(b)) + b


def toks(ids) -> bytes:
    return uv(len(ids)) + b"".join(uv(t) for t in ids)


def row(pairs) -> bytes:
    return uv(len(pairs)) + b"".join(uv(t) + f32(p) for t, p in pairs)


def frame(kind: int, payload: bytes) -> bytes:
    return uv(1 + len(payload)) + bytes([kind]) + payload


def hello_payload(version=3, auth=b"k", model=b"qwen", temp=f32(0.5), top_k=uv(20), top_p=f32(0.9),
                  rule=b"strict", seed=u64(7), mode=0, max_tokens=uv(100), logprobs=0, prompt=(1, 2, 3)) -> bytes:
    return (bytes([version]) + blob(auth) + blob(model) + temp + top_k + top_p + blob(rule) + seed
            + bytes([mode]) + max_tokens + bytes([logprobs]) + toks(prompt))


def draft_payload(flags=0, tokens=(5, 6), extra=b"", session=1, seq=2, base=3) -> bytes:
    return uv(session) + uv(seq) + uv(base) + bytes([flags]) + toks(tokens) + extra


def verdict_payload(flags=0, accepted=1, next_token=9, verify_us=1000, committed=12, extra=b"") -> bytes:
    return uv(4) + bytes([flags]) + uv(accepted) + uv(next_token) + uv(verify_us) + uv(committed) + extra


# Strategies.

token_ids = st.one_of(st.integers(0, 127), st.integers(0, DEFAULT_LIMITS.max_vocab - 1))
uint64 = st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))
probs = st.floats(0.0, 1.0, width=32)
rows = st.dictionaries(token_ids, probs, max_size=6).map(lambda d: tuple(d.items()))
texts = st.text(max_size=30)


@st.composite
def hellos(draw):
    return Hello(
        auth=draw(st.binary(max_size=40)),
        model_id=draw(texts),
        temperature=draw(st.floats(0.0, 1e6, width=32)),
        top_k=draw(uint64),
        top_p=draw(probs),
        rule=draw(st.sampled_from(["strict", "greedy", "coupled", "cactus:delta=0.35"]) | texts),
        seed=draw(uint64),
        mode=draw(st.sampled_from(Mode)),
        max_tokens=draw(uint64),
        logprobs=draw(st.integers(0, 21)),
        prompt=draw(st.lists(token_ids, max_size=60)),
    )


@st.composite
def drafts(draw):
    n = draw(st.integers(0, DEFAULT_LIMITS.max_draft_tokens))
    tokens = draw(st.lists(token_ids, min_size=n, max_size=n))
    q = draw(st.none() | st.lists(rows, min_size=n, max_size=n))
    parents = draw(st.none() | st.tuples(*[st.integers(0, i) for i in range(n)]))
    return Draft(session=draw(uint64), seq=draw(uint64), base=draw(uint64), tokens=tokens, q=q, parents=parents)


@st.composite
def verdicts(draw):
    path = draw(st.none() | st.lists(st.integers(0, 63), unique=True, max_size=64).map(sorted))
    accepted = len(path) if path is not None else draw(st.integers(0, 64))
    return Verdict(
        seq=draw(uint64),
        accepted=accepted,
        next_token=draw(token_ids),
        verify_us=draw(uint64),
        committed=draw(uint64),
        dropped=draw(st.booleans()),
        finished=draw(st.booleans()),
        p=draw(st.none() | rows),
        path=path,
    )


welcomes = st.builds(Welcome, session=uint64, committed=uint64, max_draft_tokens=uint64, secret=st.binary(max_size=64))
resumes = st.builds(Resume, auth=st.binary(max_size=40), session=uint64, committed=uint64,
                    secret=st.binary(max_size=64), digest=st.binary(max_size=64))
pings = st.builds(Ping, nonce=uint64, sent_us=uint64)
pongs = st.builds(Pong, nonce=uint64, sent_us=uint64)
errors = st.builds(Error, code=st.sampled_from(ErrorCode), message=st.text(max_size=100))
closes = st.builds(Close, reason=st.sampled_from(CloseReason))
@st.composite
def tokens_frames(draw):
    step = draw(st.booleans())  # a cloud-led step carries HAS_STEP
    drafted = draw(st.integers(0, DEFAULT_LIMITS.max_draft_tokens)) if step else None
    tokens = draw(st.lists(token_ids, max_size=100))
    logprobs = None
    if draw(st.booleans()):  # a session that asked for logprobs gets them on every TOKENS frame
        lp = st.floats(-9999.0, 0.0, width=32)
        top = st.dictionaries(token_ids, lp, max_size=20).map(lambda d: tuple(d.items()))
        logprobs = draw(st.lists(st.tuples(lp, top), min_size=len(tokens), max_size=len(tokens)))
    return Tokens(start=draw(uint64), tokens=tokens, finished=draw(st.booleans()),
                  drafted=drafted, accepted=draw(st.integers(0, drafted)) if step else 0,
                  verify_us=draw(uint64) if step else 0, logprobs=logprobs)


tokens_frames = tokens_frames()

FRAME_STRATEGIES = {
    FrameType.HELLO: hellos(),
    FrameType.WELCOME: welcomes,
    FrameType.DRAFT: drafts(),
    FrameType.VERDICT: verdicts(),
    FrameType.RESUME: resumes,
    FrameType.PING: pings,
    FrameType.PONG: pongs,
    FrameType.ERROR: errors,
    FrameType.CLOSE: closes,
    FrameType.TOKENS: tokens_frames,
}
any_frame = st.one_of(*FRAME_STRATEGIES.values())


def outcome(data: bytes, limits: Limits = DEFAULT_LIMITS):
    """decode(data), held to the contract: a frame that re-encodes to `data`, or a WireError code."""
    try:
        got = decode(data, limits)
    except WireError as exc:
        assert isinstance(exc.code, ErrorCode)
        return exc.code
    assert encode(got, limits) == data, "every frame has exactly one encoding"
    return got


def drain(chunks, limits: Limits = DEFAULT_LIMITS):
    """Feed chunks to a fresh FrameDecoder: (frames, first error code or None, pending bytes or None)."""
    decoder = FrameDecoder(limits)
    frames = []
    for chunk in chunks:
        try:
            frames += decoder.feed(chunk)
        except WireError as exc:
            return frames + list(exc.frames), exc.code, None
    return frames, None, decoder.pending


def split(data: bytes, cuts) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


# Primitives.


@given(st.integers(0, 2**64 - 1))
@FAST
def test_varint_matches_reference_leb128(n):
    assert encode_uvarint(n) == uv(n)
    assert decode_uvarint(b"\xaa" + uv(n) + b"\xbb", 1) == (n, 1 + len(uv(n)))


@given(st.integers(-(2**63), 2**63 - 1))
@FAST
def test_zigzag_round_trip(n):
    z = zigzag_encode(n)
    assert 0 <= z < 2**64 and zigzag_decode(z) == n


def test_zigzag_maps_small_magnitudes_to_small_values():
    assert [zigzag_encode(n) for n in (0, -1, 1, -2, 2)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "data",
    [b"", b"\x80", b"\x80\x00", b"\xff" * 10 + b"\x01", b"\xff" * 9 + b"\x02"],
    ids=["empty", "truncated", "not-minimal", "11-bytes", "over-2**64"],
)
def test_bad_varints(data):
    with pytest.raises(WireError) as info:
        decode_uvarint(data)
    assert info.value.code == BAD_FRAME


def test_largest_varint_is_ten_bytes():
    assert decode_uvarint(b"\xff" * 9 + b"\x01") == (2**64 - 1, 10)


# Exact layouts.

GOLDEN = [
    (
        Hello(auth=b"k", model_id="qwen", temperature=0.5, top_k=20, top_p=0.5, rule="strict", seed=7,
              mode=Mode.SPECULATIVE, max_tokens=100, prompt=[1, 2, 3]),
        frame(1, hello_payload(top_p=f32(0.5))),
    ),
    (Welcome(session=5, committed=300, max_draft_tokens=32, secret=b"s3"), frame(2, uv(5) + uv(300) + uv(32) + blob(b"s3"))),
    (Draft(session=1, seq=2, base=3, tokens=[5, 6]), frame(3, draft_payload())),
    (
        Draft(session=1, seq=2, base=3, tokens=[5, 6], q=[[(5, 0.5)], [(6, 0.25), (7, 0.125)]], parents=[0, 0]),
        frame(3, draft_payload(flags=3, extra=row([(5, 0.5)]) + row([(6, 0.25), (7, 0.125)]) + uv(0) + uv(0))),
    ),
    (
        Verdict(seq=4, accepted=1, next_token=9, verify_us=1000, committed=12),
        frame(4, verdict_payload()),
    ),
    (
        Verdict(seq=4, accepted=1, next_token=9, verify_us=1000, committed=12, dropped=True, finished=True,
                p=[(9, 0.75)], path=[1]),
        frame(4, verdict_payload(flags=0x0F, extra=row([(9, 0.75)]) + uv(1) + uv(1))),
    ),
    (Resume(auth=b"k", session=5, secret=b"s3", committed=300, digest=b"d"),
     frame(5, b"\x03" + blob(b"k") + uv(5) + blob(b"s3") + uv(300) + blob(b"d"))),
    (Ping(nonce=2**64 - 1, sent_us=123), frame(6, u64(2**64 - 1) + u64(123))),
    (Pong(nonce=1, sent_us=2), frame(7, u64(1) + u64(2))),
    (Error(code=ErrorCode.BUSY, message="é"), frame(8, b"\x00\x06" + blob("é".encode()))),
    (Close(reason=CloseReason.GOING_AWAY), frame(9, b"\x01")),
    (Tokens(start=10, tokens=[1, 300], finished=True), frame(10, uv(10) + toks([1, 300]) + b"\x01")),
    (Tokens(start=10, tokens=[1, 300], drafted=4, accepted=1, verify_us=200),
     frame(10, uv(10) + toks([1, 300]) + b"\x02" + uv(4) + uv(1) + uv(200))),
    (Tokens(start=10, tokens=[1, 300], drafted=1, accepted=1, verify_us=200,
            logprobs=[(-0.25, [(1, -0.25), (7, -2.0)]), (-1.5, [(300, -1.5), (2, -1.75)])]),
     frame(10, uv(10) + toks([1, 300]) + b"\x06" + uv(1) + uv(1) + uv(200)
           + f32(-0.25) + row([(1, -0.25), (7, -2.0)]) + f32(-1.5) + row([(300, -1.5), (2, -1.75)]))),
    (Tokens(start=3, tokens=[4], finished=True, logprobs=[(-9999.0, [])]),
     frame(10, uv(3) + toks([4]) + b"\x05" + f32(-9999.0) + row([]))),
]


@pytest.mark.parametrize("frame_obj, data", GOLDEN, ids=[type(f).__name__ for f, _ in GOLDEN])
def test_golden_bytes(frame_obj, data):
    assert encode(frame_obj) == data
    assert decode(data) == frame_obj


def test_every_frame_type_has_a_golden_example_and_a_strategy():
    assert {f.TYPE for f, _ in GOLDEN} == set(FrameType) == set(FRAME_STRATEGIES)


# Byte budgets.


def test_draft_budget_realistic_block():
    tokens = [150_000 + 37 * i for i in range(8)]
    data = encode(Draft(session=12, seq=70_000, base=1_500_000, tokens=tokens))
    token_bytes = sum(len(uv(t)) for t in tokens)
    assert token_bytes <= 3 * len(tokens)
    assert len(data) - token_bytes <= 16
    assert len(data) <= 4 * len(tokens) + 16


@pytest.mark.parametrize("k", [0, 1, 8, 39, 40, 64])
def test_draft_budget_worst_realistic_values(k):
    tokens = [2**21 - 1] * k
    data = encode(Draft(session=127, seq=2**21 - 1, base=2**21 - 1, tokens=tokens))
    assert len(data) - 3 * k <= 16


def test_verdict_budget():
    typical = Verdict(seq=2**14 - 1, accepted=64, next_token=2**21 - 1, verify_us=2**21 - 1, committed=2**21 - 1)
    assert len(encode(typical)) <= 16
    roomy = Limits(max_draft_tokens=127)
    assert len(encode(Verdict(seq=2**14 - 1, accepted=127, next_token=2**21 - 1, verify_us=2**21 - 1,
                              committed=2**21 - 1), roomy)) <= 16


def test_limits_fit_inside_the_frame_limit():
    """A frame at every count limit, with the largest ids, must still fit max_frame_bytes."""
    big = DEFAULT_LIMITS.max_vocab - 1
    k, top = DEFAULT_LIMITS.max_draft_tokens, DEFAULT_LIMITS.max_sparse_k
    full_q = [tuple((big - j, 1.0 / top) for j in range(top)) for _ in range(k)]
    draft = Draft(session=2**64 - 1, seq=2**64 - 1, base=2**64 - 1, tokens=[big] * k, q=full_q,
                  parents=list(range(k)))
    assert decode(encode(draft)) == draft
    hello = Hello(auth=b"a" * 4096, model_id="m" * 4096, rule="r" * 4096, max_tokens=1,
                  prompt=[big] * DEFAULT_LIMITS.max_prompt_tokens)
    assert decode(encode(hello)) == hello


# Round trips.


@pytest.mark.parametrize("kind", list(FrameType), ids=[t.name for t in FrameType])
def test_round_trip_every_type(kind):
    @given(FRAME_STRATEGIES[kind])
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def check(f):
        data = encode(f)
        assert decode(data) == f
        assert encode(decode(data)) == data
        _, prefix = decode_uvarint(data)
        assert data[prefix] == kind

    check()


def test_frames_accept_numpy_values_and_lists():
    listed = Draft(session=1, seq=2, base=3, tokens=[10, 20], q=[[(10, 0.5)], [(20, 1.0)]])
    arrays = Draft(session=np.int64(1), seq=np.uint32(2), base=3, tokens=np.array([10, 20]),
                   q=[[(np.int64(10), np.float32(0.5))], [(20, np.float64(1.0))]])
    assert encode(arrays) == encode(listed)
    assert decode(encode(listed)) == listed  # lists were normalised to tuples
    hash(listed)


def test_floats_travel_as_f32():
    got = decode(encode(Hello(model_id="m", max_tokens=1, prompt=[], temperature=0.1)))
    assert got.temperature == struct.unpack(">f", struct.pack(">f", 0.1))[0] != 0.1


def test_hello_repr_hides_auth():
    assert "secret" not in repr(Hello(model_id="m", max_tokens=1, prompt=[], auth=b"secret"))
    assert "secret" not in repr(Resume(session=1, committed=2, auth=b"secret", secret=b"secret"))
    assert "secret" not in repr(Welcome(session=1, committed=2, max_draft_tokens=4, secret=b"secret"))


def test_committed_digest_is_sha256_of_the_tokens_encoding():
    assert committed_digest([1, 300]) == hashlib.sha256(toks([1, 300])).digest()
    assert len(committed_digest([])) == 32
    assert committed_digest([1, 2]) != committed_digest([2, 1]) != committed_digest([1, 2, 0])


def test_error_message_is_truncated_at_a_character_boundary():
    message = "é" * 400  # 800 bytes, two per character
    got = decode(encode(Error(code=ErrorCode.INTERNAL, message=message)))
    assert got.message == "é" * (MAX_ERROR_MESSAGE_BYTES // 2)
    odd = "x" + "é" * 400  # the cut falls inside a character
    got = decode(encode(Error(code=ErrorCode.INTERNAL, message=odd))).message
    assert odd.startswith(got) and len(got.encode()) == MAX_ERROR_MESSAGE_BYTES - 1
    lone = decode(encode(Error(code=ErrorCode.INTERNAL, message="bad \udc80 text"))).message
    assert lone.startswith("bad ") and lone.endswith(" text")


# Incremental decoding.


@given(st.lists(any_frame, max_size=6), st.lists(st.integers(0, 10_000), max_size=12))
@FAST
def test_decoder_equals_one_shot_in_any_chunking(frames, cuts):
    stream = b"".join(encode(f) for f in frames)
    assert drain([stream]) == (frames, None, 0)
    assert drain(split(stream, cuts)) == (frames, None, 0)


@given(st.lists(any_frame, min_size=1, max_size=3))
@settings(max_examples=40, deadline=None)
def test_decoder_byte_by_byte(frames):
    stream = b"".join(encode(f) for f in frames)
    decoder, got = FrameDecoder(), []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == frames and decoder.pending == 0


def test_decoder_pending_and_wanted():
    data = encode(Ping(nonce=1, sent_us=2))
    decoder = FrameDecoder()
    assert decoder.pending == 0 and decoder.wanted == 1
    assert decoder.feed(data[:1]) == [] and decoder.wanted == len(data) - 1
    assert decoder.feed(data[1:5]) == [] and decoder.pending == 5 and decoder.wanted == len(data) - 5
    assert decoder.feed(data[5:] + data[:3]) == [Ping(nonce=1, sent_us=2)]
    assert decoder.pending == 3


def test_decoder_skips_a_bad_payload_and_carries_on():
    good = encode(Ping(nonce=1, sent_us=2))
    bad = frame(42, b"whatever")
    decoder = FrameDecoder()
    with pytest.raises(WireError) as info:
        decoder.feed(good + bad + good)
    assert info.value.code == BAD_FRAME
    assert info.value.frames == (Ping(nonce=1, sent_us=2),)  # decoded before the bad frame, not lost
    assert not decoder.broken
    assert decoder.feed(b"") == [Ping(nonce=1, sent_us=2)]  # the frame after the bad one
    over = encode(Draft(session=1, seq=1, base=0, tokens=[1] * 65), Limits(max_draft_tokens=65))
    with pytest.raises(WireError) as info:
        decoder.feed(over)
    assert info.value.code == OVER_LIMIT and decoder.pending == 0
    assert decoder.feed(good) == [Ping(nonce=1, sent_us=2)]


def test_decoder_is_broken_by_a_bad_length_prefix():
    decoder = FrameDecoder()
    with pytest.raises(WireError) as first:
        decoder.feed(b"\x00" + encode(Ping(nonce=1, sent_us=2)))
    assert first.value.code == BAD_FRAME and decoder.broken
    with pytest.raises(WireError) as again:
        decoder.feed(encode(Ping(nonce=1, sent_us=2)))
    assert again.value.code == BAD_FRAME


@pytest.mark.parametrize("size", [262_145, 2**32, 2**63])
def test_oversize_length_is_refused_from_the_prefix_alone(size):
    prefix = uv(size)
    decoder = FrameDecoder()
    for i, byte in enumerate(prefix):
        try:
            decoder.feed(bytes([byte]))
        except WireError as exc:
            assert exc.code == OVER_LIMIT
            assert i < len(uv(DEFAULT_LIMITS.max_frame_bytes))  # no more than the longest legal prefix
            break
    else:
        pytest.fail("oversize length prefix was accepted")
    with pytest.raises(WireError) as info:
        decode(prefix + b"\x06" + b"\x00" * 16)
    assert info.value.code == OVER_LIMIT


def test_largest_frame_is_accepted_and_one_more_byte_is_not():
    limits = Limits(max_frame_bytes=200)
    def tokens_frame(size):  # L = 1 type + 1 start + 2 count + n tokens + 1 flags
        return Tokens(start=0, tokens=[1] * (size - 5))
    assert len(encode(tokens_frame(200), limits)) == 202
    decode(encode(tokens_frame(200), limits), limits)
    with pytest.raises(WireError) as info:
        encode(tokens_frame(201), limits)
    assert info.value.code == OVER_LIMIT
    with pytest.raises(WireError) as info:
        decode(encode(tokens_frame(201)), limits)
    assert info.value.code == OVER_LIMIT


# Hostile input.


@given(st.binary(max_size=200))
@FUZZ
def test_random_bytes_decode_or_raise_wire_error(data):
    outcome(data)
    outcome(bytes([len(data) + 1 if len(data) < 127 else 1, data[0] % 12 if data else 6]) + data)
    drain([data])


def test_every_single_byte_change_of_the_golden_frames():
    """Exhaustive where the fuzzers sample: each byte of each golden frame set to each of 256 values,
    plus every truncation and a one-byte extension."""
    for _, data in GOLDEN:
        for i in range(len(data)):
            for value in range(256):
                mutant = bytearray(data)
                mutant[i] = value
                outcome(bytes(mutant))
            outcome(data[:i])
        outcome(data + b"\x00")


@st.composite
def mutated_frames(draw):
    data = bytearray(encode(draw(any_frame)))
    how = draw(st.sampled_from(["flip", "truncate", "extend", "prefix", "insert", "delete", "overwrite"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 3))):
            bit = draw(st.integers(0, 8 * len(data) - 1))
            data[bit // 8] ^= 1 << (bit % 8)
    elif how == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif how == "extend":
        data += draw(st.binary(min_size=1, max_size=20))
    elif how == "prefix":
        _, size = decode_uvarint(bytes(data))
        new = draw(st.integers(0, 2**40).map(uv) | st.binary(min_size=1, max_size=6))
        data[:size] = new
    elif how == "insert":
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.binary(min_size=1, max_size=4))
    elif how == "delete":
        at = draw(st.integers(0, len(data) - 1))
        del data[at : at + draw(st.integers(1, 4))]
    else:
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    return bytes(data)


@given(mutated_frames(), st.lists(st.integers(0, 10_000), max_size=8))
@FUZZ
def test_mutated_frames_decode_or_raise_wire_error(data, cuts):
    outcome(data)
    small = Limits(max_frame_bytes=64, max_draft_tokens=4, max_prompt_tokens=4, max_sparse_k=2,
                   max_str_bytes=8, max_vocab=1000)
    outcome(data, small)
    assert drain(split(data, cuts)) == drain([data])  # chunking never changes what comes out


@given(st.lists(any_frame, max_size=3), mutated_frames(), st.lists(any_frame, max_size=3),
       st.lists(st.integers(0, 10_000), max_size=10))
@FAST
def test_stream_with_a_bad_frame_gives_the_same_result_in_any_chunking(before, bad, after, cuts):
    stream = b"".join(map(encode, before)) + bad + b"".join(map(encode, after))
    whole = drain([stream])
    assert drain(split(stream, cuts)) == whole
    if len(stream) < 3000:  # byte by byte is slow for the odd huge draft
        assert drain([stream[i : i + 1] for i in range(len(stream))]) == whole
    assert whole[0][: len(before)] == before


MALFORMED = [
    ("no bytes", b"", BAD_FRAME, None),
    ("length 0", b"\x00", BAD_FRAME, None),
    ("length prefix not minimal", b"\x82\x00\x09\x00", BAD_FRAME, None),
    ("length prefix too long", b"\xff" * 11, OVER_LIMIT, None),
    ("frame over max_frame_bytes", uv(262_145), OVER_LIMIT, None),
    ("truncated frame", encode(Ping(nonce=1, sent_us=2))[:-1], BAD_FRAME, None),
    ("trailing bytes", encode(Ping(nonce=1, sent_us=2)) + b"\x00", BAD_FRAME, None),
    ("unread payload bytes", frame(6, u64(1) + u64(2) + b"\x00"), BAD_FRAME, None),
    ("short payload", frame(6, u64(1)), BAD_FRAME, None),
    ("frame type 0", frame(0, b""), BAD_FRAME, None),
    ("frame type 11", frame(11, b""), BAD_FRAME, None),
    ("frame type 255", frame(255, b"\x00"), BAD_FRAME, None),
    ("varint over 10 bytes", frame(2, b"\x80" * 10 + b"\x01" + uv(0) + uv(0)), BAD_FRAME, None),
    ("varint over 2**64", frame(2, b"\xff" * 9 + b"\x02" + uv(0) + uv(0)), BAD_FRAME, None),
    ("varint not minimal", frame(2, b"\x81\x00" + uv(0) + uv(0)), BAD_FRAME, None),
    ("truncated varint", frame(2, uv(0) + uv(0) + b"\x80"), BAD_FRAME, None),
    ("bad UTF-8", frame(1, hello_payload(model=b"\xff\xfe")), BAD_FRAME, None),
    ("overlong UTF-8", frame(1, hello_payload(rule=b"\xc0\x80")), BAD_FRAME, None),
    ("UTF-8 surrogate", frame(8, b"\x00\x01" + blob(b"\xed\xa0\x80")), BAD_FRAME, None),
    ("HELLO version 4", frame(1, hello_payload(version=4)), BAD_VERSION, None),
    ("HELLO version 2 (its layout)", frame(1, hello_payload(version=2)[:-5] + toks((1, 2, 3))), BAD_VERSION, None),
    ("HELLO version 1", frame(1, hello_payload(version=1)), BAD_VERSION, None),
    ("HELLO version 0", frame(1, hello_payload(version=0)), BAD_VERSION, None),
    ("HELLO version 4, unknown layout", frame(1, b"\x04\xff\xff"), BAD_VERSION, None),
    ("RESUME version 4", frame(5, b"\x04" + blob(b"") + uv(1) + blob(b"") + uv(1) + blob(b"")), BAD_VERSION, None),
    ("RESUME version 1 (its layout)", frame(5, b"\x01" + blob(b"") + uv(1) + uv(1)), BAD_VERSION, None),
    ("RESUME secret too long", frame(5, b"\x03" + blob(b"") + uv(1) + blob(b"s" * 65) + uv(1) + blob(b"")),
     OVER_LIMIT, None),
    ("RESUME digest too long", frame(5, b"\x03" + blob(b"") + uv(1) + blob(b"") + uv(1) + blob(b"d" * 65)),
     OVER_LIMIT, None),
    ("WELCOME secret too long", frame(2, uv(1) + uv(1) + uv(1) + blob(b"s" * 65)), OVER_LIMIT, None),
    ("WELCOME without its secret (v1 layout)", frame(2, uv(1) + uv(1) + uv(1)), BAD_FRAME, None),
    ("HELLO mode 3", frame(1, hello_payload(mode=3)), BAD_FRAME, None),
    ("HELLO logprobs 22 (over 1 + 20 alternatives)", frame(1, hello_payload(logprobs=22)), BAD_FRAME, None),
    ("HELLO temperature NaN", frame(1, hello_payload(temp=f32(math.nan))), BAD_FRAME, None),
    ("HELLO temperature inf", frame(1, hello_payload(temp=f32(math.inf))), BAD_FRAME, None),
    ("HELLO temperature < 0", frame(1, hello_payload(temp=f32(-1.0))), BAD_FRAME, None),
    ("HELLO top_p > 1", frame(1, hello_payload(top_p=f32(1.5))), BAD_FRAME, None),
    ("HELLO model_id too long", frame(1, hello_payload(model=b"m" * 4097)), OVER_LIMIT, None),
    ("HELLO auth too long", frame(1, hello_payload(auth=b"a" * 4097)), OVER_LIMIT, None),
    ("HELLO prompt too long", frame(1, hello_payload(prompt=range(5))), OVER_LIMIT, Limits(max_prompt_tokens=4)),
    ("HELLO prompt id >= max_vocab", frame(1, hello_payload(prompt=[2**22])), OVER_LIMIT, None),
    ("DRAFT 65 tokens", frame(3, draft_payload(tokens=[1] * 65)), OVER_LIMIT, None),
    ("DRAFT count beyond the payload", frame(3, draft_payload(tokens=[1] * 3)[:-2]), BAD_FRAME, None),
    ("DRAFT token id >= max_vocab", frame(3, draft_payload(tokens=[2**22])), OVER_LIMIT, None),
    ("DRAFT reserved flag", frame(3, draft_payload(flags=0x04)), BAD_FRAME, None),
    ("DRAFT HAS_Q without rows", frame(3, draft_payload(flags=0x01)), BAD_FRAME, None),
    ("DRAFT q row over max_sparse_k", frame(3, draft_payload(flags=1, tokens=[1], extra=uv(257))), OVER_LIMIT, None),
    ("DRAFT q NaN", frame(3, draft_payload(flags=1, tokens=[1], extra=uv(1) + uv(1) + f32(math.nan))), BAD_FRAME, None),
    ("DRAFT q negative", frame(3, draft_payload(flags=1, tokens=[1], extra=row([(1, -0.5)]))), BAD_FRAME, None),
    ("DRAFT q over 1", frame(3, draft_payload(flags=1, tokens=[1], extra=row([(1, 1.5)]))), BAD_FRAME, None),
    ("DRAFT q inf", frame(3, draft_payload(flags=1, tokens=[1], extra=row([(1, math.inf)]))), BAD_FRAME, None),
    ("DRAFT q token repeated", frame(3, draft_payload(flags=1, tokens=[1], extra=row([(1, 0.5), (1, 0.5)]))),
     BAD_FRAME, None),
    ("DRAFT q token >= max_vocab", frame(3, draft_payload(flags=1, tokens=[1], extra=row([(2**22, 0.5)]))),
     OVER_LIMIT, None),
    ("DRAFT parent points forward", frame(3, draft_payload(flags=2, tokens=[1, 2], extra=uv(0) + uv(2))),
     BAD_FRAME, None),
    ("VERDICT reserved flag", frame(4, verdict_payload(flags=0x10)), BAD_FRAME, None),
    ("VERDICT accepted over limit", frame(4, verdict_payload(accepted=65)), OVER_LIMIT, None),
    ("VERDICT next_token >= max_vocab", frame(4, verdict_payload(next_token=2**22)), OVER_LIMIT, None),
    ("VERDICT p NaN", frame(4, verdict_payload(flags=2, extra=uv(1) + uv(1) + f32(math.nan))), BAD_FRAME, None),
    ("VERDICT path count != accepted", frame(4, verdict_payload(flags=4, accepted=2, extra=toks([0]))),
     BAD_FRAME, None),
    ("VERDICT path not increasing", frame(4, verdict_payload(flags=4, accepted=2, extra=toks([3, 1]))),
     BAD_FRAME, None),
    ("VERDICT path index over limit", frame(4, verdict_payload(flags=4, accepted=1, extra=toks([64]))),
     OVER_LIMIT, None),
    ("ERROR code 0", frame(8, b"\x00\x00" + blob(b"")), BAD_FRAME, None),
    ("ERROR code 10", frame(8, b"\x00\x0a" + blob(b"")), BAD_FRAME, None),
    ("ERROR message over 512 bytes", frame(8, b"\x00\x01" + blob(b"x" * 513)), OVER_LIMIT, None),
    ("CLOSE reason 4", frame(9, b"\x04"), BAD_FRAME, None),
    ("CLOSE without reason", frame(9, b""), BAD_FRAME, None),
    ("TOKENS reserved flag", frame(10, uv(0) + toks([1]) + b"\x08"), BAD_FRAME, None),
    ("TOKENS HAS_LOGPROBS truncated", frame(10, uv(0) + toks([1]) + b"\x04"), BAD_FRAME, None),
    ("TOKENS logprob above 0", frame(10, uv(0) + toks([1]) + b"\x04" + f32(0.5) + row([])), BAD_FRAME, None),
    ("TOKENS logprob below the floor", frame(10, uv(0) + toks([1]) + b"\x04" + f32(-1e4) + row([])), BAD_FRAME, None),
    ("TOKENS logprob NaN", frame(10, uv(0) + toks([1]) + b"\x04" + f32(math.nan) + row([])), BAD_FRAME, None),
    ("TOKENS 21 alternatives", frame(10, uv(0) + toks([1]) + b"\x04" + f32(0.0) + row([(i, -1.0) for i in range(21)])),
     OVER_LIMIT, None),
    ("TOKENS alternative listed twice", frame(10, uv(0) + toks([1]) + b"\x04" + f32(0.0) + row([(1, -1.0), (1, -1.0)])),
     BAD_FRAME, None),
    ("TOKENS HAS_STEP truncated", frame(10, uv(0) + toks([1]) + b"\x02" + uv(2)), BAD_FRAME, None),
    ("TOKENS accepted > drafted", frame(10, uv(0) + toks([1]) + b"\x02" + uv(2) + uv(3) + uv(0)), BAD_FRAME, None),
    ("TOKENS drafted over limit", frame(10, uv(0) + toks([1]) + b"\x02" + uv(65) + uv(0) + uv(0)), OVER_LIMIT, None),
    ("TOKENS over limit", frame(10, uv(0) + toks([1] * 5) + b"\x00"), OVER_LIMIT, Limits(max_prompt_tokens=4)),
    ("TOKENS id >= max_vocab", frame(10, uv(0) + toks([1000]) + b"\x00"), OVER_LIMIT, Limits(max_vocab=1000)),
]


@pytest.mark.parametrize("name, data, code, limits", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_examples(name, data, code, limits):
    limits = limits or DEFAULT_LIMITS
    with pytest.raises(WireError) as info:
        decode(data, limits)
    assert info.value.code == code, info.value
    if data and name != "trailing bytes":
        # The stream decoder agrees, unless it is simply waiting for the rest of a frame.
        frames, stream_code, pending = drain([data], limits)
        assert frames == []
        assert stream_code == code or (stream_code is None and pending)


def test_well_formed_versions_of_the_malformed_examples_decode():
    """Guards against the table passing because its reference bytes are broken."""
    decode(frame(1, hello_payload()))
    decode(frame(3, draft_payload(flags=3, tokens=[1, 2], extra=row([(1, 0.5)]) + row([]) + uv(0) + uv(1))))
    decode(frame(4, verdict_payload(flags=6, accepted=2, extra=row([(1, 0.5)]) + toks([1, 3]))))
    decode(frame(8, b"\x00\x09" + blob(b"x" * 512)))
    decode(frame(1, hello_payload(logprobs=21)))
    decode(frame(10, uv(0) + toks([1]) + b"\x04" + f32(0.0) + row([(1, 0.0)] + [(i, -9999.0) for i in range(2, 21)])))
    decode(frame(5, b"\x03" + blob(b"") + uv(1) + blob(b"s" * 64) + uv(1) + blob(b"d" * 64)))
    decode(frame(2, uv(1) + uv(1) + uv(1) + blob(b"s" * 64)))


def test_version_is_checked_before_the_rest_of_the_payload():
    assert decode(frame(1, hello_payload())).version == PROTOCOL_VERSION
    with pytest.raises(WireError) as info:
        decode(frame(1, b"\x04"))
    assert info.value.code == BAD_VERSION and "version 4" in str(info.value)
    with pytest.raises(WireError) as info:
        decode(frame(5, b"\x01"))  # a version 1 RESUME: refused on its version, not its layout
    assert info.value.code == BAD_VERSION and "version 1" in str(info.value)


# Encoding refuses what decoding would.

NOT_ENCODABLE = [
    ("DRAFT over max_draft_tokens", Draft(session=1, seq=1, base=0, tokens=[1] * 65), OVER_LIMIT),
    ("negative token", Draft(session=1, seq=1, base=0, tokens=[-1]), BAD_FRAME),
    ("token >= max_vocab", Draft(session=1, seq=1, base=0, tokens=[2**22]), OVER_LIMIT),
    ("token not an int", Draft(session=1, seq=1, base=0, tokens=[1.5]), BAD_FRAME),
    ("token a str", Draft(session=1, seq=1, base=0, tokens="ab"), BAD_FRAME),
    ("q rows != tokens", Draft(session=1, seq=1, base=0, tokens=[1, 2], q=[[(1, 0.5)]]), BAD_FRAME),
    ("q NaN", Draft(session=1, seq=1, base=0, tokens=[1], q=[[(1, math.nan)]]), BAD_FRAME),
    ("q negative", Draft(session=1, seq=1, base=0, tokens=[1], q=[[(1, -0.1)]]), BAD_FRAME),
    ("q repeated token", Draft(session=1, seq=1, base=0, tokens=[1], q=[[(1, 0.1), (1, 0.2)]]), BAD_FRAME),
    ("q row too big", Draft(session=1, seq=1, base=0, tokens=[1], q=[[(i, 0.001) for i in range(257)]]),
     OVER_LIMIT),
    ("q not pairs", Draft(session=1, seq=1, base=0, tokens=[1], q=[[(1, 0.1, 2)]]), BAD_FRAME),
    ("parents forward", Draft(session=1, seq=1, base=0, tokens=[1, 2], parents=[0, 2]), BAD_FRAME),
    ("parents != tokens", Draft(session=1, seq=1, base=0, tokens=[1, 2], parents=[0]), BAD_FRAME),
    ("seq over 2**64", Draft(session=1, seq=2**64, base=0, tokens=[]), BAD_FRAME),
    ("HELLO version 4", Hello(model_id="m", max_tokens=1, prompt=[], version=4), BAD_VERSION),
    ("HELLO version 2", Hello(model_id="m", max_tokens=1, prompt=[], version=2), BAD_VERSION),
    ("HELLO logprobs 22", Hello(model_id="m", max_tokens=1, prompt=[], logprobs=22), BAD_FRAME),
    ("HELLO version 1", Hello(model_id="m", max_tokens=1, prompt=[], version=1), BAD_VERSION),
    ("RESUME secret too long", Resume(session=1, committed=1, secret=b"s" * 65), OVER_LIMIT),
    ("HELLO temperature NaN", Hello(model_id="m", max_tokens=1, prompt=[], temperature=math.nan), BAD_FRAME),
    ("HELLO temperature inf", Hello(model_id="m", max_tokens=1, prompt=[], temperature=math.inf), BAD_FRAME),
    ("HELLO temperature 1e39", Hello(model_id="m", max_tokens=1, prompt=[], temperature=1e39), BAD_FRAME),
    ("HELLO top_p 2", Hello(model_id="m", max_tokens=1, prompt=[], top_p=2.0), BAD_FRAME),
    ("HELLO model_id surrogate", Hello(model_id="\udc80", max_tokens=1, prompt=[]), BAD_FRAME),
    ("HELLO model_id too long", Hello(model_id="m" * 4097, max_tokens=1, prompt=[]), OVER_LIMIT),
    ("HELLO auth a str", Hello(model_id="m", max_tokens=1, prompt=[], auth="key"), BAD_FRAME),
    ("HELLO seed over u64", Hello(model_id="m", max_tokens=1, prompt=[], seed=2**64), BAD_FRAME),
    ("HELLO mode 7", Hello(model_id="m", max_tokens=1, prompt=[], mode=7), BAD_FRAME),
    ("HELLO prompt too long", Hello(model_id="m", max_tokens=1, prompt=[1] * 32769), OVER_LIMIT),
    ("RESUME version 0", Resume(session=1, committed=1, version=0), BAD_VERSION),
    ("VERDICT accepted over limit", Verdict(seq=1, accepted=65, next_token=1, verify_us=1, committed=1), OVER_LIMIT),
    ("VERDICT path != accepted", Verdict(seq=1, accepted=2, next_token=1, verify_us=1, committed=1, path=[0]),
     BAD_FRAME),
    ("VERDICT path not increasing",
     Verdict(seq=1, accepted=2, next_token=1, verify_us=1, committed=1, path=[1, 1]), BAD_FRAME),
    ("PING nonce negative", Ping(nonce=-1, sent_us=0), BAD_FRAME),
    ("ERROR code 99", Error(code=99, message=""), BAD_FRAME),
    ("ERROR message not a str", Error(code=ErrorCode.BUSY, message=b"x"), BAD_FRAME),
    ("CLOSE reason 9", Close(reason=9), BAD_FRAME),
    ("TOKENS id >= max_vocab", Tokens(start=0, tokens=[2**22]), OVER_LIMIT),
    ("TOKENS accepted > drafted", Tokens(start=0, tokens=[1], drafted=1, accepted=2), BAD_FRAME),
    ("TOKENS step figures without HAS_STEP", Tokens(start=0, tokens=[1], accepted=1), BAD_FRAME),
    ("TOKENS logprobs for fewer tokens", Tokens(start=0, tokens=[1, 2], logprobs=[(0.0, [])]), BAD_FRAME),
    ("TOKENS logprob above 0", Tokens(start=0, tokens=[1], logprobs=[(0.5, [])]), BAD_FRAME),
    ("TOKENS logprob -inf", Tokens(start=0, tokens=[1], logprobs=[(-math.inf, [])]), BAD_FRAME),
    ("TOKENS 21 alternatives", Tokens(start=0, tokens=[1], logprobs=[(0.0, [(i, -1.0) for i in range(21)])]),
     OVER_LIMIT),
]


@pytest.mark.parametrize("frame_obj, code", [m[1:] for m in NOT_ENCODABLE], ids=[m[0] for m in NOT_ENCODABLE])
def test_encode_refuses_what_the_receiver_would(frame_obj, code):
    with pytest.raises(WireError) as info:
        encode(frame_obj)
    assert info.value.code == code, info.value


def test_encode_rejects_non_frames():
    with pytest.raises(TypeError):
        encode(object())


def test_limits_must_be_positive_ints():
    with pytest.raises(ValueError):
        Limits(max_draft_tokens=0)
    with pytest.raises(ValueError):
        Limits(max_vocab=1.5)


def test_wire_error_pickles():
    import pickle

    exc = pickle.loads(pickle.dumps(WireError(ErrorCode.OVER_LIMIT, "too big")))
    assert exc.code == OVER_LIMIT and exc.message == "too big" and str(exc) == "OVER_LIMIT: too big"


# Stream helpers.

SAMPLE = [
    Hello(model_id="qwen", max_tokens=5, prompt=list(range(300))),
    Draft(session=1, seq=1, base=300, tokens=[150_000] * 8),
    Verdict(seq=1, accepted=8, next_token=7, verify_us=900, committed=309),
    Ping(nonce=3, sent_us=4),
]


def test_asyncio_round_trip_over_tcp():
    async def main():
        received = []

        async def serve(reader, writer):
            while (f := await read_frame(reader)) is not None:
                received.append(f)
                await write_frame(writer, f)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        echoed = []
        for f in SAMPLE:
            await write_frame(writer, f)
            echoed.append(await read_frame(reader, FrameDecoder()))
        writer.write_eof()
        assert await read_frame(reader) is None
        writer.close()
        server.close()
        await server.wait_closed()
        return received, echoed

    received, echoed = asyncio.run(asyncio.wait_for(main(), 10))
    assert received == SAMPLE and echoed == SAMPLE


def _stream(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_read_frame_reads_one_frame_at_a_time():
    async def main():
        reader = _stream(b"".join(map(encode, SAMPLE)))
        got = [await read_frame(reader) for _ in SAMPLE]  # a new decoder each call: nothing is lost
        return got, await read_frame(reader)

    got, end = asyncio.run(main())
    assert got == SAMPLE and end is None


def test_read_frame_eof_mid_frame_is_an_error():
    async def main():
        return await read_frame(_stream(encode(SAMPLE[0])[:-3]))

    with pytest.raises(WireError) as info:
        asyncio.run(main())
    assert info.value.code == BAD_FRAME


def test_read_frame_refuses_oversize_length_without_waiting_for_the_body():
    async def main():
        reader = _stream(uv(2**32) + b"body bytes", eof=False)  # the peer never sends 4 GB, nor closes
        with pytest.raises(WireError) as info:
            await asyncio.wait_for(read_frame(reader), 2)
        return info.value, await reader.read(100)

    exc, left = asyncio.run(main())
    assert exc.code == OVER_LIMIT
    assert left.endswith(b"body bytes")  # nothing beyond the prefix was read


def test_read_frame_with_a_decoder_uses_bytes_already_fed():
    async def main():
        decoder = FrameDecoder()
        data = encode(SAMPLE[3])
        assert decoder.feed(data[:4]) == []
        return await read_frame(_stream(data[4:]), decoder)

    assert asyncio.run(main()) == SAMPLE[3]


def _socket_pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def test_socket_round_trip_and_clean_end():
    a, b = _socket_pair()
    with a, b:
        for f in SAMPLE:
            send_frame(a, f)
        a.shutdown(socket.SHUT_WR)
        assert [recv_frame(b) for _ in SAMPLE] == SAMPLE
        assert recv_frame(b) is None


def test_socket_oversize_prefix_does_not_block():
    a, b = _socket_pair()
    with a, b:
        a.sendall(uv(2**40))  # an oversize prefix and nothing after it
        with pytest.raises(WireError) as info:
            recv_frame(b)
        assert info.value.code == OVER_LIMIT


def test_socket_end_mid_frame_is_an_error():
    a, b = _socket_pair()
    with a, b:
        a.sendall(encode(SAMPLE[3])[:5])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(WireError) as info:
            recv_frame(b, Limits())
        assert info.value.code == BAD_FRAME


def test_wire_imports_nothing_else_from_acespec():
    import ast
    import pathlib

    import acespec.wire

    for path in pathlib.Path(acespec.wire.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("acespec"), path
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("acespec") for a in node.names), path
            if isinstance(node, ast.ImportFrom) and node.level > 1:
                pytest.fail(f"{path} imports from outside acespec.wire")
