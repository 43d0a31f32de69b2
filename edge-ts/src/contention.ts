// Whether the edge's drafting slows the cloud (a port of acespec/loop/contention.py): ContentionGuard.
//
// An edge and a cloud that share cores (one laptop running both, an edge on the cloud's busy box) compete
// for them: two llama.cpp instances each run a thread per core, and while the drafter computes, the
// cloud's threads wait at their barriers for the ones it displaced, so the cloud's steps take several
// times as long. No draft the cloud verifies wins that back on a CPU, and the uplink's backoff cannot see
// it (the cloud goes on verifying, only slowly).
//
// The cloud reports each step's own time (TOKENS' verify_us). The guard compares the cloud's plain steps
// (those that verified no draft) while the drafter worked with its plain steps while it was idle, and
// rests the drafter while they take `margin` times as long or more: the drafter first works after
// `baselineSteps` idle plain steps (the prompt's own step, which holds the prefill, is not one); every
// `window` plain steps with it at work are judged together, and a dear window rests it, each rest twice
// the last up to `restMax`, while a window within the margin brings the rest back to `restFirst`. A cloud
// that reports no step times turns the guard off. Judging costs a probe (the drafter's prefill and a
// window of drafting), so where the edge can see its cores' load (CoreLoad, Linux) the drafter rests at
// once, without the probe, whenever other processes keep the cores too busy for its threads (`slack`).
//
// One guard may serve several sessions (a caller of runEdge passes the same one): what one learned, the
// next starts from, and a session the drafter would rest through opens as a cloud-only one (`skip`).

import { readFileSync } from "node:fs";
import { availableParallelism } from "node:os";

const CLK_TCK = 100; // /proc/stat's jiffies per second (USER_HZ: 100 on every Linux Node runs on)

/** How many cores' worth of other processes' work ran on this machine's cores between two calls: the
 * cores' busy time (/proc/stat) less this process's own CPU time. Node cannot read its CPU affinity, so
 * every `cpuN` line counts. Linux only: elsewhere (no /proc/stat) `available` is false and every call
 * answers null. */
export class CoreLoad {
  readonly available: boolean;
  private ncpus = 0;
  private last: [number, number, number] | null = null;

  constructor(readonly stat = "/proc/stat") {
    let now: [number, number, number] | null = null;
    try {
      now = this.read();
    } catch {
      now = null; // no /proc (macOS, Windows)
    }
    this.available = now !== null && this.ncpus > 0;
    this.last = this.available ? now : null;
  }

  /** [busy jiffies, all jiffies, this process's CPU seconds] over the cores, or null if it shows none. */
  private read(): [number, number, number] | null {
    let busy = 0, total = 0, cpus = 0;
    for (const line of readFileSync(this.stat, "utf8").split("\n")) {
      const [name, ...fields] = line.trim().split(/\s+/);
      if (!/^cpu\d+$/.test(name ?? "")) continue;
      // user nice system idle iowait irq softirq steal
      const v = fields.slice(0, 8).map(Number).map((x) => (Number.isFinite(x) ? x : 0));
      while (v.length < 8) v.push(0);
      busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
      total += v.reduce((a, b) => a + b, 0);
      cpus++;
    }
    this.ncpus = cpus;
    const u = process.cpuUsage();
    return total ? [busy, total, (u.user + u.system) / 1e6] : null;
  }

  /** Cores' worth of other processes' work since the last call (null: unknown, or too short an interval
   * to tell: the counters tick at 100 Hz). */
  others(): number | null {
    if (!this.available || this.last === null) return null;
    let now: [number, number, number] | null;
    try {
      now = this.read();
    } catch {
      return null;
    }
    if (now === null) return null;
    const [b0, t0, p0] = this.last, [b1, t1, p1] = now;
    const ticks = (t1 - t0) / this.ncpus; // wall time, in jiffies, per core
    if (ticks < 5) return null; // keep the interval open until it is long enough to mean something
    this.last = now;
    return Math.max(0, (b1 - b0) / ticks - (p1 - p0) / (ticks / CLK_TCK));
  }

  cores(): number {
    return this.ncpus || availableParallelism();
  }
}

/** What the guard needs of a CoreLoad (a test or another platform may give its own reading). */
export interface LoadReader {
  available: boolean;
  others(): number | null;
  cores(): number;
}

export interface ContentionConfig {
  margin: number; // plain steps while the drafter works may take up to this times as long as while it idles
  window: number; // steps with the drafter at work judged together
  baselineSteps: number; // steps with the drafter idle before it may first work (the baseline)
  restFirst: number; // steps of the first rest after a verdict that drafting slows the cloud ...
  restMax: number; // ... each next rest twice as long, up to this many steps
  slack: number; // with a load: the drafter starts only if other processes leave its threads a core each, less this
}

export const CONTENTION_DEFAULTS: ContentionConfig = {
  margin: 1.5, window: 3, baselineSteps: 2, restFirst: 16, restMax: 1024, slack: 0.5,
};

export class ContentionGuard {
  readonly cfg: ContentionConfig;
  idleS = 0; // the cloud's plain step time while the drafter was idle (EWMA; 0: none yet)
  idleSteps = 0; // plain idle steps seen (the baseline is ready at cfg.baselineSteps)
  blindSteps = 0; // plain steps that carried no step time: after baselineSteps of them, the guard is off
  busyS = 0; // the current window: seconds of ...
  busySteps = 0; // ... plain steps with the drafter at work
  rest = 0; // the length of the next rest (0: restFirst)
  resting = 0; // steps left in the current rest
  rests = 0; // rests so far (stats)
  verdicts: number[] = []; // each judged window's step time over the baseline (stats)
  othersLoad: number | null = null; // other processes' cores' worth of work on ours, over the last idle steps
  crowded = 0; // rests begun because the cores were busy (stats)

  /** `load`: the cores' load by other processes (null: judge by the cloud's steps alone); `threads`: the
   * drafter's CPU threads, the cores it needs free. */
  constructor(cfg: Partial<ContentionConfig> = {}, readonly load: LoadReader | null = null, readonly threads = 1) {
    this.cfg = { ...CONTENTION_DEFAULTS, ...cfg };
  }

  /** Whether the guard cannot judge: the cloud reports no step times. */
  off(): boolean {
    return this.idleSteps === 0 && this.blindSteps >= this.cfg.baselineSteps;
  }

  /** Whether the drafter may work now (draft, join, catch up). */
  mayDraft(): boolean {
    if (this.off()) return true;
    return this.idleSteps >= this.cfg.baselineSteps && this.resting === 0;
  }

  /** `steps` went by in a session that streamed plainly because the drafter would rest through it. */
  skip(steps: number): void {
    this.resting = Math.max(0, this.resting - steps);
  }

  /** One step of the stream: the cloud's `verifyS` for it, whether the drafter worked while the cloud
   * computed it (`busy`), whether it verified no draft (`plain`: only such steps are compared, as a verified
   * row's own cost would blur the drafter's), and whether it is the stream's `first` (it holds the prompt's
   * prefill: its time says nothing of a plain step's). */
  step(verifyS: number, busy: boolean, plain = true, first = false): void {
    const others = this.load !== null ? this.load.others() : null;
    if (first) return;
    const was = this.resting;
    this.resting = Math.max(0, this.resting - 1);
    if (!busy && others !== null) this.othersLoad = others;
    if (!plain) return;
    if (verifyS <= 0) {
      this.blindSteps++;
      return;
    }
    if (!busy) {
      this.idleS = this.idleSteps === 0 ? verifyS : 0.7 * this.idleS + 0.3 * verifyS;
      this.idleSteps++;
      if (was <= 1 && this.idleSteps >= this.cfg.baselineSteps && this.isCrowded()) {
        this.startRest(); // the drafter would start now: on cores this busy it would only slow the cloud
        this.crowded++;
      }
      return;
    }
    if (this.idleSteps < this.cfg.baselineSteps) return; // nothing to judge against yet
    this.busyS += verifyS;
    this.busySteps++;
    if (this.busySteps >= this.cfg.window) this.judge();
  }

  private judge(): void {
    const ratio = this.busyS / this.busySteps / this.idleS;
    this.verdicts.push(Math.round(ratio * 1000) / 1000);
    this.busyS = 0;
    this.busySteps = 0;
    if (ratio >= this.cfg.margin) this.startRest();
    else this.rest = 0;
  }

  private isCrowded(): boolean {
    if (this.load === null || this.othersLoad === null) return false;
    const cores = this.load.cores();
    const need = Math.min(this.threads, cores);
    return cores - this.othersLoad < need - this.cfg.slack;
  }

  private startRest(): void {
    this.resting = this.rest || this.cfg.restFirst;
    this.rest = Math.min(2 * this.resting, this.cfg.restMax);
    this.rests++;
  }
}
