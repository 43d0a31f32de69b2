// Side by side: the same prompts through the Python edge (`acespec edge`), this Node edge and, with
// --browser, the browser edge (the page in headless Chromium, drafting in WebAssembly, over the cloud's
// WebSocket port) against one cloud, per mode. Prints per edge and mode: tokens/s, time to first token,
// target passes per token, acceptance, and whether the text equals cloud-only's; then Node's tokens/s over
// Python's (the bar: >= 0.9), and the browser's.
//
//   node dist/scripts/bench-edges.js [--cloud HOST:PORT [--ws URL]] [--modes auto,sync] [--prompts 3]
//                                    [--max-tokens 32] [--python PATH] [--draft GGUF] [--target GGUF] [--browser]
//
// Without --cloud it starts `acespec serve` with the default target on a free loopback port (and a
// WebSocket port with --browser). Each run is a fresh process (model load not counted: every edge times a
// generation from its own start). The browser edge runs through scripts/browser_edge.py (selenium and
// Debian's Chromium: the Python `test` profile and scripts/setup-system.sh) with `prefill=first`: its
// WebAssembly drafter reads the prompt before the session opens (seconds), which its figures leave out;
// `auto` is `cloud-led` there (the same on the wire, without the contention guard).

import { spawn } from "node:child_process";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { defaultDraftPath } from "../src/args.js";
import { CLI, Cloud, freePort, pyEnv, python, REPO_DIR, startCloud } from "../test/helpers.js";

const PROMPTS = [
  "Write a Python function that returns the n-th Fibonacci number.",
  "Write a Python function that checks whether a string is a palindrome.",
  "Write a Python function that merges two sorted lists into one sorted list.",
  "Write a Python function that counts the words in a text file.",
];

interface Row {
  edge: "python" | "node" | "browser";
  mode: string;
  prompt: number;
  tokS: number;
  ttftS: number;
  passesPerToken: number;
  acceptance: number;
  tokens: number[];
}

function exec(cmd: string, args: string[], env: NodeJS.ProcessEnv): Promise<string> {
  return new Promise((resolve, reject) => {
    const p = spawn(cmd, args, { env, stdio: ["ignore", "pipe", "pipe"] });
    let out = "", err = "";
    p.stdout.on("data", (d) => (out += d));
    p.stderr.on("data", (d) => (err += d));
    p.on("exit", (code) => (code === 0 ? resolve(out) : reject(new Error(`${cmd} ${args.join(" ")} exited ${code}: ${err}`))));
  });
}

// One thread for each side (the cloud, and each edge's drafter), as `--cores split` arranges it, unless
// ACESPEC_THREADS says otherwise: on a two-core machine two-thread models on both sides take turns at every
// pass and spin while they wait, which buries both edges' own costs in noise.
process.env.ACESPEC_THREADS ??= "1";

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      cloud: { type: "string" }, modes: { type: "string", default: "auto,sync" }, prompts: { type: "string", default: "3" },
      "max-tokens": { type: "string", default: "32" }, python: { type: "string" }, draft: { type: "string" },
      target: { type: "string" }, browser: { type: "boolean", default: false }, ws: { type: "string" },
    },
  });
  const py = values.python ?? python();
  if (!py) throw new Error("no Python with acespec and llama_cpp: pass --python");
  const draft = values.draft ?? defaultDraftPath();
  const target = values.target ?? join(draft, "..", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
  const maxTokens = values["max-tokens"]!;
  const modes = values.modes!.split(",");
  const prompts = PROMPTS.slice(0, Number(values.prompts));
  let cloud: Cloud | null = null;
  let addr = values.cloud;
  let ws = values.ws ?? null;
  if (values.browser && addr && !ws) throw new Error("--browser with --cloud needs --ws (the cloud's WebSocket URL)");
  if (!addr) {
    const wsPort = values.browser ? await freePort() : null;
    cloud = await startCloud(py, ["--target", target, ...(wsPort === null ? [] : ["--ws-port", String(wsPort)])]);
    addr = `127.0.0.1:${cloud.port}`;
    if (wsPort !== null) ws = `ws://127.0.0.1:${wsPort}/`;
  }
  const browserEdge = join(REPO_DIR, "edge-ts", "scripts", "browser_edge.py");
  // the Python edge names the cloud-led preset `auto` once it has one; on the wire the two are the same
  const pyHelp = await exec(py, ["-m", "acespec.cli", "edge", "--help"], pyEnv());
  const pyModes = /--mode \{([^}]*)\}/.exec(pyHelp)?.[1].split(",") ?? [];
  const pyMode = (m: string): string => (m === "auto" && !pyModes.includes("auto") ? "cloud-led" : m);
  const rows: Row[] = [];
  const reference: number[][] = [];
  const common = (p: string): string[] => ["--cloud", addr!, "--draft", draft, "--prompt", p, "--chat", "--json", "--max-tokens", maxTokens];
  try {
    for (const [i, p] of prompts.entries()) {
      const ref = JSON.parse(await exec(process.execPath, [CLI, ...common(p), "--mode", "cloud-only"], process.env));
      reference.push(ref.tokens);
      for (const mode of modes) {
        const pyOut = JSON.parse((await exec(py, ["-m", "acespec.cli", "edge", ...common(p), "--mode", pyMode(mode)], pyEnv())).trim().split("\n").pop()!);
        const nodeOut = JSON.parse(await exec(process.execPath, [CLI, ...common(p), "--mode", mode], process.env));
        for (const [edge, o] of [["python", pyOut], ["node", nodeOut]] as const) {
          const s = o.stats;
          rows.push({
            edge, mode, prompt: i, tokS: s.tokens_per_s, ttftS: s.ttft_s, passesPerToken: s.target_passes_per_token,
            acceptance: s.acceptance_rate, tokens: o.tokens,
          });
        }
        let browserNote = "";
        const pageMode = mode === "auto" ? "cloud-led" : mode;
        if (ws !== null && !["cloud-led", "sync", "pipelined", "cloud-only"].includes(pageMode)) {
          browserNote = `, browser: no ${mode} mode in the page`;
        } else if (ws !== null) {
          const b = JSON.parse(await exec(py, [browserEdge, "--ws", ws, "--gguf", draft, "--text", p, "--chat", "--mode", pageMode,
            "--max-tokens", maxTokens, "--prefill", "first"], pyEnv()));
          rows.push({
            edge: "browser", mode, prompt: i, tokS: b.tok_s, ttftS: b.ttft_s, passesPerToken: b.passes_per_token,
            acceptance: b.acceptance, tokens: b.tokens,
          });
          browserNote = `, browser ${b.tok_s} tok/s (drafter load ${b.load_s} s, prefill ${b.prefill_s} s, not counted)`;
        }
        process.stderr.write(`prompt ${i} ${mode}: python ${pyOut.stats.tokens_per_s} tok/s, node ${nodeOut.stats.tokens_per_s} tok/s${browserNote}\n`);
      }
    }
  } finally {
    await cloud?.stop();
  }
  const f = (x: number, d = 2): string => x.toFixed(d);
  const lines = [
    `prompts: ${prompts.length}, max tokens: ${maxTokens}, greedy, --chat; cloud ${values.cloud ? addr : "acespec serve (default target) on loopback"}; ` +
      (ws !== null ? `browser edge over ${ws} (prefill=first, auto = cloud-led); ` : "") +
      `ACESPEC_THREADS=${process.env.ACESPEC_THREADS}`,
    "",
    `${"edge".padEnd(7)} ${"mode".padEnd(10)} ${"prompt".padStart(6)} ${"tok/s".padStart(8)} ${"ttft s".padStart(8)} ` +
      `${"passes/tok".padStart(10)} ${"accept".padStart(7)}  text = cloud-only's`,
  ];
  for (const r of rows) {
    const same = JSON.stringify(r.tokens) === JSON.stringify(reference[r.prompt]);
    lines.push(`${r.edge.padEnd(7)} ${r.mode.padEnd(10)} ${String(r.prompt).padStart(6)} ${f(r.tokS).padStart(8)} ` +
      `${f(r.ttftS, 3).padStart(8)} ${f(r.passesPerToken, 3).padStart(10)} ${f(r.acceptance, 3).padStart(7)}  ${same ? "yes" : "NO"}`);
  }
  lines.push("");
  const mean = (xs: number[]): number => xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);
  for (const mode of modes) {
    const of = (edge: string, key: keyof Row): number => mean(rows.filter((r) => r.edge === edge && r.mode === mode).map((r) => r[key] as number));
    const ratio = of("node", "tokS") / of("python", "tokS");
    lines.push(`${mode}: mean tok/s python ${f(of("python", "tokS"))}, node ${f(of("node", "tokS"))} -> node/python ${f(ratio, 3)} ` +
      `(bar 0.9: ${ratio >= 0.9 ? "met" : "NOT met"}); ttft python ${f(of("python", "ttftS"), 3)} s, node ${f(of("node", "ttftS"), 3)} s; ` +
      `passes/token python ${f(of("python", "passesPerToken"), 3)}, node ${f(of("node", "passesPerToken"), 3)}; ` +
      `acceptance python ${f(of("python", "acceptance"), 3)}, node ${f(of("node", "acceptance"), 3)}`);
    if (rows.some((r) => r.edge === "browser" && r.mode === mode)) {
      lines.push(`${mode}: browser (WebAssembly drafter) mean tok/s ${f(of("browser", "tokS"))} -> browser/python ` +
        `${f(of("browser", "tokS") / of("python", "tokS"), 3)}; ttft ${f(of("browser", "ttftS"), 3)} s; passes/token ` +
        `${f(of("browser", "passesPerToken"), 3)}; acceptance ${f(of("browser", "acceptance"), 3)}`);
    }
  }
  process.stdout.write(lines.join("\n") + "\n");
}

main().catch((e) => {
  process.stderr.write(`bench-edges: ${(e as Error).message}\n`);
  process.exit(1);
});
