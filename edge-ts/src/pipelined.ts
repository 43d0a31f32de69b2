// The edge-led pipelined mode (acespec/loop/loop.py, without the state cache or branches): the edge keeps
// drafting past a block it has sent and sends the next one without waiting for its verdict, up to
// `window` blocks in flight. A later block assumes the blocks before it are accepted in full: it starts
// at the committed length they would leave less one, and its first token is the drafter's guess of the
// previous block's bonus token (the overlap the cloud checks). The cloud verifies a block only if what it
// assumes was committed, and drops it otherwise; a verdict that parts from the edge's assumptions sends
// the edge back to drafting from the committed text, and the blocks still in flight are doomed (the
// cloud drops them) and no longer hold the window.

import { CloudSession, EdgeError } from "./session.js";
import { ChainDrafter } from "./chain.js";
import { RunResult, RunStats } from "./stats.js";
import { ErrorCode, FrameType } from "./wire/frames.js";

interface Block {
  seq: number;
  base: number; // committed length tokens[0] follows
  tokens: number[];
  doomed: boolean; // built on assumptions a verdict has since refuted
}

export async function pipelinedLoop(session: CloudSession, prompt: number[], drafter: ChainDrafter,
  opts: { k: number; window: number }, t0: number, onTokens: ((t: number[]) => void) | null): Promise<RunResult> {
  const stats = new RunStats();
  const committed = [...prompt];
  let spec = [...prompt]; // committed + the tokens the live blocks in flight assume
  const inflight: Block[] = [];
  // a block is K tokens and, after a live one, the guessed bonus before them: within WELCOME.max_draft_tokens
  const k = Math.max(1, Math.min(opts.k, session.maxDraftTokens - 1));
  let seq = 0, finished = false;
  const live = (): Block[] => inflight.filter((b) => !b.doomed);
  while (!finished) {
    while (live().length < opts.window) {
      const overlap = live().length ? 1 : 0;
      const d = await drafter.draft(spec, k + overlap);
      stats.draftS += d.seconds;
      stats.draftTokens += d.tokens.length;
      seq += 1;
      const block = { seq, base: spec.length, tokens: d.tokens, doomed: false };
      session.link.send({ type: FrameType.DRAFT, session: session.sid, seq, base: block.base, tokens: block.tokens, q: null, parents: null });
      inflight.push(block);
      spec.push(...d.tokens);
    }
    const a = await session.link.next(session.cfg.replyTimeoutMs);
    const f = a?.frame ?? null;
    if (f === null) { // the blocks in flight died with the connection: resume, and draft again from the committed text
      await session.resume(committed);
      inflight.length = 0;
      spec = [...committed];
      continue;
    }
    if (f.type === FrameType.ERROR) throw new EdgeError(`cloud error ${ErrorCode[f.code]}: ${f.message}`, f.code);
    if (f.type !== FrameType.VERDICT) continue; // PONG, CLOSE(GOING_AWAY) before the end of the stream
    const block = inflight.shift();
    if (block === undefined || Number(f.seq) !== block.seq) {
      throw new EdgeError(`verdict for block ${f.seq} arrived while block ${block?.seq} was expected`);
    }
    finished = f.finished;
    if (f.dropped) {
      stats.dropped += 1;
      if (!block.doomed) { // a block we still counted on: start again from the committed text
        spec = [...committed];
        for (const b of inflight) b.doomed = true;
      }
      continue;
    }
    const o = committed.length - block.base;
    const fresh = block.tokens.slice(o);
    const emitted = [...fresh.slice(0, f.accepted), f.next_token];
    committed.push(...emitted);
    if (committed.length !== Number(f.committed)) {
      throw new EdgeError(`edge and cloud disagree on the committed length (${committed.length} vs ${f.committed})`);
    }
    stats.observeBlock(fresh.length, f.accepted);
    stats.verifyS += Number(f.verify_us) / 1e6;
    const now = (performance.now() - t0) / 1000;
    if (stats.emitted === 0) stats.ttftS = now;
    stats.emitted += emitted.length;
    for (let i = 0; i < emitted.length; i++) stats.tokenTimes.push(now);
    onTokens?.(emitted);
    // keep speculating only while the assumptions still extend what was committed
    const n = committed.length;
    if (spec.length < n || spec.slice(0, n).some((t, i) => t !== committed[i])) {
      spec = [...committed];
      for (const b of inflight) b.doomed = true;
    }
  }
  stats.wallS = (performance.now() - t0) / 1000;
  return { tokens: committed.slice(prompt.length), stats, finished };
}
