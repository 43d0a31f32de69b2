// Whole recorded sessions (spec/vectors/sessions.json) replayed over this package's own connection code
// against a real `acespec serve` on loopback with the toy target: every frame the cloud sends must be the
// recorded one (less the fields that vary from run to run), which checks the codec and the link against
// the Python cloud byte for byte, without the real models.

import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, describe, it } from "node:test";
import { connectConfig, Link, tcpConnect } from "../src/client.js";
import { encode } from "../src/wire/codec.js";
import { Frame, FrameType } from "../src/wire/frames.js";
import { Cloud, frameFromJson, frameToJson, hex, python, scratchDir, startCloud, vectors, VECTORS_DIR } from "./helpers.js";

const V = vectors("sessions.json");
const py = V === null ? null : python(false);
const skip = V === null ? `no recorded sessions at ${VECTORS_DIR}/sessions.json`
  : py === null ? "no Python with acespec to run `acespec serve` (set ACESPEC_PYTHON)" : false;

const clouds = new Map<string, Promise<Cloud>>();

/** One server per distinct configuration the sessions ask for, shared by the sessions that ask for it. */
function cloudFor(session: any): Promise<Cloud> {
  const t = session.target.toy;
  // the recorded `pass_s` only slowed the toy's steps while recording: the stream check does not depend on it
  const target = `toy:vocab=${t.vocab},seed=${t.seed}` + (t.eos !== undefined ? `,eos=${t.eos}` : "");
  const args = ["--target", target];
  const srv = session.server ?? {};
  if (srv.max_sessions) args.push("--max-sessions", String(srv.max_sessions));
  if (srv.tenants) {
    const file = join(scratchDir(), "tenants");
    writeFileSync(file, Object.entries(srv.tenants).map(([name, tok]) => `${name}:${tok}`).join("\n") + "\n");
    args.push("--token-file", file);
  }
  const key = args.join(" ");
  if (!clouds.has(key)) clouds.set(key, startCloud(py!, args));
  return clouds.get(key)!;
}

function without(j: Record<string, any>, vary: string[] = []): Record<string, any> {
  const out = { ...j };
  for (const k of vary) delete out[k];
  return out;
}

async function replay(session: any): Promise<void> {
  const cloud = await cloudFor(session);
  const links = new Map<number, Link>();
  let live: { session: unknown; secret: unknown } | null = null;
  const link = async (conn: number): Promise<Link> => {
    if (!links.has(conn)) links.set(conn, await tcpConnect(connectConfig({ host: "127.0.0.1", port: cloud.port })));
    return links.get(conn)!;
  };
  const nextFrame = async (l: Link, what: string): Promise<Frame | null> => {
    const a = await l.next(10_000);
    assert.ok(a !== null, `${what}: nothing from the cloud within 10 s`);
    return a.frame;
  };
  const steps = session.steps;
  try {
    for (let i = 0; i < steps.length; i++) {
      const st = steps[i];
      const what = `${session.name} step ${i}`;
      const l = await link(st.conn);
      if (st.dir === "edge->cloud") {
        if (st.disconnect) {
          await l.close();
          continue;
        }
        let bytes = hex(st.hex);
        if (st.frame && (st.vary ?? []).length) { // the live session's id and secret in place of the recorded ones
          const f = frameFromJson(st.frame) as any;
          if (st.vary.includes("session")) f.session = live!.session;
          if (st.vary.includes("secret")) f.secret = live!.secret;
          bytes = encode(f);
        }
        assert.ok(l.sendBytes(bytes), `${what}: send`);
        continue;
      }
      if (st.eof) {
        const f = await nextFrame(l, what);
        assert.equal(f, null, `${what}: expected the cloud to close, got ${f && FrameType[f.type]}`);
        continue;
      }
      const want = st.frame;
      if (session.check === "stream" && want.type === "TOKENS") {
        // the recorded steps' tokens, split however this run's timing splits them
        const expected: number[] = [];
        let j = i;
        for (; j < steps.length && steps[j].dir === "cloud->edge" && steps[j].frame?.type === "TOKENS"; j++) expected.push(...steps[j].frame.tokens);
        const got: number[] = [];
        let start = want.start;
        for (;;) {
          const f = await nextFrame(l, what);
          assert.ok(f !== null && f.type === FrameType.TOKENS, `${what}: expected TOKENS, got ${f && FrameType[f.type]}`);
          assert.equal(Number(f.start), start, `${what}: the stream is continuous`);
          start += f.tokens.length;
          got.push(...f.tokens);
          assert.ok(f.drafted !== null, `${what}: a cloud-led step carries HAS_STEP`);
          if (f.finished) break;
        }
        assert.deepEqual(got, expected, `${what}: the streamed text`);
        i = j - 1;
        continue;
      }
      const f = await nextFrame(l, what);
      assert.ok(f !== null, `${what}: the cloud closed where ${want.type} was recorded`);
      if (f.type === FrameType.WELCOME) live = { session: f.session, secret: f.secret };
      assert.deepEqual(without(frameToJson(f), st.vary), without(want, st.vary), what);
    }
  } finally {
    for (const l of links.values()) await l.close();
  }
}

describe("recorded sessions replayed against a live cloud", { skip }, () => {
  after(async () => {
    for (const c of clouds.values()) await (await c).stop();
  });
  for (const session of V?.sessions ?? []) {
    it(`replays the ${session.name} session frame for frame`, { timeout: 120_000 }, () => replay(session));
  }
});
