// The browser edge's drafter: the same GGUF the Node and Python edges load, run by llama.cpp compiled to
// WebAssembly (wllama 2.x, single-threaded: the page needs no cross-origin isolation). It keeps one KV
// sequence, synced to each context as chain.ts asks (rolling back to the first token that differs), and
// drafts greedily: each token is the argmax of the model's distribution after the context.

import { LoggerWithoutDebug, Wllama } from "@wllama/wllama";
import { type DraftBackend, type Picker, sharedPrefix } from "../chain.js";
import { coupledSample } from "../coupled.js";
import { chunksReader, parseGgufMetadata } from "../ggufmeta.js";
import { tempered } from "../sampling.js";
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
  readonly fallbacks = 0; // every coupled pick reads the whole distribution: none falls back to it
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
    if (this.held.length + tokens.length > this.w.getLoadedContextInfo().n_ctx) {
      throw new DrafterError(`the drafter's context (${this.w.getLoadedContextInfo().n_ctx} tokens) is full`);
    }
    await this.w.decode([...tokens], { skipLogits: picker === null });
    this.held.push(...tokens);
    this.evals++;
    if (picker === null) return null;
    if (picker.mode === "greedy" || picker.sampling.temperature <= 0) {
      const top = await this.w.getLogits(1);
      if (!top.length) throw new DrafterError("the drafter produced no distribution");
      return top[0].token;
    }
    // coupled: argmax(log q + g) with the cloud's noise g at this position, over the whole row (wllama
    // gives no cheaper top-K with its probabilities renormalised, as llama.cpp does in drafter.ts)
    const p1 = new Float64Array(this.vocab.size);
    for (const { token, p } of await this.w.getLogits(-1)) if (token < p1.length) p1[token] = p;
    return coupledSample(tempered(p1, picker.sampling), picker.seed, this.held.length);
  }

  async dispose(): Promise<void> {
    await this.w.exit();
  }
}
