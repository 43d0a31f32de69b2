"""Why the wss tests use websockets' asyncio client: count opening handshakes that go unanswered.

    .venv/bin/python scripts/wss-client-stall.py [N]

Against websockets' own asyncio TLS server (no AceSpec code), N handshakes in a row each from:
  sync         websockets' sync client, which reads the TLS socket in a thread of its own while the
               caller writes the upgrade request: an OpenSSL connection driven by two threads at once
  sync-notix   the same client against a server that sends no TLS 1.3 session tickets (nothing arrives
               for the reader thread while the request goes out)
  one-thread   a plain TLS socket that writes the request and reads the answer from one thread
Each handshake waits at most 2 s; the line printed per client is how many went unanswered.
(tests/test_websocket.py::wss_cloud_only cites one run: 7 of 4,000 for `sync`, none of 6,000 for the others.)
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import ssl
import sys
import threading

import trustme
from websockets.asyncio.server import serve
from websockets.sync.client import connect


def server(tickets: bool) -> tuple[int, ssl.SSLContext]:
    """A TLS WebSocket echo server in a thread; its port and a client context that trusts it."""
    ca = trustme.CA()
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(sctx)
    if not tickets:
        sctx.num_tickets = 0
    cctx = ssl.create_default_context()
    ca.configure_trust(cctx)
    ready, box = threading.Event(), {}

    async def echo(ws) -> None:
        async for m in ws:
            await ws.send(m)

    async def main() -> None:
        async with serve(echo, "127.0.0.1", 0, ssl=sctx, compression=None, ping_interval=None) as s:
            box["port"] = s.sockets[0].getsockname()[1]
            ready.set()
            await asyncio.Future()

    threading.Thread(target=lambda: asyncio.run(main()), daemon=True).start()
    ready.wait()
    return box["port"], cctx


def sync_client(port: int, ctx: ssl.SSLContext) -> None:
    with connect(f"wss://127.0.0.1:{port}/", ssl=ctx, open_timeout=2, compression=None, proxy=None):
        pass


def one_thread(port: int, ctx: ssl.SSLContext) -> None:
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1") as s:
        s.settimeout(2)
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(
            f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise EOFError("closed before an answer")
            buf += chunk


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    logging.getLogger("websockets").setLevel(logging.CRITICAL)  # the one-thread client hangs up unannounced
    for name, tickets, client in (("sync", True, sync_client), ("sync-notix", False, sync_client),
                                  ("one-thread", True, one_thread)):
        port, ctx = server(tickets)
        lost = 0
        for _ in range(n):
            try:
                client(port, ctx)
            except (TimeoutError, OSError, EOFError):
                lost += 1
        print(f"{name:11s} {lost} of {n} handshakes unanswered", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
