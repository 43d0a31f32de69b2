// The session client against a live `acespec serve` with the toy target (no models needed): TLS with a
// CA file, a tenant's token, RESUME after the connection is cut mid-stream, and BUSY waited out.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { CloudSession, ConnectConfig, connectConfig, EdgeError, sleep } from "../src/client.js";
import { cloudOnly } from "../src/modes.js";
import { ErrorCode, FrameType, hello, Mode } from "../src/wire/frames.js";
import { Cloud, pyEnv, python, PY_ROOT, run, scratchDir, startCloud } from "./helpers.js";

const py = python(false);
const skip = py === null ? "no Python with acespec to run `acespec serve` (set ACESPEC_PYTHON)" : false;
// the certificates are made with trustme (the repository's dev requirements)
const tlsSkip = py !== null && spawnSync(py, ["-c", "import trustme"], { env: pyEnv(), cwd: PY_ROOT }).status !== 0
  ? "no trustme in the Python to make test certificates (install requirements/dev.txt)" : false;
const PROMPT = [3, 1, 4, 1, 5, 9, 2, 6];
const TOY = "toy:vocab=64,seed=1";

function request(cfg: ConnectConfig, maxTokens: number) {
  return hello({ model_id: "toy:vocab=64", max_tokens: maxTokens, prompt: PROMPT, auth: cfg.token, temperature: 0,
    rule: "greedy", mode: Mode.CLOUD_ONLY });
}

/** A whole greedy cloud-only generation through CloudSession. */
async function generate(cfg: ConnectConfig, maxTokens: number): Promise<number[]> {
  const s = await CloudSession.open(cfg, request(cfg, maxTokens));
  try {
    return (await cloudOnly(s, PROMPT, performance.now(), null)).tokens;
  } finally {
    await s.close(200);
  }
}

describe("the session client against a live toy cloud", { skip, timeout: 120_000 }, () => {
  const dir = scratchDir();
  let plain: Cloud, tls: Cloud, busy: Cloud;
  let reference: number[];
  const quick = { reconnectAttempts: 3, backoffMs: 10, replyTimeoutMs: 10_000 };

  before(async () => {
    // a CA, a server certificate for 127.0.0.1, and a second CA the server's certificate is not from
    const script = "import sys, trustme\nca = trustme.CA(); other = trustme.CA(); d = sys.argv[1]\n" +
      "ca.cert_pem.write_to_path(d + '/ca.pem'); other.cert_pem.write_to_path(d + '/other.pem')\n" +
      "c = ca.issue_cert('127.0.0.1', 'localhost'); c.private_key_and_cert_chain_pem.write_to_path(d + '/server.pem')";
    if (!tlsSkip) {
      const [code, , err] = await run(py!, ["-c", script, dir], pyEnv());
      assert.equal(code, 0, err);
    }
    writeFileSync(join(dir, "tenants"), "alice:alice-token\n");
    [plain, tls, busy] = await Promise.all([
      startCloud(py!, ["--target", TOY]),
      tlsSkip ? Promise.resolve(null as unknown as Cloud) : startCloud(py!, ["--target", TOY, "--tls-cert", join(dir, "server.pem"),
        "--tls-key", join(dir, "server.pem"), "--token-file", join(dir, "tenants")]),
      startCloud(py!, ["--target", TOY, "--max-sessions", "1"]),
    ]);
    reference = await generate(connectConfig({ host: "127.0.0.1", port: plain.port, ...quick }), 20);
  });
  after(async () => {
    await Promise.all([plain?.stop(), tls?.stop(), busy?.stop()]);
  });

  it("streams the whole text over plain TCP", () => {
    assert.equal(reference.length, 20);
  });

  it("streams the same text over TLS with the cloud's CA and the tenant's token", { skip: tlsSkip }, async () => {
    const cfg = connectConfig({ host: "127.0.0.1", port: tls.port, tlsCa: join(dir, "ca.pem"), token: Buffer.from("alice-token"), ...quick });
    assert.deepEqual(await generate(cfg, 20), reference);
  });

  it("fails at once, without retrying, when the cloud's certificate is not from the CA given", { skip: tlsSkip }, async () => {
    const cfg = connectConfig({ host: "127.0.0.1", port: tls.port, tlsCa: join(dir, "other.pem"), token: Buffer.from("alice-token"),
      ...quick, reconnectAttempts: 8, backoffMs: 1000 });
    const t0 = performance.now();
    await assert.rejects(CloudSession.open(cfg, request(cfg, 4)), (e: unknown) => e instanceof EdgeError && /TLS: the cloud's certificate was refused/.test(e.message));
    assert.ok(performance.now() - t0 < 5000);
  });

  it("is refused with BAD_AUTH for a token that is no tenant's", { skip: tlsSkip }, async () => {
    const cfg = connectConfig({ host: "127.0.0.1", port: tls.port, tlsCa: join(dir, "ca.pem"), token: Buffer.from("mallory"), ...quick });
    await assert.rejects(CloudSession.open(cfg, request(cfg, 4)), (e: unknown) => e instanceof EdgeError && e.code === ErrorCode.BAD_AUTH);
  });

  it("resumes after the connection is cut mid-stream and ends with the uninterrupted text", async () => {
    const cfg = connectConfig({ host: "127.0.0.1", port: plain.port, ...quick });
    const s = await CloudSession.open(cfg, request(cfg, 20));
    try {
      const got: number[] = [];
      while (got.length < 5) { // a few tokens, then the connection dies under the edge
        const a = await s.link.next(10_000);
        if (a?.frame?.type === FrameType.TOKENS) got.push(...a.frame.tokens.slice(PROMPT.length + got.length - Number(a.frame.start)));
      }
      (s.link as unknown as { transport: { destroy(): void } }).transport.destroy(); // the socket, under the link
      const agreed = await s.resume([...PROMPT, ...got]);
      assert.equal(agreed, PROMPT.length + got.length);
      assert.equal(s.reconnects, 1);
      const rest = await cloudOnly(s, [...PROMPT, ...got], performance.now(), null);
      assert.deepEqual([...got, ...rest.tokens], reference);
    } finally {
      await s.close(200);
    }
  });

  it("waits out a cloud that answers BUSY and gets the session once one is free", async () => {
    const cfg = connectConfig({ host: "127.0.0.1", port: busy.port, ...quick, busyRetryMs: 20_000, backoffMs: 100, backoffMaxMs: 300 });
    const first = await CloudSession.open(cfg, request(cfg, 4));
    const second = CloudSession.open(cfg, request(cfg, 4));
    await sleep(800);
    await first.close(200); // its slot frees up
    const s = await second;
    try {
      assert.ok(s.busyWaits > 0, "it was answered BUSY at least once");
      assert.deepEqual((await cloudOnly(s, PROMPT, performance.now(), null)).tokens, reference.slice(0, 4));
    } finally {
      await s.close(200);
    }
  });

  it("gives up on a cloud that stays busy, saying so", async () => {
    const cfg = connectConfig({ host: "127.0.0.1", port: busy.port, ...quick, busyRetryMs: 500, backoffMs: 50 });
    const holder = await CloudSession.open(cfg, request(cfg, 4));
    try {
      await assert.rejects(CloudSession.open(cfg, request(cfg, 4)), (e: unknown) => e instanceof EdgeError && e.code === ErrorCode.BUSY);
    } finally {
      await holder.close(200);
    }
  });
});

