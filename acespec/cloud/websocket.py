"""The cloud's WebSocket edge (`acespec serve --ws-port P`): the same binary frames as the TCP port, for
edges that cannot open raw TCP (a browser). docs/operate/websocket.md is the operator's account.

Each frame travels as one binary WebSocket message, both ways. A connection is handed to the very
handler that serves TCP connections (`CloudServer._on_connect`) through two small adapters that give it
the `StreamReader` / `StreamWriter` surface it uses, so auth, limits, RESUME, idle expiry and the drain
are one code path for both transports. What only WebSocket has is checked here:

- a text message, an empty one, or one that is not exactly one frame (part of a frame, or a frame and
  more) is refused with ERROR(BAD_FRAME), then CLOSE, as a malformed frame is on TCP;
- a frame whose length prefix is over `Limits.max_frame_bytes` gets OVER_LIMIT from the frame decoder
  as on TCP; a message too large to be one frame at all (over the limit plus the longest prefix) is
  refused by the WebSocket layer before it is buffered, with close code 1009 (message too big).

The WebSocket close code follows the last frame the cloud sent: 1000 after CLOSE(NORMAL or IDLE),
1001 after CLOSE(GOING_AWAY) (the drain: reconnect and RESUME), 1008 after an ERROR.

The same port answers plain GETs for a small browser edge: `/` (the page), `/ws-edge.js` (its frame
codec), `/info` (the target's name and tokenizer fingerprint, which HELLO must name), and the target's
tokenizer, so a page can send text and show text: `/tokenize?text=...` -> {"ids": [...]} and
`/detokenize?ids=1,2,3` -> {"text": "...", "bytes_b64": "..."} (the bytes, for a chunk that ends inside
a character). A request line is at most 8 KiB (the WebSocket library's HTTP limit).
A request with another method gets 405, and any other GET that is not a WebSocket upgrade gets the
library's own refusal (426).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import http
import json
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.http11 import Request, Response

from acespec import wire
from acespec.models.base import Model

STATIC = Path(__file__).resolve().parent / "static"
# path -> (file under STATIC, content type)
_PAGES = {
    "/": ("ws-edge.html", "text/html; charset=utf-8"),
    "/ws-edge.js": ("ws-edge.js", "text/javascript; charset=utf-8"),
}
_VARINT_MAX = 10  # bytes: the longest length prefix the decoder could still read
_CLOSE_TIMEOUT_S = 10.0  # the frames still queued and the closing handshake must be through within this

Handler = Callable[["WsReader", "WsWriter"], Awaitable[None]]


class ConnReader(Protocol):
    """The reader the connection handler takes: an asyncio `StreamReader`, or a `WsReader`."""

    async def read(self, n: int = -1) -> bytes: ...


class _Abortable(Protocol):
    def abort(self) -> None: ...


class ConnWriter(Protocol):
    """The writer the connection handler takes: an asyncio `StreamWriter`, or a `WsWriter`."""

    @property
    def transport(self) -> _Abortable: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


def _prefix(data: bytes | bytearray, pos: int = 0) -> tuple[int, int]:
    """(L, prefix bytes) of the frame at `pos`; WireError if its length prefix is malformed or cut short."""
    return wire.decode_uvarint(bytes(data[pos : pos + _VARINT_MAX]))


def _check_one_frame(msg: bytes, limits: wire.Limits) -> None:
    """Refuse a binary message that is not exactly one frame. A message whose prefix the frame decoder
    refuses (malformed, zero, over the frame limit) passes, so its ERROR says what it says on TCP."""
    if not msg:
        raise wire.WireError(wire.ErrorCode.BAD_FRAME, "an empty message: each binary message must carry one frame")
    try:
        length, prefix = _prefix(msg)
    except wire.WireError:
        if len(msg) < _VARINT_MAX and all(b & 0x80 for b in msg):  # a prefix cut short: part of a frame
            raise wire.WireError(
                wire.ErrorCode.BAD_FRAME,
                "a message ends inside a length prefix: send each frame as exactly one binary message",
            ) from None
        return
    if 1 <= length <= limits.max_frame_bytes and prefix + length != len(msg):
        what = "part of a frame" if prefix + length > len(msg) else "more than one frame"
        raise wire.WireError(
            wire.ErrorCode.BAD_FRAME,
            f"a message of {len(msg)} bytes holds {what} (its frame is {prefix + length} bytes): "
            "send each frame as exactly one binary message",
        )


class WsReader:
    """The `StreamReader` surface the connection handler reads with: `read()` returns the next message's
    bytes (one whole frame), b"" once the peer has closed cleanly."""

    def __init__(self, ws: ServerConnection, limits: wire.Limits) -> None:
        self._ws = ws
        self._limits = limits

    async def read(self, n: int = -1) -> bytes:
        # `n` is ignored: a message is one frame, and a frame is never more than max_frame_bytes.
        # recv() may be cancelled (the handler's frame deadline) without losing a message.
        try:
            msg = await self._ws.recv()
        except ConnectionClosedOK:
            return b""
        except ConnectionClosed as e:  # the peer vanished, or broke the WebSocket protocol
            raise ConnectionResetError(f"WebSocket closed: {e}") from None
        if isinstance(msg, str):
            raise wire.WireError(
                wire.ErrorCode.BAD_FRAME,
                "a text message: this endpoint carries binary frames only, one frame per binary message",
            )
        _check_one_frame(msg, self._limits)
        return msg


class _Abort:
    """`writer.transport`: the handler aborts an old connection that a RESUME takes over."""

    def __init__(self, ws: ServerConnection) -> None:
        self._ws = ws

    def abort(self) -> None:
        self._ws.transport.abort()


class WsWriter:
    """The `StreamWriter` surface the connection handler writes with. `write()` does not block, as on
    TCP: it queues each frame in the bytes as its own binary message, and one task sends them in order.
    `drain()` waits until every queued message is handed to the socket (so a slow reader slows the
    session, as TCP's flow control does); `close()` sends what is queued, then closes the WebSocket."""

    def __init__(self, ws: ServerConnection) -> None:
        self._ws = ws
        self.transport = _Abort(ws)
        self._out: collections.deque[bytes] = collections.deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._lost: BaseException | None = None
        self._close_code = 1000
        self._task = asyncio.create_task(self._pump())

    def get_extra_info(self, name: str, default=None):
        return self._ws.transport.get_extra_info(name, default)

    def write(self, data: bytes) -> None:
        if self._closing or self._lost is not None:
            return  # as a closing TCP transport does: the bytes go nowhere
        pos = 0
        while pos < len(data):  # our own frames: each write is one, but never send two in a message
            length, prefix = _prefix(data, pos)
            end = pos + prefix + length
            if end > len(data):
                raise ValueError("WsWriter.write takes whole encoded frames")
            self._out.append(bytes(data[pos:end]))
            self._close_code = _close_code(data[pos + prefix], data[end - 1], self._close_code)
            pos = end
        self._idle.clear()
        self._wake.set()

    async def drain(self) -> None:
        if self._lost is None:
            await self._idle.wait()
        if self._lost is not None:
            raise ConnectionResetError(f"WebSocket closed: {self._lost}")
        if self._closing:  # as TCP's drain fails once the transport is closed: a writer loop stops here
            raise ConnectionResetError("WebSocket closed by the server")

    def is_closing(self) -> bool:
        return self._closing or self._lost is not None

    def close(self) -> None:
        self._closing = True
        self._wake.set()

    async def wait_closed(self) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._task), _CLOSE_TIMEOUT_S)
        except TimeoutError:
            # a peer that reads nothing and answers no close: drop the connection, as a TCP reset would
            self._ws.transport.abort()
            self._task.cancel()

    async def _pump(self) -> None:
        try:
            while True:
                while self._out:
                    await self._ws.send(self._out.popleft())
                self._idle.set()
                if self._closing:
                    break
                self._wake.clear()
                await self._wake.wait()
            await self._ws.close(self._close_code)
        except ConnectionClosed as e:
            self._lost = e
        finally:
            self._out.clear()
            self._idle.set()


def _close_code(frame_type: int, last_byte: int, current: int) -> int:
    """The WebSocket close code that follows the frame just queued (the module docstring)."""
    if frame_type == wire.FrameType.ERROR:
        return 1008
    if frame_type == wire.FrameType.CLOSE:
        return 1001 if last_byte == wire.CloseReason.GOING_AWAY else (1008 if current == 1008 else 1000)
    return current


class WsListener:
    """The WebSocket port: accepts connections and hands each to `handler` as a reader and a writer."""

    def __init__(self, handler: Handler, limits: wire.Limits, target: Model) -> None:
        self._handler = handler
        self._limits = limits
        self._tokenizer = target.tokenizer
        self._vocab = target.vocab_size
        self._info = json.dumps(
            {
                "model_id": target.tokenizer.fingerprint,
                "target": target.name,
                "max_prompt_tokens": limits.max_prompt_tokens,
            }
        ).encode()
        self._server: Server | None = None
        self.port = 0

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None, open_timeout_s: float) -> None:
        self._server = await serve(
            self._serve_one,
            host,
            port,
            ssl=tls,
            open_timeout=open_timeout_s,
            # the largest legal frame and its prefix fit; anything larger cannot be one frame
            max_size=self._limits.max_frame_bytes + _VARINT_MAX,
            compression=None,  # frames are small and dense: deflate would cost CPU and latency for little
            ping_interval=None,  # liveness is the protocol's (PING/PONG, idle expiry), as on TCP
            process_request=self._static,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop accepting; open connections are the handler's to end (the drain tells each GOING_AWAY)."""
        if self._server is not None:
            self._server.close(close_connections=False)

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve_one(self, ws: ServerConnection) -> None:
        writer = WsWriter(ws)
        try:
            await self._handler(WsReader(ws, self._limits), writer)
        finally:
            writer.close()
            await writer.wait_closed()

    def _static(self, conn: ServerConnection, request: Request) -> Response | None:
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None  # the opening handshake goes on
        if request.method != "GET":
            return _error(conn, http.HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method}: this port answers GET only")
        path, _, query = request.path.partition("?")
        if path == "/info":
            return _response(conn, self._info, "application/json")
        if path in ("/tokenize", "/detokenize"):
            return self._tokens(conn, path, urllib.parse.parse_qs(query))
        if path in _PAGES:
            name, ctype = _PAGES[path]
            return _response(conn, (STATIC / name).read_bytes(), ctype)
        return None

    def _tokens(self, conn: ServerConnection, path: str, query: dict[str, list[str]]) -> Response:
        """/tokenize and /detokenize: the target's own tokenizer, for a page that sends and shows text;
        `/tokenize?chat=1` gives the ids of `text` as one user turn in the target's chat template, ready for
        the assistant's reply (as the edge's API builds a chat's prompt). The WebSocket library's HTTP
        parser takes request lines of at most 8 KiB, which bounds the work."""
        arg = (query.get("text") if path == "/tokenize" else query.get("ids")) or [""]
        body: dict[str, object]  # JSON
        if path == "/tokenize":
            chat = (query.get("chat") or ["0"])[0]
            if chat not in ("0", "1"):
                return _error(conn, http.HTTPStatus.BAD_REQUEST, f"chat must be 0 or 1, got {chat!r}")
            turn = [{"role": "user", "content": arg[0]}]
            body = {"ids": self._tokenizer.chat_prompt(turn) if chat == "1" else self._tokenizer.encode(arg[0])}
        else:
            try:
                ids = [int(t) for t in arg[0].split(",") if t.strip()]
            except ValueError:
                return _error(conn, http.HTTPStatus.BAD_REQUEST, "ids must be comma-separated token ids")
            if any(not 0 <= t < self._vocab for t in ids):
                return _error(conn, http.HTTPStatus.BAD_REQUEST, "a token id outside the target vocabulary")
            raw = self._tokenizer.decode_bytes(ids)  # a chunk may end inside a character: the page joins the bytes
            body = {"text": raw.decode("utf-8", "replace"), "bytes_b64": base64.b64encode(raw).decode()}
        return _response(conn, json.dumps(body).encode(), "application/json")


def _error(conn: ServerConnection, status: http.HTTPStatus, message: str) -> Response:
    r = _response(conn, json.dumps({"error": message}).encode(), "application/json")
    r.status_code, r.reason_phrase = status.value, status.phrase
    return r


def _response(conn: ServerConnection, body: bytes, ctype: str) -> Response:
    r = conn.respond(http.HTTPStatus.OK, "")
    r.body = body
    del r.headers["Content-Type"]
    del r.headers["Content-Length"]
    r.headers["Content-Type"] = ctype
    r.headers["Content-Length"] = str(len(body))
    r.headers["Cache-Control"] = "no-cache"
    if ctype == "application/json":
        # a page served from elsewhere may read these too: /info and the tokenizer's answers are public
        # facts of the target, and the sessions are behind the WebSocket's token, which no CORS rule governs
        r.headers["Access-Control-Allow-Origin"] = "*"
    return r
