// What one generation measured, named as the Python edge's RunStats names it (loop/stats.py).

export class RunStats {
  rounds = 0; // target passes (verdicts, cloud-led steps; cloud-only: one per token)
  drafted = 0; // draft tokens the cloud verified
  accepted = 0; // of which kept
  emitted = 0; // tokens committed
  dropped = 0; // blocks the cloud dropped (built on a stale prefix)
  ttftS = 0; // first committed token, from the start of the run
  wallS = 0;
  draftS = 0; // time spent drafting
  draftTokens = 0;
  verifyS = 0; // target time the cloud reported
  bytesUp = 0;
  bytesDown = 0;
  tokenTimes: number[] = [];
  extra: Record<string, number> = {};

  observeBlock(drafted: number, accepted: number): void {
    this.rounds += 1;
    this.drafted += drafted;
    this.accepted += accepted;
  }

  get tokensPerS(): number {
    return this.wallS > 0 ? this.emitted / this.wallS : 0;
  }

  get targetPassesPerToken(): number {
    return this.emitted ? this.rounds / this.emitted : 0;
  }

  get acceptanceRate(): number {
    return this.drafted ? this.accepted / this.drafted : 0;
  }

  summary(): Record<string, unknown> {
    const r = (x: number, d: number): number => Math.round(x * 10 ** d) / 10 ** d;
    return {
      rounds: this.rounds, dropped: this.dropped, drafted: this.drafted, accepted: this.accepted, emitted: this.emitted,
      acceptance_rate: r(this.acceptanceRate, 4), target_passes_per_token: r(this.targetPassesPerToken, 4),
      tokens_per_s: r(this.tokensPerS, 3), wall_s: r(this.wallS, 4), ttft_s: r(this.ttftS, 4),
      draft_s: r(this.draftS, 4), draft_tokens: this.draftTokens, verify_s: r(this.verifyS, 4),
      bytes_up: this.bytesUp, bytes_down: this.bytesDown, ...this.extra,
    };
  }
}

export interface RunResult {
  tokens: number[]; // generated tokens (the prompt not included)
  stats: RunStats;
  finished: boolean;
}

/** A run as `acespec-edge --json` prints it, and as the browser page reports it (with its own extras). */
export interface RunJson {
  text: string;
  tokens: number[];
  drafted: number;
  accepted: number;
  target_passes: number;
  tok_s: number;
  ttft_s: number;
  finished: boolean;
  mode: string;
  rule: string;
  stats: Record<string, unknown>;
}

export function runJson(res: RunResult, text: string, mode: string, rule: string): RunJson {
  const s = res.stats;
  return {
    text, tokens: res.tokens, drafted: s.drafted, accepted: s.accepted, target_passes: s.rounds,
    tok_s: Math.round(s.tokensPerS * 1000) / 1000, ttft_s: Math.round(s.ttftS * 10000) / 10000,
    finished: res.finished, mode, rule, stats: s.summary(),
  };
}
