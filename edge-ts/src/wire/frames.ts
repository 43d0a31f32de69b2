// AceSpec wire format, protocol version 3: the frame types, limits and errors. The format is specified
// in the Python package's `acespec/wire/frames.py` docstring (and docs/reference/wire.md); this module
// and codec.ts implement the same format, with the same checks and the same error codes.

export const PROTOCOL_VERSION = 3;
export const MAX_TOP_LOGPROBS = 20; // alternatives per token that HELLO.logprobs may ask for
export const LOGPROB_FLOOR = -9999.0; // the smallest log-probability on the wire; it stands for anything below it too
export const MAX_ERROR_MESSAGE_BYTES = 512;
export const MAX_SECRET_BYTES = 64; // longest WELCOME/RESUME secret and RESUME digest

export const U64_MAX = (1n << 64n) - 1n;
// largest finite binary32
export const F32_MAX = new DataView(new Uint8Array([0x7f, 0x7f, 0xff, 0xff]).buffer).getFloat32(0);

export enum ErrorCode {
  BAD_FRAME = 1,
  BAD_VERSION = 2,
  BAD_AUTH = 3,
  UNKNOWN_SESSION = 4,
  OVER_LIMIT = 5,
  BUSY = 6,
  BAD_REQUEST = 7,
  MODEL_MISMATCH = 8,
  INTERNAL = 9,
}

export enum FrameType {
  HELLO = 1,
  WELCOME = 2,
  DRAFT = 3,
  VERDICT = 4,
  RESUME = 5,
  PING = 6,
  PONG = 7,
  ERROR = 8,
  CLOSE = 9,
  TOKENS = 10,
}

export enum Mode {
  SPECULATIVE = 0, // the edge drafts, the cloud verifies each DRAFT (VERDICT)
  CLOUD_ONLY = 1, // the cloud generates alone and streams TOKENS
  CLOUD_LED = 2, // the cloud decodes without waiting and streams TOKENS; DRAFTs speed it up
}

export enum CloseReason {
  NORMAL = 0,
  GOING_AWAY = 1,
  ERROR = 2,
  IDLE = 3,
}

/** The one exception type of the wire layer: decoding raises it and nothing else, whatever the bytes. */
export class WireError extends Error {
  readonly code: ErrorCode;
  readonly detail: string;
  frames: Frame[]; // frames FrameDecoder.feed decoded, in the same call, before the bad one

  constructor(code: ErrorCode, detail: string, frames: Frame[] = []) {
    super(`${ErrorCode[code]}: ${detail}`);
    this.name = "WireError";
    this.code = code;
    this.detail = detail;
    this.frames = frames;
  }
}

export interface Limits {
  maxFrameBytes: number; // largest L (type byte + payload), checked from the prefix alone
  maxDraftTokens: number; // tokens in one DRAFT block; bounds VERDICT accepted and path too
  maxPromptTokens: number; // tokens in a HELLO prompt or in one TOKENS frame
  maxSparseK: number; // entries in one sparse probability row
  maxStrBytes: number; // bytes in any str or bytes field
  maxVocab: number; // every token id must be < this
}

export const DEFAULT_LIMITS: Readonly<Limits> = Object.freeze({
  maxFrameBytes: 262144,
  maxDraftTokens: 64,
  maxPromptTokens: 32768,
  maxSparseK: 256,
  maxStrBytes: 4096,
  maxVocab: 1 << 22,
});

/** An unsigned integer field: a number while it is exactly representable, a bigint beyond 2**53 - 1. */
export type UInt = number | bigint;

/** A sparse probability row: [token id, probability] pairs with distinct ids. */
export type SparseRow = Array<[number, number]>;

export interface Hello {
  type: FrameType.HELLO;
  version: number;
  auth: Uint8Array;
  model_id: string;
  temperature: number;
  top_k: UInt;
  top_p: number;
  rule: string;
  seed: UInt;
  mode: Mode;
  max_tokens: UInt;
  logprobs: number; // 0: none; 1 + m: each streamed token's log-probability and the m likeliest
  prompt: number[];
}

export interface Welcome {
  type: FrameType.WELCOME;
  session: UInt;
  committed: UInt;
  max_draft_tokens: UInt;
  secret: Uint8Array;
}

export interface Draft {
  type: FrameType.DRAFT;
  session: UInt;
  seq: UInt;
  base: UInt;
  tokens: number[];
  q: SparseRow[] | null; // one row per token; sent iff not null (HAS_Q)
  parents: number[] | null; // one per token; sent iff not null (HAS_TREE)
}

export interface Verdict {
  type: FrameType.VERDICT;
  seq: UInt;
  accepted: number;
  next_token: number;
  verify_us: UInt;
  committed: UInt;
  dropped: boolean;
  finished: boolean;
  p: SparseRow | null;
  path: number[] | null;
}

export interface Resume {
  type: FrameType.RESUME;
  version: number;
  auth: Uint8Array;
  session: UInt;
  secret: Uint8Array;
  committed: UInt;
  digest: Uint8Array;
}

export interface Ping {
  type: FrameType.PING;
  nonce: UInt;
  sent_us: UInt;
}

export interface Pong {
  type: FrameType.PONG;
  nonce: UInt;
  sent_us: UInt;
}

export interface ErrorFrame {
  type: FrameType.ERROR;
  code: ErrorCode;
  message: string;
}

export interface Close {
  type: FrameType.CLOSE;
  reason: CloseReason;
}

export interface Tokens {
  type: FrameType.TOKENS;
  start: UInt;
  tokens: number[];
  finished: boolean;
  drafted: number | null; // HAS_STEP: draft tokens the step verified
  accepted: UInt; // HAS_STEP: of which kept
  verify_us: UInt; // HAS_STEP: the step's target time
  logprobs: TokenLogprob[] | null; // HAS_LOGPROBS: one per token
}

/** One streamed token's log-probability and its position's top alternatives as [token id, log-probability]. */
export type TokenLogprob = [number, SparseRow];

export type Frame = Hello | Welcome | Draft | Verdict | Resume | Ping | Pong | ErrorFrame | Close | Tokens;

// Constructors with the Python dataclasses' defaults, so callers name only what matters.

export function hello(f: Partial<Omit<Hello, "type">> & Pick<Hello, "model_id" | "max_tokens" | "prompt">): Hello {
  return {
    type: FrameType.HELLO, version: PROTOCOL_VERSION, auth: new Uint8Array(0), temperature: 1.0, top_k: 0, top_p: 1.0,
    rule: "strict", seed: 0, mode: Mode.SPECULATIVE, logprobs: 0, ...f,
  };
}

export function welcome(f: Omit<Welcome, "type" | "secret"> & { secret?: Uint8Array }): Welcome {
  return { type: FrameType.WELCOME, secret: new Uint8Array(0), ...f };
}

export function draft(f: Omit<Draft, "type" | "q" | "parents"> & Partial<Pick<Draft, "q" | "parents">>): Draft {
  return { type: FrameType.DRAFT, q: null, parents: null, ...f };
}

export function verdict(f: Omit<Verdict, "type" | "dropped" | "finished" | "p" | "path"> &
  Partial<Pick<Verdict, "dropped" | "finished" | "p" | "path">>): Verdict {
  return { type: FrameType.VERDICT, dropped: false, finished: false, p: null, path: null, ...f };
}

export function resume(f: Pick<Resume, "session" | "committed"> & Partial<Omit<Resume, "type">>): Resume {
  return {
    type: FrameType.RESUME, version: PROTOCOL_VERSION, auth: new Uint8Array(0), secret: new Uint8Array(0),
    digest: new Uint8Array(0), ...f,
  };
}

export function tokensFrame(f: Pick<Tokens, "start" | "tokens"> & Partial<Omit<Tokens, "type">>): Tokens {
  return { type: FrameType.TOKENS, finished: false, drafted: null, accepted: 0, verify_us: 0, logprobs: null, ...f };
}
