// The contention guard in the follow loop, with the real drafter (the default 0.5B GGUF) against a cloud on
// loopback whose steps take five times as long while that drafter works, as on cores the two share: the
// guard cuts the drafter's work to a fraction and the text is the cloud's either way; against a cloud the
// drafter does not slow, it never rests. And a run the guard would rest through opens as a cloud-only
// session. The cloud is this test's own small server (real sockets, this package's codec): it must see
// when the drafter in this process ran a model pass, which no real cloud can.

import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { createServer, Server, Socket } from "node:net";
import { after, before, describe, it } from "node:test";
import { defaultDraftPath } from "../src/args.js";
import { CloudSession, connectConfig, sleep } from "../src/client.js";
import { ContentionGuard } from "../src/contention.js";
import { ChainDrafter, DraftModel } from "../src/drafter.js";
import { FOLLOW_DEFAULTS, FollowLoop } from "../src/follow.js";
import { EdgeConfig, runEdge } from "../src/modes.js";
import { RunResult } from "../src/stats.js";
import { encode } from "../src/wire/codec.js";
import { FrameDecoder } from "../src/wire/framing.js";
import { FrameType, hello, Mode, tokensFrame, welcome } from "../src/wire/frames.js";

const DRAFT = process.env.ACESPEC_DRAFT_GGUF || defaultDraftPath();
const skip = existsSync(DRAFT) ? false : `the default drafter is not installed (${DRAFT}): run \`acespec models install\``;
const STEP_MS = 20; // a plain step's time with the drafter idle
const STEPS = 160;

/** The drafter's model passes, counted as they start and end (the cloud must see a pass in flight: on a
 * loaded machine one prefill may span many of its steps). */
class Passes {
  inflight = 0;
  done = 0;
  constructor(model: DraftModel) {
    const evaluate = model.eval.bind(model);
    model.eval = async (tokens, picker) => {
      this.inflight++;
      try {
        return await evaluate(tokens, picker);
      } finally {
        this.inflight--;
        this.done++;
      }
    };
  }

  /** A mark to ask `since` about. */
  mark(): [number, boolean] {
    return [this.done, this.inflight > 0];
  }

  /** Whether a pass ran at any time since `mark`. */
  since([done, inflight]: [number, boolean]): boolean {
    return inflight || this.inflight > 0 || this.done !== done;
  }
}

/** A cloud that streams `text` one token a step and verifies no draft (its steps are all plain, as a
 * busy cloud's often are), so the drafter's work is all cost. A step during which the drafter ran a model
 * pass takes `slowdown` times as long, and says so in its verify_us (the step's nominal cost: a timer's
 * delay on a loaded machine is no step's). */
class ContendedCloud {
  drafts = 0; // DRAFT frames received
  slowSteps = 0;
  modes: Mode[] = []; // each HELLO's mode
  private server: Server | null = null;

  constructor(readonly text: number[], readonly passes: Passes, readonly slowdown: number) {}

  async listen(): Promise<number> {
    this.server = createServer((sock) => this.serve(sock));
    await new Promise<void>((r) => this.server!.listen(0, "127.0.0.1", r));
    return (this.server.address() as { port: number }).port;
  }

  close(): void {
    this.server?.close();
  }

  private serve(sock: Socket): void {
    const dec = new FrameDecoder();
    sock.on("error", () => undefined);
    sock.on("data", (d) => {
      for (const f of dec.feed(new Uint8Array(d))) {
        if (f.type === FrameType.HELLO) {
          this.modes.push(f.mode);
          sock.write(encode(welcome({ session: 1, committed: f.prompt.length, max_draft_tokens: 16, secret: new Uint8Array(16).fill(7) })));
          void this.stream(sock, f.prompt.length, Math.min(Number(f.max_tokens), this.text.length));
        } else if (f.type === FrameType.DRAFT) {
          this.drafts++;
        } else if (f.type === FrameType.PING) {
          sock.write(encode({ type: FrameType.PONG, nonce: f.nonce, sent_us: f.sent_us }));
        } else if (f.type === FrameType.CLOSE) {
          sock.end();
        }
      }
    });
  }

  private async stream(sock: Socket, base: number, n: number): Promise<void> {
    for (let i = 0; i < n && !sock.destroyed; i++) {
      const mark = this.passes.mark();
      await sleep(STEP_MS);
      let ms = STEP_MS;
      if (this.passes.since(mark)) { // the drafter computed while this step did: it took longer
        await sleep((this.slowdown - 1) * STEP_MS);
        ms = this.slowdown * STEP_MS;
        this.slowSteps++;
      }
      if (sock.destroyed) return;
      sock.write(encode(tokensFrame({
        start: base + i, tokens: [this.text[i]], finished: i === n - 1, drafted: 0, accepted: 0, verify_us: Math.round(ms * 1000),
      })));
    }
  }
}

describe("the contention guard in the follow loop, with the real drafter", { skip, timeout: 300_000 }, () => {
  let model: DraftModel;
  let passes: Passes;
  let prompt: number[];
  let text: number[];

  before(async () => {
    model = await DraftModel.load(DRAFT, { threads: 1, nCtx: 1024 });
    passes = new Passes(model);
    prompt = model.encode("def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n");
    const body = model.encode("    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n");
    text = Array.from({ length: STEPS }, (_, i) => body[i % body.length]);
  });
  after(async () => {
    await model?.dispose();
  });

  /** One cloud-led run against a cloud `slowdown` times as slow while the drafter works. */
  async function follow(slowdown: number, guard: ContentionGuard | null): Promise<[RunResult, ContendedCloud, number]> {
    const cloud = new ContendedCloud(text, passes, slowdown);
    const port = await cloud.listen();
    try {
      const h = hello({ model_id: model.fingerprint, max_tokens: STEPS, prompt, mode: Mode.CLOUD_LED });
      const session = await CloudSession.open(connectConfig({ host: "127.0.0.1", port }), h);
      const drafter = new ChainDrafter(model, { mode: "greedy", seed: 0n, sampling: { temperature: 0, topK: 0, topP: 1 } });
      // the uplink's own backoff would also cut drafting against a cloud that verifies nothing: kept out of it
      const cfg = { ...FOLLOW_DEFAULTS, maxTokens: STEPS, maxLead: 16, idleAfter: 1_000_000 };
      const done = passes.done;
      const loop = new FollowLoop(session, prompt, drafter, cfg, null, null, { lateJoin: true, guard });
      const res = await loop.run(performance.now());
      await session.close();
      return [res, cloud, passes.done - done];
    } finally {
      cloud.close();
    }
  }

  it("rests a drafter that slows the cloud's steps, and the text stays the cloud's", async (t) => {
    const [free, freeCloud, freeEvals] = await follow(5, null);
    const guard = new ContentionGuard({ restFirst: 8, restMax: 64 });
    const [guarded, guardedCloud, guardedEvals] = await follow(5, guard);
    assert.deepEqual(free.tokens, text);
    assert.deepEqual(guarded.tokens, text);
    t.diagnostic(`drafter passes ${guardedEvals} guarded, ${freeEvals} free; slowed steps ${guardedCloud.slowSteps} guarded, ` +
      `${freeCloud.slowSteps} free; verdicts ${guard.verdicts}`);
    assert.ok(guarded.stats.extra.contention_rests as number >= 2, `rests ${guarded.stats.extra.contention_rests}, verdicts ${guard.verdicts}`);
    assert.ok(guardedEvals < freeEvals / 2, `drafter passes: ${guardedEvals} guarded, ${freeEvals} free; slow steps ${guardedCloud.slowSteps} guarded, ${freeCloud.slowSteps} free; rests ${guarded.stats.extra.contention_rests}, verdicts ${guard.verdicts}, idle steps ${guard.idleSteps}`);
    assert.ok(guardedCloud.slowSteps < freeCloud.slowSteps / 2, `slow steps: ${guardedCloud.slowSteps} guarded, ${freeCloud.slowSteps} free`);
  });

  it("never rests a drafter that does not slow the cloud", async () => {
    const guard = new ContentionGuard();
    const [guarded, cloud, evals] = await follow(1, guard);
    assert.deepEqual(guarded.tokens, text);
    assert.equal(guarded.stats.extra.contention_rests, 0);
    assert.ok(cloud.drafts > 0 && evals > 0, `drafts ${cloud.drafts}, passes ${evals}`);
    assert.ok(guard.verdicts.length > 0, "the guard judged the drafter's windows"); // and found none too dear
  });

  it("opens a run the guard would rest the drafter through as a cloud-only session, its steps counting towards the rest", async () => {
    const cloud = new ContendedCloud(text, passes, 1);
    const port = await cloud.listen();
    try {
      const cfg: EdgeConfig = {
        mode: "auto", rule: "greedy", k: 4, window: 2, temperature: 0, topK: 0, topP: 1, seed: 0n, maxTokens: 40,
        connect: connectConfig({ host: "127.0.0.1", port }),
      };
      const guard = new ContentionGuard();
      guard.resting = 100;
      const evals = model.evals;
      let res = await runEdge(model, prompt, cfg, null, guard);
      assert.deepEqual(res.tokens, text.slice(0, 40));
      assert.equal(res.stats.extra.streamed_plain, true);
      assert.deepEqual([cloud.modes, guard.resting, model.evals - evals], [[Mode.CLOUD_ONLY], 60, 0]);
      res = await runEdge(model, prompt, cfg, null, guard);
      assert.equal(guard.resting, 20);
      res = await runEdge(model, prompt, cfg, null, guard); // a rest shorter than the run: cloud-led again
      assert.deepEqual(res.tokens, text.slice(0, 40));
      assert.equal(cloud.modes[2], Mode.CLOUD_LED);
      assert.equal(res.stats.extra.streamed_plain, undefined);
    } finally {
      cloud.close();
    }
  });
});
