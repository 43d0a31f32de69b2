// The command line: bad arguments get a clear error and a non-zero exit, before anything is loaded.

import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { describe, it } from "node:test";
import { parseCli, UsageError } from "../src/args.js";
import { CLI, run, scratchDir } from "./helpers.js";

const ok = ["--cloud", "127.0.0.1:7070", "--prompt", "hi", "--draft", CLI]; // any existing file stands in for the GGUF

function refused(args: string[], pattern: RegExp): void {
  assert.throws(() => parseCli(args), (e: unknown) => e instanceof UsageError && pattern.test(e.message));
}

describe("the command line", () => {
  it("parses a complete command into the edge's configuration", () => {
    const a = parseCli([...ok, "--mode", "sync", "--rule", "coupled", "--temperature", "1.0", "--seed", "18446744073709551615",
      "--max-tokens", "0", "--chat", "--json"]);
    assert.equal(a.cfg.mode, "sync");
    assert.equal(a.cfg.rule, "coupled");
    assert.equal(a.cfg.temperature, 1.0);
    assert.equal(a.cfg.seed, (1n << 64n) - 1n);
    assert.equal(a.cfg.maxTokens, 0);
    assert.deepEqual([a.cfg.connect.host, a.cfg.connect.port, a.chat, a.json], ["127.0.0.1", 7070, true, true]);
  });

  it("sends the token file's bytes less surrounding ASCII whitespace, as the Python edge does", () => {
    const file = join(scratchDir(), "token");
    writeFileSync(file, Buffer.from([0x20, 0x0a, 0xa0, 0x61, 0x62, 0x20, 0x63, 0xa0, 0x0d, 0x0a]));
    assert.deepEqual(Array.from(parseCli([...ok, "--token-file", file]).cfg.connect.token), [0xa0, 0x61, 0x62, 0x20, 0x63, 0xa0]);
    writeFileSync(file, " \n");
    refused([...ok, "--token-file", file], /the token file .* is empty/);
  });

  it("defaults to the auto mode, greedy, 128 tokens", () => {
    const a = parseCli(ok);
    assert.deepEqual([a.cfg.mode, a.cfg.rule, a.cfg.maxTokens, a.cfg.temperature], ["auto", "greedy", 128, 0]);
  });

  it("keeps the contention guard on unless --no-contention-guard turns it off", () => {
    assert.equal(parseCli(ok).cfg.contentionGuard, true);
    assert.equal(parseCli([...ok, "--no-contention-guard"]).cfg.contentionGuard, false);
  });

  it("refuses each kind of bad argument with a message that names it", () => {
    refused(["--prompt", "hi"], /--cloud HOST:PORT is required/);
    refused(["--cloud", "nohost", "--prompt", "x"], /--cloud: expected HOST:PORT/);
    refused(["--cloud", "h:70000", "--prompt", "x"], /--cloud port/);
    refused(["--cloud", "h:1"], /--prompt is required/);
    refused([...ok, "--mode", "fast"], /--mode must be one of auto, cloud-led, cloud-only, sync, pipelined/);
    refused([...ok, "--rule", "strict"], /--rule must be one of greedy, coupled/);
    refused([...ok, "--max-tokens", "1.5"], /--max-tokens must be an integer >= 0/);
    refused([...ok, "--window", "0"], /--window must be an integer >= 1/);
    refused([...ok, "--temperature=-1"], /--temperature must be a number >= 0/);
    refused([...ok, "--seed", "x"], /--seed must be an integer/);
    refused([...ok, "--token-file", "/nonexistent/token"], /cannot read the token file/);
    refused([...ok, "--tls-ca", "/nonexistent/ca.pem"], /--tls-ca: no such file/);
    refused(["--cloud", "h:1", "--prompt", "x", "--draft", "/nonexistent.gguf"], /drafter GGUF not found/);
    refused([...ok, "--bogus"], /Unknown option '--bogus'/);
  });

  it("exits with status 2 and the reason on stderr for a bad argument", async () => {
    const [code, out, err] = await run(process.execPath, [CLI, "--cloud", "127.0.0.1:7070", "--mode", "fast", "--prompt", "x"]);
    assert.equal(code, 2);
    assert.equal(out, "");
    assert.match(err, /^acespec-edge: error: --mode must be one of/);
  });
});
