"""A client on raw frames, for the tests that send what a well-behaved edge never would: open a session
with a HELLO and read its WELCOME, then read until the server's ERROR."""

from __future__ import annotations

import socket

from acespec import wire


def open_session(port: int, hello: wire.Hello, timeout: float = 5.0):
    """(socket, its frame decoder, the WELCOME) of a session opened with `hello` on 127.0.0.1:port."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(wire.encode(hello))
    dec, frames = wire.FrameDecoder(), []
    while not frames:
        data = s.recv(65536)
        assert data, "closed before WELCOME"
        frames = dec.feed(data)
    assert isinstance(frames[0], wire.Welcome), frames[0]
    return s, dec, frames[0]


def read_until_error(s: socket.socket, dec: wire.FrameDecoder) -> wire.Error:
    """Skip the frames before the server's ERROR (the session's TOKENS, say) and return it."""
    while True:
        data = s.recv(65536)
        assert data, "closed without an ERROR"
        for f in dec.feed(data):
            if isinstance(f, wire.Error):
                return f
