#!/usr/bin/env node
// acespec-edge: draft locally with a GGUF drafter, have an AceSpec cloud verify, print the text.
//
//   acespec-edge --cloud HOST:PORT --mode auto --prompt "..." [--chat] [--max-tokens N] [--json]
//                [--rule greedy|coupled] [--temperature T] [--seed S] [--token-file F] [--tls-ca F] [--draft PATH]

import { CliArgs, parseCli, resultJson, UsageError } from "./args.js";
import { DraftModel } from "./drafter.js";
import { runEdge } from "./modes.js";
import { RunResult } from "./stats.js";
import { ErrorCode } from "./wire/frames.js";

async function main(): Promise<number> {
  let args: CliArgs;
  try {
    args = parseCli(process.argv.slice(2));
  } catch (e) {
    if (e instanceof UsageError) {
      process.stderr.write(`acespec-edge: error: ${e.message}\n`);
      return 2;
    }
    throw e;
  }
  // the weights only when there is something to draft: cloud-only, and max_tokens 0, need the vocabulary alone
  const model = await DraftModel.load(args.draft, { vocabOnly: args.cfg.mode === "cloud-only" || args.cfg.maxTokens === 0 });
  try {
    const ids = args.chat ? model.chatPrompt(args.prompt) : model.encode(args.prompt);
    if (!ids.length) throw new UsageError("the prompt is empty after tokenization");
    const stream = new TextDecoder("utf-8");
    const produced: number[] = [];
    const push = (toks: number[]): void => {
      produced.push(...toks);
      if (!args.json) process.stdout.write(stream.decode(model.vocab.decodeBytes(toks), { stream: true }));
    };
    let res: RunResult;
    try {
      res = await runEdge(model, ids, args.cfg, push);
    } catch (e) {
      const code = (e as { code?: ErrorCode | null }).code;
      if (args.json) { // the text committed so far is the caller's, failure or not
        const text = new TextDecoder().decode(model.vocab.decodeBytes(produced));
        process.stdout.write(JSON.stringify({
          text, tokens: produced, error: { message: (e as Error).message, code: code ? ErrorCode[code] : null, type: (e as Error).name },
        }) + "\n");
      }
      process.stderr.write(`acespec-edge: error: ${(e as Error).message}\n`);
      return 1;
    }
    if (args.json) {
      const text = new TextDecoder().decode(model.vocab.decodeBytes(res.tokens));
      process.stdout.write(JSON.stringify(resultJson(res, text, args.cfg)) + "\n");
    } else {
      process.stdout.write(stream.decode() + "\n");
      const s = res.stats;
      process.stderr.write(`--- stats ---\n mode: ${args.cfg.mode}  rule: ${args.cfg.rule}  tokens: ${s.emitted}  tokens/s: ` +
        `${s.tokensPerS.toFixed(2)}  drafted: ${s.drafted}  accepted: ${s.accepted}  target passes/token: ` +
        `${s.targetPassesPerToken.toFixed(3)}  time to first token s: ${s.ttftS.toFixed(3)}\n`);
    }
    return 0;
  } finally {
    await model.dispose();
  }
}

main().then((rc) => process.exit(rc), (e) => {
  process.stderr.write(`acespec-edge: error: ${(e as Error).message}\n`);
  process.exit(1);
});
