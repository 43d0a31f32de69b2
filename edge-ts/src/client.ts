// The Node edge's connection to the cloud: one TCP (or TLS) connection at a time, carrying the session
// that session.ts runs over any frame transport. Everything of session.ts is exported from here too.

import { readFileSync } from "node:fs";
import * as net from "node:net";
import * as tls from "node:tls";
import { ConnectConfig, connectConfigWith, EdgeError, Link } from "./session.js";
import { ErrorCode } from "./wire/frames.js";

export * from "./session.js";

const SOCKET_ERRORS = new Set(["ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "EPIPE", "EHOSTUNREACH", "ENETUNREACH",
  "ECONNABORTED", "EAI_AGAIN", "ENOTFOUND"]);

/** A session's settings with the defaults, connecting over TCP (TLS with `tlsCa`). */
export function connectConfig(c: Partial<ConnectConfig> & Pick<ConnectConfig, "host" | "port">): ConnectConfig {
  return connectConfigWith(tcpConnect, c);
}

/** One TCP (or TLS) connection to the cloud, as a Link. */
export function tcpConnect(cfg: ConnectConfig): Promise<Link> {
  return new Promise((resolve, reject) => {
    let sock: net.Socket;
    const ready = (): void => {
      clearTimeout(timer);
      sock.removeListener("error", fail);
      sock.setNoDelay(true);
      const s = sock;
      const link = new Link({
        write: (data) => void s.write(data), end: () => void s.end(), destroy: () => void s.destroy(),
        get destroyed() { return s.destroyed; },
      }, cfg.limits);
      s.on("data", (data: Buffer) => link.received(data));
      s.on("error", (e) => link.ended(e));
      s.on("close", () => link.ended(null));
      resolve(link);
    };
    const fail = (e: Error): void => {
      clearTimeout(timer);
      sock.destroy();
      // with TLS, anything but a socket error is the handshake refusing the cloud (its certificate):
      // retrying cannot help, so it is an EdgeError, which the handshake loop does not retry
      const errno = (e as NodeJS.ErrnoException).code ?? "";
      reject(cfg.tlsCa !== null && !SOCKET_ERRORS.has(errno) && !e.message.startsWith("connect timed out")
        ? new EdgeError(`TLS: the cloud's certificate was refused: ${e.message}`, ErrorCode.BAD_AUTH) : e);
    };
    if (cfg.tlsCa !== null) {
      const name = cfg.tlsServerName ?? cfg.host;
      sock = tls.connect({
        host: cfg.host, port: cfg.port, ca: readFileSync(cfg.tlsCa), minVersion: "TLSv1.2",
        servername: net.isIP(name) ? undefined : name,
        checkServerIdentity: (_host, cert) => tls.checkServerIdentity(name, cert),
      }, ready);
    } else {
      sock = net.connect({ host: cfg.host, port: cfg.port }, ready);
    }
    sock.once("error", fail);
    const timer = setTimeout(() => fail(new Error(`connect timed out after ${cfg.connectTimeoutMs} ms`)), cfg.connectTimeoutMs);
  });
}
