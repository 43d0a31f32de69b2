r"""AceSpec wire format, protocol version 2: the binary frames between edge and cloud.

This docstring is the specification. The code below implements it, and tests/test_wire.py pins it
byte by byte. Why the protocol is shaped this way is in DESIGN.md, "The edge-cloud protocol".

Primitive encodings
-------------------
varint   Unsigned LEB128: 7 bits per byte, least significant group first, the high bit set on every
         byte except the last. 0..127 take 1 byte, up to 2**14-1 take 2, up to 2**21-1 take 3.
         A varint is at most 10 bytes, its value is < 2**64, and it must be minimal (a multi-byte
         varint never ends in 0x00). So each value has exactly one encoding.
zigzag   Signed integers would be mapped 0, -1, 1, -2, ... -> 0, 1, 2, 3, ... and sent as varints
         (`zigzag_encode`). No field of version 2 is signed.
u8 u16 u64
         Fixed-width unsigned integers, big-endian.
f32      IEEE 754 binary32, big-endian. Always finite on the wire; each field states its range.
bytes    varint length, then that many bytes.
str      Like bytes, and the bytes must be strict UTF-8.
tokens   varint count, then one varint per token id. Every token id is < Limits.max_vocab.
row      A sparse probability row, e.g. the top-k of q or p at one position: varint count, then
         count x (token varint, prob f32). Token ids in a row are distinct; 0 <= prob <= 1; order is
         free (senders usually list by descending prob).

Positions and lengths count tokens of the whole sequence, prompt included: a new session's WELCOME
says committed = len(prompt), and DRAFT.tokens[0] stands at position DRAFT.base.

Framing
-------
    frame = varint L | u8 type | payload            where L = 1 + len(payload)

1 <= L <= Limits.max_frame_bytes. The length prefix comes first so that a reader learns L from at
most 3 bytes (for the default limit) and refuses an oversize frame before it buffers the body: a
hostile 4 GB prefix costs the reader three bytes. A prefix longer than the longest legal one is
refused as OVER_LIMIT as soon as that many bytes are in.

Frames (field | encoding | meaning)
-----------------------------------
1  HELLO    edge -> cloud. Opens a session.
       version      u8      PROTOCOL_VERSION (2)
       auth         bytes   the tenant's token; the cloud checks it (BAD_AUTH) and binds the session to
                            that tenant
       model_id     str     tokenizer fingerprint; the cloud refuses a mismatch (MODEL_MISMATCH)
       temperature  f32     >= 0 (0 = greedy)
       top_k        varint  0 = off
       top_p        f32     0..1 (1 = off)
       rule         str     verification rule spec, e.g. "strict" or "cactus:delta=0.35"
       seed         u64     shared seed (coupled sampling derives its noise from it)
       mode         u8      0 = speculative, 1 = cloud-only (the cloud generates and streams TOKENS)
       max_tokens   varint  generation budget, in new tokens
       prompt       tokens  at most Limits.max_prompt_tokens
2  WELCOME  cloud -> edge. Answers HELLO or RESUME.
       session      varint  id to name in DRAFT and RESUME (random, not sequential; < 2**21 from this
                            server, so 3 bytes at most)
       committed    varint  committed length the edge continues from
       max_draft_tokens varint  the server's limit on tokens per DRAFT block
       secret       bytes   the session's secret, at most MAX_SECRET_BYTES (the server sends 32 random
                            bytes, the same in every WELCOME of the session): RESUME must present it
3  DRAFT    edge -> cloud. One block of drafted tokens.
       session      varint
       seq          varint  block sequence number; the VERDICT echoes it
       base         varint  committed length the block builds on (tokens[0] is at position base)
       flags        u8      0x01 HAS_Q, 0x02 HAS_TREE; other bits must be 0
       tokens       tokens  n = count <= Limits.max_draft_tokens (n = 0 asks for the next token only)
       q            n x row          only if HAS_Q: the drafter's sparse q at each drafted position
       parents      n x varint       only if HAS_TREE: parents[i] = 0 if token i extends the base,
                                     j + 1 if it extends token j; j < i always (so parents[i] <= i),
                                     which keeps the tree in topological order and free of cycles.
       In plain mode (no q, no tree) the framing is the length prefix, the type, flags and count
       bytes, and the session, seq and base varints: 13 bytes for session, seq, base < 2**21 (14 once
       L passes 127, i.e. from 38 three-byte tokens on). Token ids < 2**21 cost <= 3 bytes.
4  VERDICT  cloud -> edge. The outcome of one DRAFT.
       seq          varint  the DRAFT's seq
       flags        u8      0x01 DROPPED: the block was built on a stale prefix and not verified;
                            0x02 HAS_P; 0x04 HAS_PATH; 0x08 FINISHED: generation has ended (EOS,
                            stop or max_tokens), no later block will be verified. Other bits must be 0.
       accepted     varint  draft tokens kept, <= Limits.max_draft_tokens (senders put 0 when DROPPED)
       next_token   varint  the token emitted after them: recovered on a rejection, bonus after a full
                            accept (senders put 0 when DROPPED; receivers ignore it)
       verify_us    varint  cloud verify time in microseconds (for the edge's depth controller)
       committed    varint  committed length after this verdict
       p            row     only if HAS_P: sparse top-k of p at the rejected position
       path         varint count + count varints, only if HAS_PATH: the draft indices of the
                            accepted tree path, root first; count = accepted, strictly increasing,
                            each < Limits.max_draft_tokens.
       A typical verdict (seq < 2**14, accepted < 128, ids, verify_us and committed < 2**21) is 15
       bytes including length and type.
5  RESUME   edge -> cloud. Reconnects to a session; the cloud answers WELCOME (see DESIGN.md,
            "Sessions and faults", for how the committed prefix is agreed).
       version      u8      PROTOCOL_VERSION
       auth         bytes   the tenant's token (the tenant that opened the session)
       session      varint
       secret       bytes   the session's secret from WELCOME, at most MAX_SECRET_BYTES
       committed    varint  the last committed length the edge saw
       digest       bytes   committed_digest() of the committed tokens (prompt included) up to that
                            length, at most MAX_SECRET_BYTES: the cloud refuses a RESUME whose tokens
                            differ from its own (BAD_REQUEST), so both sides agree on content, not only
                            on length. A wrong secret, another tenant's token or an unknown session all
                            get the same UNKNOWN_SESSION.
6  PING     either way.    nonce u64, sent_us u64 (sender's monotonic clock, microseconds)
7  PONG     answers PING.  nonce u64, sent_us u64, both copied from the PING, so the pinger gets the
                           round-trip time as now - sent_us without keeping state.
8  ERROR    either way.
       code         u16     an ErrorCode; unknown codes are refused
       message      str     human-readable; at most 512 bytes (encode truncates at a character
                            boundary, decode refuses longer)
9  CLOSE    either way.    reason u8: a CloseReason (0 normal end, 1 going away: reconnect later with
                           RESUME, 2 after an ERROR, 3 idle timeout); unknown reasons are refused
10 TOKENS   cloud -> edge, cloud-only mode: a chunk of generated tokens.
       start        varint  position of tokens[0]
       tokens       tokens  at most Limits.max_prompt_tokens
       flags        u8      0x01 FINISHED: the last chunk of the generation; other bits must be 0

Validation and errors
---------------------
`decode`, `FrameDecoder` and the stream helpers raise `WireError` and nothing else for any input
bytes. `WireError.code` is:
  OVER_LIMIT   for anything checked against `Limits`: frame length, token counts, row sizes,
               string and bytes lengths, token ids >= max_vocab, an ERROR message over 512 bytes,
               a VERDICT accepted count or path index beyond max_draft_tokens;
  BAD_VERSION  for a HELLO or RESUME whose version byte is not PROTOCOL_VERSION;
  BAD_FRAME    for everything else: truncation, trailing bytes (after the frame or inside its
               payload), unknown frame types, set reserved flag bits, unknown enum values, bad
               varints (too long, over 2**64 - 1, not minimal), invalid UTF-8, non-finite or
               out-of-range floats (a probability must be 0..1), duplicate ids in a row, parents
               pointing forward, a q or parents list whose length is not n, a VERDICT path that does
               not match `accepted`; a WELCOME or RESUME secret, or a RESUME digest, over MAX_SECRET_BYTES is
OVER_LIMIT.

The decoder checks the version, not the server: everything after the version byte may change in a
later version, so the bytes that follow cannot be trusted to parse. The check runs before the rest of
the payload is read, so a newer client gets BAD_VERSION, not BAD_FRAME. The codec checks structure
only; whether a rule exists, a session is known or an auth token is good is the server's business
(BAD_REQUEST, UNKNOWN_SESSION, BAD_AUTH).

`encode` applies the same checks, with the same codes, to the frame it is given (it fails
BAD_FRAME on a field of the wrong type too, and raises TypeError for an object that is no frame). To put a bad frame on the wire in a test, patch the
bytes; e.g. HELLO's version byte is the one right after the type byte.

Every frame has exactly one encoding: varints are minimal, reserved bits are 0, floats are finite,
UTF-8 is strict. So for any bytes `b` that decode, `encode(decode(b)) == b`.

Streams
-------
`FrameDecoder` takes bytes as they arrive. A frame with a good length prefix but a bad payload is
consumed and raised; the stream stays in step, so a server can answer ERROR and carry on. A bad
length prefix (oversize, zero, malformed) leaves no way to find the next frame: the decoder is then
broken and raises the same error on every call. Frames that `feed` decoded before the error ride on
`WireError.frames`. `read_frame` / `recv_frame` (acespec.wire.stream) never read past the frame they
return, so they need no state between calls.

Evolving the protocol
---------------------
New frame types, new fields, new flag bits and new enum values all need a new PROTOCOL_VERSION: a
version 2 peer refuses each of them. Version 2 added WELCOME.secret and RESUME.secret and .digest
(per-session credentials); a version 1 HELLO or RESUME gets BAD_VERSION.

committed_digest(tokens) = SHA-256 over the `tokens` encoding above (varint count, then one varint per
id) of the whole committed sequence, prompt included: 32 bytes. Python floats are f64, so a float field that is not an exact
f32 comes back rounded.
"""

from __future__ import annotations

import hashlib
import numbers
import operator
import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum, IntFlag
from typing import ClassVar, Optional, Union

from .errors import ErrorCode, WireError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_ERROR_MESSAGE_BYTES",
    "FrameType",
    "Mode",
    "CloseReason",
    "DraftFlag",
    "VerdictFlag",
    "TokensFlag",
    "Limits",
    "DEFAULT_LIMITS",
    "SparseRow",
    "Hello",
    "Welcome",
    "Draft",
    "Verdict",
    "Resume",
    "Ping",
    "Pong",
    "Error",
    "Close",
    "Tokens",
    "Frame",
    "encode",
    "decode",
    "FrameDecoder",
    "encode_uvarint",
    "decode_uvarint",
    "zigzag_encode",
    "zigzag_decode",
    "committed_digest",
    "MAX_SECRET_BYTES",
]

PROTOCOL_VERSION = 2
MAX_ERROR_MESSAGE_BYTES = 512
MAX_SECRET_BYTES = 64  # longest WELCOME/RESUME secret and RESUME digest

_U8_MAX = 0xFF
_U16_MAX = 0xFFFF
_U64_MAX = (1 << 64) - 1
_F32_MAX = struct.unpack(">f", b"\x7f\x7f\xff\xff")[0]  # largest finite binary32

_F32 = struct.Struct(">f")
_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")

BAD_FRAME = ErrorCode.BAD_FRAME
OVER_LIMIT = ErrorCode.OVER_LIMIT


class FrameType(IntEnum):
    """The type byte that follows the length prefix."""

    HELLO = 1
    WELCOME = 2
    DRAFT = 3
    VERDICT = 4
    RESUME = 5
    PING = 6
    PONG = 7
    ERROR = 8
    CLOSE = 9
    TOKENS = 10


class Mode(IntEnum):
    """HELLO.mode: who generates."""

    SPECULATIVE = 0  # the edge drafts, the cloud verifies
    CLOUD_ONLY = 1  # the cloud generates alone and streams TOKENS


class CloseReason(IntEnum):
    """CLOSE.reason."""

    NORMAL = 0  # finished, nothing wrong
    GOING_AWAY = 1  # shutting down or restarting; reconnect later with RESUME
    ERROR = 2  # follows an ERROR frame
    IDLE = 3  # idle timeout


class DraftFlag(IntFlag):
    HAS_Q = 0x01
    HAS_TREE = 0x02


class VerdictFlag(IntFlag):
    DROPPED = 0x01
    HAS_P = 0x02
    HAS_PATH = 0x04
    FINISHED = 0x08


class TokensFlag(IntFlag):
    FINISHED = 0x01


@dataclass(frozen=True, slots=True)
class Limits:
    """What a receiver accepts; anything beyond it is refused with OVER_LIMIT."""

    max_frame_bytes: int = 262144  # largest L (type byte + payload), checked from the prefix alone
    max_draft_tokens: int = 64  # tokens in one DRAFT block; bounds VERDICT accepted and path too
    max_prompt_tokens: int = 32768  # tokens in a HELLO prompt or in one TOKENS frame
    max_sparse_k: int = 256  # entries in one sparse probability row
    max_str_bytes: int = 4096  # bytes in any str or bytes field (auth, model_id, rule, message)
    max_vocab: int = 1 << 22  # every token id must be < this

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()

SparseRow = tuple[tuple[int, float], ...]
"""A sparse probability row: (token id, probability) pairs with distinct ids."""


# Frames. Sequence fields are normalised to tuples so that a frame built from lists equals its decoded
# copy (decode always yields tuples) and stays hashable. Values are checked by encode and decode,
# against the Limits in force there, not here.


def _tuple(value):
    return value if value is None or type(value) is tuple else tuple(value)


def _row(row) -> SparseRow:
    return tuple(_tuple(pair) for pair in row)


def _set(frame, name, value):
    object.__setattr__(frame, name, value)  # the dataclasses are frozen


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """HELLO, edge -> cloud: open a session (protocol, sampling parameters, prompt)."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    model_id: str
    max_tokens: int
    prompt: tuple[int, ...]
    auth: bytes = field(default=b"", repr=False)  # keep secrets out of logs
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    rule: str = "strict"
    seed: int = 0
    mode: Mode = Mode.SPECULATIVE
    version: int = PROTOCOL_VERSION

    def __post_init__(self):
        _set(self, "prompt", _tuple(self.prompt))


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    """WELCOME, cloud -> edge: the session id and where to continue from."""

    TYPE: ClassVar[FrameType] = FrameType.WELCOME
    session: int
    committed: int
    max_draft_tokens: int
    secret: bytes = field(default=b"", repr=False)  # RESUME must present it


@dataclass(frozen=True, slots=True, kw_only=True)
class Draft:
    """DRAFT, edge -> cloud: a block of drafted tokens, optionally with q rows and a tree shape."""

    TYPE: ClassVar[FrameType] = FrameType.DRAFT
    session: int
    seq: int
    base: int
    tokens: tuple[int, ...]
    q: Optional[tuple[SparseRow, ...]] = None  # one row per token; sent iff not None (HAS_Q)
    parents: Optional[tuple[int, ...]] = None  # one per token; sent iff not None (HAS_TREE)

    def __post_init__(self):
        _set(self, "tokens", _tuple(self.tokens))
        if self.q is not None:
            _set(self, "q", tuple(_row(row) for row in self.q))
        _set(self, "parents", _tuple(self.parents))


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """VERDICT, cloud -> edge: how much of a DRAFT was accepted and the token that follows."""

    TYPE: ClassVar[FrameType] = FrameType.VERDICT
    seq: int
    accepted: int
    next_token: int
    verify_us: int
    committed: int
    dropped: bool = False
    finished: bool = False
    p: Optional[SparseRow] = None  # sent iff not None (HAS_P)
    path: Optional[tuple[int, ...]] = None  # sent iff not None (HAS_PATH)

    def __post_init__(self):
        if self.p is not None:
            _set(self, "p", _row(self.p))
        _set(self, "path", _tuple(self.path))


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """RESUME, edge -> cloud: reattach to a session after a reconnect."""

    TYPE: ClassVar[FrameType] = FrameType.RESUME
    session: int
    committed: int
    auth: bytes = field(default=b"", repr=False)
    secret: bytes = field(default=b"", repr=False)  # the session's secret, from WELCOME
    digest: bytes = b""  # committed_digest() of the committed tokens
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    TYPE: ClassVar[FrameType] = FrameType.PING
    nonce: int
    sent_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Pong:
    """Answers a PING with its nonce and sent_us unchanged."""

    TYPE: ClassVar[FrameType] = FrameType.PONG
    nonce: int
    sent_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Error:
    """ERROR, either way: a refusal with an ErrorCode and a human-readable message."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR
    code: ErrorCode
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Close:
    TYPE: ClassVar[FrameType] = FrameType.CLOSE
    reason: CloseReason = CloseReason.NORMAL


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens:
    """TOKENS, cloud -> edge in cloud-only mode: generated tokens from position `start` on."""

    TYPE: ClassVar[FrameType] = FrameType.TOKENS
    start: int
    tokens: tuple[int, ...]
    finished: bool = False

    def __post_init__(self):
        _set(self, "tokens", _tuple(self.tokens))


Frame = Union[Hello, Welcome, Draft, Verdict, Resume, Ping, Pong, Error, Close, Tokens]


# Checking Python values on the way out. Failures are WireErrors with the code the receiver would
# use, so a sender learns about a bad frame before it costs a round trip.


def _uint(value, what: str, max_value: int = _U64_MAX) -> int:
    if type(value) is not int:
        try:
            value = operator.index(value)  # accepts numpy integers
        except TypeError:
            raise WireError(BAD_FRAME, f"{what} must be an integer, not {type(value).__name__}") from None
    if value < 0 or value > max_value:
        raise WireError(BAD_FRAME, f"{what} = {value} is outside 0..{max_value}")
    return value


def _float(value, what: str, low: float, high: float) -> float:
    if type(value) is not float:
        if not isinstance(value, numbers.Real):
            raise WireError(BAD_FRAME, f"{what} must be a real number, not {type(value).__name__}")
        value = float(value)
    if not low <= value <= high:  # false for NaN too
        raise WireError(BAD_FRAME, f"{what} = {value!r} is outside {low}..{high}")
    return value


def _enum(enum_type, value, what: str):
    try:
        return enum_type(value)
    except ValueError:
        raise WireError(BAD_FRAME, f"unknown {what} {value}") from None


def _check_version(version: int, what: str) -> None:
    if version != PROTOCOL_VERSION:
        raise WireError(
            ErrorCode.BAD_VERSION,
            f"{what} speaks protocol version {version}; this peer speaks {PROTOCOL_VERSION}",
        )


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _put_uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


class _Writer:
    """Appends checked fields to a payload; mirrors `_Reader` check for check."""

    __slots__ = ("out", "limits")

    def __init__(self, limits: Limits):
        self.out = bytearray()
        self.limits = limits

    def u8(self, value, what):
        self.out.append(_uint(value, what, _U8_MAX))

    def u16(self, value, what):
        self.out += _U16.pack(_uint(value, what, _U16_MAX))

    def u64(self, value, what):
        self.out += _U64.pack(_uint(value, what))

    def uvarint(self, value, what):
        _put_uvarint(self.out, _uint(value, what))

    def count(self, n: int, limit: int, what):
        if n > limit:
            raise WireError(OVER_LIMIT, f"{what}: {n} exceeds the limit of {limit}")
        _put_uvarint(self.out, n)

    def token(self, value, what):
        value = _uint(value, what)
        if value >= self.limits.max_vocab:
            raise WireError(OVER_LIMIT, f"{what} = {value} is not below max_vocab {self.limits.max_vocab}")
        _put_uvarint(self.out, value)

    def tokens(self, values, limit: int, what):
        self.count(len(values), limit, f"{what} count")
        out, vocab = self.out, self.limits.max_vocab
        for value in values:
            if type(value) is not int or not 0 <= value < vocab:
                self.token(value, f"{what} id")  # the slow path: converts, or raises the right error
                continue
            while value >= 0x80:
                out.append((value & 0x7F) | 0x80)
                value >>= 7
            out.append(value)

    def f32(self, value, what, low, high):
        self.out += _F32.pack(_float(value, what, low, high))

    def blob(self, value, what, max_bytes: int):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise WireError(BAD_FRAME, f"{what} must be bytes, not {type(value).__name__}")
        value = bytes(value)
        self.count(len(value), max_bytes, f"{what} length")
        self.out += value

    def text(self, value, what, max_bytes: int):
        if not isinstance(value, str):
            raise WireError(BAD_FRAME, f"{what} must be a str, not {type(value).__name__}")
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise WireError(BAD_FRAME, f"{what} is not valid Unicode: {exc.reason}") from None
        self.blob(raw, what, max_bytes)

    def row(self, row, what):
        self.count(len(row), self.limits.max_sparse_k, f"{what} size")
        seen = set()
        for pair in row:
            if len(pair) != 2:
                raise WireError(BAD_FRAME, f"{what} entries must be (token, prob) pairs")
            token, prob = pair
            self.token(token, f"{what} token")
            if token in seen:
                raise WireError(BAD_FRAME, f"{what} lists token {token} twice")
            seen.add(token)
            self.f32(prob, f"{what} prob", 0.0, 1.0)


class _Reader:
    """Reads fields from buf[pos:end]; every shortfall or bad value is a WireError."""

    __slots__ = ("buf", "pos", "end", "limits")

    def __init__(self, buf, pos: int, end: int, limits: Limits):
        self.buf = buf
        self.pos = pos
        self.end = end
        self.limits = limits

    def _take(self, n: int, what) -> int:
        pos = self.pos
        if pos + n > self.end:
            raise WireError(BAD_FRAME, f"truncated {what}: needs {n} bytes, {self.end - pos} left")
        self.pos = pos + n
        return pos

    def u8(self, what) -> int:
        return self.buf[self._take(1, what)]

    def u16(self, what) -> int:
        return _U16.unpack_from(self.buf, self._take(2, what))[0]

    def u64(self, what) -> int:
        return _U64.unpack_from(self.buf, self._take(8, what))[0]

    def uvarint(self, what) -> int:
        buf, pos, end = self.buf, self.pos, self.end
        if pos < end and buf[pos] < 0x80:  # most varints on the wire are one byte
            self.pos = pos + 1
            return buf[pos]
        value = shift = 0
        while True:
            if pos >= end:
                raise WireError(BAD_FRAME, f"truncated varint in {what}")
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
            if shift == 70:
                raise WireError(BAD_FRAME, f"varint in {what} is longer than 10 bytes")
        if byte == 0:
            raise WireError(BAD_FRAME, f"varint in {what} is not minimally encoded")
        if value > _U64_MAX:
            raise WireError(BAD_FRAME, f"varint in {what} overflows 64 bits")
        self.pos = pos
        return value

    def count(self, limit: int, what) -> int:
        n = self.uvarint(what)
        if n > limit:
            raise WireError(OVER_LIMIT, f"{what}: {n} exceeds the limit of {limit}")
        return n

    def token(self, what) -> int:
        value = self.uvarint(what)
        if value >= self.limits.max_vocab:
            raise WireError(OVER_LIMIT, f"{what} = {value} is not below max_vocab {self.limits.max_vocab}")
        return value

    def tokens(self, limit: int, what) -> tuple[int, ...]:
        n = self.count(limit, f"{what} count")
        return tuple(self.token(f"{what} id") for _ in range(n))

    def f32(self, what, low, high) -> float:
        value = _F32.unpack_from(self.buf, self._take(4, what))[0]
        if not low <= value <= high:  # false for NaN too
            raise WireError(BAD_FRAME, f"{what} = {value!r} is outside {low}..{high}")
        return value

    def blob(self, what, max_bytes: int) -> bytes:
        n = self.count(max_bytes, f"{what} length")
        start = self._take(n, what)
        return bytes(self.buf[start : start + n])

    def text(self, what, max_bytes: int) -> str:
        raw = self.blob(what, max_bytes)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireError(BAD_FRAME, f"{what} is not valid UTF-8: {exc.reason}") from None

    def row(self, what) -> SparseRow:
        n = self.count(self.limits.max_sparse_k, f"{what} size")
        pairs = tuple((self.token(f"{what} token"), self.f32(f"{what} prob", 0.0, 1.0)) for _ in range(n))
        if len({token for token, _ in pairs}) != n:
            raise WireError(BAD_FRAME, f"{what} lists a token twice")
        return pairs

    def flags(self, known: int, what) -> int:
        flags = self.u8(what)
        if flags & ~int(known):  # int(): ~ on an IntFlag inverts only its defined bits, giving 0
            raise WireError(BAD_FRAME, f"{what} has reserved bits set: {flags:#04x}")
        return flags


# One encoder and one decoder per frame type, written side by side so they stay mirror images.


def _enc_hello(w: _Writer, f: Hello) -> None:
    limits = w.limits
    _check_version(_uint(f.version, "HELLO.version", _U8_MAX), "HELLO")
    w.u8(f.version, "HELLO.version")
    w.blob(f.auth, "HELLO.auth", limits.max_str_bytes)
    w.text(f.model_id, "HELLO.model_id", limits.max_str_bytes)
    w.f32(f.temperature, "HELLO.temperature", 0.0, _F32_MAX)
    w.uvarint(f.top_k, "HELLO.top_k")
    w.f32(f.top_p, "HELLO.top_p", 0.0, 1.0)
    w.text(f.rule, "HELLO.rule", limits.max_str_bytes)
    w.u64(f.seed, "HELLO.seed")
    w.u8(_enum(Mode, _uint(f.mode, "HELLO.mode", _U8_MAX), "HELLO.mode"), "HELLO.mode")
    w.uvarint(f.max_tokens, "HELLO.max_tokens")
    w.tokens(f.prompt, limits.max_prompt_tokens, "HELLO.prompt")


def _dec_hello(r: _Reader) -> Hello:
    limits = r.limits
    version = r.u8("HELLO.version")
    _check_version(version, "HELLO")  # before anything else: the rest of a newer HELLO may differ
    return Hello(
        version=version,
        auth=r.blob("HELLO.auth", limits.max_str_bytes),
        model_id=r.text("HELLO.model_id", limits.max_str_bytes),
        temperature=r.f32("HELLO.temperature", 0.0, _F32_MAX),
        top_k=r.uvarint("HELLO.top_k"),
        top_p=r.f32("HELLO.top_p", 0.0, 1.0),
        rule=r.text("HELLO.rule", limits.max_str_bytes),
        seed=r.u64("HELLO.seed"),
        mode=_enum(Mode, r.u8("HELLO.mode"), "HELLO.mode"),
        max_tokens=r.uvarint("HELLO.max_tokens"),
        prompt=r.tokens(limits.max_prompt_tokens, "HELLO.prompt"),
    )


def _enc_welcome(w: _Writer, f: Welcome) -> None:
    w.uvarint(f.session, "WELCOME.session")
    w.uvarint(f.committed, "WELCOME.committed")
    w.uvarint(f.max_draft_tokens, "WELCOME.max_draft_tokens")
    w.blob(f.secret, "WELCOME.secret", MAX_SECRET_BYTES)


def _dec_welcome(r: _Reader) -> Welcome:
    return Welcome(
        session=r.uvarint("WELCOME.session"),
        committed=r.uvarint("WELCOME.committed"),
        max_draft_tokens=r.uvarint("WELCOME.max_draft_tokens"),
        secret=r.blob("WELCOME.secret", MAX_SECRET_BYTES),
    )


def _check_parent(parent: int, i: int) -> None:
    if parent > i:
        raise WireError(
            BAD_FRAME, f"DRAFT.parents[{i}] = {parent}: must be 0 (the base) or j + 1 for a token j < {i}"
        )


def _enc_draft(w: _Writer, f: Draft) -> None:
    w.uvarint(f.session, "DRAFT.session")
    w.uvarint(f.seq, "DRAFT.seq")
    w.uvarint(f.base, "DRAFT.base")
    n = len(f.tokens)
    w.out.append((DraftFlag.HAS_Q if f.q is not None else 0) | (DraftFlag.HAS_TREE if f.parents is not None else 0))
    w.tokens(f.tokens, w.limits.max_draft_tokens, "DRAFT.tokens")
    if f.q is not None:
        if len(f.q) != n:
            raise WireError(BAD_FRAME, f"DRAFT.q has {len(f.q)} rows for {n} tokens")
        for i, row in enumerate(f.q):
            w.row(row, f"DRAFT.q[{i}]")
    if f.parents is not None:
        if len(f.parents) != n:
            raise WireError(BAD_FRAME, f"DRAFT.parents has {len(f.parents)} entries for {n} tokens")
        for i, parent in enumerate(f.parents):
            parent = _uint(parent, f"DRAFT.parents[{i}]")
            _check_parent(parent, i)
            _put_uvarint(w.out, parent)


def _dec_draft(r: _Reader) -> Draft:
    session = r.uvarint("DRAFT.session")
    seq = r.uvarint("DRAFT.seq")
    base = r.uvarint("DRAFT.base")
    flags = r.flags(DraftFlag.HAS_Q | DraftFlag.HAS_TREE, "DRAFT.flags")
    tokens = r.tokens(r.limits.max_draft_tokens, "DRAFT.tokens")
    q = parents = None
    if flags & DraftFlag.HAS_Q:
        q = tuple(r.row(f"DRAFT.q[{i}]") for i in range(len(tokens)))
    if flags & DraftFlag.HAS_TREE:
        parents = tuple(r.uvarint(f"DRAFT.parents[{i}]") for i in range(len(tokens)))
        for i, parent in enumerate(parents):
            _check_parent(parent, i)
    return Draft(session=session, seq=seq, base=base, tokens=tokens, q=q, parents=parents)


def _check_path(path: tuple[int, ...], accepted: int, limits: Limits) -> None:
    if len(path) != accepted:
        raise WireError(BAD_FRAME, f"VERDICT.path has {len(path)} entries for {accepted} accepted tokens")
    previous = -1
    for index in path:
        if index >= limits.max_draft_tokens:
            raise WireError(OVER_LIMIT, f"VERDICT.path index {index} is beyond max_draft_tokens")
        if index <= previous:
            raise WireError(BAD_FRAME, "VERDICT.path must be strictly increasing (parents precede children)")
        previous = index


def _enc_verdict(w: _Writer, f: Verdict) -> None:
    limits = w.limits
    w.uvarint(f.seq, "VERDICT.seq")
    flags = (
        (VerdictFlag.DROPPED if f.dropped else 0)
        | (VerdictFlag.HAS_P if f.p is not None else 0)
        | (VerdictFlag.HAS_PATH if f.path is not None else 0)
        | (VerdictFlag.FINISHED if f.finished else 0)
    )
    w.out.append(flags)
    accepted = _uint(f.accepted, "VERDICT.accepted")
    w.count(accepted, limits.max_draft_tokens, "VERDICT.accepted")
    w.token(f.next_token, "VERDICT.next_token")
    w.uvarint(f.verify_us, "VERDICT.verify_us")
    w.uvarint(f.committed, "VERDICT.committed")
    if f.p is not None:
        w.row(f.p, "VERDICT.p")
    if f.path is not None:
        path = tuple(_uint(index, "VERDICT.path index") for index in f.path)
        _check_path(path, accepted, limits)
        w.count(len(path), limits.max_draft_tokens, "VERDICT.path count")
        for index in path:
            _put_uvarint(w.out, index)


def _dec_verdict(r: _Reader) -> Verdict:
    limits = r.limits
    seq = r.uvarint("VERDICT.seq")
    flags = r.flags(
        VerdictFlag.DROPPED | VerdictFlag.HAS_P | VerdictFlag.HAS_PATH | VerdictFlag.FINISHED, "VERDICT.flags"
    )
    accepted = r.count(limits.max_draft_tokens, "VERDICT.accepted")
    next_token = r.token("VERDICT.next_token")
    verify_us = r.uvarint("VERDICT.verify_us")
    committed = r.uvarint("VERDICT.committed")
    p = r.row("VERDICT.p") if flags & VerdictFlag.HAS_P else None
    path = None
    if flags & VerdictFlag.HAS_PATH:
        n = r.count(limits.max_draft_tokens, "VERDICT.path count")
        path = tuple(r.uvarint("VERDICT.path index") for _ in range(n))
        _check_path(path, accepted, limits)
    return Verdict(
        seq=seq,
        accepted=accepted,
        next_token=next_token,
        verify_us=verify_us,
        committed=committed,
        dropped=bool(flags & VerdictFlag.DROPPED),
        finished=bool(flags & VerdictFlag.FINISHED),
        p=p,
        path=path,
    )


def _enc_resume(w: _Writer, f: Resume) -> None:
    _check_version(_uint(f.version, "RESUME.version", _U8_MAX), "RESUME")
    w.u8(f.version, "RESUME.version")
    w.blob(f.auth, "RESUME.auth", w.limits.max_str_bytes)
    w.uvarint(f.session, "RESUME.session")
    w.blob(f.secret, "RESUME.secret", MAX_SECRET_BYTES)
    w.uvarint(f.committed, "RESUME.committed")
    w.blob(f.digest, "RESUME.digest", MAX_SECRET_BYTES)


def _dec_resume(r: _Reader) -> Resume:
    version = r.u8("RESUME.version")
    _check_version(version, "RESUME")
    return Resume(
        version=version,
        auth=r.blob("RESUME.auth", r.limits.max_str_bytes),
        session=r.uvarint("RESUME.session"),
        secret=r.blob("RESUME.secret", MAX_SECRET_BYTES),
        committed=r.uvarint("RESUME.committed"),
        digest=r.blob("RESUME.digest", MAX_SECRET_BYTES),
    )


def _enc_ping(w: _Writer, f: Ping | Pong) -> None:
    w.u64(f.nonce, f"{f.TYPE.name}.nonce")
    w.u64(f.sent_us, f"{f.TYPE.name}.sent_us")


def _dec_ping(r: _Reader) -> Ping:
    return Ping(nonce=r.u64("PING.nonce"), sent_us=r.u64("PING.sent_us"))


def _dec_pong(r: _Reader) -> Pong:
    return Pong(nonce=r.u64("PONG.nonce"), sent_us=r.u64("PONG.sent_us"))


def _message_limit(limits: Limits) -> int:
    return min(MAX_ERROR_MESSAGE_BYTES, limits.max_str_bytes)


def _enc_error(w: _Writer, f: Error) -> None:
    w.u16(_enum(ErrorCode, _uint(f.code, "ERROR.code", _U16_MAX), "ERROR.code"), "ERROR.code")
    if not isinstance(f.message, str):
        raise WireError(BAD_FRAME, f"ERROR.message must be a str, not {type(f.message).__name__}")
    # An error report must not fail for its text: replace what UTF-8 cannot carry, and cut at a
    # character boundary rather than refuse a long message.
    raw = f.message.encode("utf-8", "replace")
    limit = _message_limit(w.limits)
    if len(raw) > limit:
        raw = raw[:limit].decode("utf-8", "ignore").encode("utf-8")
    w.blob(raw, "ERROR.message", limit)


def _dec_error(r: _Reader) -> Error:
    return Error(
        code=_enum(ErrorCode, r.u16("ERROR.code"), "ERROR.code"),
        message=r.text("ERROR.message", _message_limit(r.limits)),
    )


def _enc_close(w: _Writer, f: Close) -> None:
    w.u8(_enum(CloseReason, _uint(f.reason, "CLOSE.reason", _U8_MAX), "CLOSE.reason"), "CLOSE.reason")


def _dec_close(r: _Reader) -> Close:
    return Close(reason=_enum(CloseReason, r.u8("CLOSE.reason"), "CLOSE.reason"))


def _enc_tokens(w: _Writer, f: Tokens) -> None:
    w.uvarint(f.start, "TOKENS.start")
    w.tokens(f.tokens, w.limits.max_prompt_tokens, "TOKENS.tokens")
    w.out.append(TokensFlag.FINISHED if f.finished else 0)


def _dec_tokens(r: _Reader) -> Tokens:
    start = r.uvarint("TOKENS.start")
    tokens = r.tokens(r.limits.max_prompt_tokens, "TOKENS.tokens")
    flags = r.flags(TokensFlag.FINISHED, "TOKENS.flags")
    return Tokens(start=start, tokens=tokens, finished=bool(flags & TokensFlag.FINISHED))


_ENCODERS = {
    Hello: _enc_hello,
    Welcome: _enc_welcome,
    Draft: _enc_draft,
    Verdict: _enc_verdict,
    Resume: _enc_resume,
    Ping: _enc_ping,
    Pong: _enc_ping,
    Error: _enc_error,
    Close: _enc_close,
    Tokens: _enc_tokens,
}

_DECODERS = {
    FrameType.HELLO: _dec_hello,
    FrameType.WELCOME: _dec_welcome,
    FrameType.DRAFT: _dec_draft,
    FrameType.VERDICT: _dec_verdict,
    FrameType.RESUME: _dec_resume,
    FrameType.PING: _dec_ping,
    FrameType.PONG: _dec_pong,
    FrameType.ERROR: _dec_error,
    FrameType.CLOSE: _dec_close,
    FrameType.TOKENS: _dec_tokens,
}


def encode(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The complete frame (length prefix, type byte, payload) as bytes.

    Raises WireError for a frame the receiver would refuse under `limits`; TypeError for an object
    that is not a frame at all.
    """
    encoder = _ENCODERS.get(type(frame))
    if encoder is None:
        raise TypeError(f"not a wire frame: {type(frame).__name__}")
    w = _Writer(limits)
    w.out.append(frame.TYPE)
    encoder(w, frame)
    length = len(w.out)
    if length > limits.max_frame_bytes:
        raise WireError(
            OVER_LIMIT, f"{frame.TYPE.name} frame of {length} bytes exceeds max_frame_bytes {limits.max_frame_bytes}"
        )
    prefix = bytearray()
    _put_uvarint(prefix, length)
    return bytes(prefix + w.out)


def _parse_length(buf, pos: int, end: int, max_frame_bytes: int) -> tuple[int, int] | None:
    """(L, prefix size) of the frame at buf[pos:end], or None while the prefix is incomplete.

    Looks at no more bytes than the longest legal prefix, so an oversize frame is refused before any
    of its body is read.
    """
    max_prefix = _varint_size(max_frame_bytes)
    value = 0
    for i in range(min(end - pos, max_prefix)):
        byte = buf[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            if byte == 0 and i:
                raise WireError(BAD_FRAME, "frame length prefix is not minimally encoded")
            if value == 0:
                raise WireError(BAD_FRAME, "frame length 0: no type byte")
            if value > max_frame_bytes:
                raise WireError(OVER_LIMIT, f"frame of {value} bytes exceeds max_frame_bytes {max_frame_bytes}")
            return value, i + 1
    if end - pos >= max_prefix:
        raise WireError(
            OVER_LIMIT, f"frame length prefix runs past {max_prefix} bytes: over max_frame_bytes {max_frame_bytes}"
        )
    return None


def _decode_payload(buf, pos: int, end: int, limits: Limits) -> Frame:
    """The frame whose type byte is buf[pos] and whose payload ends at `end`."""
    kind = buf[pos]
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise WireError(BAD_FRAME, f"unknown frame type {kind}")
    r = _Reader(buf, pos + 1, end, limits)
    frame = decoder(r)
    if r.pos != end:
        raise WireError(BAD_FRAME, f"{end - r.pos} unread bytes at the end of the {frame.TYPE.name} payload")
    return frame


def decode(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """The one frame that `data` holds, from its length prefix to its last byte.

    Raises WireError if `data` is anything else: a partial frame, a frame followed by more bytes,
    or malformed or over-limit content.
    """
    header = _parse_length(data, 0, len(data), limits.max_frame_bytes)
    if header is None:
        raise WireError(BAD_FRAME, "truncated length prefix" if data else "no bytes to decode")
    length, prefix = header
    end = prefix + length
    if len(data) < end:
        raise WireError(BAD_FRAME, f"truncated frame: {len(data) - prefix} of {length} bytes")
    if len(data) > end:
        raise WireError(BAD_FRAME, f"{len(data) - end} trailing bytes after the frame")
    return _decode_payload(data, prefix, end, limits)


class FrameDecoder:
    """Splits a byte stream into frames, whatever the chunks it arrives in.

    `feed` returns the frames completed so far. A malformed frame whose length was sound is dropped
    and raised, and the decoder carries on with the next; a bad length prefix breaks the decoder for
    good (there is no telling where the next frame starts), and every later call raises it again.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS):
        self.limits = limits
        self._buf = bytearray()
        self._start = 0  # bytes before this are consumed; dropped lazily to avoid quadratic copying
        self._failure: tuple[ErrorCode, str] | None = None

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a returned frame."""
        return len(self._buf) - self._start

    @property
    def broken(self) -> bool:
        """True after a bad length prefix: the stream cannot be resynchronised."""
        return self._failure is not None

    @property
    def wanted(self) -> int:
        """Bytes to read before the next frame can complete, never more than it needs.

        1 while the length prefix is incomplete; 0 if a complete frame is already buffered. Reading
        at most this many bytes never takes a byte of the frame after, which is how `read_frame` and
        `recv_frame` stay stateless.
        """
        if self._failure is not None:
            return 1
        try:
            header = _parse_length(self._buf, self._start, len(self._buf), self.limits.max_frame_bytes)
        except WireError:
            return 1  # next_frame() raises it
        if header is None:
            return 1
        length, prefix = header
        return max(0, prefix + length - self.pending)

    def feed(self, data: bytes) -> list[Frame]:
        """Add received bytes; return every frame now complete, in order."""
        if self._start:
            del self._buf[: self._start]
            self._start = 0
        self._buf += data
        frames: list[Frame] = []
        try:
            while (frame := self.next_frame()) is not None:
                frames.append(frame)
        except WireError as exc:
            exc.frames = tuple(frames)
            raise
        return frames

    def next_frame(self) -> Frame | None:
        """Decode one frame from the bytes already fed, or return None if none is complete."""
        if self._failure is not None:
            raise WireError(*self._failure)
        buf, start = self._buf, self._start
        try:
            header = _parse_length(buf, start, len(buf), self.limits.max_frame_bytes)
        except WireError as exc:
            self._failure = (exc.code, exc.message)
            raise
        if header is None:
            return None
        length, prefix = header
        end = start + prefix + length
        if end > len(buf):
            return None
        # Consume before decoding, so a malformed payload costs only itself and the stream stays in step.
        self._start = end
        try:
            return _decode_payload(buf, start + prefix, end, self.limits)
        finally:
            if self._start == len(buf):
                buf.clear()
                self._start = 0


def committed_digest(tokens) -> bytes:
    """SHA-256 of the `tokens` encoding (varint count, then one varint per id) of a committed sequence,
    prompt included: what RESUME.digest carries."""
    out = bytearray()
    _put_uvarint(out, len(tokens))
    for t in tokens:
        _put_uvarint(out, _uint(t, "token id"))
    return hashlib.sha256(out).digest()


def encode_uvarint(value: int) -> bytes:
    """The minimal unsigned LEB128 encoding of 0 <= value < 2**64."""
    out = bytearray()
    _put_uvarint(out, _uint(value, "varint"))
    return bytes(out)


def decode_uvarint(data: bytes, pos: int = 0) -> tuple[int, int]:
    """(value, position after it) of the varint at data[pos:]; WireError if it is not a valid one."""
    r = _Reader(data, pos, len(data), DEFAULT_LIMITS)
    value = r.uvarint("varint")
    return value, r.pos


def zigzag_encode(value: int) -> int:
    """Map a signed 64-bit int onto an unsigned one, small magnitudes to small values: 0,-1,1 -> 0,1,2."""
    if type(value) is not int:
        value = operator.index(value)
    if not -(1 << 63) <= value < (1 << 63):
        raise WireError(BAD_FRAME, f"{value} does not fit a signed 64-bit integer")
    return value << 1 if value >= 0 else ((-value) << 1) - 1


def zigzag_decode(value: int) -> int:
    """Inverse of zigzag_encode."""
    value = _uint(value, "zigzag value")
    return (value >> 1) ^ -(value & 1)
