// The command line of acespec-edge, checked: every bad argument is a UsageError that says what is wrong.

import { existsSync, readFileSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { connectConfig } from "./client.js";
import { EdgeConfig, EdgeMode, MODES, RULES, RuleName } from "./modes.js";
import { RunJson, RunResult, runJson } from "./stats.js";

export class UsageError extends Error {}

/** Where the Python side installs the default drafter (acespec/models/registry.py: models_dir()). */
export function defaultDraftPath(): string {
  const dir = process.env.ACESPEC_MODELS_DIR || join(homedir(), ".cache", "acespec", "models");
  return join(dir, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

export interface CliArgs {
  cfg: EdgeConfig;
  prompt: string;
  chat: boolean;
  json: boolean;
  draft: string;
}

function num(text: string, what: string, check: (v: number) => boolean, rule: string): number {
  const v = Number(text);
  if (text.trim() === "" || !Number.isFinite(v) || !check(v)) throw new UsageError(`${what} must be ${rule}, got ${JSON.stringify(text)}`);
  return v;
}

export function parseHostPort(text: string): [string, number] {
  const i = text.lastIndexOf(":");
  const host = text.slice(0, i).replace(/^\[|\]$/g, "");
  if (i < 0 || !host) throw new UsageError(`--cloud: expected HOST:PORT, got ${JSON.stringify(text)}`);
  const port = num(text.slice(i + 1), "--cloud port", (p) => Number.isInteger(p) && p > 0 && p < 65536, "an integer in 1..65535");
  return [host, port];
}

export function parseCli(argv: string[]): CliArgs {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv, strict: true, allowPositionals: false, options: {
        cloud: { type: "string" }, mode: { type: "string", default: "auto" }, prompt: { type: "string" },
        chat: { type: "boolean", default: false }, "max-tokens": { type: "string", default: "128" },
        json: { type: "boolean", default: false }, rule: { type: "string", default: "greedy" },
        temperature: { type: "string" }, seed: { type: "string", default: "0" }, "top-k": { type: "string", default: "0" },
        "top-p": { type: "string", default: "1" }, k: { type: "string", default: "4" }, window: { type: "string", default: "2" }, "token-file": { type: "string" },
        "tls-ca": { type: "string" }, "tls-server-name": { type: "string" }, draft: { type: "string" },
        "busy-retry": { type: "string", default: "60" }, "no-contention-guard": { type: "boolean", default: false },
      },
    }));
  } catch (e) {
    throw new UsageError((e as Error).message);
  }
  if (!values.cloud) throw new UsageError("--cloud HOST:PORT is required");
  if (values.prompt === undefined) throw new UsageError("--prompt is required");
  const [host, port] = parseHostPort(values.cloud);
  const mode = values.mode as EdgeMode;
  if (!MODES.includes(mode)) throw new UsageError(`--mode must be one of ${MODES.join(", ")}, got ${JSON.stringify(values.mode)}`);
  const rule = values.rule as RuleName;
  if (!RULES.includes(rule)) throw new UsageError(`--rule must be one of ${RULES.join(", ")}, got ${JSON.stringify(values.rule)}`);
  const isCount = (v: number): boolean => Number.isInteger(v) && v >= 0;
  const maxTokens = num(values["max-tokens"]!, "--max-tokens", isCount, "an integer >= 0");
  // 0 (greedy sampling) unless given, as in the Python edge
  const temperature = num(values.temperature ?? "0", "--temperature", (v) => v >= 0, "a number >= 0");
  if (!/^\d+$/.test(values.seed!) || BigInt(values.seed!) >= 1n << 64n) {
    throw new UsageError(`--seed must be an integer in 0..2**64-1, got ${JSON.stringify(values.seed)}`);
  }
  const topK = num(values["top-k"]!, "--top-k", isCount, "an integer >= 0");
  const topP = num(values["top-p"]!, "--top-p", (v) => v > 0 && v <= 1, "a number in (0, 1]");
  const k = num(values.k!, "--k", (v) => Number.isInteger(v) && v >= 1, "an integer >= 1");
  const window = num(values.window!, "--window", (v) => Number.isInteger(v) && v >= 1, "an integer >= 1");
  const busyRetry = num(values["busy-retry"]!, "--busy-retry", (v) => v >= 0, "a number of seconds >= 0");
  let token: Uint8Array = new Uint8Array(0);
  if (values["token-file"] !== undefined) {
    let raw: Buffer;
    try {
      raw = readFileSync(values["token-file"]);
    } catch (e) {
      throw new UsageError(`cannot read the token file ${values["token-file"]}: ${(e as Error).message}`);
    }
    // the bytes of the file less surrounding ASCII whitespace, as the Python edge sends them (bytes.strip())
    const space = (b: number): boolean => b === 0x20 || (b >= 0x09 && b <= 0x0d);
    let a = 0, z = raw.length;
    while (a < z && space(raw[a])) a++;
    while (z > a && space(raw[z - 1])) z--;
    token = new Uint8Array(raw.subarray(a, z));
    if (!token.length) throw new UsageError(`the token file ${values["token-file"]} is empty`);
  }
  const tlsCa = values["tls-ca"] ?? null;
  if (tlsCa !== null && !existsSync(tlsCa)) throw new UsageError(`--tls-ca: no such file ${tlsCa}`);
  const draft = values.draft ?? defaultDraftPath();
  if (!existsSync(draft)) {
    throw new UsageError(`drafter GGUF not found: ${draft} (install it with \`acespec models install\`, or pass --draft PATH)`);
  }
  return {
    prompt: values.prompt, chat: values.chat!, json: values.json!, draft,
    cfg: {
      mode, rule, k, window, temperature, topK, topP, seed: BigInt(values.seed!), maxTokens,
      contentionGuard: !values["no-contention-guard"],
      connect: connectConfig({ host, port, token, tlsCa, tlsServerName: values["tls-server-name"] ?? null, busyRetryMs: busyRetry * 1000 }),
    },
  };
}

/** The run as `--json` prints it (stats.ts: runJson). */
export function resultJson(res: RunResult, text: string, cfg: EdgeConfig): RunJson {
  return runJson(res, text, cfg.mode, cfg.rule);
}

