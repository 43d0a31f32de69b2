r"""AceSpec wire format, protocol version 3: the binary frames between edge and cloud.

This docstring specifies the frames; docs/reference/wire.md is the whole protocol (the frames with
every limit and error, the session state machine of every mode, RESUME's agreement rule, the tokenizer
fingerprint, rule strings, coupled sampling, versioning) and what an implementation in another language
follows. The code below implements it; tests/test_wire.py pins it byte by byte and tests/test_vectors.py
checks it against the language-neutral vectors in spec/vectors/.

Primitive encodings
-------------------
varint   Unsigned LEB128: 7 bits per byte, least significant group first, the high bit set on every
         byte except the last. 0..127 take 1 byte, up to 2**14-1 take 2, up to 2**21-1 take 3.
         A varint is at most 10 bytes, its value is < 2**64, and it must be minimal (a multi-byte
         varint never ends in 0x00). So each value has exactly one encoding.
zigzag   Signed integers would be mapped 0, -1, 1, -2, ... -> 0, 1, 2, 3, ... and sent as varints
         (`zigzag_encode`). No field of version 3 is signed.
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
       version      u8      PROTOCOL_VERSION (3)
       auth         bytes   the tenant's token; the cloud checks it (BAD_AUTH) and binds the session to
                            that tenant
       model_id     str     tokenizer fingerprint; the cloud refuses a mismatch (MODEL_MISMATCH)
       temperature  f32     >= 0 (0 = greedy)
       top_k        varint  0 = off
       top_p        f32     0..1 (1 = off)
       rule         str     verification rule spec, e.g. "strict" or "cactus:delta=0.35"
       seed         u64     shared seed (coupled sampling derives its noise from it)
       mode         u8      0 = speculative (edge-led: the cloud verifies each DRAFT and answers a VERDICT),
                            1 = cloud-only (the cloud generates and streams TOKENS),
                            2 = cloud-led (the cloud decodes and streams TOKENS without waiting; DRAFTs
                            are suggestions it verifies when they agree with the stream, see TOKENS)
       max_tokens   varint  generation budget, in new tokens
       logprobs     u8      0 = none; 1 + m (m <= MAX_TOP_LOGPROBS = 20): every TOKENS frame carries each
                            token's log-probability and the m likeliest tokens at its position
                            (HAS_LOGPROBS). Streaming modes only: the cloud refuses it in mode 0
                            (BAD_REQUEST), and an engine that cannot compute it refuses it too
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
                            0x02 HAS_P; 0x04 HAS_PATH; 0x08 FINISHED: generation has ended (an
                            end-of-generation token of the target, EOS or another end-of-turn token such
                            as <|im_end|>, was committed, or max_tokens was reached), no later block will
                            be verified. Other bits must be 0.
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
5  RESUME   edge -> cloud. Reconnects to a session; the cloud answers WELCOME (how the committed prefix
            is agreed: docs/reference/wire.md, "RESUME and the agreement rule").
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
10 TOKENS   cloud -> edge, cloud-only and cloud-led modes: a chunk of generated tokens.
       start        varint  position of tokens[0]
       tokens       tokens  at most Limits.max_prompt_tokens
       flags        u8      0x01 FINISHED: the last chunk of the generation (a stream with nothing left to
                            generate, e.g. max_tokens 0, gets one empty FINISHED chunk right after WELCOME);
                            0x02 HAS_STEP; 0x04 HAS_LOGPROBS; other bits must be 0
       drafted      varint  only if HAS_STEP: draft tokens the step verified (0: a plain step),
                            <= Limits.max_draft_tokens
       accepted     varint  only if HAS_STEP: how many of them were kept, <= drafted
       verify_us    varint  only if HAS_STEP: the step's target time in microseconds
       logprobs     n x (logprob f32, top lrow)   only if HAS_LOGPROBS (set on every TOKENS frame of a
                            session whose HELLO asked, never otherwise; n = len(tokens)): the token's
                            log-probability under the target, then the m likeliest tokens there, most
                            likely first. An lrow is a row whose floats are log-probabilities in
                            LOGPROB_FLOOR..0 (LOGPROB_FLOOR = -9999, which also stands for any smaller
                            value, e.g. a probability that is 0 in f32) and whose count is at most
                            MAX_TOP_LOGPROBS. The distribution is the target's log-softmax over its whole
                            vocabulary at that position, before temperature, top-k and top-p.
       In cloud-led mode each TOKENS is one target step and carries HAS_STEP. There a DRAFT names no
       block to answer: `base` is the committed length its first token follows (at most what the
       edge has seen streamed), and the draft (a chain, or a tree of alternatives with HAS_TREE)
       assumes the committed tokens up to `base`. Before each step the cloud verifies the longest
       path through a draft it holds that agrees with every token committed since that draft's
       base, or decodes one token if none does; it never waits for a DRAFT, sends no VERDICT, and
       forgets drafts that disagree with the stream or lie wholly behind it.

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
version 3 peer refuses each of them. Version 3 added HELLO.logprobs and TOKENS' HAS_LOGPROBS; version 2
added WELCOME.secret and RESUME.secret and .digest (per-session credentials). A HELLO or RESUME of
another version gets BAD_VERSION.

committed_digest(tokens) = SHA-256 over the `tokens` encoding above (varint count, then one varint per
id) of the whole committed sequence, prompt included: 32 bytes. Python floats are f64, so a float field that is not an exact
f32 comes back rounded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum, IntFlag
from typing import ClassVar

from .errors import ErrorCode

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
    "TokenLogprob",
    "MAX_TOP_LOGPROBS",
    "LOGPROB_FLOOR",
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
    "MAX_SECRET_BYTES",
]

PROTOCOL_VERSION = 3
MAX_TOP_LOGPROBS = 20  # alternatives per token that HELLO.logprobs may ask for (OpenAI's top_logprobs limit)
LOGPROB_FLOOR = -9999.0  # the smallest log-probability on the wire; it stands for anything below it too
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
    CLOUD_LED = 2  # the cloud decodes without waiting and streams TOKENS; edge DRAFTs speed it up


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
    HAS_STEP = 0x02
    HAS_LOGPROBS = 0x04


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

TokenLogprob = tuple[float, SparseRow]
"""One streamed token's log-probability and its position's top alternatives as (token id, log-probability)."""


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
    logprobs: int = 0  # 0: none; 1 + m: each streamed token's log-probability and the m likeliest
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
    q: tuple[SparseRow, ...] | None = None  # one row per token; sent iff not None (HAS_Q)
    parents: tuple[int, ...] | None = None  # one per token; sent iff not None (HAS_TREE)

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
    p: SparseRow | None = None  # sent iff not None (HAS_P)
    path: tuple[int, ...] | None = None  # sent iff not None (HAS_PATH)

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
    """TOKENS, cloud -> edge (cloud-only, cloud-led): generated tokens from position `start` on;
    `drafted` is not None (HAS_STEP) when the frame reports one cloud-led step."""

    TYPE: ClassVar[FrameType] = FrameType.TOKENS
    start: int
    tokens: tuple[int, ...]
    finished: bool = False
    drafted: int | None = None  # HAS_STEP: draft tokens the step verified
    accepted: int = 0  # HAS_STEP: of which kept
    verify_us: int = 0  # HAS_STEP: the step's target time
    logprobs: tuple[TokenLogprob, ...] | None = None  # HAS_LOGPROBS: one per token

    def __post_init__(self):
        _set(self, "tokens", _tuple(self.tokens))
        if self.logprobs is not None:
            _set(self, "logprobs", tuple((lp, _row(top)) for lp, top in self.logprobs))


Frame = Hello | Welcome | Draft | Verdict | Resume | Ping | Pong | Error | Close | Tokens


# The byte-level codec (encode, decode) is in codec.py and the stream framing (FrameDecoder) and small
# public helpers in framing.py; `acespec.wire` exports them all.
