// A GGUF file's metadata (the key/value header before the tensors), parsed from any byte source: the
// file on disk (gguf.ts, Node) or the bytes a browser fetched. The vocabulary (what the tokenizer
// fingerprint is computed from) and the chat template live there. Nothing here depends on Node.

export type GgufValue = number | bigint | boolean | string | GgufValue[];

/** `n` bytes of the file from `offset` (fewer only at its end). */
export type ReadAt = (offset: number, n: number) => Uint8Array;

const utf8 = new TextDecoder("utf-8");

class MetaReader {
  private buf = new Uint8Array(0);
  private bufStart = 0; // file offset of buf[0]
  pos = 0; // file offset of the next read

  constructor(private readAt: ReadAt) {}

  private ensure(n: number): void {
    const have = this.bufStart + this.buf.length - this.pos;
    if (have >= n) return;
    const keep = this.buf.subarray(this.pos - this.bufStart);
    const chunk = this.readAt(this.bufStart + this.buf.length, Math.max(n - keep.length, 1 << 22));
    const next = new Uint8Array(keep.length + chunk.length);
    next.set(keep);
    next.set(chunk, keep.length);
    this.buf = next;
    this.bufStart = this.pos;
    if (this.buf.length < n) throw new Error("GGUF: the file ends inside its metadata");
  }

  take(n: number): DataView {
    this.ensure(n);
    const at = this.pos - this.bufStart;
    this.pos += n;
    return new DataView(this.buf.buffer, this.buf.byteOffset + at, n);
  }

  u32(): number {
    return this.take(4).getUint32(0, true);
  }

  u64(): number {
    const v = this.take(8).getBigUint64(0, true);
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new Error("GGUF: a length beyond 2**53");
    return Number(v);
  }

  str(): string {
    const v = this.take(this.u64());
    return utf8.decode(new Uint8Array(v.buffer, v.byteOffset, v.byteLength));
  }

  value(type: number): GgufValue {
    switch (type) {
      case 0: return this.take(1).getUint8(0);
      case 1: return this.take(1).getInt8(0);
      case 2: return this.take(2).getUint16(0, true);
      case 3: return this.take(2).getInt16(0, true);
      case 4: return this.take(4).getUint32(0, true);
      case 5: return this.take(4).getInt32(0, true);
      case 6: return this.take(4).getFloat32(0, true);
      case 7: return this.take(1).getUint8(0) !== 0;
      case 8: return this.str();
      case 9: {
        const itemType = this.u32();
        const n = this.u64();
        const out: GgufValue[] = new Array(n);
        for (let i = 0; i < n; i++) out[i] = this.value(itemType);
        return out;
      }
      case 10: return this.take(8).getBigUint64(0, true);
      case 11: return this.take(8).getBigInt64(0, true);
      case 12: return this.take(8).getFloat64(0, true);
      default:
        throw new Error(`GGUF: unknown value type ${type}`);
    }
  }
}

/** Every metadata key of the GGUF file that `readAt` reads (`name`: for the errors), with its value. */
export function parseGgufMetadata(readAt: ReadAt, name: string): Map<string, GgufValue> {
  const r = new MetaReader(readAt);
  const magic = r.take(4);
  if (String.fromCharCode(magic.getUint8(0), magic.getUint8(1), magic.getUint8(2), magic.getUint8(3)) !== "GGUF") {
    throw new Error(`${name} is not a GGUF file`);
  }
  const version = r.u32();
  if (version < 2) throw new Error(`${name}: GGUF version ${version} is not supported`);
  r.u64(); // tensor count
  const nKv = r.u64();
  const out = new Map<string, GgufValue>();
  for (let i = 0; i < nKv; i++) {
    const key = r.str();
    out.set(key, r.value(r.u32()));
  }
  return out;
}

/** A ReadAt over a file held as consecutive chunks (as a fetch streams it). */
export function chunksReader(chunks: readonly Uint8Array[]): ReadAt {
  return (offset, n) => {
    const out: Uint8Array[] = [];
    let base = 0, left = n, at = offset;
    for (const c of chunks) {
      if (left <= 0) break;
      if (at < base + c.length) {
        const part = c.subarray(at - base, Math.min(c.length, at - base + left));
        out.push(part);
        at += part.length;
        left -= part.length;
      }
      base += c.length;
    }
    const total = out.reduce((s, p) => s + p.length, 0);
    const joined = new Uint8Array(total);
    let o = 0;
    for (const p of out) {
      joined.set(p, o);
      o += p.length;
    }
    return joined;
  };
}
