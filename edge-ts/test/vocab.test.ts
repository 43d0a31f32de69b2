// The GGUF metadata reader and the vocabulary rebuilt from it, on a small GGUF file written here: token
// bytes as llama.cpp's token_to_piece gives them (byte-level BPE decoded, control tokens as their text,
// unused ids empty), the fingerprint over them, and plain text that leaves control tokens out.

import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { describe, it } from "node:test";
import { readGgufMetadata } from "../src/gguf.js";
import { Vocab, vocabFingerprint } from "../src/vocab.js";
import { scratchDir } from "./helpers.js";

function str(s: string): Buffer {
  const b = Buffer.from(s, "utf8");
  const n = Buffer.alloc(8);
  n.writeBigUInt64LE(BigInt(b.length));
  return Buffer.concat([n, b]);
}

const u32 = (v: number): Buffer => {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(v);
  return b;
};
const u64 = (v: number): Buffer => {
  const b = Buffer.alloc(8);
  b.writeBigUInt64LE(BigInt(v));
  return b;
};

/** A GGUF v3 file with only metadata: a gpt2 (byte-level BPE) vocabulary and a chat template. */
function tinyGguf(tokens: string[], types: number[]): string {
  const kv = [
    Buffer.concat([str("general.architecture"), u32(8), str("test")]),
    Buffer.concat([str("tokenizer.ggml.model"), u32(8), str("gpt2")]),
    Buffer.concat([str("tokenizer.ggml.tokens"), u32(9), u32(8), u64(tokens.length), ...tokens.map(str)]),
    Buffer.concat([str("tokenizer.ggml.token_type"), u32(9), u32(5), u64(types.length), ...types.map(u32)]),
    Buffer.concat([str("tokenizer.ggml.eos_token_id"), u32(4), u32(3)]),
    Buffer.concat([str("tokenizer.chat_template"), u32(8), str("{{ messages[0]['content'] }}")]),
  ];
  const file = join(scratchDir(), "tiny.gguf");
  writeFileSync(file, Buffer.concat([Buffer.from("GGUF"), u32(3), u64(0), u64(kv.length), ...kv]));
  return file;
}

describe("a GGUF vocabulary", () => {
  // "Ġ" is the byte-level alphabet's space, "Ċ" its newline; "Ã©" the two bytes of "é"
  const tokens = ["hi", "Ġthere", "ĊÃ©", "<|im_end|>", "[PAD9]", "<tool>"];
  const types = [1, 1, 1, 3, 5, 4]; // normal x3, control, unused, user-defined
  const vocab = new Vocab(readGgufMetadata(tinyGguf(tokens, types)));

  it("reads every metadata key with its value", () => {
    const meta = readGgufMetadata(tinyGguf(tokens, types));
    assert.equal(meta.get("general.architecture"), "test");
    assert.deepEqual(meta.get("tokenizer.ggml.tokens"), tokens);
    assert.equal(meta.get("tokenizer.ggml.eos_token_id"), 3);
  });

  it("gives each token the bytes llama.cpp gives it with special tokens rendered", () => {
    assert.deepEqual(vocab.pieces.map((p) => Buffer.from(p).toString("hex")),
      ["6869", "207468657265", "0ac3a9", Buffer.from("<|im_end|>").toString("hex"), "", Buffer.from("<tool>").toString("hex")]);
  });

  it("fingerprints exactly those bytes", () => {
    assert.equal(vocab.fingerprint, vocabFingerprint(vocab.pieces));
    assert.match(vocab.fingerprint, /^vocab:6:[0-9a-f]{16}$/);
  });

  it("writes plain text without control tokens, user-defined ones included", () => {
    assert.equal(new TextDecoder().decode(vocab.decodeBytes([0, 1, 2, 3, 5])), "hi there\né<tool>");
    assert.equal(vocab.special(3), "<|im_end|>");
    assert.equal(vocab.chatTemplate, "{{ messages[0]['content'] }}");
  });

  it("refuses a file that is not GGUF", () => {
    const file = join(scratchDir(), "not.gguf");
    writeFileSync(file, "GGML and then some");
    assert.throws(() => readGgufMetadata(file), /is not a GGUF file/);
  });
});
