// The edge's drafter: a GGUF model run by llama.cpp through node-llama-cpp's prebuilt binaries, the same
// file the Python edge loads. It keeps one KV sequence that it syncs to each context it is asked to draft
// after (rolling back to the first token that differs), as the Python ChainDrafter does, and picks each
// token the way the verification rule expects: the argmax for greedy, the shared-seed Gumbel argmax of
// its distribution for coupled.

import { Template } from "@huggingface/jinja";
import { getLlama, Llama, LlamaContext, LlamaContextSequence, LlamaLogLevel, LlamaModel, Token } from "node-llama-cpp";
import { availableParallelism } from "node:os";
import { coupledSample, coupledTop } from "./coupled.js";
import { readGgufMetadata } from "./gguf.js";
import { DraftBackend, Picker, sharedPrefix } from "./chain.js";
import { Vocab } from "./vocab.js";

export { ChainDrafter } from "./chain.js";
export type { DraftBackend, DraftResult, Picker, Sampling } from "./chain.js";

// how many of the likeliest tokens a coupled pick asks llama.cpp for (see DraftModel.eval)
const TOP_K = 8192;

let llamaPromise: Promise<Llama> | null = null;

function llama(): Promise<Llama> {
  // build "never": only the prebuilt CPU binary of @node-llama-cpp/linux-x64 (nothing is compiled or fetched)
  llamaPromise ??= getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error, progressLogs: false });
  return llamaPromise;
}

/** The model's tokenizer and vocabulary, without its weights when `vocabOnly` (cloud-only needs no drafter). */
export class DraftModel implements DraftBackend {
  private sequence: LlamaContextSequence | null = null;
  private context: LlamaContext | null = null;
  held: number[] = []; // the tokens the KV sequence holds, in order
  evals = 0; // model passes run
  fallbacks = 0; // coupled picks that needed the whole distribution
  threads = 0; // the CPU threads its context computes with (0: a vocabulary-only model)

  private constructor(readonly model: LlamaModel, readonly vocab: Vocab, readonly path: string) {}

  static async load(path: string, opts: { vocabOnly?: boolean; nCtx?: number; threads?: number } = {}): Promise<DraftModel> {
    const vocab = new Vocab(readGgufMetadata(path));
    const l = await llama();
    const model = await l.loadModel({ modelPath: path, vocabOnly: opts.vocabOnly ?? false, gpuLayers: 0 });
    const d = new DraftModel(model, vocab, path);
    if (!opts.vocabOnly) {
      // threads: every core, as the Python edge's drafter takes them (ACESPEC_THREADS overrides both)
      const threads = opts.threads ?? (Number(process.env.ACESPEC_THREADS) || availableParallelism());
      d.context = await model.createContext({
        contextSize: opts.nCtx ?? 4096, batchSize: 256, sequences: 1, flashAttention: true,
        threads: { ideal: threads, min: threads },
      });
      d.threads = threads;
      d.sequence = d.context.getSequence();
    }
    return d;
  }

  get fingerprint(): string {
    return this.vocab.fingerprint;
  }

  /** Token ids of `text` as the Python edge's tokenizer gives them (no BOS; `special`: parse special tokens). */
  encode(text: string, special = false): number[] {
    return Array.from(this.model.tokenize(text, special), Number);
  }

  /** The prompt for one user message through the GGUF's chat template, as the Python edge builds it. */
  chatPrompt(text: string): number[] {
    const messages = [{ role: "user", content: text }];
    const tpl = this.vocab.chatTemplate;
    if (!tpl) return this.encode(text + "\n", true);
    const rendered = new Template(tpl).render({
      messages, add_generation_prompt: true, eos_token: this.vocab.special(this.vocab.eosId),
      bos_token: this.vocab.special(this.vocab.bosId),
    });
    return this.encode(rendered, true);
  }

  private seq(): LlamaContextSequence {
    if (this.sequence === null) throw new Error("this drafter was loaded without weights (vocabOnly)");
    return this.sequence;
  }

  /** Roll the KV sequence back to the longest prefix of `tokens` it holds; returns that length. */
  async sync(tokens: readonly number[]): Promise<number> {
    const held = this.held;
    const m = sharedPrefix(held, tokens);
    if (m < held.length) {
      await this.seq().eraseContextTokenRanges([{ start: m, end: held.length }]);
      held.length = m;
    }
    return m;
  }

  /** Evaluate `tokens` after what the sequence holds; with `picker`, the token chosen after the last one. */
  async eval(tokens: readonly number[], picker: Picker | null): Promise<number | null> {
    if (tokens.length === 0) return null;
    const pos = this.held.length + tokens.length; // the absolute position of the token to pick
    if (picker === null) {
      await this.evaluate(tokens, null);
      return null;
    }
    const sp = picker.sampling;
    if (picker.mode !== "coupled" || sp.temperature <= 0) {
      const next = await this.evaluate(tokens, { temperature: 0, topK: 0, topP: 1, minP: 0 }, false);
      if (next?.token == null) throw new Error("the drafter produced no token");
      return next.token;
    }
    // Coupled: argmax(log q + g) over the whole vocabulary. llama.cpp hands over the TOP_K likeliest
    // tokens cheaply (their q renormalised over them, which shifts every log q alike); a token outside
    // them has q <= the smallest inside, so if even the largest noise among them cannot lift that q past
    // the best score inside, the argmax is inside. Otherwise (rare) the position is evaluated again with
    // the whole distribution.
    const k = sp.topK > 0 ? Math.min(sp.topK, TOP_K) : TOP_K;
    const opts = { temperature: sp.temperature, topK: k, topP: sp.topP, minP: 0 };
    const top = (await this.evaluate(tokens, opts, true))?.probabilities;
    if (top === undefined) throw new Error("the drafter produced no distribution");
    const x = coupledTop(top, this.vocab.size, picker.seed, pos, sp.topK > 0 && sp.topK <= TOP_K);
    if (x !== null) return x;
    this.fallbacks++;
    const last = this.held.length - 1;
    await this.seq().eraseContextTokenRanges([{ start: last, end: this.held.length }]);
    this.held.length = last;
    const full = (await this.evaluate(tokens.slice(-1), { ...opts, topK: sp.topK }, true))?.probabilities;
    if (full === undefined) throw new Error("the drafter produced no distribution");
    const dense = new Float64Array(this.vocab.size);
    for (const [tok, p] of full) dense[tok] = p;
    return coupledSample(dense, picker.seed, pos);
  }

  private async evaluate(tokens: readonly number[], options: object | null, probabilities = false) {
    const last = tokens[tokens.length - 1] as Token;
    const input = [
      ...(tokens.slice(0, -1) as Token[]),
      options === null ? last : ([last, { generateNext: { token: !probabilities, probabilities, options } }] as const),
    ];
    const out = await this.seq().controlledEvaluate(input as Parameters<LlamaContextSequence["controlledEvaluate"]>[0]);
    this.held.push(...tokens);
    this.evals++;
    return out[tokens.length - 1]?.next;
  }

  async dispose(): Promise<void> {
    await this.context?.dispose();
    await this.model.dispose();
  }
}
