"""TLS for the edge-cloud link: the two `ssl.SSLContext`s that `acespec serve` and `acespec edge` use.

The server presents a certificate (`--tls-cert/--tls-key`) and, with `--tls-client-ca`, asks every
edge for a certificate that CA signed. The edge checks the server's certificate against `--tls-ca`
(or the system's trust store) and its host name, and presents its own with `--tls-cert/--tls-key`.
TLS 1.2 is the floor. With TLS on, the server speaks nothing else: a plaintext HELLO fails the TLS
handshake and the connection is closed before any frame is read.
"""

from __future__ import annotations

import ssl


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The cloud's context: its certificate chain and key; with `client_ca`, client certificates required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """The edge's context: verifies the cloud against `ca` (default: the system's CAs) and its host
    name; presents `cert`/`key` when the cloud asks for a client certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        ctx.load_cert_chain(cert, key)
    elif key:
        raise ValueError("a TLS key needs its certificate (--tls-cert)")
    return ctx
