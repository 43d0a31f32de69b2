"""Frames over asyncio streams and blocking sockets.

The readers ask the decoder how many bytes the current frame still needs (`FrameDecoder.wanted`)
and never read more, so they never hold bytes of the next frame and need no state between calls:
pass `Limits` for that. Pass a `FrameDecoder` instead to go on from bytes already fed to it.
Only the length prefix is read before an oversize frame is refused.

I/O failures (resets, timeouts) propagate as the usual OSError / asyncio exceptions; a peer that
closes mid-frame is a WireError (BAD_FRAME), one that closes between frames is a clean end (None).
"""

from __future__ import annotations

import asyncio
import socket

from .codec import encode
from .errors import ErrorCode, WireError
from .frames import DEFAULT_LIMITS, Frame, Limits
from .framing import FrameDecoder

__all__ = ["read_frame", "write_frame", "recv_frame", "send_frame"]


def _decoder(source: Limits | FrameDecoder) -> FrameDecoder:
    if isinstance(source, FrameDecoder):
        return source
    if isinstance(source, Limits):
        return FrameDecoder(source)
    raise TypeError(f"expected Limits or FrameDecoder, not {type(source).__name__}")


def _end_of_stream(decoder: FrameDecoder) -> None:
    """A clean end of the stream (nothing buffered) reads as None; one in the middle of a frame is a WireError."""
    if decoder.pending:
        raise WireError(ErrorCode.BAD_FRAME, f"connection closed mid-frame, {decoder.pending} bytes in")


async def read_frame(
    reader: asyncio.StreamReader, decoder_or_limits: Limits | FrameDecoder = DEFAULT_LIMITS
) -> Frame | None:
    """The next frame from `reader`; None on a clean end of stream between frames."""
    decoder = _decoder(decoder_or_limits)
    frame = decoder.next_frame()  # one may be buffered already if the caller fed the decoder
    while frame is None:
        data = await reader.read(decoder.wanted)
        if not data:
            _end_of_stream(decoder)
            return None
        frames = decoder.feed(data)  # at most one: we read no more than the frame needs
        frame = frames[0] if frames else None
    return frame


async def write_frame(writer: asyncio.StreamWriter, frame: Frame, limits: Limits = DEFAULT_LIMITS) -> None:
    """Encode (checking `frame` against `limits`), write, and wait for the transport to drain."""
    writer.write(encode(frame, limits))
    await writer.drain()


def recv_frame(sock: socket.socket, decoder_or_limits: Limits | FrameDecoder = DEFAULT_LIMITS) -> Frame | None:
    """The next frame from a blocking socket; None on a clean end of stream between frames."""
    decoder = _decoder(decoder_or_limits)
    frame = decoder.next_frame()
    while frame is None:
        data = sock.recv(decoder.wanted)
        if not data:
            _end_of_stream(decoder)
            return None
        frames = decoder.feed(data)
        frame = frames[0] if frames else None
    return frame


def send_frame(sock: socket.socket, frame: Frame, limits: Limits = DEFAULT_LIMITS) -> None:
    """Encode (checking `frame` against `limits`) and send all of it on a blocking socket."""
    sock.sendall(encode(frame, limits))
