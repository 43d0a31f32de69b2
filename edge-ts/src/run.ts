// A generation through the cloud in any of the modes below, with any drafter model (chain.ts's
// DraftBackend) and any transport (the ConnectConfig's connector): the Node edge runs it through
// modes.ts, a browser page through web/page.ts. Nothing here depends on Node.
//
// - cloud-only: no drafting; the cloud generates and streams TOKENS.
// - cloud-led:  the cloud streams as in cloud-only without ever waiting; the edge follows and uploads drafts
//               ahead of the stream (follow.ts). `auto` is this mode: on the wire it is cloud-led, and the
//               stream's first token never waits for the drafter's prefill. By default auto has a
//               contention guard (contention.ts): the drafter joins once the first token is here and
//               rests while its work slows the cloud's steps (an edge sharing the cloud's cores).
// - sync:       stop-and-wait: draft K tokens, send a DRAFT, wait for its VERDICT, repeat.
// - pipelined:  edge-led with `window` blocks in flight (pipelined.ts).

import { ChainDrafter, DraftBackend, Picker } from "./chain.js";
import { DraftGuard, FOLLOW_DEFAULTS, FollowLoop } from "./follow.js";
import { pipelinedLoop } from "./pipelined.js";
import { CloudSession, ConnectConfig, EdgeError } from "./session.js";
import { RunResult, RunStats } from "./stats.js";
import { ErrorCode, FrameType, hello, Mode } from "./wire/frames.js";

export const MODES = ["auto", "cloud-led", "cloud-only", "sync", "pipelined"] as const;
export type EdgeMode = (typeof MODES)[number];
export const RULES = ["greedy", "coupled"] as const;
export type RuleName = (typeof RULES)[number];

export interface EdgeConfig {
  mode: EdgeMode;
  rule: RuleName;
  k: number; // sync, pipelined: draft tokens per block
  window: number; // pipelined: blocks in flight
  temperature: number;
  topK: number;
  topP: number;
  seed: bigint;
  maxTokens: number;
  connect: ConnectConfig;
  contentionGuard?: boolean; // auto: rest the drafter while its work slows the cloud's steps (default true)
}

/** One generation through the cloud. `model` is the drafter (its tokenizer fingerprint names the vocabulary).
 * `guard`: in auto, what earlier runs learned of whether drafting slows this cloud (one guard shared across
 * runs); without one, auto makes a fresh one with `freshGuard` unless `cfg.contentionGuard` is false (no
 * `freshGuard`: auto runs without a guard). A run the guard would
 * rest the drafter through opens as a cloud-only session: nothing of the cloud-led path runs for drafts
 * that will not come, and its steps count towards the rest. */
export async function runSession(model: DraftBackend, prompt: number[], cfg: EdgeConfig,
  onTokens: ((t: number[]) => void) | null = null, guard: DraftGuard | null = null,
  freshGuard: ((model: DraftBackend) => DraftGuard) | null = null): Promise<RunResult> {
  const auto = cfg.mode === "auto";
  const g = !auto ? null : guard ?? (cfg.contentionGuard === false || freshGuard === null ? null : freshGuard(model));
  const plain = g !== null && g.resting >= cfg.maxTokens && cfg.maxTokens > 0;
  const wireMode = cfg.mode === "cloud-only" || plain ? Mode.CLOUD_ONLY
    : cfg.mode === "sync" || cfg.mode === "pipelined" ? Mode.SPECULATIVE : Mode.CLOUD_LED;
  const h = hello({
    model_id: model.fingerprint, max_tokens: cfg.maxTokens, prompt, auth: cfg.connect.token, temperature: cfg.temperature,
    top_k: cfg.topK, top_p: cfg.topP, rule: cfg.rule, seed: cfg.seed, mode: wireMode,
  });
  const t0 = performance.now();
  let drafter: ChainDrafter | null = null;
  let prefill: Promise<void> | null = null;
  if (cfg.mode !== "cloud-only" && !plain && cfg.maxTokens > 0) {
    const picker: Picker = {
      mode: cfg.rule === "coupled" && cfg.temperature > 0 ? "coupled" : "greedy", seed: cfg.seed,
      sampling: { temperature: cfg.temperature, topK: cfg.topK, topP: cfg.topP },
    };
    drafter = new ChainDrafter(model, picker);
    if (g === null) {
      // the handshake is a round trip of waiting: the drafter prefills the prompt meanwhile (with a guard it
      // joins after the first token, as the guard's baseline is the cloud's steps with the drafter idle)
      prefill = drafter.prefill(prompt);
      prefill.catch(() => undefined); // awaited below; this only keeps an early failure from going unhandled
    }
  }
  let session: CloudSession;
  try {
    session = await CloudSession.open(cfg.connect, h);
  } catch (e) {
    await prefill?.catch(() => undefined);
    throw e;
  }
  try {
    let res: RunResult;
    if (cfg.maxTokens === 0) {
      // nothing to generate: the WELCOME was the cloud's whole answer (a cloud may add an empty FINISHED
      // TOKENS frame, an older one sends nothing more, so there is nothing to wait for)
      const stats = new RunStats();
      stats.wallS = (performance.now() - t0) / 1000;
      res = { tokens: [], stats, finished: true };
    } else if (drafter === null) {
      res = await cloudOnly(session, prompt, t0, onTokens);
      if (plain) {
        g!.skip(res.tokens.length);
        Object.assign(res.stats.extra, { drafter_joined_at: null, contention_rests: 0, streamed_plain: true });
      }
    } else if (cfg.mode === "sync") {
      await prefill;
      res = await syncLoop(session, prompt, drafter, cfg, t0, onTokens);
    } else if (cfg.mode === "pipelined") {
      await prefill;
      res = await pipelinedLoop(session, prompt, drafter, cfg, t0, onTokens);
    } else {
      const follow = { ...FOLLOW_DEFAULTS, maxTokens: cfg.maxTokens, maxLead: Math.min(FOLLOW_DEFAULTS.maxLead, session.maxDraftTokens) };
      // the stream starts as soon as the cloud has the prompt: the prefill goes on beside the loop
      res = await new FollowLoop(session, prompt, drafter, follow, onTokens, prefill, { lateJoin: g !== null, guard: g }).run(t0);
    }
    [res.stats.bytesUp, res.stats.bytesDown] = session.totalBytes();
    Object.assign(res.stats.extra, { reconnects: session.reconnects, recoveries: session.recoveries, busy_waits: session.busyWaits,
      drafter_fallbacks: model.fallbacks });
    return res;
  } finally {
    await prefill?.catch(() => undefined);
    await session.close();
  }
}

function deliver(stats: RunStats, fresh: number[], t0: number, onTokens: ((t: number[]) => void) | null): void {
  if (!fresh.length) return;
  const now = (performance.now() - t0) / 1000;
  if (stats.emitted === 0) stats.ttftS = now;
  stats.emitted += fresh.length;
  for (let i = 0; i < fresh.length; i++) stats.tokenTimes.push(now);
  onTokens?.(fresh);
}

export async function cloudOnly(session: CloudSession, prompt: number[], t0: number,
  onTokens: ((t: number[]) => void) | null): Promise<RunResult> {
  const stats = new RunStats();
  const out: number[] = [];
  let finished = false;
  while (!finished) {
    const a = await session.link.next(session.cfg.replyTimeoutMs);
    const f = a?.frame ?? null;
    if (f !== null && f.type === FrameType.TOKENS) {
      const committed = prompt.length + out.length;
      if (Number(f.start) > committed) throw new EdgeError(`cloud streamed from ${f.start}, the edge holds ${committed}`);
      const fresh = f.tokens.slice(committed - Number(f.start));
      out.push(...fresh);
      stats.rounds += fresh.length;
      deliver(stats, fresh, t0, onTokens);
      finished = f.finished;
    } else if (f !== null && f.type === FrameType.ERROR) {
      throw new EdgeError(`cloud error ${ErrorCode[f.code]}: ${f.message}`, f.code);
    } else if (f === null) { // silence past the reply timeout, or the connection ended: resume
      await session.resume([...prompt, ...out]); // the cloud goes on streaming from what we have
    }
  }
  stats.wallS = (performance.now() - t0) / 1000;
  return { tokens: out, stats, finished };
}

async function syncLoop(session: CloudSession, prompt: number[], drafter: ChainDrafter, cfg: EdgeConfig, t0: number,
  onTokens: ((t: number[]) => void) | null): Promise<RunResult> {
  const stats = new RunStats();
  const committed = [...prompt];
  // a block must stay within what the cloud said it takes (WELCOME.max_draft_tokens)
  const k = Math.max(1, Math.min(cfg.k, session.maxDraftTokens - 1));
  let seq = 0, finished = false;
  while (!finished) {
    const d = await drafter.draft(committed, k);
    stats.draftS += d.seconds;
    stats.draftTokens += d.tokens.length;
    seq += 1;
    session.link.send({ type: FrameType.DRAFT, session: session.sid, seq, base: committed.length, tokens: d.tokens, q: null, parents: null });
    for (;;) { // until this block's verdict, or a resume that makes it void
      const a = await session.link.next(session.cfg.replyTimeoutMs);
      const f = a?.frame ?? null;
      if (f === null) {
        await session.resume(committed);
        break; // the block died with the connection: draft again from the committed text
      }
      if (f.type === FrameType.ERROR) throw new EdgeError(`cloud error ${ErrorCode[f.code]}: ${f.message}`, f.code);
      if (f.type !== FrameType.VERDICT) continue; // PONG, CLOSE(GOING_AWAY) before the end of the stream
      if (Number(f.seq) !== seq) continue; // a verdict for a block sent before a resume
      if (f.dropped) {
        stats.dropped += 1;
        finished = f.finished;
        break;
      }
      const emitted = [...d.tokens.slice(0, f.accepted), f.next_token];
      committed.push(...emitted);
      if (committed.length !== Number(f.committed)) {
        throw new EdgeError(`edge and cloud disagree on the committed length (${committed.length} vs ${f.committed})`);
      }
      stats.observeBlock(d.tokens.length, f.accepted);
      stats.verifyS += Number(f.verify_us) / 1e6;
      deliver(stats, emitted, t0, onTokens);
      finished = f.finished;
      break;
    }
  }
  stats.wallS = (performance.now() - t0) / 1000;
  return { tokens: committed.slice(prompt.length), stats, finished };
}
