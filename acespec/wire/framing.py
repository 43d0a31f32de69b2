"""Splitting a byte stream into frames (`FrameDecoder`), and the small public helpers of the format:
the committed-prefix digest RESUME carries, varints and zigzag integers.
"""

from __future__ import annotations

import hashlib
import operator

from .codec import _decode_payload, _parse_length
from .errors import ErrorCode, WireError
from .fields import _put_uvarint, _Reader, _uint
from .frames import BAD_FRAME, DEFAULT_LIMITS, Frame, Limits

__all__ = ["FrameDecoder", "committed_digest", "encode_uvarint", "decode_uvarint", "zigzag_encode", "zigzag_decode"]


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
