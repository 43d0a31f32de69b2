"""The binary frame format between edge and cloud: encode/decode, limits, versioning.

The format itself is specified in the docstring of `acespec.wire.frames`; start there.

    encode(frame, limits=DEFAULT_LIMITS) -> bytes          a whole frame, length prefix included
    decode(data, limits=DEFAULT_LIMITS) -> frame           exactly one whole frame
    FrameDecoder(limits).feed(data) -> list[frame]         incremental, for byte streams
    await read_frame(reader, limits) / write_frame(writer, frame)    asyncio streams
    recv_frame(sock, limits) / send_frame(sock, frame)               blocking sockets

Frames are frozen dataclasses, one per FrameType: Hello, Welcome, Draft, Verdict, Resume, Ping,
Pong, Error, Close, Tokens. Decoding raises WireError (with an ErrorCode) and nothing else.

This package depends on the standard library only, so either side can use it alone.
"""

from . import codec as _codec
from . import frames as _frames
from . import framing as _framing
from .codec import decode, encode
from .errors import ErrorCode, WireError
from .frames import (
    DEFAULT_LIMITS,
    LOGPROB_FLOOR,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_SECRET_BYTES,
    MAX_TOP_LOGPROBS,
    PROTOCOL_VERSION,
    Close,
    CloseReason,
    Draft,
    DraftFlag,
    Error,
    Frame,
    FrameType,
    Hello,
    Limits,
    Mode,
    Ping,
    Pong,
    Resume,
    SparseRow,
    TokenLogprob,
    Tokens,
    TokensFlag,
    Verdict,
    VerdictFlag,
    Welcome,
)
from .framing import FrameDecoder, committed_digest, decode_uvarint, encode_uvarint, zigzag_decode, zigzag_encode
from .stream import read_frame, recv_frame, send_frame, write_frame

# everything frames.py, codec.py and framing.py export, plus the error types and the stream helpers
__all__ = [
    "ErrorCode",
    "WireError",
    *_frames.__all__,
    *_codec.__all__,
    *_framing.__all__,
    "read_frame",
    "write_frame",
    "recv_frame",
    "send_frame",
]
