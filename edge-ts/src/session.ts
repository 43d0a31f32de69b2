// The edge's session with the cloud over any transport that carries whole frames both ways: a TCP or TLS
// stream (client.ts, Node) or a WebSocket (web/ws.ts, a browser). Frames are decoded as they arrive into
// a queue the modes read with a timeout, and a session survives a dropped connection.
//
// As in the Python edge (acespec/edge/client.py): every handshake (connect, HELLO or RESUME, WELCOME) is
// retried as a whole with jittered exponential backoff; a cloud that answers BUSY is waited out for up to
// `busyRetryMs` without using up attempts; after a reset the edge sends RESUME with the session's secret
// and the committed tokens it holds (length and digest), and if the cloud no longer knows the session it
// opens a new one whose prompt is everything committed so far, with the budget reduced to match.
//
// Nothing here depends on Node: the same code runs in a browser.

import { encode } from "./wire/codec.js";
import { committedDigest, FrameDecoder } from "./wire/framing.js";
import {
  CloseReason, DEFAULT_LIMITS, ErrorCode, Frame, FrameType, Hello, Limits, resume, Welcome,
} from "./wire/frames.js";

/** What a Link writes through: a connection's sending half. */
export interface FrameTransport {
  write(data: Uint8Array): void;
  /** No more writes; the peer's close then ends the link (a WebSocket closes: it has no half-close). */
  end(): void;
  destroy(): void;
  readonly destroyed: boolean;
}

/** Opens one connection to the cloud (TCP or TLS in Node, a WebSocket in a browser). */
export type Connector = (cfg: ConnectConfig) => Promise<Link>;

export class EdgeError extends Error {
  constructor(message: string, readonly code: ErrorCode | null = null) {
    super(message);
    this.name = "EdgeError";
  }
}

export interface ConnectConfig {
  connector: Connector; // how a connection is opened
  host: string;
  port: number;
  token: Uint8Array; // this tenant's auth token (HELLO.auth, RESUME.auth)
  tlsCa: string | null; // PEM file: connect with TLS and check the cloud's certificate against it
  tlsServerName: string | null; // the name the certificate must carry (default: host)
  connectTimeoutMs: number;
  handshakeTimeoutMs: number;
  replyTimeoutMs: number; // longest wait for any frame mid-session before the link is called dead
  reconnectAttempts: number;
  backoffMs: number; // first retry delay; doubles up to backoffMaxMs, each wait jittered to 50-100 %
  backoffMaxMs: number;
  busyRetryMs: number; // keep retrying a cloud that answers BUSY for this long
  recover: boolean; // open a new session carrying the committed text if the cloud lost ours
  limits: Limits;
}

/** The defaults, for a connector's own `connectConfig`. */
export function connectConfigWith(connector: Connector,
  c: Partial<ConnectConfig> & Pick<ConnectConfig, "host" | "port">): ConnectConfig {
  return {
    connector,
    token: new Uint8Array(0), tlsCa: null, tlsServerName: null, connectTimeoutMs: 10_000, handshakeTimeoutMs: 10_000,
    replyTimeoutMs: 60_000, reconnectAttempts: 8, backoffMs: 50, backoffMaxMs: 2_000, busyRetryMs: 60_000, recover: true,
    limits: DEFAULT_LIMITS, ...c,
  };
}

/** What a link yields: a frame, or the end of the connection (with the error that ended it, if any). */
export type Arrival = { t: number; frame: Frame } | { t: number; frame: null; error: Error | null };

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** One connection and the frames it has brought. */
export class Link {
  private queue: Arrival[] = [];
  private waiter: (() => void) | null = null;
  alive = true;
  goingAway = false; // the cloud sent CLOSE(GOING_AWAY)
  bytesUp = 0;
  bytesDown = 0;

  private readonly dec: FrameDecoder;

  /** A link over `transport`; whoever owns the transport hands it what arrives (`received`) and says when
   * it ended (`ended`). */
  constructor(private transport: FrameTransport, limits: Limits) {
    this.dec = new FrameDecoder(limits);
  }

  /** Bytes from the peer: a piece of the TCP stream, or one whole WebSocket message. */
  received(data: Uint8Array): void {
    if (!this.alive) return;
    this.bytesDown += data.length;
    let frames: Frame[];
    try {
      frames = this.dec.feed(data);
    } catch (e) {
      const err = e as Error & { frames?: Frame[] };
      for (const f of err.frames ?? []) this.push({ t: performance.now(), frame: f });
      this.end(err);
      this.transport.destroy();
      return;
    }
    for (const f of frames) {
      if (f.type === FrameType.CLOSE && f.reason === CloseReason.GOING_AWAY) this.goingAway = true;
      this.push({ t: performance.now(), frame: f });
    }
  }

  /** The connection is over (`error`: what ended it, null for a plain close). */
  ended(error: Error | null): void {
    this.end(error);
  }

  private push(a: Arrival): void {
    this.queue.push(a);
    const w = this.waiter;
    this.waiter = null;
    w?.();
  }

  private end(error: Error | null): void {
    if (!this.alive) return;
    this.alive = false;
    this.push({ t: performance.now(), frame: null, error });
  }

  send(frame: Frame): boolean {
    return this.sendBytes(encode(frame));
  }

  /** Bytes already framed (a recorded frame, or one no encoder would write, in a test). */
  sendBytes(data: Uint8Array): boolean {
    if (!this.alive || this.transport.destroyed) return false;
    this.transport.write(data);
    this.bytesUp += data.length;
    return true;
  }

  /** The next arrival, or null when none came within `timeoutMs` (0: only what is already here). */
  async next(timeoutMs: number): Promise<Arrival | null> {
    if (this.queue.length) return this.queue.shift()!;
    if (timeoutMs <= 0) return null;
    await new Promise<void>((resolve) => {
      const timer = setTimeout(() => {
        this.waiter = null;
        resolve();
      }, timeoutMs);
      this.waiter = () => {
        clearTimeout(timer);
        resolve();
      };
    });
    return this.queue.shift() ?? null;
  }

  /** Close; with `lingerMs`, half-close first and wait for the peer to close, so our CLOSE gets there. */
  async close(lingerMs = 0): Promise<void> {
    if (lingerMs > 0 && this.alive) {
      this.transport.end();
      const deadline = performance.now() + lingerMs;
      while (this.alive && performance.now() < deadline) {
        const a = await this.next(deadline - performance.now());
        if (a === null) break;
      }
    }
    this.alive = false;
    this.transport.destroy();
  }
}

async function expectWelcome(link: Link, timeoutMs: number): Promise<Welcome> {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    const a = await link.next(Math.max(1, deadline - performance.now()));
    if (a === null) throw new EdgeError(`no answer from the cloud within ${timeoutMs / 1000} s`);
    const f = a.frame;
    if (f === null) {
      const err = (a as { error: Error | null }).error;
      throw new EdgeError(err ? `connection failed during the handshake: ${err.message}`
        : "the cloud closed the connection during the handshake");
    }
    if (f.type === FrameType.WELCOME) return f;
    if (f.type === FrameType.ERROR) throw new EdgeError(`cloud refused the session: ${ErrorCode[f.code]}: ${f.message}`, f.code);
    if (f.type !== FrameType.PONG && f.type !== FrameType.CLOSE) throw new EdgeError(`unexpected ${FrameType[f.type]} during the handshake`);
  }
}

/** A session with the cloud: HELLO once, RESUME after every dropped connection, a fresh HELLO carrying the
 * committed text if the cloud lost the session. */
export class CloudSession {
  link!: Link;
  sid: number | bigint = 0;
  secret = new Uint8Array(0);
  committed = 0;
  maxDraftTokens = 0;
  reconnects = 0; // successful RESUMEs
  recoveries = 0; // new sessions opened because the cloud had lost ours
  busyWaits = 0; // BUSY answers waited out
  private bytesUpDone = 0;
  private bytesDownDone = 0;

  private constructor(readonly cfg: ConnectConfig, readonly hello: Hello) {}

  static async open(cfg: ConnectConfig, hello: Hello): Promise<CloudSession> {
    const s = new CloudSession(cfg, hello);
    const [link, w] = await s.handshake(hello);
    s.link = link;
    s.welcomed(w);
    return s;
  }

  private welcomed(w: Welcome): void {
    this.sid = w.session;
    this.secret = w.secret;
    this.committed = Number(w.committed);
    this.maxDraftTokens = Number(w.max_draft_tokens);
  }

  /** Connect, send the greeting, wait for WELCOME; retry the whole exchange (see the module comment). */
  private async handshake(greeting: Frame, attempts = this.cfg.reconnectAttempts): Promise<[Link, Welcome]> {
    const cfg = this.cfg;
    let delay = cfg.backoffMs, failures = 0;
    let busyUntil: number | null = null;
    for (;;) {
      let link: Link | null = null;
      let last: Error;
      try {
        link = await cfg.connector(cfg);
        if (!link.send(greeting)) throw new EdgeError("connection lost while sending the handshake");
        return [link, await expectWelcome(link, cfg.handshakeTimeoutMs)];
      } catch (e) {
        await link?.close();
        const code = e instanceof EdgeError ? e.code : null;
        if (code !== null && code !== ErrorCode.BUSY) throw e;
        last = e as Error;
        if (code === ErrorCode.BUSY) {
          const now = performance.now();
          busyUntil ??= now + cfg.busyRetryMs;
          if (now >= busyUntil) throw new EdgeError(`the cloud stayed busy for ${cfg.busyRetryMs / 1000} s: ${last.message}`, ErrorCode.BUSY);
          this.busyWaits++;
        } else if (++failures >= Math.max(1, attempts)) {
          throw new EdgeError(`cannot reach the cloud at ${cfg.host}:${cfg.port} after ${failures} attempts: ${last.message}`);
        }
      }
      await sleep(delay * (0.5 + 0.5 * Math.random())); // jitter: a crowd of edges does not retry in step
      delay = Math.min(cfg.backoffMaxMs, delay * 2);
    }
  }

  private retire(): void {
    this.bytesUpDone += this.link.bytesUp;
    this.bytesDownDone += this.link.bytesDown;
    void this.link.close();
  }

  /** Reconnect and continue from `committed` (prompt included); returns the committed length agreed. */
  async resume(committed: readonly number[]): Promise<number> {
    this.retire();
    const greeting = resume({
      session: this.sid, committed: committed.length, auth: this.cfg.token, secret: this.secret,
      digest: committedDigest(committed),
    });
    try {
      const [link, w] = await this.handshake(greeting);
      this.link = link;
      this.reconnects++;
      this.welcomed(w);
      return Number(w.committed);
    } catch (e) {
      if (!(e instanceof EdgeError) || e.code !== ErrorCode.UNKNOWN_SESSION || !this.cfg.recover) throw e;
      return this.recover(committed);
    }
  }

  /** A new session continuing this one: prompt = `committed`, budget = what is left. */
  async recover(committed: readonly number[]): Promise<number> {
    const h = this.hello;
    const generated = committed.length - h.prompt.length;
    if (generated < 0 || h.prompt.some((t, i) => committed[i] !== t)) {
      throw new EdgeError("cannot recover: the committed tokens do not start with the prompt");
    }
    const hello: Hello = { ...h, prompt: [...committed], max_tokens: Math.max(0, Number(h.max_tokens) - generated) };
    const [link, w] = await this.handshake(hello);
    this.link = link;
    if (Number(w.committed) !== committed.length) {
      throw new EdgeError(`the new session starts at ${w.committed}, the edge holds ${committed.length} tokens`);
    }
    this.recoveries++;
    this.welcomed(w);
    return Number(w.committed);
  }

  totalBytes(): [number, number] {
    return [this.bytesUpDone + this.link.bytesUp, this.bytesDownDone + this.link.bytesDown];
  }

  async close(lingerMs = 2000): Promise<void> {
    if (this.link.alive) this.link.send({ type: FrameType.CLOSE, reason: CloseReason.NORMAL });
    await this.link.close(lingerMs);
  }
}
