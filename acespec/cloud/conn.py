"""What every part of the cloud server does on a connection: read the next frames (with a deadline once
a frame has begun), refuse with an ERROR and a CLOSE, and name the peer. `ProtocolError` is how any part
says "refuse this connection with this code"; the connection handler (`server.py`) catches it and
refuses. `FrameIO` also counts the ERROR frames sent, by code (`CloudServer.errors_sent`, read by
`metrics.py`)."""

from __future__ import annotations

import asyncio
import logging

from acespec import wire
from acespec.cloud.server_config import ServerConfig
from acespec.cloud.websocket import ConnReader, ConnWriter

log = logging.getLogger("acespec.cloud")

# What a draining or stopped replica tells a live edge (the drain, a step that meets the stopped
# engine, a verdict writer past its last verdict): reconnect, and carry your text to whoever answers.
GOING_AWAY = wire.encode(wire.Close(reason=wire.CloseReason.GOING_AWAY))


class ProtocolError(Exception):
    def __init__(self, code: wire.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def peer_addr(writer: ConnWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


class FrameIO:
    """Reads frames off a connection under the server's deadlines, and refuses connections."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.errors_sent: dict[str, int] = {}  # ErrorCode name -> count, for tests, logs and metrics

    async def next_frame(self, reader: ConnReader, decoder: wire.FrameDecoder, *, deadline: bool = True) -> list | None:
        """The next non-empty batch of whole frames, or None on a clean end of stream.

        With `deadline`, a frame that has begun to arrive must be complete within `frame_timeout_s`: a
        peer that sends half a frame and stalls is dropped then, not at the idle sweep. Silence between
        frames is the idle sweep's business."""
        while True:
            if deadline and decoder.pending:
                try:
                    data = await asyncio.wait_for(reader.read(65536), self.cfg.frame_timeout_s)
                except TimeoutError:
                    raise ProtocolError(
                        wire.ErrorCode.BAD_FRAME,
                        f"a frame was begun and not completed within {self.cfg.frame_timeout_s:g} s",
                    ) from None
            else:
                data = await reader.read(65536)
            if not data:
                if decoder.pending:
                    raise wire.WireError(wire.ErrorCode.BAD_FRAME, "connection closed in the middle of a frame")
                return None
            frames = decoder.feed(data)
            if frames:
                return frames

    async def refuse(self, writer: ConnWriter, code: wire.ErrorCode, message: str) -> None:
        """Send ERROR(code, message) and CLOSE(ERROR); the caller closes the connection."""
        self.errors_sent[code.name] = self.errors_sent.get(code.name, 0) + 1
        log.info("refusing connection: %s %s", code.name, message)
        try:
            writer.write(wire.encode(wire.Error(code=code, message=message)))
            writer.write(wire.encode(wire.Close(reason=wire.CloseReason.ERROR)))
            await asyncio.wait_for(writer.drain(), 2.0)
        except (TimeoutError, ConnectionError, OSError):
            pass
