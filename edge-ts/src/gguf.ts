// A GGUF file's metadata (the key/value header before the tensors), read without loading the model:
// the vocabulary (what the tokenizer fingerprint is computed from) and the chat template live there.

import { closeSync, openSync, readSync } from "node:fs";

export type GgufValue = number | bigint | boolean | string | GgufValue[];

class FileReader {
  private buf = Buffer.alloc(0);
  private bufStart = 0; // file offset of buf[0]
  pos = 0; // file offset of the next read

  constructor(private fd: number) {}

  private ensure(n: number): void {
    const have = this.bufStart + this.buf.length - this.pos;
    if (have >= n) return;
    const keep = this.buf.subarray(this.pos - this.bufStart);
    const chunk = Buffer.alloc(Math.max(n - keep.length, 1 << 22));
    const got = readSync(this.fd, chunk, 0, chunk.length, this.bufStart + this.buf.length);
    this.buf = Buffer.concat([keep, chunk.subarray(0, got)]);
    this.bufStart = this.pos;
    if (this.buf.length < n) throw new Error("GGUF: the file ends inside its metadata");
  }

  take(n: number): Buffer {
    this.ensure(n);
    const at = this.pos - this.bufStart;
    this.pos += n;
    return this.buf.subarray(at, at + n);
  }

  u32(): number {
    return this.take(4).readUInt32LE(0);
  }

  u64(): number {
    const v = this.take(8).readBigUInt64LE(0);
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new Error("GGUF: a length beyond 2**53");
    return Number(v);
  }

  str(): string {
    return this.take(this.u64()).toString("utf8");
  }

  value(type: number): GgufValue {
    switch (type) {
      case 0: return this.take(1).readUInt8(0);
      case 1: return this.take(1).readInt8(0);
      case 2: return this.take(2).readUInt16LE(0);
      case 3: return this.take(2).readInt16LE(0);
      case 4: return this.take(4).readUInt32LE(0);
      case 5: return this.take(4).readInt32LE(0);
      case 6: return this.take(4).readFloatLE(0);
      case 7: return this.take(1).readUInt8(0) !== 0;
      case 8: return this.str();
      case 9: {
        const itemType = this.u32();
        const n = this.u64();
        const out: GgufValue[] = new Array(n);
        for (let i = 0; i < n; i++) out[i] = this.value(itemType);
        return out;
      }
      case 10: return this.take(8).readBigUInt64LE(0);
      case 11: return this.take(8).readBigInt64LE(0);
      case 12: return this.take(8).readDoubleLE(0);
      default:
        throw new Error(`GGUF: unknown value type ${type}`);
    }
  }
}

/** Every metadata key of the GGUF file at `path`, with its value. */
export function readGgufMetadata(path: string): Map<string, GgufValue> {
  const fd = openSync(path, "r");
  try {
    const r = new FileReader(fd);
    if (r.take(4).toString("latin1") !== "GGUF") throw new Error(`${path} is not a GGUF file`);
    const version = r.u32();
    if (version < 2) throw new Error(`${path}: GGUF version ${version} is not supported`);
    r.u64(); // tensor count
    const nKv = r.u64();
    const out = new Map<string, GgufValue>();
    for (let i = 0; i < nKv; i++) {
      const key = r.str();
      out.set(key, r.value(r.u32()));
    }
    return out;
  } finally {
    closeSync(fd);
  }
}
