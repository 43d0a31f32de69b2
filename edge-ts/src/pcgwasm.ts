// PCG64's hot loop in WebAssembly: a whole vocabulary's uniform draws for one position. The 128-bit state
// update needs 64-bit multiplies, which JavaScript numbers cannot do exactly; in JS (coupled.ts, Pcg64)
// a row of 151,936 draws costs about 50 ms, here about 2. The module is assembled below from its opcodes
// (no toolchain, nothing fetched) and checked against the JS generator by the tests.

// PCG64's multiplier, 0x2360ED051FC65DA4_4385DF649FCCF645
const M_HI = 0x2360ed051fc65da4n;
const M_LO = 0x4385df649fccf645n;

function uleb(n: number): number[] {
  const out: number[] = [];
  do {
    let b = n & 0x7f;
    n >>>= 7;
    if (n) b |= 0x80;
    out.push(b);
  } while (n);
  return out;
}

/** Signed LEB128 of a 64-bit value given as an unsigned bigint (what i64.const takes). */
function sleb64(v: bigint): number[] {
  let x = BigInt.asIntN(64, v);
  const out: number[] = [];
  for (;;) {
    const b = Number(x & 0x7fn);
    x >>= 7n;
    const done = (x === 0n && !(b & 0x40)) || (x === -1n && (b & 0x40));
    out.push(done ? b : b | 0x80);
    if (done) return out;
  }
}

const vec = (items: number[][]): number[] => [...uleb(items.length), ...items.flat()];
const section = (id: number, body: number[]): number[] => [id, ...uleb(body.length), ...body];
// plain JS, no Buffer: the browser edge draws coupled noise with this module too
const name = (s: string): number[] => [...uleb(s.length), ...Array.from(s, (c) => c.charCodeAt(0) & 0xff)];

// opcodes
const GET = 0x20, SET = 0x21, TEE = 0x22, I64C = 0x42, I32C = 0x41, F64C = 0x44;
const I64_AND = 0x83, I64_XOR = 0x85, I64_SHR_U = 0x88, I64_ROTR = 0x8a, I64_MUL = 0x7e, I64_ADD = 0x7c, I64_LT_U = 0x54;
const I64_EXTEND_I32_U = 0xad, F64_CONVERT_I64_U = 0xba, F64_MUL = 0xa2, F64_STORE = 0x39;
const I32_GE_U = 0x4f, I32_SHL = 0x74, I32_ADD = 0x6a, BLOCK = 0x02, LOOP = 0x03, BR = 0x0c, BR_IF = 0x0d, END = 0x0b, VOID = 0x40;

// locals: params n (i32), shi, slo, ihi, ilo (i64); then i (i32); alo, ahi, p1, p2, hi, nlo (i64)
const N = 0, SHI = 1, SLO = 2, IHI = 3, ILO = 4, I = 5, ALO = 6, AHI = 7, P1 = 8, P2 = 9, HI = 10, NLO = 11;

function i64c(v: bigint): number[] {
  return [I64C, ...sleb64(v)];
}

function f64c(x: number): number[] {
  const b = new DataView(new ArrayBuffer(8));
  b.setFloat64(0, x, true);
  return [F64C, ...new Uint8Array(b.buffer)];
}

function body(): number[] {
  const mask = i64c(0xffffffffn), bLo = i64c(M_LO & 0xffffffffn), bHi = i64c(M_LO >> 32n);
  const shr32 = [...i64c(32n), I64_SHR_U];
  return [
    BLOCK, VOID, LOOP, VOID,
    GET, I, GET, N, I32_GE_U, BR_IF, 1,
    // mulhi(slo, M_LO) from 32-bit halves
    GET, SLO, ...mask, I64_AND, SET, ALO,
    GET, SLO, ...shr32, SET, AHI,
    GET, ALO, ...bLo, I64_MUL, ...shr32,
    GET, ALO, ...bHi, I64_MUL, TEE, P1, ...mask, I64_AND, I64_ADD,
    GET, AHI, ...bLo, I64_MUL, TEE, P2, ...mask, I64_AND, I64_ADD,
    ...shr32,
    GET, AHI, ...bHi, I64_MUL, I64_ADD,
    GET, P1, ...shr32, I64_ADD,
    GET, P2, ...shr32, I64_ADD,
    // + slo * M_HI + shi * M_LO: the high half of state * M (mod 2**128)
    GET, SLO, ...i64c(M_HI), I64_MUL, I64_ADD,
    GET, SHI, ...i64c(M_LO), I64_MUL, I64_ADD,
    SET, HI,
    // low half + inc, with its carry into the high half
    GET, SLO, ...i64c(M_LO), I64_MUL, GET, ILO, I64_ADD, SET, NLO,
    GET, HI, GET, IHI, I64_ADD, GET, NLO, GET, ILO, I64_LT_U, I64_EXTEND_I32_U, I64_ADD, SET, SHI,
    GET, NLO, SET, SLO,
    // XSL-RR output, its top 53 bits as a double in [0, 1), stored at i * 8
    GET, I, I32C, 3, I32_SHL,
    GET, SHI, GET, SLO, I64_XOR, GET, SHI, ...i64c(58n), I64_SHR_U, I64_ROTR,
    ...i64c(11n), I64_SHR_U, F64_CONVERT_I64_U, ...f64c(2 ** -53), F64_MUL,
    F64_STORE, 3, 0,
    GET, I, I32C, 1, I32_ADD, SET, I,
    BR, 0,
    END, END, END,
  ];
}

function moduleBytes(pages: number): Uint8Array {
  const I32 = 0x7f, I64 = 0x7e;
  const code = [...vec([[1, I32], [6, I64]]), ...body()];
  return Uint8Array.from([
    0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00,
    ...section(1, vec([[0x60, ...vec([[I32], [I64], [I64], [I64], [I64]]), 0x00]])),
    ...section(3, vec([[0]])),
    ...section(5, vec([[0x00, ...uleb(pages)]])),
    ...section(7, vec([[...name("fill"), 0x00, 0], [...name("mem"), 0x02, 0]])),
    ...section(10, vec([[...uleb(code.length), ...code]])),
  ]);
}

type Fill = (n: number, shi: bigint, slo: bigint, ihi: bigint, ilo: bigint) => void;
let instance: { fill: Fill; mem: WebAssembly.Memory } | null = null;

/** `n` uniform draws next_double() of a PCG64 whose 128-bit state and increment are given (the state
 * before the first draw). The array is a view into the module's memory: the next call overwrites it. */
export function uniformRow(n: number, state: bigint, inc: bigint): Float64Array {
  if (instance === null) {
    const mod = new WebAssembly.Module(moduleBytes(Math.max(1, Math.ceil((n * 8) / 65536))));
    const exp = new WebAssembly.Instance(mod).exports as unknown as { fill: Fill; mem: WebAssembly.Memory };
    instance = exp;
  }
  const need = Math.ceil((n * 8) / 65536) - instance.mem.buffer.byteLength / 65536;
  if (need > 0) instance.mem.grow(need);
  const u64 = (v: bigint): bigint => BigInt.asIntN(64, v);
  instance.fill(n, u64(state >> 64n), u64(state), u64(inc >> 64n), u64(inc));
  return new Float64Array(instance.mem.buffer, 0, n);
}
