// The checked field readers and writers every frame is made of (the wire's primitive encodings: varints,
// fixed-width integers, f32, bytes, str, token lists, sparse rows), mirroring `_Writer` and `_Reader` in
// acespec/wire/codec.py check for check: a failure is a WireError with the code the receiver would use.

import { ErrorCode, Limits, PROTOCOL_VERSION, SparseRow, U64_MAX, UInt, WireError } from "./frames.js";

const BAD_FRAME = ErrorCode.BAD_FRAME;
const OVER_LIMIT = ErrorCode.OVER_LIMIT;

const utf8 = new TextEncoder();
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;
const strictUtf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/** A decoded integer as the wire's users want it: a number when exact, a bigint beyond 2**53 - 1. */
export function narrow(v: bigint): UInt {
  return v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;
}

export function isInt(v: unknown): v is UInt {
  return typeof v === "bigint" || (typeof v === "number" && Number.isInteger(v));
}

export function typeName(v: unknown): string {
  if (v === null) return "None";
  if (Array.isArray(v)) return "list";
  return typeof v === "number" ? (Number.isInteger(v) ? "int" : "float") : typeof v;
}

/** `value` checked as an unsigned integer <= max (u64 by default). */
export function uint(value: unknown, what: string, max: bigint = U64_MAX): UInt {
  if (!isInt(value)) throw new WireError(BAD_FRAME, `${what} must be an integer, not ${typeName(value)}`);
  const big = BigInt(value);
  if (big < 0n || big > max) throw new WireError(BAD_FRAME, `${what} = ${value} is outside 0..${max}`);
  return value;
}

export function float(value: unknown, what: string, low: number, high: number): number {
  if (typeof value !== "number") throw new WireError(BAD_FRAME, `${what} must be a real number, not ${typeName(value)}`);
  if (!(low <= value && value <= high)) throw new WireError(BAD_FRAME, `${what} = ${value} is outside ${low}..${high}`);
  return value;
}

export function enumValue<T extends object>(e: T, value: number, what: string): number {
  if (!(value in e) || typeof (e as Record<number, unknown>)[value] !== "string") {
    throw new WireError(BAD_FRAME, `unknown ${what} ${value}`);
  }
  return value;
}

export function checkVersion(version: number, what: string): void {
  if (version !== PROTOCOL_VERSION) {
    throw new WireError(ErrorCode.BAD_VERSION,
      `${what} speaks protocol version ${version}; this peer speaks ${PROTOCOL_VERSION}`);
  }
}

export function varintSize(value: number): number {
  let n = 1;
  while (value >= 0x80) {
    value = Math.floor(value / 128);
    n++;
  }
  return n;
}

/** Appends checked fields to a payload; mirrors Reader check for check. */
export class Writer {
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

  /** A sparse row; its floats are probabilities (0..1) unless `low`/`high` say otherwise (an lrow). */
  row(row: unknown, what: string, limit?: number, low = 0.0, high = 1.0): void {
    if (!Array.isArray(row)) throw new WireError(BAD_FRAME, `${what} must be a list of pairs, not ${typeName(row)}`);
    this.count(row.length, limit ?? this.limits.maxSparseK, `${what} size`);
    const seen = new Set<number>();
    for (const pair of row) {
      if (!Array.isArray(pair) || pair.length !== 2) throw new WireError(BAD_FRAME, `${what} entries must be (token, prob) pairs`);
      const [token, prob] = pair;
      this.token(token, `${what} token`);
      if (seen.has(Number(token))) throw new WireError(BAD_FRAME, `${what} lists token ${token} twice`);
      seen.add(Number(token));
      this.f32(prob, `${what} value`, low, high);
    }
  }
}

/** Reads fields from buf[pos:end]; every shortfall or bad value is a WireError. */
export class Reader {
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

  row(what: string, limit?: number, low = 0.0, high = 1.0): SparseRow {
    const n = this.count(limit ?? this.limits.maxSparseK, `${what} size`);
    const pairs: SparseRow = [];
    for (let i = 0; i < n; i++) pairs.push([this.token(`${what} token`), this.f32(`${what} value`, low, high)]);
    if (new Set(pairs.map((p) => p[0])).size !== n) throw new WireError(BAD_FRAME, `${what} lists a token twice`);
    return pairs;
  }

  flags(known: number, what: string): number {
    const flags = this.u8(what);
    if (flags & ~known) throw new WireError(BAD_FRAME, `${what} has reserved bits set: 0x${flags.toString(16).padStart(2, "0")}`);
    return flags;
  }
}

