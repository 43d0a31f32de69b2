// The browser edge's drafter: the same GGUF the Node and Python edges load, run by llama.cpp compiled to
// WebAssembly (wllama 2.x, single-threaded: the page needs no cross-origin isolation). It keeps one KV
// sequence, synced to each context as chain.ts asks (rolling back to the first token that differs), and
// drafts greedily: each token is the argmax of the model's distribution after the context.

import { LoggerWithoutDebug, Wllama } from "@wllama/wllama";
import { type DraftBackend, type Picker, sharedPrefix } from "../chain.js";
import { chunksReader, parseGgufMetadata } from "../ggufmeta.js";
import { Vocab } from "../vocab.js";

export class DrafterError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "DrafterError";
  }
}

export interface WllamaLoad {
  wasmUrl: string; // wllama's single-thread/wllama.wasm
  nCtx?: number;
  onProgress?: (loaded: number, total: number) => void;
}

export class WllamaDraftModel implements DraftBackend {
  held: number[] = [];
  readonly fallbacks = 0; // greedy only: no coupled picks
  readonly threads = 1;
  evals = 0; // model passes run

  private constructor(readonly w: Wllama, readonly vocab: Vocab) {}

  get fingerprint(): string {
    return this.vocab.fingerprint;
  }

  /** Fetch the GGUF at `ggufUrl` and load it into a single-threaded wllama. */
  static async load(ggufUrl: string, opts: WllamaLoad): Promise<WllamaDraftModel> {
    const res = await fetch(ggufUrl);
    if (!res.ok || res.body === null) throw new DrafterError(`cannot fetch the drafter GGUF ${ggufUrl}: HTTP ${res.status}`);
    const total = Number(res.headers.get("content-length") ?? 0);
    const parts: Uint8Array[] = [];
    let loaded = 0;
    const reader = res.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      parts.push(value);
      loaded += value.length;
      opts.onProgress?.(loaded, total);
    }
    // the vocabulary from the GGUF's own token table, as the Node edge reads it: the tokenizer fingerprint
    // HELLO names, and each token's bytes for the text
    const vocab = new Vocab(parseGgufMetadata(chunksReader(parts), ggufUrl));
    const w = new Wllama({ "single-thread/wllama.wasm": opts.wasmUrl }, { suppressNativeLog: true, logger: LoggerWithoutDebug });
    await w.loadModel([new Blob(parts)], { n_ctx: opts.nCtx ?? 2048, n_batch: 256, n_threads: 1 });
    if (w.isMultithread()) throw new DrafterError("wllama loaded its multi-threaded build; the page expects the single-threaded one");
    return new WllamaDraftModel(w, vocab);
  }

  /** Token ids of `text` (no BOS; `special`: parse special tokens). */
  encode(text: string, special = false): Promise<number[]> {
    return this.w.tokenize(text, special);
  }

  /** The bytes of `ids` as text shows them (a chunk may end inside a character: decode it streaming). */
  decodeBytes(ids: readonly number[]): Uint8Array {
    return this.vocab.decodeBytes(ids);
  }

  async sync(tokens: readonly number[]): Promise<number> {
    const held = this.held;
    const m = sharedPrefix(held, tokens);
    if (m < held.length) {
      await this.w.kvRemove(m, held.length - m);
      held.length = m;
    }
    return m;
  }

  async eval(tokens: readonly number[], picker: Picker | null): Promise<number | null> {
    if (tokens.length === 0) return null;
    if (picker !== null && picker.mode !== "greedy") {
      throw new DrafterError("the WebAssembly drafter drafts greedily only (rule greedy, or temperature 0)");
    }
    if (this.held.length + tokens.length > this.w.getLoadedContextInfo().n_ctx) {
      throw new DrafterError(`the drafter's context (${this.w.getLoadedContextInfo().n_ctx} tokens) is full`);
    }
    await this.w.decode([...tokens], { skipLogits: picker === null });
    this.held.push(...tokens);
    this.evals++;
    if (picker === null) return null;
    const top = await this.w.getLogits(1);
    if (!top.length) throw new DrafterError("the drafter produced no distribution");
    return top[0].token;
  }

  async dispose(): Promise<void> {
    await this.w.exit();
  }
}
