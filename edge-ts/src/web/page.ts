// The browser edge's page: the TypeScript edge's session logic (run.ts) in a browser, drafting with the
// default drafter's GGUF in WebAssembly (wllama.ts), talking to the cloud over a WebSocket (ws.ts).
// web/index.html loads this bundle. Its query names the run, and `run=1` starts it at once:
//   ws        the cloud's WebSocket URL (`acespec serve --ws-port`), e.g. ws://127.0.0.1:7071/
//   gguf      the drafter GGUF's URL (the same file `acespec models install` puts in place)
//   prompt    the prompt's token ids, comma-separated; or `text`, which the drafter's tokenizer splits
//   chat      `1`: `text` is one user turn in the target's chat template (the cloud's /tokenize?chat=1
//             builds the ids, as the edge's API does for a chat), so an instruct model answers it
//   mode      cloud-led (default), sync, pipelined (edge-led with `window` blocks in flight) or cloud-only
//   rule      greedy (default) or coupled; temperature (default 0: greedy), seed (default 0), top_k (0: off),
//             top_p (1: off): the session's sampling, which the cloud samples with and the drafter follows
//   max_tokens (default 32), k (sync, pipelined: draft tokens per block, default 4), window (pipelined:
//             blocks in flight, default 2), token (the tenant's auth token)
//   wasm      wllama's single-thread wllama.wasm (default: beside the page)
//   prefill   `first`: the drafter reads the prompt before the session opens, so in cloud-led mode it
//             starts drafting with the stream's first token instead of catching up with the stream (a
//             WebAssembly drafter's prefill can outlast a short answer); the result's prefill_s is what it
//             cost, and ttft_s counts from the session's start, after it. Default: as the Node edge does,
//             the prefill runs beside the handshake and, in cloud-led mode, beside the stream.
// The text streams into #output; the result (text, tokens, drafted, accepted, target_passes, tok_s, ...)
// lands on window.acespecResult and in #output's data-result, with data-state loading/running/done/error.

import { EdgeConfig, EdgeMode, RULES, RuleName, runSession } from "../run.js";
import { connectConfigWith } from "../session.js";
import { runJson, RunJson } from "../stats.js";
import { WllamaDraftModel } from "./wllama.js";
import { wsConnector } from "./ws.js";

const PAGE_MODES: EdgeMode[] = ["cloud-led", "sync", "pipelined", "cloud-only"];

export interface PageResult extends RunJson {
  prompt: number[]; // the prompt's ids as sent (?text= split by the drafter's tokenizer, or by the cloud's chat template)
  passes_per_token: number;
  acceptance: number;
  model_id: string;
  load_s: number;
  prefill_s: number | null; // the drafter's prefill before the session (prefill=first), else null
  drafter_evals: number;
}

declare global {
  interface Window {
    acespecResult?: PageResult;
    acespecError?: string;
  }
}

class PageError extends Error {}

function param(q: URLSearchParams, name: string): string {
  const v = q.get(name);
  if (v === null || v === "") throw new PageError(`the page needs ?${name}=`);
  return v;
}

function intParam(q: URLSearchParams, name: string, dflt: number): number {
  const v = q.get(name);
  if (v === null || v === "") return dflt;
  const n = Number(v);
  if (!Number.isInteger(n) || n < 0) throw new PageError(`?${name}= must be a whole number, got ${JSON.stringify(v)}`);
  return n;
}

/** `text` as one user turn in the target's chat template: the ids the cloud's WebSocket port gives
 * (`/tokenize?chat=1`, on the same host and port as `ws`), since wllama's tokenizer knows no template. */
async function chatPrompt(ws: URL, text: string): Promise<number[]> {
  const http = new URL(`/tokenize?chat=1&text=${encodeURIComponent(text)}`, ws.href.replace(/^ws/, "http"));
  const r = await fetch(http);
  const body = await r.json();
  if (!r.ok || !Array.isArray(body.ids)) throw new PageError(`the cloud's /tokenize?chat=1 answered ${r.status}: ${body.error ?? "no ids"}`);
  return body.ids as number[];
}

function numParam(q: URLSearchParams, name: string, dflt: number, ok: (v: number) => boolean, what: string): number {
  const v = q.get(name);
  if (v === null || v === "") return dflt;
  const n = Number(v);
  if (!Number.isFinite(n) || !ok(n)) throw new PageError(`?${name}= must be ${what}, got ${v}`);
  return n;
}

async function run(q: URLSearchParams, out: HTMLElement, status: HTMLElement): Promise<PageResult> {
  const mode = (q.get("mode") || "cloud-led") as EdgeMode;
  if (!PAGE_MODES.includes(mode)) throw new PageError(`?mode= must be one of ${PAGE_MODES.join(", ")}, got ${mode}`);
  const wsUrl = param(q, "ws");
  const ggufUrl = param(q, "gguf");
  const maxTokens = intParam(q, "max_tokens", 32);
  const k = intParam(q, "k", 4);
  const inFlight = intParam(q, "window", 2);
  if (k < 1 || inFlight < 1) throw new PageError(`?k= and ?window= must be at least 1, got ${k} and ${inFlight}`);
  const rule = (q.get("rule") || "greedy") as RuleName;
  if (!RULES.includes(rule)) throw new PageError(`?rule= must be one of ${RULES.join(", ")}, got ${rule}`);
  const temperature = numParam(q, "temperature", 0, (v) => v >= 0, "a number >= 0");
  const topK = intParam(q, "top_k", 0);
  const topP = numParam(q, "top_p", 1, (v) => v > 0 && v <= 1, "a number in (0, 1]");
  const seedText = q.get("seed") || "0";
  if (!/^\d+$/.test(seedText) || BigInt(seedText) >= 1n << 64n) throw new PageError(`?seed= must be an integer in 0..2**64-1, got ${seedText}`);
  const url = new URL(wsUrl, location.href);
  const t0 = performance.now();
  status.textContent = "loading the drafter";
  const model = await WllamaDraftModel.load(ggufUrl, {
    wasmUrl: new URL(q.get("wasm") || "wllama.wasm", location.href).href,
    onProgress: (loaded, total) => {
      status.textContent = `loading the drafter: ${(loaded / 2 ** 20).toFixed(0)}${total ? ` of ${(total / 2 ** 20).toFixed(0)}` : ""} MiB`;
    },
  });
  const loadS = (performance.now() - t0) / 1000;
  const text = q.get("text");
  const chat = q.get("chat") || "0";
  if (chat !== "0" && chat !== "1") throw new PageError(`?chat= must be 0 or 1, got ${chat}`);
  const prompt = q.get("prompt") ? param(q, "prompt").split(",").map((s) => {
    const n = Number(s);
    if (!Number.isInteger(n) || n < 0 || n >= model.vocab.size) throw new PageError(`?prompt= holds ${JSON.stringify(s)}, not a token id`);
    return n;
  }) : text === null ? [] : chat === "1" ? await chatPrompt(url, text) : await model.encode(text);
  if (!prompt.length) throw new PageError("the page needs ?prompt= (token ids) or ?text=");
  const cfg: EdgeConfig = {
    mode, rule, k, window: inFlight, temperature, topK, topP, seed: BigInt(seedText), maxTokens,
    connect: connectConfigWith(wsConnector(url.href), {
      host: url.hostname, port: Number(url.port) || (url.protocol === "wss:" ? 443 : 80),
      token: new TextEncoder().encode(q.get("token") ?? ""),
    }),
  };
  let prefillS: number | null = null;
  const prefill = q.get("prefill") || "beside";
  if (prefill !== "first" && prefill !== "beside") throw new PageError(`?prefill= must be first or beside, got ${prefill}`);
  if (prefill === "first" && mode !== "cloud-only") {
    status.textContent = "the drafter reads the prompt";
    const t = performance.now();
    await model.eval(prompt.slice(0, -1), null); // what the run's own prefill would do: it then finds it done
    prefillS = (performance.now() - t) / 1000;
  }
  status.textContent = `${mode}: generating`;
  out.dataset.state = "running";
  const decoder = new TextDecoder();
  let shown = "";
  const res = await runSession(model, prompt, cfg, (fresh) => {
    shown += decoder.decode(model.decodeBytes(fresh), { stream: true });
    out.textContent = shown;
  });
  shown += decoder.decode();
  out.textContent = shown;
  const s = res.stats;
  const r4 = (x: number): number => Math.round(x * 1e4) / 1e4;
  const result: PageResult = {
    ...runJson(res, shown, mode, cfg.rule), prompt, passes_per_token: r4(s.targetPassesPerToken),
    acceptance: r4(s.acceptanceRate), model_id: model.fingerprint, load_s: r4(loadS),
    prefill_s: prefillS === null ? null : r4(prefillS), drafter_evals: model.evals,
  };
  await model.dispose();
  status.textContent = `${mode}: ${s.emitted} tokens at ${result.tok_s} tok/s, ${s.accepted} of ${s.drafted} drafted accepted`;
  return result;
}

function main(): void {
  const q = new URLSearchParams(location.search);
  const out = document.getElementById("output")!;
  const status = document.getElementById("status")!;
  const form = document.getElementById("form") as HTMLFormElement;
  for (const [k, v] of q) {
    const input = form.elements.namedItem(k);
    if (input instanceof HTMLInputElement || input instanceof HTMLSelectElement) input.value = v;
  }
  const start = (params: URLSearchParams): void => {
    out.dataset.state = "loading";
    out.textContent = "";
    run(params, out, status).then((result) => {
      window.acespecResult = result;
      out.dataset.result = JSON.stringify(result);
      out.dataset.state = "done";
    }, (e: unknown) => {
      const msg = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
      window.acespecError = msg;
      status.textContent = msg;
      out.dataset.error = msg;
      out.dataset.state = "error";
    });
  };
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const params = new URLSearchParams();
    for (const el of Array.from(form.elements)) {
      if ((el instanceof HTMLInputElement || el instanceof HTMLSelectElement) && el.name && el.value) params.set(el.name, el.value);
    }
    start(params);
  });
  if (q.get("run") === "1") start(q);
}

main();
