// The byte-level codec of the frames in frames.ts: checked encoding and decoding of one frame, the
// stream splitter (FrameDecoder), the committed-prefix digest and the varint helpers. Every check and
// every error code mirrors acespec/wire/codec.py and framing.py, so a frame one side refuses the other
// refuses too, with the same code.

import { createHash } from "node:crypto";
import {
  CloseReason, DEFAULT_LIMITS, Draft, ErrorCode, ErrorFrame, F32_MAX, Frame, FrameType, Hello, Limits,
  MAX_ERROR_MESSAGE_BYTES, MAX_SECRET_BYTES, Mode, PROTOCOL_VERSION, Resume, SparseRow, Tokens, U64_MAX, UInt, Verdict,
  Welcome, WireError,
} from "./frames.js";

const BAD_FRAME = ErrorCode.BAD_FRAME;
const OVER_LIMIT = ErrorCode.OVER_LIMIT;
const D_Q = 0x01, D_TREE = 0x02;
const V_DROPPED = 0x01, V_P = 0x02, V_PATH = 0x04, V_FINISHED = 0x08;
const T_FINISHED = 0x01, T_STEP = 0x02;

const utf8 = new TextEncoder();
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;
const LONE_SURROGATES = new RegExp(LONE_SURROGATE.source, "g");
const strictUtf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/** A decoded integer as the wire's users want it: a number when exact, a bigint beyond 2**53 - 1. */
function narrow(v: bigint): UInt {
  return v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;
}

function isInt(v: unknown): v is UInt {
  return typeof v === "bigint" || (typeof v === "number" && Number.isInteger(v));
}

function typeName(v: unknown): string {
  if (v === null) return "None";
  if (Array.isArray(v)) return "list";
  return typeof v === "number" ? (Number.isInteger(v) ? "int" : "float") : typeof v;
}

/** `value` checked as an unsigned integer <= max (u64 by default). */
function uint(value: unknown, what: string, max: bigint = U64_MAX): UInt {
  if (!isInt(value)) throw new WireError(BAD_FRAME, `${what} must be an integer, not ${typeName(value)}`);
  const big = BigInt(value);
  if (big < 0n || big > max) throw new WireError(BAD_FRAME, `${what} = ${value} is outside 0..${max}`);
  return value;
}

function float(value: unknown, what: string, low: number, high: number): number {
  if (typeof value !== "number") throw new WireError(BAD_FRAME, `${what} must be a real number, not ${typeName(value)}`);
  if (!(low <= value && value <= high)) throw new WireError(BAD_FRAME, `${what} = ${value} is outside ${low}..${high}`);
  return value;
}

function enumValue<T extends object>(e: T, value: number, what: string): number {
  if (!(value in e) || typeof (e as Record<number, unknown>)[value] !== "string") {
    throw new WireError(BAD_FRAME, `unknown ${what} ${value}`);
  }
  return value;
}

function checkVersion(version: number, what: string): void {
  if (version !== PROTOCOL_VERSION) {
    throw new WireError(ErrorCode.BAD_VERSION,
      `${what} speaks protocol version ${version}; this peer speaks ${PROTOCOL_VERSION}`);
  }
}

function varintSize(value: number): number {
  let n = 1;
  while (value >= 0x80) {
    value = Math.floor(value / 128);
    n++;
  }
  return n;
}

/** Appends checked fields to a payload; mirrors Reader check for check. */
class Writer {
  private buf = new Uint8Array(256);
  len = 0;
  constructor(readonly limits: Limits) {}

  private room(n: number): void {
    if (this.len + n <= this.buf.length) return;
    let size = this.buf.length * 2;
    while (size < this.len + n) size *= 2;
    const next = new Uint8Array(size);
    next.set(this.buf.subarray(0, this.len));
    this.buf = next;
  }

  bytes(): Uint8Array {
    return this.buf.subarray(0, this.len);
  }

  byte(v: number): void {
    this.room(1);
    this.buf[this.len++] = v;
  }

  raw(data: Uint8Array): void {
    this.room(data.length);
    this.buf.set(data, this.len);
    this.len += data.length;
  }

  /** The minimal LEB128 encoding of an already checked value. */
  putVarint(value: UInt): void {
    this.room(10);
    if (typeof value === "number" && value < 0x80000000) {
      while (value >= 0x80) {
        this.buf[this.len++] = (value & 0x7f) | 0x80;
        value >>>= 7;
      }
      this.buf[this.len++] = value;
      return;
    }
    let v = BigInt(value);
    while (v >= 0x80n) {
      this.buf[this.len++] = Number(v & 0x7fn) | 0x80;
      v >>= 7n;
    }
    this.buf[this.len++] = Number(v);
  }

  u8(value: unknown, what: string): void {
    this.byte(Number(uint(value, what, 0xffn)));
  }

  u16(value: unknown, what: string): void {
    const v = Number(uint(value, what, 0xffffn));
    this.byte(v >>> 8);
    this.byte(v & 0xff);
  }

  u64(value: unknown, what: string): void {
    const v = BigInt(uint(value, what));
    this.room(8);
    new DataView(this.buf.buffer, this.buf.byteOffset).setBigUint64(this.len, v, false);
    this.len += 8;
  }

  uvarint(value: unknown, what: string): void {
    this.putVarint(uint(value, what));
  }

  count(n: number, limit: number, what: string): void {
    if (n > limit) throw new WireError(OVER_LIMIT, `${what}: ${n} exceeds the limit of ${limit}`);
    this.putVarint(n);
  }

  token(value: unknown, what: string): void {
    const v = uint(value, what);
    if (BigInt(v) >= BigInt(this.limits.maxVocab)) {
      throw new WireError(OVER_LIMIT, `${what} = ${v} is not below max_vocab ${this.limits.maxVocab}`);
    }
    this.putVarint(v);
  }

  tokens(values: unknown, limit: number, what: string): void {
    if (!Array.isArray(values)) throw new WireError(BAD_FRAME, `${what} must be a list, not ${typeName(values)}`);
    this.count(values.length, limit, `${what} count`);
    const vocab = this.limits.maxVocab;
    for (const v of values) {
      if (typeof v === "number" && Number.isInteger(v) && v >= 0 && v < vocab) this.putVarint(v);
      else this.token(v, `${what} id`);
    }
  }

  f32(value: unknown, what: string, low: number, high: number): void {
    const v = float(value, what, low, high);
    this.room(4);
    new DataView(this.buf.buffer, this.buf.byteOffset).setFloat32(this.len, v, false);
    this.len += 4;
  }

  blob(value: unknown, what: string, maxBytes: number): void {
    if (!(value instanceof Uint8Array)) throw new WireError(BAD_FRAME, `${what} must be bytes, not ${typeName(value)}`);
    this.count(value.length, maxBytes, `${what} length`);
    this.raw(value);
  }

  text(value: unknown, what: string, maxBytes: number): void {
    if (typeof value !== "string") throw new WireError(BAD_FRAME, `${what} must be a str, not ${typeName(value)}`);
    if (LONE_SURROGATE.test(value)) throw new WireError(BAD_FRAME, `${what} is not valid Unicode: a lone surrogate`);
    this.blob(utf8.encode(value), what, maxBytes);
  }

  row(row: unknown, what: string): void {
    if (!Array.isArray(row)) throw new WireError(BAD_FRAME, `${what} must be a list of pairs, not ${typeName(row)}`);
    this.count(row.length, this.limits.maxSparseK, `${what} size`);
    const seen = new Set<number>();
    for (const pair of row) {
      if (!Array.isArray(pair) || pair.length !== 2) throw new WireError(BAD_FRAME, `${what} entries must be (token, prob) pairs`);
      const [token, prob] = pair;
      this.token(token, `${what} token`);
      if (seen.has(Number(token))) throw new WireError(BAD_FRAME, `${what} lists token ${token} twice`);
      seen.add(Number(token));
      this.f32(prob, `${what} prob`, 0.0, 1.0);
    }
  }
}

/** Reads fields from buf[pos:end]; every shortfall or bad value is a WireError. */
class Reader {
  private view: DataView;
  constructor(private buf: Uint8Array, public pos: number, private end: number, readonly limits: Limits) {
    this.view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  }

  private take(n: number, what: string): number {
    const pos = this.pos;
    if (pos + n > this.end) throw new WireError(BAD_FRAME, `truncated ${what}: needs ${n} bytes, ${this.end - pos} left`);
    this.pos = pos + n;
    return pos;
  }

  u8(what: string): number {
    return this.buf[this.take(1, what)];
  }

  u16(what: string): number {
    return this.view.getUint16(this.take(2, what), false);
  }

  u64(what: string): UInt {
    return narrow(this.view.getBigUint64(this.take(8, what), false));
  }

  uvarint(what: string): UInt {
    const buf = this.buf, end = this.end;
    let pos = this.pos;
    if (pos < end && buf[pos] < 0x80) { // most varints on the wire are one byte
      this.pos = pos + 1;
      return buf[pos];
    }
    let value = 0n, shift = 0n, byte = 0;
    for (;;) {
      if (pos >= end) throw new WireError(BAD_FRAME, `truncated varint in ${what}`);
      byte = buf[pos++];
      value |= BigInt(byte & 0x7f) << shift;
      if (byte < 0x80) break;
      shift += 7n;
      if (shift === 70n) throw new WireError(BAD_FRAME, `varint in ${what} is longer than 10 bytes`);
    }
    if (byte === 0) throw new WireError(BAD_FRAME, `varint in ${what} is not minimally encoded`);
    if (value > U64_MAX) throw new WireError(BAD_FRAME, `varint in ${what} overflows 64 bits`);
    this.pos = pos;
    return narrow(value);
  }

  count(limit: number, what: string): number {
    const n = this.uvarint(what);
    if (typeof n === "bigint" || n > limit) throw new WireError(OVER_LIMIT, `${what}: ${n} exceeds the limit of ${limit}`);
    return n;
  }

  token(what: string): number {
    const v = this.uvarint(what);
    if (typeof v === "bigint" || v >= this.limits.maxVocab) {
      throw new WireError(OVER_LIMIT, `${what} = ${v} is not below max_vocab ${this.limits.maxVocab}`);
    }
    return v;
  }

  tokens(limit: number, what: string): number[] {
    const n = this.count(limit, `${what} count`);
    const out = new Array<number>(n);
    const vocab = this.limits.maxVocab;
    for (let i = 0; i < n; i++) {
      const v = this.uvarint(what);
      if (typeof v === "bigint" || v >= vocab) throw new WireError(OVER_LIMIT, `${what} id = ${v} is not below max_vocab ${vocab}`);
      out[i] = v;
    }
    return out;
  }

  f32(what: string, low: number, high: number): number {
    const v = this.view.getFloat32(this.take(4, what), false);
    if (!(low <= v && v <= high)) throw new WireError(BAD_FRAME, `${what} = ${v} is outside ${low}..${high}`);
    return v;
  }

  blob(what: string, maxBytes: number): Uint8Array {
    const n = this.count(maxBytes, `${what} length`);
    const start = this.take(n, what);
    return this.buf.slice(start, start + n);
  }

  text(what: string, maxBytes: number): string {
    const raw = this.blob(what, maxBytes);
    try {
      return strictUtf8.decode(raw);
    } catch {
      throw new WireError(BAD_FRAME, `${what} is not valid UTF-8`);
    }
  }

  row(what: string): SparseRow {
    const n = this.count(this.limits.maxSparseK, `${what} size`);
    const pairs: SparseRow = [];
    for (let i = 0; i < n; i++) pairs.push([this.token(`${what} token`), this.f32(`${what} prob`, 0.0, 1.0)]);
    if (new Set(pairs.map((p) => p[0])).size !== n) throw new WireError(BAD_FRAME, `${what} lists a token twice`);
    return pairs;
  }

  flags(known: number, what: string): number {
    const flags = this.u8(what);
    if (flags & ~known) throw new WireError(BAD_FRAME, `${what} has reserved bits set: 0x${flags.toString(16).padStart(2, "0")}`);
    return flags;
  }
}

// One encoder and one decoder per frame type, side by side so they stay mirror images.

function encHello(w: Writer, f: Hello): void {
  const limits = w.limits;
  checkVersion(Number(uint(f.version, "HELLO.version", 0xffn)), "HELLO");
  w.u8(f.version, "HELLO.version");
  w.blob(f.auth, "HELLO.auth", limits.maxStrBytes);
  w.text(f.model_id, "HELLO.model_id", limits.maxStrBytes);
  w.f32(f.temperature, "HELLO.temperature", 0.0, F32_MAX);
  w.uvarint(f.top_k, "HELLO.top_k");
  w.f32(f.top_p, "HELLO.top_p", 0.0, 1.0);
  w.text(f.rule, "HELLO.rule", limits.maxStrBytes);
  w.u64(f.seed, "HELLO.seed");
  w.u8(enumValue(Mode, Number(uint(f.mode, "HELLO.mode", 0xffn)), "HELLO.mode"), "HELLO.mode");
  w.uvarint(f.max_tokens, "HELLO.max_tokens");
  w.tokens(f.prompt, limits.maxPromptTokens, "HELLO.prompt");
}

function decHello(r: Reader): Hello {
  const limits = r.limits;
  const version = r.u8("HELLO.version");
  checkVersion(version, "HELLO"); // before anything else: the rest of a newer HELLO may differ
  return {
    type: FrameType.HELLO,
    version,
    auth: r.blob("HELLO.auth", limits.maxStrBytes),
    model_id: r.text("HELLO.model_id", limits.maxStrBytes),
    temperature: r.f32("HELLO.temperature", 0.0, F32_MAX),
    top_k: r.uvarint("HELLO.top_k"),
    top_p: r.f32("HELLO.top_p", 0.0, 1.0),
    rule: r.text("HELLO.rule", limits.maxStrBytes),
    seed: r.u64("HELLO.seed"),
    mode: enumValue(Mode, r.u8("HELLO.mode"), "HELLO.mode") as Mode,
    max_tokens: r.uvarint("HELLO.max_tokens"),
    prompt: r.tokens(limits.maxPromptTokens, "HELLO.prompt"),
  };
}

function encWelcome(w: Writer, f: Welcome): void {
  w.uvarint(f.session, "WELCOME.session");
  w.uvarint(f.committed, "WELCOME.committed");
  w.uvarint(f.max_draft_tokens, "WELCOME.max_draft_tokens");
  w.blob(f.secret, "WELCOME.secret", MAX_SECRET_BYTES);
}

function decWelcome(r: Reader): Welcome {
  return {
    type: FrameType.WELCOME,
    session: r.uvarint("WELCOME.session"),
    committed: r.uvarint("WELCOME.committed"),
    max_draft_tokens: r.uvarint("WELCOME.max_draft_tokens"),
    secret: r.blob("WELCOME.secret", MAX_SECRET_BYTES),
  };
}

function checkParent(parent: UInt, i: number): void {
  if (BigInt(parent) > BigInt(i)) {
    throw new WireError(BAD_FRAME, `DRAFT.parents[${i}] = ${parent}: must be 0 (the base) or j + 1 for a token j < ${i}`);
  }
}

function encDraft(w: Writer, f: Draft): void {
  w.uvarint(f.session, "DRAFT.session");
  w.uvarint(f.seq, "DRAFT.seq");
  w.uvarint(f.base, "DRAFT.base");
  const hasQ = f.q !== null && f.q !== undefined, hasTree = f.parents !== null && f.parents !== undefined;
  w.byte((hasQ ? D_Q : 0) | (hasTree ? D_TREE : 0));
  w.tokens(f.tokens, w.limits.maxDraftTokens, "DRAFT.tokens");
  const n = f.tokens.length;
  if (hasQ) {
    if (f.q!.length !== n) throw new WireError(BAD_FRAME, `DRAFT.q has ${f.q!.length} rows for ${n} tokens`);
    f.q!.forEach((row, i) => w.row(row, `DRAFT.q[${i}]`));
  }
  if (hasTree) {
    if (f.parents!.length !== n) throw new WireError(BAD_FRAME, `DRAFT.parents has ${f.parents!.length} entries for ${n} tokens`);
    f.parents!.forEach((parent, i) => {
      const p = uint(parent, `DRAFT.parents[${i}]`);
      checkParent(p, i);
      w.putVarint(p);
    });
  }
}

function decDraft(r: Reader): Draft {
  const session = r.uvarint("DRAFT.session");
  const seq = r.uvarint("DRAFT.seq");
  const base = r.uvarint("DRAFT.base");
  const flags = r.flags(D_Q | D_TREE, "DRAFT.flags");
  const tokens = r.tokens(r.limits.maxDraftTokens, "DRAFT.tokens");
  let q: SparseRow[] | null = null, parents: number[] | null = null;
  if (flags & D_Q) q = tokens.map((_, i) => r.row(`DRAFT.q[${i}]`));
  if (flags & D_TREE) {
    const raw = tokens.map((_, i) => r.uvarint(`DRAFT.parents[${i}]`));
    raw.forEach((p, i) => checkParent(p, i));
    parents = raw.map(Number);
  }
  return { type: FrameType.DRAFT, session, seq, base, tokens, q, parents };
}

function checkPath(path: UInt[], accepted: number, limits: Limits): void {
  if (path.length !== accepted) {
    throw new WireError(BAD_FRAME, `VERDICT.path has ${path.length} entries for ${accepted} accepted tokens`);
  }
  let previous = -1n;
  for (const index of path) {
    const i = BigInt(index);
    if (i >= BigInt(limits.maxDraftTokens)) throw new WireError(OVER_LIMIT, `VERDICT.path index ${index} is beyond max_draft_tokens`);
    if (i <= previous) throw new WireError(BAD_FRAME, "VERDICT.path must be strictly increasing (parents precede children)");
    previous = i;
  }
}

function encVerdict(w: Writer, f: Verdict): void {
  const limits = w.limits;
  w.uvarint(f.seq, "VERDICT.seq");
  const hasP = f.p !== null && f.p !== undefined, hasPath = f.path !== null && f.path !== undefined;
  w.byte((f.dropped ? V_DROPPED : 0) | (hasP ? V_P : 0) | (hasPath ? V_PATH : 0) | (f.finished ? V_FINISHED : 0));
  const accepted = uint(f.accepted, "VERDICT.accepted");
  if (BigInt(accepted) > BigInt(limits.maxDraftTokens)) {
    throw new WireError(OVER_LIMIT, `VERDICT.accepted: ${accepted} exceeds the limit of ${limits.maxDraftTokens}`);
  }
  w.putVarint(accepted);
  w.token(f.next_token, "VERDICT.next_token");
  w.uvarint(f.verify_us, "VERDICT.verify_us");
  w.uvarint(f.committed, "VERDICT.committed");
  if (hasP) w.row(f.p, "VERDICT.p");
  if (hasPath) {
    const path = f.path!.map((index) => uint(index, "VERDICT.path index"));
    checkPath(path, Number(accepted), limits);
    w.count(path.length, limits.maxDraftTokens, "VERDICT.path count");
    path.forEach((index) => w.putVarint(index));
  }
}

function decVerdict(r: Reader): Verdict {
  const limits = r.limits;
  const seq = r.uvarint("VERDICT.seq");
  const flags = r.flags(V_DROPPED | V_P | V_PATH | V_FINISHED, "VERDICT.flags");
  const accepted = r.count(limits.maxDraftTokens, "VERDICT.accepted");
  const next_token = r.token("VERDICT.next_token");
  const verify_us = r.uvarint("VERDICT.verify_us");
  const committed = r.uvarint("VERDICT.committed");
  const p = flags & V_P ? r.row("VERDICT.p") : null;
  let path: number[] | null = null;
  if (flags & V_PATH) {
    const n = r.count(limits.maxDraftTokens, "VERDICT.path count");
    const raw: UInt[] = [];
    for (let i = 0; i < n; i++) raw.push(r.uvarint("VERDICT.path index"));
    checkPath(raw, accepted, limits);
    path = raw.map(Number);
  }
  return {
    type: FrameType.VERDICT, seq, accepted, next_token, verify_us, committed,
    dropped: Boolean(flags & V_DROPPED), finished: Boolean(flags & V_FINISHED), p, path,
  };
}

function encResume(w: Writer, f: Resume): void {
  checkVersion(Number(uint(f.version, "RESUME.version", 0xffn)), "RESUME");
  w.u8(f.version, "RESUME.version");
  w.blob(f.auth, "RESUME.auth", w.limits.maxStrBytes);
  w.uvarint(f.session, "RESUME.session");
  w.blob(f.secret, "RESUME.secret", MAX_SECRET_BYTES);
  w.uvarint(f.committed, "RESUME.committed");
  w.blob(f.digest, "RESUME.digest", MAX_SECRET_BYTES);
}

function decResume(r: Reader): Resume {
  const version = r.u8("RESUME.version");
  checkVersion(version, "RESUME");
  return {
    type: FrameType.RESUME,
    version,
    auth: r.blob("RESUME.auth", r.limits.maxStrBytes),
    session: r.uvarint("RESUME.session"),
    secret: r.blob("RESUME.secret", MAX_SECRET_BYTES),
    committed: r.uvarint("RESUME.committed"),
    digest: r.blob("RESUME.digest", MAX_SECRET_BYTES),
  };
}

function messageLimit(limits: Limits): number {
  return Math.min(MAX_ERROR_MESSAGE_BYTES, limits.maxStrBytes);
}

function encError(w: Writer, f: ErrorFrame): void {
  w.u16(enumValue(ErrorCode, Number(uint(f.code, "ERROR.code", 0xffffn)), "ERROR.code"), "ERROR.code");
  if (typeof f.message !== "string") throw new WireError(BAD_FRAME, `ERROR.message must be a str, not ${typeName(f.message)}`);
  // An error report must not fail for its text: replace what UTF-8 cannot carry, cut at a character boundary.
  // (lone surrogates become "?", as Python's encode("utf-8", "replace") makes them)
  let raw = utf8.encode(f.message.replace(LONE_SURROGATES, "?"));
  const limit = messageLimit(w.limits);
  if (raw.length > limit) {
    let cut = limit;
    while (cut > 0 && (raw[cut] & 0xc0) === 0x80) cut--; // back to the first byte of the character cut in two
    raw = raw.subarray(0, cut);
  }
  w.blob(raw, "ERROR.message", limit);
}

function decError(r: Reader): ErrorFrame {
  return {
    type: FrameType.ERROR,
    code: enumValue(ErrorCode, r.u16("ERROR.code"), "ERROR.code") as ErrorCode,
    message: r.text("ERROR.message", messageLimit(r.limits)),
  };
}

function encTokens(w: Writer, f: Tokens): void {
  w.uvarint(f.start, "TOKENS.start");
  w.tokens(f.tokens, w.limits.maxPromptTokens, "TOKENS.tokens");
  const step = f.drafted !== null && f.drafted !== undefined;
  w.byte((f.finished ? T_FINISHED : 0) | (step ? T_STEP : 0));
  if (!step) {
    if ((f.accepted && f.accepted !== 0n) || (f.verify_us && f.verify_us !== 0n)) {
      throw new WireError(BAD_FRAME, "TOKENS.accepted and verify_us need HAS_STEP (drafted set)");
    }
    return;
  }
  const drafted = uint(f.drafted, "TOKENS.drafted");
  if (BigInt(drafted) > BigInt(w.limits.maxDraftTokens)) {
    throw new WireError(OVER_LIMIT, `TOKENS.drafted: ${drafted} exceeds the limit of ${w.limits.maxDraftTokens}`);
  }
  w.putVarint(drafted);
  if (BigInt(uint(f.accepted, "TOKENS.accepted")) > BigInt(drafted)) {
    throw new WireError(BAD_FRAME, `TOKENS.accepted ${f.accepted} is more than drafted ${drafted}`);
  }
  w.uvarint(f.accepted, "TOKENS.accepted");
  w.uvarint(f.verify_us, "TOKENS.verify_us");
}

function decTokens(r: Reader): Tokens {
  const start = r.uvarint("TOKENS.start");
  const tokens = r.tokens(r.limits.maxPromptTokens, "TOKENS.tokens");
  const flags = r.flags(T_FINISHED | T_STEP, "TOKENS.flags");
  const finished = Boolean(flags & T_FINISHED);
  if (!(flags & T_STEP)) return { type: FrameType.TOKENS, start, tokens, finished, drafted: null, accepted: 0, verify_us: 0 };
  const drafted = r.count(r.limits.maxDraftTokens, "TOKENS.drafted");
  const accepted = r.uvarint("TOKENS.accepted");
  if (BigInt(accepted) > BigInt(drafted)) throw new WireError(BAD_FRAME, `TOKENS.accepted ${accepted} is more than drafted ${drafted}`);
  return { type: FrameType.TOKENS, start, tokens, finished, drafted, accepted, verify_us: r.uvarint("TOKENS.verify_us") };
}

function encPing(w: Writer, f: { nonce: UInt; sent_us: UInt }, name: string): void {
  w.u64(f.nonce, `${name}.nonce`);
  w.u64(f.sent_us, `${name}.sent_us`);
}

function encodePayload(w: Writer, frame: Frame): void {
  switch (frame.type) {
    case FrameType.HELLO: return encHello(w, frame);
    case FrameType.WELCOME: return encWelcome(w, frame);
    case FrameType.DRAFT: return encDraft(w, frame);
    case FrameType.VERDICT: return encVerdict(w, frame);
    case FrameType.RESUME: return encResume(w, frame);
    case FrameType.PING: return encPing(w, frame, "PING");
    case FrameType.PONG: return encPing(w, frame, "PONG");
    case FrameType.ERROR: return encError(w, frame);
    case FrameType.CLOSE:
      return w.u8(enumValue(CloseReason, Number(uint(frame.reason, "CLOSE.reason", 0xffn)), "CLOSE.reason"), "CLOSE.reason");
    case FrameType.TOKENS: return encTokens(w, frame);
    default: throw new TypeError(`not a wire frame: ${JSON.stringify((frame as { type?: unknown }).type)}`);
  }
}

const DECODERS: Record<number, (r: Reader) => Frame> = {
  [FrameType.HELLO]: decHello,
  [FrameType.WELCOME]: decWelcome,
  [FrameType.DRAFT]: decDraft,
  [FrameType.VERDICT]: decVerdict,
  [FrameType.RESUME]: decResume,
  [FrameType.PING]: (r) => ({ type: FrameType.PING, nonce: r.u64("PING.nonce"), sent_us: r.u64("PING.sent_us") }),
  [FrameType.PONG]: (r) => ({ type: FrameType.PONG, nonce: r.u64("PONG.nonce"), sent_us: r.u64("PONG.sent_us") }),
  [FrameType.ERROR]: decError,
  [FrameType.CLOSE]: (r) => ({ type: FrameType.CLOSE, reason: enumValue(CloseReason, r.u8("CLOSE.reason"), "CLOSE.reason") }),
  [FrameType.TOKENS]: decTokens,
};

/** The complete frame (length prefix, type byte, payload). WireError for a frame the receiver would refuse. */
export function encode(frame: Frame, limits: Limits = DEFAULT_LIMITS): Uint8Array {
  if (frame === null || typeof frame !== "object" || !(frame.type in DECODERS)) {
    throw new TypeError("not a wire frame");
  }
  const w = new Writer(limits);
  w.byte(frame.type);
  encodePayload(w, frame);
  const length = w.len;
  if (length > limits.maxFrameBytes) {
    throw new WireError(OVER_LIMIT, `${FrameType[frame.type]} frame of ${length} bytes exceeds max_frame_bytes ${limits.maxFrameBytes}`);
  }
  const prefix = new Writer(limits);
  prefix.putVarint(length);
  const out = new Uint8Array(prefix.len + length);
  out.set(prefix.bytes());
  out.set(w.bytes(), prefix.len);
  return out;
}

/** [L, prefix size] of the frame at buf[pos:end], or null while the prefix is incomplete. Looks at no
 * more bytes than the longest legal prefix, so an oversize frame is refused before its body is read. */
function parseLength(buf: Uint8Array, pos: number, end: number, maxFrameBytes: number): [number, number] | null {
  const maxPrefix = varintSize(maxFrameBytes);
  let value = 0;
  for (let i = 0; i < Math.min(end - pos, maxPrefix); i++) {
    const byte = buf[pos + i];
    value += (byte & 0x7f) * 2 ** (7 * i);
    if (byte < 0x80) {
      if (byte === 0 && i) throw new WireError(BAD_FRAME, "frame length prefix is not minimally encoded");
      if (value === 0) throw new WireError(BAD_FRAME, "frame length 0: no type byte");
      if (value > maxFrameBytes) throw new WireError(OVER_LIMIT, `frame of ${value} bytes exceeds max_frame_bytes ${maxFrameBytes}`);
      return [value, i + 1];
    }
  }
  if (end - pos >= maxPrefix) {
    throw new WireError(OVER_LIMIT, `frame length prefix runs past ${maxPrefix} bytes: over max_frame_bytes ${maxFrameBytes}`);
  }
  return null;
}

function decodePayload(buf: Uint8Array, pos: number, end: number, limits: Limits): Frame {
  const kind = buf[pos];
  const decoder = DECODERS[kind];
  if (decoder === undefined) throw new WireError(BAD_FRAME, `unknown frame type ${kind}`);
  const r = new Reader(buf, pos + 1, end, limits);
  const frame = decoder(r);
  if (r.pos !== end) throw new WireError(BAD_FRAME, `${end - r.pos} unread bytes at the end of the ${FrameType[frame.type]} payload`);
  return frame;
}

/** The one frame that `data` holds, from its length prefix to its last byte. */
export function decode(data: Uint8Array, limits: Limits = DEFAULT_LIMITS): Frame {
  const header = parseLength(data, 0, data.length, limits.maxFrameBytes);
  if (header === null) throw new WireError(BAD_FRAME, data.length ? "truncated length prefix" : "no bytes to decode");
  const [length, prefix] = header;
  const end = prefix + length;
  if (data.length < end) throw new WireError(BAD_FRAME, `truncated frame: ${data.length - prefix} of ${length} bytes`);
  if (data.length > end) throw new WireError(BAD_FRAME, `${data.length - end} trailing bytes after the frame`);
  return decodePayload(data, prefix, end, limits);
}

/** Splits a byte stream into frames, whatever the chunks it arrives in. A malformed frame whose length
 * was sound is dropped and raised and the decoder carries on; a bad length prefix breaks it for good. */
export class FrameDecoder {
  private buf = new Uint8Array(0);
  private start = 0;
  private len = 0;
  private failure: WireError | null = null;

  constructor(readonly limits: Limits = DEFAULT_LIMITS) {}

  get pending(): number {
    return this.len - this.start;
  }

  get broken(): boolean {
    return this.failure !== null;
  }

  feed(data: Uint8Array): Frame[] {
    if (this.start) {
      this.buf.copyWithin(0, this.start, this.len);
      this.len -= this.start;
      this.start = 0;
    }
    if (this.len + data.length > this.buf.length) {
      const next = new Uint8Array(Math.max(this.len + data.length, this.buf.length * 2));
      next.set(this.buf.subarray(0, this.len));
      this.buf = next;
    }
    this.buf.set(data, this.len);
    this.len += data.length;
    const frames: Frame[] = [];
    try {
      for (let f = this.nextFrame(); f !== null; f = this.nextFrame()) frames.push(f);
    } catch (e) {
      if (e instanceof WireError) e.frames = frames;
      throw e;
    }
    return frames;
  }

  nextFrame(): Frame | null {
    if (this.failure !== null) throw new WireError(this.failure.code, this.failure.detail);
    let header: [number, number] | null;
    try {
      header = parseLength(this.buf, this.start, this.len, this.limits.maxFrameBytes);
    } catch (e) {
      this.failure = e as WireError;
      throw e;
    }
    if (header === null) return null;
    const [length, prefix] = header;
    const begin = this.start, end = begin + prefix + length;
    if (end > this.len) return null;
    this.start = end; // consumed before decoding: a malformed payload costs only itself
    try {
      return decodePayload(this.buf, begin + prefix, end, this.limits);
    } finally {
      if (this.start === this.len) this.start = this.len = 0;
    }
  }
}

/** SHA-256 of the `tokens` encoding (varint count, one varint per id) of a committed sequence: RESUME.digest. */
export function committedDigest(tokens: readonly number[]): Uint8Array {
  const w = new Writer(DEFAULT_LIMITS);
  w.putVarint(tokens.length);
  for (const t of tokens) w.putVarint(uint(t, "token id"));
  return new Uint8Array(createHash("sha256").update(w.bytes()).digest());
}

/** The minimal unsigned LEB128 encoding of 0 <= value < 2**64. */
export function encodeUvarint(value: UInt): Uint8Array {
  const w = new Writer(DEFAULT_LIMITS);
  w.putVarint(uint(value, "varint"));
  return w.bytes().slice();
}

/** [value, position after it] of the varint at data[pos:]; WireError if it is not a valid one. */
export function decodeUvarint(data: Uint8Array, pos = 0): [UInt, number] {
  const r = new Reader(data, pos, data.length, DEFAULT_LIMITS);
  const v = r.uvarint("varint");
  return [v, r.pos];
}

/** Signed 64-bit -> unsigned, small magnitudes to small values: 0, -1, 1 -> 0, 1, 2. */
export function zigzagEncode(value: bigint | number): bigint {
  const v = BigInt(value);
  if (v < -(1n << 63n) || v >= 1n << 63n) throw new WireError(BAD_FRAME, `${value} does not fit a signed 64-bit integer`);
  return v >= 0n ? v << 1n : ((-v) << 1n) - 1n;
}

export function zigzagDecode(value: bigint | number): bigint {
  const v = BigInt(uint(typeof value === "bigint" ? narrow(value) : value, "zigzag value"));
  return (v >> 1n) ^ -(v & 1n);
}
