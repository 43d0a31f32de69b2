// The Node edge's runs: run.ts's modes (cloud-only, cloud-led, auto, sync, pipelined) with the
// node-llama-cpp drafter, and in auto a contention guard that reads this machine's core load.

import { DraftBackend } from "./chain.js";
import { ContentionGuard, CoreLoad } from "./contention.js";
import { DraftModel } from "./drafter.js";
import { EdgeConfig, runSession } from "./run.js";
import { RunResult } from "./stats.js";

export { cloudOnly, MODES, RULES, runSession } from "./run.js";
export type { EdgeConfig, EdgeMode, RuleName } from "./run.js";

/** A contention guard for one run: it watches this machine's cores where it can read their load. */
export function freshGuard(model: DraftBackend): ContentionGuard {
  const load = new CoreLoad();
  return new ContentionGuard({}, load.available ? load : null, model.threads || 1);
}

/** One generation through the cloud with the Node drafter (run.ts's runSession); in auto, a fresh
 * contention guard watching this machine's cores unless `guard` is given or `cfg.contentionGuard` is false. */
export async function runEdge(model: DraftModel, prompt: number[], cfg: EdgeConfig,
  onTokens: ((t: number[]) => void) | null = null, guard: ContentionGuard | null = null): Promise<RunResult> {
  return runSession(model, prompt, cfg, onTokens, guard, freshGuard);
}
