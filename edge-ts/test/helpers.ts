// Shared by the tests: where the repository's files are, the JSON vectors' frame notation, and a real
// `acespec serve` started on loopback for the live tests.

import { ChildProcess, spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { Frame, FrameType } from "../src/wire/frames.js";

const here = dirname(fileURLToPath(import.meta.url)); // edge-ts/dist/test
export const EDGE_DIR = resolve(here, "..", ".."); // edge-ts
export const REPO_DIR = resolve(EDGE_DIR, "..");
export const VECTORS_DIR = process.env.ACESPEC_VECTORS_DIR || join(REPO_DIR, "spec", "vectors");
export const CLI = join(EDGE_DIR, "dist", "src", "cli.js");

/** The JSON file in spec/vectors, or null when the repository has none (the test then skips, saying why). */
export function vectors(name: string): any | null {
  const path = join(VECTORS_DIR, name);
  if (!existsSync(path)) return null;
  // integers beyond 2**53 (u64 varints written as JSON numbers) would lose their low bits in a double
  const text = readFileSync(path, "utf8").replace(/([:\[,]\s*)(\d{16,})(?=\s*[,\]}])/g, '$1"__big__$2"');
  return JSON.parse(text, (_k, v) => {
    if (typeof v !== "string" || !v.startsWith("__big__")) return v;
    const big = BigInt(v.slice(7));
    return big <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(big) : big;
  });
}

export const hex = (s: string): Uint8Array => new Uint8Array(Buffer.from(s, "hex"));
export const toHex = (b: Uint8Array): string => Buffer.from(b).toString("hex");

const BYTES = new Set(["auth", "secret", "digest"]);
const U64 = new Set(["seed", "nonce", "sent_us"]);

/** A frame in the vectors' notation (type names, flags as on the wire, bytes as hex, u64 as decimal strings). */
export function frameFromJson(j: Record<string, any>): Frame {
  const f: Record<string, any> = { ...j, type: FrameType[j.type as keyof typeof FrameType] };
  for (const k of Object.keys(f)) {
    if (BYTES.has(k)) f[k] = hex(f[k]);
    else if (U64.has(k)) f[k] = BigInt(f[k]) <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(f[k]) : BigInt(f[k]);
  }
  if (f.type === FrameType.VERDICT) {
    f.dropped = Boolean(j.flags & 1);
    f.finished = Boolean(j.flags & 8);
    delete f.flags;
  } else if (f.type === FrameType.TOKENS) {
    f.finished = Boolean(j.flags & 1);
    if (!(j.flags & 2)) Object.assign(f, { drafted: null, accepted: 0, verify_us: 0 });
    if (!(j.flags & 4)) f.logprobs = null;
    delete f.flags;
  } else if (f.type === FrameType.DRAFT) {
    delete f.flags;
  }
  return f as Frame;
}

/** The inverse of frameFromJson, for comparing a decoded frame with the vector's. */
export function frameToJson(f: Frame): Record<string, any> {
  const j: Record<string, any> = { ...f, type: FrameType[f.type] };
  for (const k of Object.keys(j)) {
    if (BYTES.has(k)) j[k] = toHex(j[k]);
    else if (U64.has(k)) j[k] = String(j[k]);
  }
  if (f.type === FrameType.VERDICT) {
    j.flags = (f.dropped ? 1 : 0) | (f.p ? 2 : 0) | (f.path ? 4 : 0) | (f.finished ? 8 : 0);
    delete j.dropped;
    delete j.finished;
  } else if (f.type === FrameType.TOKENS) {
    j.flags = (f.finished ? 1 : 0) | (f.drafted !== null ? 2 : 0) | (f.logprobs !== null ? 4 : 0);
    delete j.finished;
    if (f.logprobs === null) delete j.logprobs;
    if (f.drafted === null) {
      delete j.drafted;
      delete j.accepted;
      delete j.verify_us;
    }
  } else if (f.type === FrameType.DRAFT) {
    j.flags = (f.q ? 1 : 0) | (f.parents ? 2 : 0);
  }
  return j;
}

// -- the Python side, for the live tests ------------------------------------------------------------

/** The Python interpreter that runs the repository's acespec (ACESPEC_PYTHON, else the repository's
 * .venv, else python3), or null when none can; `llama`: it must load GGUF models too. */
export function python(llama = true): string | null {
  const candidates = [process.env.ACESPEC_PYTHON, join(REPO_DIR, ".venv", "bin", "python"), "python3"];
  const imports = "import acespec.cloud.server" + (llama ? ", llama_cpp" : "");
  for (const c of candidates) {
    if (!c) continue;
    const r = spawnSync(c, ["-c", imports], { env: pyEnv(), cwd: PY_ROOT, stdio: "ignore" });
    if (r.status === 0) return c;
  }
  return null;
}

/** Where the acespec package that the Python side runs lives: this repository, or ACESPEC_PYTHONPATH. */
export const PY_ROOT = process.env.ACESPEC_PYTHONPATH || REPO_DIR;

const scratch: string[] = [];
process.on("exit", () => { for (const d of scratch) rmSync(d, { recursive: true, force: true }); });

/** A fresh directory under the system's temporary one, removed when the test process exits (a CI machine
 *  runs the suite many times; nothing a test writes should outlive it). */
export function scratchDir(): string {
  const d = mkdtempSync(join(tmpdir(), "acespec-edge-ts-"));
  scratch.push(d);
  return d;
}

export function pyEnv(): NodeJS.ProcessEnv {
  // the repository's own acespec package, whichever interpreter runs it (`python -m` puts the working
  // directory first on sys.path, so the Python processes also run from PY_ROOT)
  return { ...process.env, PYTHONPATH: PY_ROOT };
}

export function freePort(): Promise<number> {
  return new Promise((res, rej) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => res(port));
    });
    s.on("error", rej);
  });
}

export interface Cloud {
  port: number;
  proc: ChildProcess;
  log: () => string;
  stop: () => Promise<void>;
}

/** A real `acespec serve` on loopback, ready when it accepts connections. */
export async function startCloud(py: string, args: string[], readyTimeoutMs = 120_000): Promise<Cloud> {
  const port = await freePort();
  const proc = spawn(py, ["-m", "acespec.cli", "serve", "--host", "127.0.0.1", "--port", String(port), ...args], {
    env: pyEnv(), cwd: PY_ROOT, stdio: ["ignore", "pipe", "pipe"],
  });
  let out = "";
  proc.stdout!.on("data", (d) => (out += d));
  proc.stderr!.on("data", (d) => (out += d));
  const stop = async (): Promise<void> => {
    if (proc.exitCode === null) {
      proc.kill("SIGTERM");
      await new Promise((r) => proc.once("exit", r));
    }
  };
  const deadline = Date.now() + readyTimeoutMs;
  for (;;) {
    if (proc.exitCode !== null) throw new Error(`acespec serve exited with ${proc.exitCode}:\n${out}`);
    if (await accepts(port)) return { port, proc, log: () => out, stop };
    if (Date.now() > deadline) {
      await stop();
      throw new Error(`acespec serve did not listen within ${readyTimeoutMs / 1000} s:\n${out}`);
    }
    await new Promise((r) => setTimeout(r, 200));
  }
}

async function accepts(port: number): Promise<boolean> {
  const { connect } = await import("node:net");
  return new Promise((res) => {
    const s = connect({ host: "127.0.0.1", port }, () => {
      s.destroy();
      res(true);
    });
    s.on("error", () => res(false));
  });
}

/** Run a command to its end: [exit code, stdout, stderr]. */
export function run(cmd: string, args: string[], env: NodeJS.ProcessEnv = process.env, timeoutMs = 600_000):
  Promise<[number | null, string, string]> {
  return new Promise((res) => {
    const p = spawn(cmd, args, { env, cwd: PY_ROOT, stdio: ["ignore", "pipe", "pipe"] });
    let out = "", err = "";
    p.stdout.on("data", (d) => (out += d));
    p.stderr.on("data", (d) => (err += d));
    const timer = setTimeout(() => p.kill("SIGKILL"), timeoutMs);
    p.on("exit", (code) => {
      clearTimeout(timer);
      res([code, out, err]);
    });
  });
}

/** A TCP relay to 127.0.0.1:`port` that cuts its first connection (both ways, no CLOSE) once `after`
 * bytes have come down from the cloud: a link that dies mid-session. Later connections pass through. */
export async function cuttingRelay(port: number, after: number): Promise<{ port: number; cuts: () => number; close: () => void }> {
  const { createServer: tcpServer, connect } = await import("node:net");
  let cuts = 0, first = true;
  const server = tcpServer((edge) => {
    const cut = first;
    first = false;
    const cloud = connect({ host: "127.0.0.1", port });
    let down = 0;
    edge.on("data", (d) => cloud.write(d));
    cloud.on("data", (d) => {
      down += d.length;
      if (cut && down >= after) {
        cuts++;
        edge.destroy();
        cloud.destroy();
        return;
      }
      edge.write(d);
    });
    edge.on("error", () => cloud.destroy());
    cloud.on("error", () => edge.destroy());
    edge.on("close", () => cloud.destroy());
    cloud.on("close", () => edge.destroy());
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  return { port: (server.address() as { port: number }).port, cuts: () => cuts, close: () => server.close() };
}
