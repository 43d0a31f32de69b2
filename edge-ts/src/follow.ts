// The edge side of a cloud-led session (a port of acespec/loop/follow.py, without branches): follow the
// cloud's token stream and draft ahead of it.
//
// The cloud decodes without waiting and streams each step's tokens (TOKENS with HAS_STEP). The edge keeps
// a *chain*, its drafter's guess of the tokens after everything it has seen streamed, drafts it ahead a
// few tokens at a time and uploads it as a DRAFT keyed by the committed length it follows (`base`). A
// streamed token equal to the chain's head pops it (the drafter's KV already holds it); the first one that
// differs breaks the chain, and drafting restarts after the new committed tokens. The cloud checks a draft
// against what it committed since the draft's base, so a chain built before the edge saw the latest
// tokens still counts: that hides the uplink's half round trip. Nothing waits for the drafter: its long
// calls (the prompt's prefill, catching up after a rest) run beside the loop, which meanwhile goes on
// handing the stream's tokens to the user.
//
// With a contention guard (contention.ts's ContentionGuard) the drafter works only while the guard lets
// it: where the edge shares cores with the cloud, its work slows the cloud's steps more than its drafts
// can win back. Each step tells the guard whether the drafter worked while the cloud computed it; a
// resting drafter leaves the loop blocking on the stream, as the guard changes only at a step.
//
// Nothing here depends on Node: a browser runs the same loop.

import { CloudSession, EdgeError } from "./session.js";
import { ChainDrafter } from "./chain.js";
import { RunResult, RunStats } from "./stats.js";
import { ErrorCode, FrameType } from "./wire/frames.js";

export class StreamError extends Error {}

/** What the loop asks of a contention guard (contention.ts's ContentionGuard, in Node). */
export interface DraftGuard {
  readonly rests: number; // rests so far
  readonly resting: number; // steps left in the current rest
  mayDraft(): boolean;
  skip(steps: number): void; // steps of a session the drafter sat out (cloud-only)
  step(verifyS: number, busy: boolean, plain?: boolean, first?: boolean): void;
}

interface Step {
  start: number;
  tokens: number[];
  finished: boolean;
  drafted: number;
  accepted: number;
  verifyS: number;
  arrived: number; // ms, performance.now()
}

type Disconnected = { disconnected: string };

export interface FollowConfig {
  maxTokens: number;
  maxLead: number; // most tokens the chain runs ahead of the stream (<= the server's max_draft_tokens)
  chunk: number; // tokens drafted between looks at the stream
  resend: number; // upload the chain again once it has grown by this many tokens
  priorRttS: number; // round trip assumed until the link measures one
  idleAfter: number; // steps that could have verified a draft of ours and did not, before the uplink backs off
  idleGapMax: number;
  catchUpAfter: number; // stream tokens the drafter may lag by before it catches up beside the loop
  pollMs: number; // how often the loop looks for a finished job while the stream is quiet
  pingEveryMs: number;
}

export const FOLLOW_DEFAULTS: Omit<FollowConfig, "maxTokens"> = {
  maxLead: 24, chunk: 2, resend: 2, priorRttS: 0.1, idleAfter: 16, idleGapMax: 64, catchUpAfter: 16, pollMs: 5,
  pingEveryMs: 1000,
};

/** How far ahead of the stream to keep the chain: the tokens the cloud commits while a draft travels up,
 * plus the depth worth verifying at the measured acceptance. */
class LeadDepth {
  accept = 0.7;
  rate = 0; // committed tokens per second (EWMA)
  constructor(private cfg: FollowConfig) {}

  observe(c: Step, gapS: number | null): void {
    if (c.drafted) this.accept = 0.8 * this.accept + 0.2 * (c.accepted / c.drafted);
    if (gapS && gapS > 0) {
      const r = c.tokens.length / gapS;
      this.rate = this.rate === 0 ? r : 0.8 * this.rate + 0.2 * r;
    }
  }

  target(rttS: number | null): number {
    const rtt = rttS ?? this.cfg.priorRttS;
    const transit = Math.ceil(this.rate * rtt) + 1;
    const a = Math.min(Math.max(this.accept, 1e-3), 0.999);
    const worth = Math.ceil(Math.log(0.1) / Math.log(a));
    return Math.max(1, Math.min(this.cfg.maxLead, transit + worth));
  }
}

/** Whether to draft and upload now: after `idleAfter` telling steps with none of our drafts verified, one
 * short draft per `gap` steps, the gap doubling up to `gapMax` (Python's UplinkBackoff). */
class UplinkBackoff {
  ignored = 0;
  gap = 0;
  since = 0;
  sentAny = false;
  constructor(private idleAfter: number, private gapMax: number) {}

  /** `kept`: of the `drafted` tokens the step verified, how many the cloud kept; a draft rejected whole
   * (a probe) leaves the uplink resting. */
  step(drafted: number, telling: boolean, kept: number): void {
    this.since += 1;
    if (drafted && kept > 0) {
      this.ignored = 0;
      this.gap = 0;
    } else if (this.sentAny && telling) {
      this.ignored += 1;
      if (this.ignored >= this.idleAfter && !this.gap) {
        this.gap = this.idleAfter;
        this.since = 0;
      }
    }
  }

  maySend(): boolean {
    return !this.gap || this.since >= this.gap;
  }

  sent(): void {
    if (this.gap) this.gap = Math.min(2 * this.gap, this.gapMax);
    this.sentAny = true;
    this.since = 0;
  }
}

/** A cloud-led session's link: steps down, drafts up, PINGs for the round trip. */
class LeadLink {
  private rtt: number | null = null; // seconds
  private pinged = 0;
  private seq = 0;
  constructor(readonly s: CloudSession, private pingEveryMs: number) {}

  rttS(): number | null {
    return this.rtt;
  }

  sendDraft(base: number, tokens: number[]): void {
    this.seq += 1;
    this.s.link.send({ type: FrameType.DRAFT, session: this.s.sid, seq: this.seq, base, tokens, q: null, parents: null });
  }

  async recv(timeoutMs: number | null): Promise<Step | Disconnected | null> {
    const now = performance.now();
    if (now - this.pinged >= this.pingEveryMs) {
      this.pinged = now;
      // sent_us on the edge's own monotonic clock: the PONG echoes it back
      this.s.link.send({ type: FrameType.PING, nonce: this.seq, sent_us: Math.floor(now * 1000) });
    }
    const deadline = now + (timeoutMs ?? this.s.cfg.replyTimeoutMs);
    for (;;) {
      const a = await this.s.link.next(Math.max(0, deadline - performance.now()));
      if (a === null) return timeoutMs === null ? { disconnected: "no step within the reply timeout" } : null;
      const f = a.frame;
      if (f === null) return { disconnected: (a as { error: Error | null }).error?.message ?? "connection closed" };
      if (f.type === FrameType.TOKENS) {
        return {
          start: Number(f.start), tokens: f.tokens, finished: f.finished, drafted: f.drafted ?? 0, accepted: Number(f.accepted),
          verifyS: Number(f.verify_us) / 1e6, arrived: a.t,
        };
      }
      if (f.type === FrameType.PONG) {
        const rtt = Math.max(0, (a.t - Number(f.sent_us) / 1000) / 1000);
        this.rtt = this.rtt === null ? rtt : 0.7 * this.rtt + 0.3 * rtt;
      } else if (f.type === FrameType.ERROR) {
        throw new EdgeError(`cloud error ${ErrorCode[f.code]}: ${f.message}`, f.code);
      }
      // CLOSE(GOING_AWAY) is followed by the end of the stream
    }
  }
}

export class FollowLoop {
  readonly stats = new RunStats();
  private committed: number[];
  private chain: number[] = [];
  private depth: LeadDepth;
  private uplink: UplinkBackoff;
  private link: LeadLink;
  private gen = 0; // the chain's generation: a break starts a new one
  private sentGen = -1;
  private sentEnd = 0;
  private upGen = -1;
  private upAt = 0;
  private job: Promise<void> | null = null; // drafter work beside the loop; while it runs the loop leaves the drafter alone
  private jobDone = false;
  private jobError: unknown = null;
  private lastArrival: number | null = null;
  private t0 = 0;
  private readonly guard: DraftGuard | null;
  // when the drafter last worked, and when the two steps before the latest arrived (ms, performance.now())
  private workedAt = -Infinity;
  private arrivals = [-Infinity, -Infinity];
  private joined: boolean; // whether the drafter's KV holds (or is being given) the text so far
  drafts = 0;
  chainBreaks = 0;
  catchUps = 0;
  joinedAt: number | null = null; // tokens streamed when the drafter joined late

  /** `job`: the drafter's prefill, started while the handshake was in flight. `lateJoin`: the drafter has
   * not seen the prompt; the loop prefills it beside the stream once the first token is here (and the
   * guard lets it work), so its prefill never competes with the cloud's for a first token. `guard`: rests
   * the drafter while its work slows the cloud's steps (contention.ts). */
  constructor(session: CloudSession, private prompt: number[], private drafter: ChainDrafter, private cfg: FollowConfig,
    private onTokens: ((t: number[]) => void) | null, job: Promise<void> | null,
    opts: { lateJoin?: boolean; guard?: DraftGuard | null } = {}) {
    this.committed = [...prompt];
    this.depth = new LeadDepth(cfg);
    this.uplink = new UplinkBackoff(cfg.idleAfter, cfg.idleGapMax);
    this.link = new LeadLink(session, cfg.pingEveryMs);
    this.guard = opts.guard ?? null;
    this.joined = !opts.lateJoin;
    if (job) this.watch(job);
  }

  private watch(job: Promise<void>): void {
    this.jobDone = false;
    // a job that ends between two steps worked during the later one's computation too (the contention guard)
    const done = (): void => { this.jobDone = true; this.workedAt = performance.now(); };
    this.job = job.then(done, (e) => { this.jobError = e; done(); });
  }

  async run(t0: number): Promise<RunResult> {
    this.t0 = t0;
    let finished = false;
    const rests = this.guard?.rests ?? 0;
    try {
      while (!finished) {
        const busy = this.want() > 0;
        const resting = this.guard !== null && !this.guard.mayDraft(); // it changes only at a step
        let got = await this.link.recv(busy ? 0 : !resting && this.job !== null ? this.cfg.pollMs : null);
        while (got !== null) {
          if ("disconnected" in got) await this.resume();
          else finished = this.apply(got) || finished;
          got = finished ? null : await this.link.recv(0);
        }
        if (finished) break;
        const want = this.want();
        if (want > 0 && !this.chain.length && this.drafter.missing(this.committed) > this.cfg.catchUpAfter) {
          this.watch(this.drafter.prefill([...this.committed]));
          this.catchUps++;
          this.workedAt = performance.now();
        } else if (want > 0) {
          await this.draft(Math.min(want, this.cfg.chunk));
        }
        if (this.chain.length && this.uplink.maySend() &&
            (this.sentGen !== this.gen || this.committed.length + this.chain.length >= this.sentEnd + this.cfg.resend)) {
          this.upload();
        }
      }
    } finally {
      if (this.job !== null) await this.job; // the drafter must be idle before its owner uses it again
    }
    this.stats.wallS = (performance.now() - t0) / 1000;
    Object.assign(this.stats.extra, {
      drafts_sent: this.drafts, chain_breaks: this.chainBreaks, catch_ups: this.catchUps, drafter_joined_at: this.joinedAt,
      contention_rests: this.guard === null ? null : this.guard.rests - rests,
    });
    return { tokens: this.committed.slice(this.prompt.length), stats: this.stats, finished };
  }

  /** Tokens to draft now: up to the lead depth, never past the generation budget. */
  private want(): number {
    if (this.guard !== null && !this.guard.mayDraft()) return 0; // drafting slows the cloud's steps, or no baseline yet
    if (!this.joined) {
      this.join();
      return 0;
    }
    if (!this.uplink.maySend() || !this.drafterFree()) return 0;
    const left = this.cfg.maxTokens - (this.committed.length - this.prompt.length);
    return Math.min(this.depth.target(this.link.rttS()), left) - this.chain.length;
  }

  /** A late drafter's prefill of everything streamed so far, beside the loop, once the first token is here. */
  private join(): void {
    if (this.stats.emitted === 0) return;
    this.joined = true;
    this.joinedAt = this.stats.emitted;
    this.watch(this.drafter.prefill([...this.committed]));
    this.workedAt = performance.now();
  }

  private jobRunning(): boolean {
    return this.job !== null && !this.jobDone;
  }

  private drafterFree(): boolean {
    if (this.job === null) return true;
    if (!this.jobDone) return false;
    this.job = null;
    if (this.jobError !== null) {
      const e = this.jobError;
      this.jobError = null;
      throw e;
    }
    return true;
  }

  private async draft(n: number): Promise<void> {
    const d = await this.drafter.draft([...this.committed, ...this.chain], n);
    this.chain.push(...d.tokens);
    this.stats.draftS += d.seconds;
    this.stats.draftTokens += d.tokens.length;
    this.workedAt = performance.now();
  }

  private upload(): void {
    const n = Math.min(this.chain.length, this.cfg.maxLead);
    this.link.sendDraft(this.committed.length, this.chain.slice(0, n));
    this.sentGen = this.gen;
    this.sentEnd = this.committed.length + n;
    this.upGen = this.gen;
    this.upAt = performance.now();
    this.drafts++;
    this.uplink.sent();
  }

  private apply(c: Step): boolean {
    const have = this.committed.length;
    if (c.start > have) throw new StreamError(`the cloud streamed from ${c.start}, the edge holds ${have}`);
    const fresh = c.tokens.slice(have - c.start);
    const now = (performance.now() - this.t0) / 1000;
    const gap = this.lastArrival === null ? null : (c.arrived - this.lastArrival) / 1000;
    this.lastArrival = c.arrived;
    if (!fresh.length) return c.finished;
    if (this.stats.emitted === 0) this.stats.ttftS = now;
    const rtt = this.link.rttS() ?? this.cfg.priorRttS;
    // the cloud held our chain for this step if it went up a round trip before the step came back
    const held = this.upGen === this.gen && c.start < this.sentEnd && this.upAt <= c.arrived - rtt * 1000;
    const slow = this.stats.draftS > 0 && this.stats.draftTokens / this.stats.draftS <= this.depth.rate;
    const breaks = this.chainBreaks;
    for (const t of fresh) this.take(t);
    this.stats.observeBlock(c.drafted, c.accepted);
    this.uplink.step(c.drafted, held || slow || this.chainBreaks > breaks, c.accepted);
    this.stats.emitted += fresh.length;
    this.stats.verifyS += c.verifyS;
    for (let i = 0; i < fresh.length; i++) this.stats.tokenTimes.push(now);
    this.depth.observe(c, gap);
    if (this.guard !== null) { // the step was computed about half a round trip before it arrived: the drafter
      // counts as at work if it worked in this gap between arrivals or the one before, or its job is running.
      // Arrival times, not the loop's turns: steps that came in while a drafter call held the loop arrive
      // together, and each of them was computed while the drafter worked.
      const busy = this.workedAt > this.arrivals[0] || this.jobRunning();
      this.guard.step(c.verifyS, busy, !c.drafted, c.start <= this.prompt.length);
    }
    this.arrivals = [this.arrivals[1], c.arrived];
    this.onTokens?.(fresh);
    return c.finished;
  }

  /** One committed token: pop it off the chain, or break the chain. */
  private take(t: number): void {
    if (this.chain.length && this.chain[0] === t) {
      this.chain.shift();
    } else if (this.chain.length) {
      this.chainBreaks++;
      this.gen++;
      this.chain.length = 0;
    }
    this.committed.push(t);
  }

  private async resume(): Promise<void> {
    const agreed = await this.link.s.resume(this.committed);
    if (agreed !== this.committed.length) {
      throw new StreamError(`the cloud resumed at ${agreed}, the edge holds ${this.committed.length}`);
    }
    this.sentGen = this.upGen = -1; // a new session's board is empty: upload again
  }
}
