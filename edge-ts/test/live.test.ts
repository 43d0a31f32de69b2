// The Node edge against a real `acespec serve` on loopback with the default model pair (the Python
// side's qwen2.5-coder 1.5B target, the 0.5B drafter this edge loads): the same prompt tokens and
// tokenizer fingerprint as the Python edge, the same greedy text in every mode with drafts accepted, an
// answer for max_tokens 0, and coupled sampling at temperature 1.0 writing the Python edge's text.

import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { defaultDraftPath, parseCli, resultJson } from "../src/args.js";
import { DraftModel } from "../src/drafter.js";
import { runEdge } from "../src/modes.js";
import { RunJson } from "../src/stats.js";
import { CLI, Cloud, cuttingRelay, pyEnv, python, run, startCloud } from "./helpers.js";

// one thread for each side (the cloud, and each edge's drafter), as `--cores split` arranges it: on a
// two-core machine two-thread models on both sides take turns at every pass and spin while they wait
process.env.ACESPEC_THREADS ??= "1";

const DRAFT = process.env.ACESPEC_DRAFT_GGUF || defaultDraftPath();
const TARGET = process.env.ACESPEC_TARGET_GGUF || join(DRAFT, "..", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
const PROMPT = "Write a Python function that returns the n-th Fibonacci number.";
const TOKENS = 16;

const py = python();
const skip = !existsSync(DRAFT) || !existsSync(TARGET)
  ? `the default models are not installed (${DRAFT}, ${TARGET}): run \`acespec models install\``
  : py === null ? "no Python with acespec and llama_cpp to run `acespec serve` (set ACESPEC_PYTHON)" : false;

type EdgeOut = RunJson;

/** The CLI, as a user runs it. */
async function cliEdge(port: number, args: string[]): Promise<EdgeOut> {
  const [code, out, err] = await run(process.execPath, [CLI, "--cloud", `127.0.0.1:${port}`, "--draft", DRAFT, "--prompt", PROMPT,
    "--chat", "--json", ...args]);
  assert.equal(code, 0, `acespec-edge ${args.join(" ")} failed: ${err}`);
  return JSON.parse(out);
}

/** The same run in this process, with the drafter loaded once for every test (loading it is most of a
 * short run's time); the options as the CLI reads them. */
async function nodeEdge(model: DraftModel, port: number, args: string[]): Promise<EdgeOut> {
  const a = parseCli(["--cloud", `127.0.0.1:${port}`, "--draft", DRAFT, "--prompt", PROMPT, "--chat", "--json", ...args]);
  const res = await runEdge(model, model.chatPrompt(PROMPT), a.cfg);
  return resultJson(res, new TextDecoder().decode(model.vocab.decodeBytes(res.tokens)), a.cfg);
}

async function pythonEdge(port: number, args: string[]): Promise<{ text: string; tokens: number[] }> {
  const [code, out, err] = await run(py!, ["-m", "acespec.cli", "edge", "--cloud", `127.0.0.1:${port}`, "--draft", DRAFT,
    "--prompt", PROMPT, "--chat", "--json", ...args], pyEnv());
  assert.equal(code, 0, `acespec edge ${args.join(" ")} failed: ${err}`);
  return JSON.parse(out.trim().split("\n").pop()!);
}

describe("the Node edge against a live cloud with the default models", { skip, timeout: 600_000 }, () => {
  let cloud: Cloud;
  let model: DraftModel;
  let reference: EdgeOut; // cloud-only, greedy, through the CLI

  before(async () => {
    [cloud, model] = await Promise.all([startCloud(py!, ["--target", TARGET]), DraftModel.load(DRAFT)]);
    reference = await cliEdge(cloud.port, ["--mode", "cloud-only", "--max-tokens", String(TOKENS)]);
  });
  after(async () => {
    await Promise.all([cloud?.stop(), model?.dispose()]);
  });

  it("tokenizes prompts exactly as the Python edge does, and names the same vocabulary", async () => {
    const prompts = [PROMPT, "  two  spaces\tand a tab\n", "héllo wörld ✓ 你好 🙂", "<|im_end|> is text here", "x"];
    const script = "import json,sys\nfrom acespec.models import load_model\nfrom acespec.cli import prompt_tokens\n" +
      "m=load_model(sys.argv[1]); t=m.tokenizer; ps=json.loads(sys.argv[2])\n" +
      "print(json.dumps({'fp': t.fingerprint, 'plain': [t.encode(p) for p in ps], 'chat': [prompt_tokens(t, p, True) for p in ps]}))";
    const [code, out, err] = await run(py!, ["-c", script, DRAFT, JSON.stringify(prompts)], pyEnv());
    assert.equal(code, 0, err);
    const want = JSON.parse(out);
    assert.equal(model.fingerprint, want.fp);
    assert.deepEqual(prompts.map((p) => model.encode(p)), want.plain);
    assert.deepEqual(prompts.map((p) => model.chatPrompt(p)), want.chat);
  });

  it("streams a whole greedy text in cloud-only mode through the command line", () => {
    assert.equal(reference.tokens.length, TOKENS);
    assert.ok(reference.text.length > 0);
    assert.equal(reference.drafted, 0);
  });

  for (const mode of ["auto", "sync", "pipelined"]) { // (cloud-led is auto on the wire)
    it(`writes cloud-only's greedy text in ${mode} mode, with drafts ${mode === "auto" ? "sent" : "accepted"}`, async () => {
      // the contention guard off: on a machine the cloud shares with the edge it may rightly rest the drafter
      // through the whole text (contended.test checks the guard; the resume test below runs auto with it)
      const guard = mode === "auto" ? ["--no-contention-guard"] : [];
      const r = await nodeEdge(model, cloud.port, ["--mode", mode, "--max-tokens", String(TOKENS), ...guard]);
      assert.deepEqual(r.tokens, reference.tokens);
      assert.equal(r.text, reference.text);
      if (mode === "auto") {
        // the cloud never waits for an auto edge's drafts, so how many it verifies depends on the machine's
        // load (on a busy one, none may pay): what the edge owes is drafting and uploading them
        const stats = (r as unknown as { stats: { drafts_sent: number; draft_tokens: number } }).stats;
        assert.ok(stats.drafts_sent > 0 && stats.draft_tokens > 0, `drafts sent ${stats.drafts_sent}`);
      } else {
        assert.ok(r.drafted > 0 && r.accepted > 0, `drafted ${r.drafted}, accepted ${r.accepted}`);
      }
      assert.ok(r.target_passes > 0 && r.tok_s > 0);
    });
  }

  for (const mode of ["auto", "sync", "pipelined"]) {
    it(`resumes ${mode === "auto" ? "an" : "a"} ${mode} session whose connection is cut mid-stream, and writes the same text`, async () => {
      const relay = await cuttingRelay(cloud.port, 60);
      try {
        const r = await nodeEdge(model, relay.port, ["--mode", mode, "--max-tokens", String(TOKENS)]);
        assert.equal(relay.cuts(), 1);
        assert.equal((r as unknown as { stats: { reconnects: number } }).stats.reconnects, 1);
        assert.deepEqual(r.tokens, reference.tokens);
      } finally {
        relay.close();
      }
    });
  }

  for (const mode of ["cloud-only", "auto", "sync"]) {
    it(`answers max_tokens 0 with an empty text in ${mode} mode`, async () => {
      const t0 = performance.now();
      const r = await nodeEdge(model, cloud.port, ["--mode", mode, "--max-tokens", "0"]);
      assert.deepEqual([r.tokens, r.text], [[], ""]);
      assert.ok(performance.now() - t0 < 30_000, "it did not wait for a timeout");
    });
  }

  it("writes the Python edge's text with coupled sampling at temperature 1.0 and the same seed", async () => {
    const args = ["--rule", "coupled", "--temperature", "1.0", "--seed", "7", "--max-tokens", String(TOKENS)];
    const theirs = await pythonEdge(cloud.port, ["--mode", "cloud-led", ...args]);
    const mine = await nodeEdge(model, cloud.port, ["--mode", "auto", ...args]);
    assert.deepEqual(mine.tokens, theirs.tokens);
    assert.equal(mine.text, theirs.text);
    // stop-and-wait has every block verified, so the drafter's coupled picks show: with the shared noise
    // they are the target's own samples wherever the two models agree (a cloud-led stream verifies
    // drafts only when its pricing says they pay, which at temperature 1.0 may be none in 16 tokens)
    const sync = await nodeEdge(model, cloud.port, ["--mode", "sync", ...args]);
    assert.deepEqual(sync.tokens, theirs.tokens);
    assert.ok(sync.drafted > 0 && sync.accepted > 0, `drafted ${sync.drafted}, accepted ${sync.accepted}`);
  });
});
