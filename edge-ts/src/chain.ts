// Chain drafting (the Python ChainDrafter) over any drafter model that keeps one KV sequence: the
// node-llama-cpp DraftModel (drafter.ts) or wllama's WebAssembly build in a browser (web/wllama.ts).
// Nothing here depends on Node.

export interface Sampling {
  temperature: number; // 0 = greedy
  topK: number; // 0 = off
  topP: number; // 1 = off
}

/** How the drafter picks a token: the rule that will verify it decides. */
export interface Picker {
  mode: "greedy" | "coupled";
  seed: bigint;
  sampling: Sampling;
}

/** How many leading ids `held` (a drafter's KV sequence) and `tokens` share: what a sync may keep. */
export function sharedPrefix(held: readonly number[], tokens: readonly number[]): number {
  const n = Math.min(held.length, tokens.length);
  let m = 0;
  while (m < n && held[m] === tokens[m]) m++;
  return m;
}

export interface DraftResult {
  tokens: number[];
  seconds: number;
}

/** A drafter model with one KV sequence, as ChainDrafter drives it. */
export interface DraftBackend {
  /** The tokens the KV sequence holds, in order. */
  readonly held: number[];
  /** The tokenizer's fingerprint (HELLO.model_id names the vocabulary with it). */
  readonly fingerprint: string;
  /** Coupled picks that needed the whole distribution (0 for a drafter that only drafts greedily). */
  readonly fallbacks: number;
  /** CPU threads its computation uses (0: unknown, or none). */
  readonly threads: number;
  /** Roll the KV sequence back to the longest prefix of `tokens` it holds; returns that length. */
  sync(tokens: readonly number[]): Promise<number>;
  /** Evaluate `tokens` after what the sequence holds; with `picker`, the token chosen after the last one. */
  eval(tokens: readonly number[], picker: Picker | null): Promise<number | null>;
}

/** Chain drafting after a context (the Python ChainDrafter's draft/prefill/missing). */
export class ChainDrafter {
  tokensDrafted = 0;
  constructor(readonly model: DraftBackend, readonly picker: Picker) {}

  /** Put all of `context` but its last token in the KV cache (draft() evaluates the last one). */
  async prefill(context: readonly number[]): Promise<void> {
    const m = await this.model.sync(context.slice(0, -1));
    await this.model.eval(context.slice(m, -1), null);
  }

  /** Tokens of `context` but its last that the KV cache does not hold. */
  missing(context: readonly number[]): number {
    const held = this.model.held;
    const n = Math.min(held.length, context.length - 1);
    let m = 0;
    while (m < n && held[m] === context[m]) m++;
    return context.length - 1 - m;
  }

  /** Up to `n` tokens after `context`. */
  async draft(context: readonly number[], n: number): Promise<DraftResult> {
    const t0 = performance.now();
    if (n <= 0) return { tokens: [], seconds: 0 };
    const m = await this.model.sync(context.slice(0, -1));
    let x = await this.model.eval(context.slice(m), this.picker);
    const tokens: number[] = [];
    for (;;) {
      tokens.push(x!);
      if (tokens.length >= n) break;
      x = await this.model.eval([x!], this.picker);
    }
    this.tokensDrafted += tokens.length;
    return { tokens, seconds: (performance.now() - t0) / 1000 };
  }
}
