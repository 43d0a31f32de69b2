// The codec against the language-neutral vectors (spec/vectors/frames.json), and the properties the
// format promises (one encoding per frame, a stream decoder that stays in step).

import { createHash } from "node:crypto";
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { decode, encode } from "../src/wire/codec.js";
import { sha256 } from "../src/wire/sha256.js";
import { committedDigest, decodeUvarint, encodeUvarint, FrameDecoder, zigzagDecode, zigzagEncode } from "../src/wire/framing.js";
import { ErrorCode, FrameType, WireError } from "../src/wire/frames.js";
import { vocabFingerprint } from "../src/vocab.js";
import { frameFromJson, frameToJson, hex, toHex, vectors, VECTORS_DIR } from "./helpers.js";

const V = vectors("frames.json");
const skip = V === null ? `no wire vectors at ${VECTORS_DIR}/frames.json` : false;

function wireError(fn: () => unknown): WireError {
  try {
    fn();
  } catch (e) {
    assert.ok(e instanceof WireError, `expected a WireError, got ${e}`);
    return e;
  }
  assert.fail("expected a WireError, nothing was raised");
}

describe("the codec against the wire vectors", { skip }, () => {
  it("encodes every valid vector's frame to exactly its bytes", () => {
    for (const v of V.valid) assert.equal(toHex(encode(frameFromJson(v.frame))), v.hex, v.name);
  });

  it("decodes every valid vector's bytes to exactly its frame", () => {
    for (const v of V.valid) assert.deepEqual(frameToJson(decode(hex(v.hex))), v.frame, v.name);
  });

  it("refuses every malformed vector with the vector's error code", () => {
    for (const v of V.malformed) {
      const e = wireError(() => decode(hex(v.hex)));
      assert.equal(ErrorCode[e.code], v.error, `${v.name}: ${e.message}`);
    }
  });

  it("keeps a byte stream in step after a bad payload and breaks it for good after a bad length prefix", () => {
    const close = hex("020900");
    for (const v of V.malformed) {
      const dec = new FrameDecoder();
      if (v.stream === "incomplete") {
        assert.deepEqual(dec.feed(hex(v.hex)), [], v.name);
        continue;
      }
      const e = wireError(() => dec.feed(hex(v.hex)));
      assert.equal(ErrorCode[e.code], v.error, v.name);
      if (v.stream === "payload") {
        assert.equal(dec.broken, false, v.name);
        assert.deepEqual(dec.feed(close).map((f) => f.type), [FrameType.CLOSE], v.name);
      } else {
        assert.equal(dec.broken, true, v.name);
        assert.equal(wireError(() => dec.feed(close)).code, e.code, v.name);
      }
    }
  });

  it("decodes every valid frame whatever the chunks the bytes arrive in", () => {
    const all = Buffer.concat(V.valid.map((v: { hex: string }) => hex(v.hex)));
    for (const size of [1, 2, 7, 64, all.length]) {
      const dec = new FrameDecoder();
      const got = [];
      for (let i = 0; i < all.length; i += size) got.push(...dec.feed(all.subarray(i, i + size)));
      assert.deepEqual(got.map((f) => toHex(encode(f))), V.valid.map((v: { hex: string }) => v.hex), `chunks of ${size}`);
      assert.equal(dec.pending, 0);
    }
  });

  it("computes the committed digest RESUME carries as the vectors do", () => {
    for (const v of V.committed_digest) assert.equal(toHex(committedDigest(v.tokens)), v.digest);
  });

  it("hashes as Node's SHA-256 does at every padding boundary (the digest's own code, which a browser runs)", () => {
    for (let n = 0; n <= 200; n++) {
      const data = new Uint8Array(n).map((_, i) => (i * 131 + n * 7) & 0xff);
      assert.equal(toHex(sha256(data)), createHash("sha256").update(data).digest("hex"), `${n} bytes`);
    }
  });

  it("computes the vocabulary fingerprint as the vectors do", () => {
    for (const v of V.vocab_fingerprint) assert.equal(vocabFingerprint(v.pieces_hex.map(hex)), v.fingerprint);
  });
});

describe("the codec's own promises", () => {
  it("encodes varints minimally and decodes them back, up to 2**64 - 1", () => {
    for (const [value, h] of [[0, "00"], [127, "7f"], [128, "8001"], [16383, "ff7f"], [(1n << 64n) - 1n, "ffffffffffffffffff01"]] as const) {
      assert.equal(toHex(encodeUvarint(value)), h);
      assert.deepEqual(decodeUvarint(hex(h)), [value, h.length / 2]);
    }
  });

  it("maps signed integers onto unsigned ones with zigzag and back", () => {
    for (const [s, u] of [[0n, 0n], [-1n, 1n], [1n, 2n], [-(1n << 63n), (1n << 64n) - 1n]]) {
      assert.equal(zigzagEncode(s), u);
      assert.equal(zigzagDecode(u), s);
    }
  });

  it("refuses to encode a frame the receiver would refuse, with the receiver's code", () => {
    const draft = { type: FrameType.DRAFT, session: 1, seq: 1, base: 3, tokens: new Array(65).fill(1), q: null, parents: null } as const;
    assert.equal(wireError(() => encode(draft)).code, ErrorCode.OVER_LIMIT);
    assert.equal(wireError(() => encode({ ...draft, tokens: [1, 2], parents: [0, 2] })).code, ErrorCode.BAD_FRAME);
    assert.equal(wireError(() => encode({ ...draft, tokens: [1 << 22] })).code, ErrorCode.OVER_LIMIT);
    assert.equal(wireError(() => encode({ ...draft, tokens: [1.5] })).code, ErrorCode.BAD_FRAME);
    const hello = { type: FrameType.HELLO, version: 3, auth: new Uint8Array(0), model_id: "m", temperature: NaN, top_k: 0,
      top_p: 1, rule: "greedy", seed: 0, mode: 2, max_tokens: 1, logprobs: 0, prompt: [1] as number[] } as const;
    assert.equal(wireError(() => encode(hello)).code, ErrorCode.BAD_FRAME);
    assert.equal(wireError(() => encode({ ...hello, temperature: 0, version: 4 })).code, ErrorCode.BAD_VERSION);
    assert.equal(wireError(() => encode({ ...hello, temperature: 0, version: 2 })).code, ErrorCode.BAD_VERSION);
    assert.equal(wireError(() => encode({ ...hello, temperature: 0, logprobs: 22 })).code, ErrorCode.BAD_FRAME);
    const tokens = { type: FrameType.TOKENS as const, start: 0, tokens: [1], finished: false, drafted: null, accepted: 0, verify_us: 0 };
    const lp = (entries: unknown) => ({ ...tokens, logprobs: entries as [number, [number, number][]][] });
    assert.equal(wireError(() => encode(lp([[0.5, []]]))).code, ErrorCode.BAD_FRAME);
    assert.equal(wireError(() => encode(lp([]))).code, ErrorCode.BAD_FRAME);
    assert.equal(wireError(() => encode(lp([[-1, Array.from({ length: 21 }, (_, i) => [i, -1])]]))).code, ErrorCode.OVER_LIMIT);
    assert.equal(wireError(() => encode({ ...hello, temperature: 0, model_id: "\ud800" })).code, ErrorCode.BAD_FRAME);
  });

  it("cuts a long ERROR message at a character boundary instead of refusing it", () => {
    const bytes = encode({ type: FrameType.ERROR, code: ErrorCode.INTERNAL, message: "é".repeat(300) + "x" });
    const f = decode(bytes);
    assert.equal(f.type, FrameType.ERROR);
    assert.equal(f.type === FrameType.ERROR && f.message, "é".repeat(256));
  });
});
