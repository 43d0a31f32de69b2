// The contention guard (src/contention.ts), rule by rule as the Python guard's tests check them: a baseline
// of idle steps first; a window of dearer steps rests the drafter, each rest twice the last; a window within
// the margin ends the doubling; a cloud with no step times turns it off; cores other processes keep busy
// (a /proc/stat file the test writes) rest the drafter before it starts work.

import assert from "node:assert/strict";
import { existsSync, mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, it } from "node:test";
import { ContentionGuard, CoreLoad } from "../src/contention.js";

const STEP = 0.08; // a plain step's time, as the cloud reports it

function idle(g: ContentionGuard, n: number, s = STEP): void {
  for (let i = 0; i < n; i++) g.step(s, false);
}

function busy(g: ContentionGuard, n: number, s: number): void {
  for (let i = 0; i < n; i++) g.step(s, true);
}

/** A /proc/stat of `cpus` cores whose busy and idle jiffies the test sets. */
class FakeStat {
  busy = 0;
  idle = 1000;
  constructor(readonly path: string, readonly cpus: number) {
    this.write();
  }

  advance(busyCores: number, wallS: number): void {
    const ticks = wallS * 100;
    this.busy += Math.round((busyCores * ticks) / this.cpus);
    this.idle += Math.round(((this.cpus - busyCores) * ticks) / this.cpus);
    this.write();
  }

  write(): void {
    const lines = ["cpu  0 0 0 0 0 0 0 0 0 0"];
    for (let c = 0; c < this.cpus; c++) lines.push(`cpu${c} ${this.busy} 0 0 ${this.idle} 0 0 0 0 0 0`);
    writeFileSync(this.path, lines.join("\n") + "\nintr 0\n");
  }
}

describe("the contention guard", () => {
  it("lets the drafter first work after a baseline of idle steps, and the prompt's step is not one", () => {
    const g = new ContentionGuard({ baselineSteps: 2 });
    assert.ok(!g.mayDraft());
    g.step(5.0, false, true, true); // the prompt's prefill: no baseline
    assert.ok(!g.mayDraft());
    assert.equal(g.idleSteps, 0);
    idle(g, 1);
    assert.ok(!g.mayDraft());
    idle(g, 1);
    g.step(STEP / 2, false, false); // a step that verified a draft: not a plain step's time
    assert.ok(g.mayDraft());
    assert.ok(Math.abs(g.idleS - STEP) < 1e-12);
    assert.equal(g.idleSteps, 2);
  });

  it("rests the drafter after a window of dearer steps, each rest twice the last up to the most", () => {
    const g = new ContentionGuard({ baselineSteps: 2, window: 3, margin: 1.5, restFirst: 4, restMax: 16 });
    idle(g, 2);
    busy(g, 3, 4 * STEP); // drafting made the cloud's steps 4x as dear
    assert.ok(!g.mayDraft());
    assert.equal(g.resting, 4);
    assert.equal(g.rests, 1);
    assert.deepEqual(g.verdicts, [4.0]);
    idle(g, 4); // the rest: idle steps, which also refresh the baseline
    assert.ok(g.mayDraft());
    busy(g, 3, 4 * STEP);
    assert.equal(g.resting, 8);
    idle(g, 8);
    busy(g, 3, 4 * STEP);
    assert.equal(g.resting, 16);
    idle(g, 16);
    busy(g, 3, 4 * STEP);
    assert.equal(g.resting, 16); // restMax
  });

  it("keeps the drafter at work after a window within the margin, and ends the doubling", () => {
    const g = new ContentionGuard({ baselineSteps: 2, window: 3, restFirst: 4 });
    idle(g, 2);
    busy(g, 3, 4 * STEP);
    idle(g, 4);
    busy(g, 3, 1.2 * STEP); // a little slower, within the margin (the machine's own noise)
    assert.ok(g.mayDraft());
    assert.equal(g.rest, 0);
    assert.equal(g.rests, 1);
    // steps that verified drafts take longer for their rows, not for the drafter: never judged
    for (let i = 0; i < 10; i++) g.step(4 * STEP, true, false);
    assert.ok(g.mayDraft());
    assert.deepEqual(g.verdicts, [4.0, 1.2]);
  });

  it("turns itself off for a cloud that reports no step times", () => {
    const g = new ContentionGuard({ baselineSteps: 2 });
    assert.ok(!g.mayDraft());
    g.step(0, false);
    g.step(0, false);
    assert.ok(g.off());
    assert.ok(g.mayDraft());
  });

  it("counts down a rest through the steps of a session streamed plainly", () => {
    const g = new ContentionGuard({ baselineSteps: 2, window: 3, restFirst: 4 });
    idle(g, 2);
    busy(g, 3, 4 * STEP);
    assert.equal(g.resting, 4);
    g.skip(3);
    assert.equal(g.resting, 1);
    g.skip(10);
    assert.ok(g.mayDraft());
  });

  it("has the Python guard's defaults", () => {
    assert.deepEqual(new ContentionGuard().cfg, { margin: 1.5, window: 3, baselineSteps: 2, restFirst: 16, restMax: 1024, slack: 0.5 });
  });
});

describe("the cores' load", () => {
  it("rests the drafter before it starts work while other processes keep the cores busy", () => {
    const n = 4;
    const stat = new FakeStat(join(mkdtempSync(join(tmpdir(), "acespec-stat-")), "stat"), n);
    const load = new CoreLoad(stat.path);
    assert.ok(load.available);
    assert.equal(load.cores(), n);
    const g = new ContentionGuard({ baselineSteps: 2, restFirst: 4 }, load, n);
    for (let i = 0; i < 2; i++) {
      stat.advance(n - 0.1, 1.0); // the cloud's threads, on every core the drafter would use
      g.step(STEP, false);
    }
    assert.ok(!g.mayDraft());
    assert.equal(g.crowded, 1);
    assert.equal(g.resting, 4);
    // this process's own CPU time counts against the others' (a test's few ms of it, here)
    assert.ok(Math.abs(g.othersLoad! - (n - 0.1)) < 0.1, `others ${g.othersLoad}`);
    for (let i = 0; i < 4; i++) { // still crowded when the rest ends: rest again, twice as long, without a probe
      stat.advance(n - 0.1, 1.0);
      g.step(STEP, false);
    }
    assert.equal(g.crowded, 2);
    assert.equal(g.resting, 8);
    assert.deepEqual(g.verdicts, []);
    for (let i = 0; i < 8; i++) { // the cores went quiet: the drafter starts
      stat.advance(0.05, 1.0);
      g.step(STEP, false);
    }
    assert.ok(g.mayDraft());
    assert.equal(g.crowded, 2);
  });

  it("lets the drafter work on cores other processes leave free", () => {
    const stat = new FakeStat(join(mkdtempSync(join(tmpdir(), "acespec-stat-")), "stat"), 4);
    const g = new ContentionGuard({ baselineSteps: 2 }, new CoreLoad(stat.path), 2);
    for (let i = 0; i < 2; i++) {
      stat.advance(1.0, 1.0); // one core busy: three left for the drafter's two threads
      g.step(STEP, false);
    }
    assert.ok(g.mayDraft());
    assert.equal(g.crowded, 0);
  });

  it("is unavailable where there is no /proc/stat, and answers nothing", () => {
    const load = new CoreLoad(join(tmpdir(), `acespec-no-such-stat-${process.pid}`));
    assert.ok(!load.available);
    assert.equal(load.others(), null);
  });

  it("reads this machine's /proc/stat where it has one", { skip: existsSync("/proc/stat") ? false : "no /proc/stat here" }, () => {
    const load = new CoreLoad();
    assert.ok(load.available);
    assert.ok(load.cores() >= 1);
  });
});
