// A GGUF vocabulary as llama.cpp reads it: each token's bytes (what llama_token_to_piece gives), the
// tokenizer fingerprint the cloud checks HELLO.model_id against, and bytes -> text for the output.
//
// node-llama-cpp hands token pieces over as JS strings, which cannot carry the partial UTF-8 sequences
// byte-level BPE tokens hold; the fingerprint hashes bytes, so the pieces are rebuilt here from the
// GGUF's own token table, with llama.cpp's rules (llama-vocab.cpp, token_to_piece).

import type { GgufValue } from "./ggufmeta.js";
import { sha256 } from "./wire/sha256.js";

// llama.cpp's token types (GGUF tokenizer.ggml.token_type)
const NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, BYTE = 6;

/** GPT-2's byte-level BPE alphabet, inverted: code point -> byte. */
function gpt2ByteDecoder(): Map<number, number> {
  const bytes: number[] = [];
  for (let b = 33; b <= 126; b++) bytes.push(b);
  for (let b = 161; b <= 172; b++) bytes.push(b);
  for (let b = 174; b <= 255; b++) bytes.push(b);
  const cps = [...bytes];
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bytes.includes(b)) {
      bytes.push(b);
      cps.push(256 + n++);
    }
  }
  const out = new Map<number, number>();
  bytes.forEach((b, i) => out.set(cps[i], b));
  return out;
}

const utf8 = new TextEncoder();

export class Vocab {
  /** Each token's bytes with special tokens rendered (llama_token_to_piece(special=true)). */
  readonly pieces: Uint8Array[];
  readonly hidden: Uint8Array; // 1 where a token renders as nothing in plain text (control, unknown)
  readonly fingerprint: string;
  readonly chatTemplate: string | null;
  readonly bosId: number;
  readonly eosId: number;

  constructor(meta: Map<string, GgufValue>) {
    const model = meta.get("tokenizer.ggml.model");
    const tokens = meta.get("tokenizer.ggml.tokens");
    if (!Array.isArray(tokens)) throw new Error("the GGUF holds no tokenizer.ggml.tokens");
    const types = meta.get("tokenizer.ggml.token_type");
    const typeOf = (i: number): number => (Array.isArray(types) ? Number(types[i]) : NORMAL);
    this.pieces = new Array(tokens.length);
    this.hidden = new Uint8Array(tokens.length);
    const decoder = model === "gpt2" ? gpt2ByteDecoder() : null;
    if (model !== "gpt2" && model !== "llama") throw new Error(`tokenizer model ${String(model)} is not supported (gpt2 and llama are)`);
    for (let i = 0; i < tokens.length; i++) {
      const text = String(tokens[i]);
      const type = typeOf(i);
      this.hidden[i] = type === CONTROL || type === UNKNOWN ? 1 : 0;
      if (type === CONTROL || type === UNKNOWN || type === USER_DEFINED) {
        this.pieces[i] = utf8.encode(text);
      } else if (type === NORMAL) {
        this.pieces[i] = decoder ? bpeBytes(text, decoder) : utf8.encode(text.replaceAll("\u2581", " "));
      } else if (type === BYTE && !decoder) {
        this.pieces[i] = Uint8Array.of(parseInt(text.slice(3, 5), 16)); // "<0xAB>"
      } else {
        this.pieces[i] = new Uint8Array(0); // unused tokens (e.g. padding ids) have no bytes
      }
    }
    this.fingerprint = vocabFingerprint(this.pieces);
    const tpl = meta.get("tokenizer.chat_template");
    this.chatTemplate = typeof tpl === "string" ? tpl : null;
    this.bosId = Number(meta.get("tokenizer.ggml.bos_token_id") ?? -1);
    this.eosId = Number(meta.get("tokenizer.ggml.eos_token_id") ?? -1);
  }

  get size(): number {
    return this.pieces.length;
  }

  /** The bytes of `ids` as text shows them: control tokens render as nothing. */
  decodeBytes(ids: readonly number[]): Uint8Array {
    const parts = ids.map((t) => (this.hidden[t] ? new Uint8Array(0) : this.pieces[t] ?? new Uint8Array(0)));
    return concat(parts);
  }

  /** A token's text with special tokens rendered (for the chat template's bos/eos strings). */
  special(id: number): string {
    return id >= 0 && id < this.pieces.length ? new TextDecoder().decode(this.pieces[id]) : "";
  }
}

function bpeBytes(text: string, decoder: Map<number, number>): Uint8Array {
  const out: number[] = [];
  for (const ch of text) {
    const b = decoder.get(ch.codePointAt(0)!);
    if (b === undefined) {
      // llama.cpp's llama_decode_text marks a code point outside the byte alphabet this way
      const raw = utf8.encode(ch);
      const hex = Array.from(raw, (x) => x.toString(16).padStart(2, "0")).join("");
      out.push(...utf8.encode(`[UNK_BYTE_0x${hex}${text}]`));
    } else {
      out.push(b);
    }
  }
  return Uint8Array.from(out);
}

/** `vocab:<n>:<hash>`: SHA-256 over every token's bytes, each prefixed by its length (u32, big-endian),
 * first 16 hex digits; the Python side's `models.base.vocab_fingerprint`. */
export function vocabFingerprint(pieces: readonly Uint8Array[]): string {
  const framed: Uint8Array[] = [];
  for (const p of pieces) {
    const len = new Uint8Array(4);
    new DataView(len.buffer).setUint32(0, p.length);
    framed.push(len, p);
  }
  const digest = Array.from(sha256(concat(framed)), (b) => b.toString(16).padStart(2, "0")).join("");
  return `vocab:${pieces.length}:` + digest.slice(0, 16);
}

function concat(parts: readonly Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((s, p) => s + p.length, 0));
  let o = 0;
  for (const p of parts) {
    out.set(p, o);
    o += p.length;
  }
  return out;
}
