// A browser edge for AceSpec's cloud over WebSocket: the wire format (protocol version 3, specified in
// acespec/wire/frames.py) for the frames a cloud-only or cloud-led session uses, and a session that
// streams the cloud's tokens, answers PING, measures the round trip with its own PINGs, and after a
// dropped connection or a drain (CLOSE(GOING_AWAY)) reconnects and RESUMEs, or, when the cloud has
// lost the session, opens a new one that carries the text so far. One frame per binary message.
//
// It drafts nothing: in cloud-led mode the cloud decodes without waiting for drafts, so an edge with no
// drafter streams exactly the cloud-only text (each TOKENS frame then also says the step verified
// no draft).

export const PROTOCOL_VERSION = 3;
export const FrameType = Object.freeze({
  HELLO: 1, WELCOME: 2, DRAFT: 3, VERDICT: 4, RESUME: 5, PING: 6, PONG: 7, ERROR: 8, CLOSE: 9, TOKENS: 10,
});
export const Mode = Object.freeze({ SPECULATIVE: 0, CLOUD_ONLY: 1, CLOUD_LED: 2 });
export const CloseReason = Object.freeze({ NORMAL: 0, GOING_AWAY: 1, ERROR: 2, IDLE: 3 });
export const ErrorCode = Object.freeze({
  1: "BAD_FRAME", 2: "BAD_VERSION", 3: "BAD_AUTH", 4: "UNKNOWN_SESSION", 5: "OVER_LIMIT", 6: "BUSY",
  7: "BAD_REQUEST", 8: "MODEL_MISMATCH", 9: "INTERNAL",
});
const TYPE_NAME = Object.fromEntries(Object.entries(FrameType).map(([k, v]) => [v, k]));
const T_FINISHED = 0x01, T_STEP = 0x02;
const MAX_FRAME_BYTES = 262144; // the cloud's default Limits.max_frame_bytes

/** A frame this codec cannot decode, or will not encode; `code` is the ErrorCode name it means. */
export class WireError extends Error {
  constructor(code, message) { super(`${code}: ${message}`); this.code = code; }
}

/** The cloud refused the session: its ERROR frame's code (a name) and message. */
export class CloudError extends Error {
  constructor(code, message) { super(`${code}: ${message}`); this.code = code; this.detail = message; }
}

// -- encoding ----------------------------------------------------------------------------------------

class Writer {
  constructor() { this.bytes = []; }
  u8(v) { this.bytes.push(v & 0xff); }
  u16(v) { this.bytes.push((v >> 8) & 0xff, v & 0xff); }
  u64(v) {
    let b = BigInt.asUintN(64, BigInt(v));
    const out = new Array(8);
    for (let i = 7; i >= 0; i--) { out[i] = Number(b & 0xffn); b >>= 8n; }
    this.bytes.push(...out);
  }
  f32(v) {
    const dv = new DataView(new ArrayBuffer(4));
    dv.setFloat32(0, v, false); // big-endian, as every fixed-width field
    this.bytes.push(...new Uint8Array(dv.buffer));
  }
  varint(v) { // unsigned LEB128, minimal; exact for ids and counts (< 2**53)
    if (!Number.isSafeInteger(v) || v < 0) throw new WireError("BAD_FRAME", `not an unsigned integer: ${v}`);
    while (v >= 0x80) { this.bytes.push((v % 0x80) | 0x80); v = Math.floor(v / 0x80); }
    this.bytes.push(v);
  }
  blob(b) { this.varint(b.length); for (const x of b) this.bytes.push(x); }
  text(s) { this.blob(new TextEncoder().encode(s)); }
  tokens(ids) { this.varint(ids.length); for (const t of ids) this.varint(t); }
}

function frame(type, fill) {
  const w = new Writer();
  w.u8(type);
  fill(w);
  const prefix = new Writer();
  prefix.varint(w.bytes.length);
  return Uint8Array.from([...prefix.bytes, ...w.bytes]);
}

const bytesOf = (x) => (typeof x === "string" ? new TextEncoder().encode(x) : Uint8Array.from(x || []));

/** HELLO: open a session. `mode` is a Mode; `auth` a string or bytes; `prompt` token ids. */
export function encodeHello({ auth = "", modelId, temperature = 1.0, topK = 0, topP = 1.0, rule = "strict",
                              seed = 0, mode = Mode.CLOUD_ONLY, maxTokens, prompt }) {
  if (!prompt || !prompt.length) throw new WireError("BAD_REQUEST", "an empty prompt");
  return frame(FrameType.HELLO, (w) => {
    w.u8(PROTOCOL_VERSION); w.blob(bytesOf(auth)); w.text(modelId); w.f32(temperature); w.varint(topK);
    w.f32(topP); w.text(rule); w.u64(seed); w.u8(mode); w.varint(maxTokens); w.u8(0 /* logprobs: none */); w.tokens(prompt);
  });
}

/** RESUME: reattach to `session` at `committed` tokens; `digest` from committedDigest(). */
export function encodeResume({ auth = "", session, secret, committed, digest }) {
  return frame(FrameType.RESUME, (w) => {
    w.u8(PROTOCOL_VERSION); w.blob(bytesOf(auth)); w.varint(session); w.blob(secret); w.varint(committed);
    w.blob(digest);
  });
}

export const encodePing = (nonce, sentUs) => frame(FrameType.PING, (w) => { w.u64(nonce); w.u64(sentUs); });
export const encodePong = (nonce, sentUs) => frame(FrameType.PONG, (w) => { w.u64(nonce); w.u64(sentUs); });
export const encodeClose = (reason = CloseReason.NORMAL) => frame(FrameType.CLOSE, (w) => w.u8(reason));

/** SHA-256 of the committed tokens (prompt included) in the `tokens` encoding: what RESUME carries. */
export async function committedDigest(tokens) {
  const w = new Writer();
  w.tokens(tokens);
  return new Uint8Array(await crypto.subtle.digest("SHA-256", Uint8Array.from(w.bytes)));
}

// -- decoding ----------------------------------------------------------------------------------------

class Reader {
  constructor(bytes, pos, end) { this.b = bytes; this.pos = pos; this.end = end; }
  need(n, what) {
    if (this.pos + n > this.end) throw new WireError("BAD_FRAME", `truncated ${what}`);
  }
  u8(what) { this.need(1, what); return this.b[this.pos++]; }
  u16(what) { this.need(2, what); const v = (this.b[this.pos] << 8) | this.b[this.pos + 1]; this.pos += 2; return v; }
  u64(what) {
    this.need(8, what);
    let v = 0n;
    for (let i = 0; i < 8; i++) v = (v << 8n) | BigInt(this.b[this.pos + i]);
    this.pos += 8;
    return v;
  }
  varint(what) {
    let v = 0, scale = 1;
    for (let i = 0; i < 8; i++) { // 8 bytes: 56 bits, past any id, count or length a browser meets
      const byte = this.u8(what);
      v += (byte & 0x7f) * scale;
      if (byte < 0x80) {
        if (byte === 0 && i > 0) throw new WireError("BAD_FRAME", `${what}: varint not minimally encoded`);
        if (!Number.isSafeInteger(v)) throw new WireError("OVER_LIMIT", `${what}: ${v} is past 2**53`);
        return v;
      }
      scale *= 0x80;
    }
    throw new WireError("OVER_LIMIT", `${what}: varint too long for this edge`);
  }
  blob(what) {
    const n = this.varint(what);
    this.need(n, what);
    const out = this.b.slice(this.pos, this.pos + n);
    this.pos += n;
    return out;
  }
  text(what) {
    try { return new TextDecoder("utf-8", { fatal: true }).decode(this.blob(what)); }
    catch (e) { if (e instanceof WireError) throw e; throw new WireError("BAD_FRAME", `${what}: invalid UTF-8`); }
  }
  tokens(what) {
    const n = this.varint(what), out = new Array(n);
    for (let i = 0; i < n; i++) out[i] = this.varint(what);
    return out;
  }
}

const DECODERS = {
  [FrameType.WELCOME]: (r) => ({
    session: r.varint("WELCOME.session"), committed: r.varint("WELCOME.committed"),
    maxDraftTokens: r.varint("WELCOME.max_draft_tokens"), secret: r.blob("WELCOME.secret"),
  }),
  [FrameType.TOKENS]: (r) => {
    const start = r.varint("TOKENS.start"), tokens = r.tokens("TOKENS.tokens"), flags = r.u8("TOKENS.flags");
    if (flags & ~(T_FINISHED | T_STEP)) throw new WireError("BAD_FRAME", `TOKENS.flags: reserved bits set (${flags})`);
    const f = { start, tokens, finished: Boolean(flags & T_FINISHED), drafted: null, accepted: 0, verifyUs: 0 };
    if (flags & T_STEP) {
      f.drafted = r.varint("TOKENS.drafted");
      f.accepted = r.varint("TOKENS.accepted");
      f.verifyUs = r.varint("TOKENS.verify_us");
      if (f.accepted > f.drafted) throw new WireError("BAD_FRAME", "TOKENS.accepted is more than drafted");
    }
    return f;
  },
  [FrameType.ERROR]: (r) => {
    const code = r.u16("ERROR.code");
    return { code: ErrorCode[code] || `code ${code}`, message: r.text("ERROR.message") };
  },
  [FrameType.CLOSE]: (r) => ({ reason: r.u8("CLOSE.reason") }),
  [FrameType.PING]: (r) => ({ nonce: r.u64("PING.nonce"), sentUs: r.u64("PING.sent_us") }),
  [FrameType.PONG]: (r) => ({ nonce: r.u64("PONG.nonce"), sentUs: r.u64("PONG.sent_us") }),
};

/** The one frame a binary message holds, as {type: "TOKENS", ...fields}; WireError for anything else. */
export function decodeFrame(data) {
  const b = data instanceof Uint8Array ? data : new Uint8Array(data);
  const r = new Reader(b, 0, b.length);
  const length = r.varint("frame length");
  if (length < 1) throw new WireError("BAD_FRAME", "frame length 0: no type byte");
  if (length > MAX_FRAME_BYTES) throw new WireError("OVER_LIMIT", `frame of ${length} bytes`);
  if (r.pos + length !== b.length) {
    throw new WireError("BAD_FRAME", `a message of ${b.length} bytes holds a frame of ${r.pos + length}`);
  }
  const type = r.u8("frame type"), decode = DECODERS[type];
  if (!decode) throw new WireError("BAD_FRAME", `a ${TYPE_NAME[type] || `type ${type}`} frame is not for this edge`);
  const f = decode(r);
  if (r.pos !== b.length) throw new WireError("BAD_FRAME", `${b.length - r.pos} unread bytes after ${TYPE_NAME[type]}`);
  return { type: TYPE_NAME[type], ...f };
}

// -- a session ---------------------------------------------------------------------------------------

const nowUs = () => BigInt(Math.round(performance.now() * 1000));

/**
 * Stream one generation from the cloud at `url` (ws:// or wss://).
 *
 * `opts`: {modelId, prompt (token ids), maxTokens, mode ("cloud-only" | "cloud-led"; "auto" is cloud-led
 * on the wire), temperature, topK, topP, rule, seed, auth, reconnects (default 3), pingEveryMs (default 1000)}.
 * `on`: optional callbacks welcome(frame), tokens(chunk, all), rtt(ms), status(text).
 * Resolves to {tokens, steps, resumed, reopened}; rejects with CloudError (the cloud's ERROR) or Error.
 */
export function streamGeneration(url, opts, on = {}) {
  const mode = opts.mode === "cloud-only" ? Mode.CLOUD_ONLY : Mode.CLOUD_LED;
  const prompt = [...opts.prompt], maxTokens = opts.maxTokens;
  const got = [];
  // session: the cloud's id once welcomed; reopen: the cloud lost it, the next greeting opens a new one
  const st = { session: null, secret: null, reopen: false, steps: 0, resumed: 0, reopened: 0, tries: 0 };
  const say = (s) => on.status && on.status(s);

  return new Promise((resolve, reject) => {
    let done = false;
    const finish = (err, value) => { if (!done) { done = true; err ? reject(err) : resolve(value); } };

    async function greeting() {
      // RESUME's digest needs crypto.subtle, which a browser gives only to secure pages (https, or
      // http on localhost): elsewhere the edge reopens with its text instead of resuming
      if (st.session !== null && !st.reopen && !globalThis.crypto?.subtle) st.reopen = true;
      if (st.session !== null && !st.reopen) { // a session the cloud may still hold: ask for it back
        const committed = [...prompt, ...got];
        return encodeResume({ auth: opts.auth, session: st.session, secret: st.secret, committed: committed.length,
                              digest: await committedDigest(committed) });
      }
      // a new session; after a lost one, it carries the text so far and asks only for the rest
      return encodeHello({ auth: opts.auth, modelId: opts.modelId, temperature: opts.temperature ?? 1.0,
                           topK: opts.topK ?? 0, topP: opts.topP ?? 1.0, rule: opts.rule ?? "strict",
                           seed: opts.seed ?? 0, mode, maxTokens: maxTokens - got.length,
                           prompt: [...prompt, ...got] });
    }

    function connect() {
      const ws = new WebSocket(url);
      ws.binaryType = "arraybuffer";
      let welcomed = false, ended = false, pinger = null;
      const retry = (why) => {
        if (ended || done) return;
        ended = true;
        clearInterval(pinger);
        try { ws.close(); } catch (_) { /* already closing */ }
        if (st.tries++ >= (opts.reconnects ?? 3)) { finish(new Error(`connection lost: ${why}`)); return; }
        say(`reconnecting (${why})`);
        setTimeout(connect, Math.min(2000, 100 * 2 ** st.tries));
      };
      ws.onopen = async () => {
        say("connected");
        try {
          ws.send(await greeting());
        } catch (e) { // a prompt or option the codec refuses: nothing to retry
          ended = true;
          finish(e);
          ws.close();
        }
      };
      ws.onmessage = (ev) => {
        if (typeof ev.data === "string") { finish(new Error("the cloud sent a text message")); ws.close(); return; }
        let f;
        try { f = decodeFrame(ev.data); } catch (e) { finish(e); ws.close(); return; }
        if (f.type === "WELCOME") {
          welcomed = true;
          st.tries = 0;
          if (st.reopen) {
            st.reopened++;
            st.reopen = false;
          } else if (st.session !== null) {
            if (f.session !== st.session) {
              ended = true;
              finish(new Error(`RESUME of ${st.session} welcomed as ${f.session}`));
              ws.close();
              return;
            }
            st.resumed++;
            got.length = f.committed - prompt.length; // the cloud goes on from here (it undid what we did not see)
          }
          st.session = f.session; st.secret = f.secret;
          say(`session ${f.session}`);
          if (on.welcome) on.welcome(f);
          pinger = setInterval(() => ws.readyState === WebSocket.OPEN && ws.send(encodePing(0n, nowUs())),
                               opts.pingEveryMs ?? 1000);
        } else if (f.type === "TOKENS") {
          // positions count the whole sequence; a reopened session's prompt is the text so far, so its
          // positions are the same as the first session's
          if (!welcomed || f.start !== prompt.length + got.length) {
            ended = true;
            finish(new Error(`TOKENS at ${f.start}, expected ${prompt.length + got.length}`));
            ws.close();
            return;
          }
          got.push(...f.tokens);
          st.steps++;
          if (on.tokens) on.tokens(f, got);
          if (f.finished) {
            ended = true;
            clearInterval(pinger);
            ws.send(encodeClose(CloseReason.NORMAL));
            ws.close(1000);
            finish(null, { tokens: [...got], steps: st.steps, resumed: st.resumed, reopened: st.reopened });
          }
        } else if (f.type === "PING") {
          ws.send(encodePong(f.nonce, f.sentUs));
        } else if (f.type === "PONG") {
          if (on.rtt) on.rtt(Number(nowUs() - f.sentUs) / 1000);
        } else if (f.type === "ERROR") {
          if (["UNKNOWN_SESSION", "BUSY"].includes(f.code) && st.session !== null && !st.reopen && !welcomed) {
            st.reopen = true; // the session is gone (or this replica is draining): open one carrying the text
            retry(`${f.code} on RESUME`);
            return;
          }
          ended = true;
          clearInterval(pinger);
          finish(new CloudError(f.code, f.message));
        } else if (f.type === "CLOSE") {
          if (f.reason === CloseReason.GOING_AWAY) retry("the cloud is going away");
          else if (f.reason === CloseReason.IDLE) retry("idle");
        }
      };
      ws.onerror = () => retry("WebSocket error");
      ws.onclose = (ev) => retry(`closed (${ev.code})`);
    }
    connect();
  });
}
