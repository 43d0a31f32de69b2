// Splitting a byte stream into frames (FrameDecoder), and the small public helpers of the format: the
// committed-prefix digest RESUME carries, varints and zigzag integers (acespec/wire/framing.py).

import { decodePayload, parseLength } from "./codec.js";
import { narrow, Reader, uint, Writer } from "./fields.js";
import { DEFAULT_LIMITS, ErrorCode, Frame, Limits, UInt, WireError } from "./frames.js";
import { sha256 } from "./sha256.js";

const BAD_FRAME = ErrorCode.BAD_FRAME;

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
  return sha256(w.bytes());
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
