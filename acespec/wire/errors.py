"""The one exception type of the wire layer, and the error codes that ERROR frames carry.

Decoding raises only `WireError`, whatever the bytes were, so a server can answer any bad input with
`Error(code=exc.code, message=str(exc))` and keep running. Encoding raises it too, for a frame the
other side would refuse, so a peer never sends what its counterpart must reject.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ErrorCode", "WireError"]


class ErrorCode(IntEnum):
    """Why something was refused; the u16 `code` of an ERROR frame and `WireError.code`."""

    BAD_FRAME = 1  # malformed bytes: truncated, trailing, unknown type/flag/enum, bad varint/UTF-8/value
    BAD_VERSION = 2  # HELLO or RESUME speaks a protocol version this peer does not
    BAD_AUTH = 3  # auth token refused (server's decision, never raised by the codec)
    UNKNOWN_SESSION = 4  # RESUME or DRAFT names a session the cloud does not hold
    OVER_LIMIT = 5  # a size, count or token id beyond the receiver's `Limits`
    BUSY = 6  # the cloud cannot take the session now; retry later
    BAD_REQUEST = 7  # well-formed but unacceptable (e.g. an unknown rule); server's decision
    MODEL_MISMATCH = 8  # HELLO.model_id differs from the cloud's tokenizer fingerprint
    INTERNAL = 9  # the peer failed; not the sender's fault


class WireError(Exception):
    """A frame could not be decoded or encoded.

    `code` says what kind of failure it was (an `ErrorCode`), `message` says what exactly.
    `frames` holds the frames that `FrameDecoder.feed` had already decoded, in the same call, before
    it met the bad one: a caller that keeps the connection open handles those first.
    """

    def __init__(self, code: ErrorCode | int, message: str, frames: tuple = ()):
        self.code = ErrorCode(code)
        self.message = message
        self.frames = tuple(frames)
        super().__init__(f"{self.code.name}: {message}")

    def __reduce__(self):
        # Exception pickles `args` (the formatted text), which would not rebuild code and message.
        return (type(self), (self.code, self.message, self.frames))
