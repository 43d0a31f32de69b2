// The byte-level codec of the frames in frames.ts: checked encoding and decoding of one frame. Every check
// and every error code mirrors acespec/wire/codec.py, so a frame one side refuses the other refuses too,
// with the same code. The stream splitter and the small helpers of the format are in framing.ts.

import {
  CloseReason, DEFAULT_LIMITS, Draft, ErrorCode, ErrorFrame, F32_MAX, Frame, FrameType, Hello, Limits, LOGPROB_FLOOR,
  MAX_ERROR_MESSAGE_BYTES, MAX_SECRET_BYTES, MAX_TOP_LOGPROBS, Mode, Resume, SparseRow, TokenLogprob, Tokens, UInt,
  Verdict, Welcome, WireError,
} from "./frames.js";
import { checkVersion, enumValue, Reader, typeName, uint, varintSize, Writer } from "./fields.js";

const BAD_FRAME = ErrorCode.BAD_FRAME;
const OVER_LIMIT = ErrorCode.OVER_LIMIT;
const D_Q = 0x01, D_TREE = 0x02;
const V_DROPPED = 0x01, V_P = 0x02, V_PATH = 0x04, V_FINISHED = 0x08;
const T_FINISHED = 0x01, T_STEP = 0x02, T_LOGPROBS = 0x04;
const utf8 = new TextEncoder();
const LONE_SURROGATES = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g;

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
  w.u8(helloLogprobs(Number(uint(f.logprobs ?? 0, "HELLO.logprobs", 0xffn))), "HELLO.logprobs");
  w.tokens(f.prompt, limits.maxPromptTokens, "HELLO.prompt");
}

function helloLogprobs(value: number): number {
  if (value > MAX_TOP_LOGPROBS + 1) {
    throw new WireError(BAD_FRAME, `HELLO.logprobs = ${value}: at most 1 + ${MAX_TOP_LOGPROBS} alternatives`);
  }
  return value;
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
    logprobs: helloLogprobs(r.u8("HELLO.logprobs")),
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
  const lps = f.logprobs !== null && f.logprobs !== undefined;
  w.byte((f.finished ? T_FINISHED : 0) | (step ? T_STEP : 0) | (lps ? T_LOGPROBS : 0));
  if (step) {
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
  } else if ((f.accepted && f.accepted !== 0n) || (f.verify_us && f.verify_us !== 0n)) {
    throw new WireError(BAD_FRAME, "TOKENS.accepted and verify_us need HAS_STEP (drafted set)");
  }
  if (!lps) return;
  const entries = f.logprobs!;
  if (!Array.isArray(entries) || entries.length !== f.tokens.length) {
    throw new WireError(BAD_FRAME, `TOKENS.logprobs must have one entry per token (${f.tokens.length})`);
  }
  entries.forEach((entry, i) => {
    if (!Array.isArray(entry) || entry.length !== 2) throw new WireError(BAD_FRAME, `TOKENS.logprobs[${i}] must be a (logprob, top) pair`);
    w.f32(entry[0], `TOKENS.logprobs[${i}]`, LOGPROB_FLOOR, 0.0);
    w.row(entry[1], `TOKENS.logprobs[${i}].top`, MAX_TOP_LOGPROBS, LOGPROB_FLOOR, 0.0);
  });
}

function decTokens(r: Reader): Tokens {
  const start = r.uvarint("TOKENS.start");
  const tokens = r.tokens(r.limits.maxPromptTokens, "TOKENS.tokens");
  const flags = r.flags(T_FINISHED | T_STEP | T_LOGPROBS, "TOKENS.flags");
  const out: Tokens = {
    type: FrameType.TOKENS, start, tokens, finished: Boolean(flags & T_FINISHED), drafted: null, accepted: 0, verify_us: 0,
    logprobs: null,
  };
  if (flags & T_STEP) {
    const drafted = r.count(r.limits.maxDraftTokens, "TOKENS.drafted");
    const accepted = r.uvarint("TOKENS.accepted");
    if (BigInt(accepted) > BigInt(drafted)) throw new WireError(BAD_FRAME, `TOKENS.accepted ${accepted} is more than drafted ${drafted}`);
    Object.assign(out, { drafted, accepted, verify_us: r.uvarint("TOKENS.verify_us") });
  }
  if (flags & T_LOGPROBS) {
    out.logprobs = tokens.map((_, i): TokenLogprob => [
      r.f32(`TOKENS.logprobs[${i}]`, LOGPROB_FLOOR, 0.0),
      r.row(`TOKENS.logprobs[${i}].top`, MAX_TOP_LOGPROBS, LOGPROB_FLOOR, 0.0),
    ]);
  }
  return out;
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
export function parseLength(buf: Uint8Array, pos: number, end: number, maxFrameBytes: number): [number, number] | null {
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

export function decodePayload(buf: Uint8Array, pos: number, end: number, limits: Limits): Frame {
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
