// Coupled sampling's shared noise, bit for bit as the Python side derives it:
//
//     gumbel_noise(seed, pos, vocab) = np.random.default_rng([seed & (2**64 - 1), pos]).gumbel(size=vocab)
//
// i.e. numpy's SeedSequence over the entropy words of [seed, pos], a PCG64 (XSL-RR 128/64) generator
// seeded from it, and Gumbel draws -log(-log(1 - U)) with U = (next_uint64 >> 11) * 2**-53. The cloud
// emits argmax(log p + g) at each absolute position; a drafter that picks argmax(log q + g) with the same
// g proposes exactly the target's sample whenever the two distributions agree, so the text depends on
// the cloud alone and the drafter's choices only decide how much of it is accepted.

import { uniformRow } from "./pcgwasm.js";

const INIT_A = 0x43b0d7e5;
const MULT_A = 0x931e8875;
const INIT_B = 0x8b51f9dd;
const MULT_B = 0x58f38ded;
const MIX_MULT_L = 0xca01f9dd;
const MIX_MULT_R = 0x4973f715;
const POOL_SIZE = 4;

/** numpy's _int_to_uint32_array: little-endian 32-bit words, [0] for 0. */
function intWords(n: bigint): number[] {
  if (n < 0n) throw new RangeError("negative entropy");
  if (n === 0n) return [0];
  const out: number[] = [];
  while (n > 0n) {
    out.push(Number(n & 0xffffffffn));
    n >>= 32n;
  }
  return out;
}

/** numpy.random.SeedSequence(entropy).generate_state(nWords, uint32). */
export function seedSequenceState(entropy: bigint[], nWords: number): Uint32Array {
  const words = entropy.flatMap(intWords);
  const pool = new Uint32Array(POOL_SIZE);
  let hashConst = INIT_A;
  const hashmix = (value: number): number => {
    value = (value ^ hashConst) >>> 0;
    hashConst = Math.imul(hashConst, MULT_A) >>> 0;
    value = Math.imul(value, hashConst) >>> 0;
    return (value ^ (value >>> 16)) >>> 0;
  };
  const mix = (x: number, y: number): number => {
    const r = (Math.imul(MIX_MULT_L, x) - Math.imul(MIX_MULT_R, y)) >>> 0;
    return (r ^ (r >>> 16)) >>> 0;
  };
  for (let i = 0; i < POOL_SIZE; i++) pool[i] = hashmix(i < words.length ? words[i] : 0);
  for (let src = 0; src < POOL_SIZE; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) if (src !== dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  }
  for (let src = POOL_SIZE; src < words.length; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) pool[dst] = mix(pool[dst], hashmix(words[src]));
  }
  const out = new Uint32Array(nWords);
  let hc = INIT_B;
  for (let i = 0; i < nWords; i++) {
    let v = pool[i % POOL_SIZE];
    v = (v ^ hc) >>> 0;
    hc = Math.imul(hc, MULT_B) >>> 0;
    v = Math.imul(v, hc) >>> 0;
    out[i] = (v ^ (v >>> 16)) >>> 0;
  }
  return out;
}

// PCG64's multiplier 0x2360ED051FC65DA44385DF649FCCF645 in 16-bit limbs, least significant first: a
// 128-bit product then needs only products of 16-bit numbers, which doubles hold exactly.
const MULT = [0xf645, 0x9fcc, 0xdf64, 0x4385, 0x5da4, 0x1fc6, 0xed05, 0x2360];

/** numpy's PCG64 (XSL-RR output), state and increment as 8 16-bit limbs each. */
export class Pcg64 {
  private s = new Float64Array(8);
  private inc = new Float64Array(8);
  private t = new Float64Array(8);

  /** Seeded as numpy seeds it from a SeedSequence: generate_state(4, uint64) = [s_hi, s_lo, inc_hi, inc_lo]. */
  static fromEntropy(entropy: bigint[]): Pcg64 {
    const w = seedSequenceState(entropy, 8); // uint64 k = w[2k] | w[2k+1] << 32 (little-endian view)
    const u64 = (k: number): bigint => BigInt(w[2 * k]) | (BigInt(w[2 * k + 1]) << 32n);
    const initState = (u64(0) << 64n) | u64(1);
    const initSeq = (u64(2) << 64n) | u64(3);
    const g = new Pcg64();
    g.setBig(g.inc, ((initSeq << 1n) | 1n) & ((1n << 128n) - 1n));
    g.setBig(g.s, 0n);
    g.step();
    g.setBig(g.s, (g.getBig(g.s) + initState) & ((1n << 128n) - 1n));
    g.step();
    return g;
  }

  private setBig(limbs: Float64Array, v: bigint): void {
    for (let i = 0; i < 8; i++) limbs[i] = Number((v >> BigInt(16 * i)) & 0xffffn);
  }

  private getBig(limbs: Float64Array): bigint {
    let v = 0n;
    for (let i = 7; i >= 0; i--) v = (v << 16n) | BigInt(limbs[i]);
    return v;
  }

  /** state = state * MULT + inc (mod 2**128). */
  private step(): void {
    const s = this.s, t = this.t, inc = this.inc;
    let carry = 0;
    for (let k = 0; k < 8; k++) {
      let acc = carry + inc[k];
      for (let i = 0; i <= k; i++) acc += s[i] * MULT[k - i];
      const lo = acc % 65536;
      t[k] = lo;
      carry = (acc - lo) / 65536;
    }
    s.set(t);
  }

  stateBig(): bigint {
    return this.getBig(this.s);
  }

  incBig(): bigint {
    return this.getBig(this.inc);
  }

  /** The 128-bit state and increment as 32 hex digits (for the vectors' checks). */
  stateHex(): string {
    return this.getBig(this.s).toString(16).padStart(32, "0");
  }

  incHex(): string {
    return this.getBig(this.inc).toString(16).padStart(32, "0");
  }

  /** The next 64-bit output as a bigint (slow; nextDouble is the generator's hot path). */
  nextUint64(): bigint {
    this.next();
    return (BigInt(this.xhi) << 32n) | BigInt(this.xlo);
  }

  /** The next output's top 53 bits as a double in [0, 1): numpy's next_double. */
  nextDouble(): number {
    this.next();
    return (this.xhi * 2097152 + (this.xlo >>> 11)) / 9007199254740992; // ((x >> 11) as 53 bits) * 2**-53
  }

  private xhi = 0;
  private xlo = 0;

  private next(): void {
    this.step();
    const s = this.s;
    // XSL-RR: x = hi64 ^ lo64, rotated right by the state's top 6 bits
    let xhi = ((s[7] * 65536 + s[6]) ^ (s[3] * 65536 + s[2])) >>> 0;
    let xlo = ((s[5] * 65536 + s[4]) ^ (s[1] * 65536 + s[0])) >>> 0;
    let rot = (s[7] >>> 10) & 63;
    if (rot >= 32) {
      const tmp = xhi;
      xhi = xlo;
      xlo = tmp;
      rot -= 32;
    }
    if (rot) {
      const h = ((xhi >>> rot) | (xlo << (32 - rot))) >>> 0;
      const l = ((xlo >>> rot) | (xhi << (32 - rot))) >>> 0;
      xhi = h;
      xlo = l;
    }
    this.xhi = xhi;
    this.xlo = xlo;
  }

  /** numpy's random_gumbel(loc=0, scale=1). */
  nextGumbel(): number {
    for (;;) {
      const u = 1.0 - this.nextDouble();
      if (u < 1.0) return -Math.log(-Math.log(u));
    }
  }
}

const U64 = (1n << 64n) - 1n;

/** The uniform draws of a whole row at (seed, pos), from the WebAssembly loop; null in the one case it
 * cannot serve: a draw of exactly 0, which numpy's Gumbel rejects and redraws, shifting the row after it
 * (probability 2**-53 a draw); the JS generator then does the row. */
function fastRow(seed: bigint | number, pos: number, vocab: number): Float64Array | null {
  const g = Pcg64.fromEntropy([BigInt(seed) & U64, BigInt(pos)]);
  const u = uniformRow(vocab, g.stateBig(), g.incBig());
  for (let i = 0; i < vocab; i++) if (u[i] === 0) return null;
  return u;
}

/** The shared noise at one absolute position: gumbel_noise(seed, pos, vocab). */
export function gumbelNoise(seed: bigint | number, pos: number, vocab: number): Float64Array {
  const out = new Float64Array(vocab);
  const u = fastRow(seed, pos, vocab);
  if (u !== null) {
    for (let i = 0; i < vocab; i++) out[i] = -Math.log(-Math.log(1.0 - u[i]));
    return out;
  }
  const g = Pcg64.fromEntropy([BigInt(seed) & U64, BigInt(pos)]);
  for (let i = 0; i < vocab; i++) out[i] = g.nextGumbel();
  return out;
}

/** argmax(log dist + g): coupled_sample(dist, seed, pos). `dist` is dense over the vocabulary. */
export function coupledSample(dist: Float64Array | Float32Array, seed: bigint | number, pos: number): number {
  let nonzero = 0, first = 0;
  for (let i = 0; i < dist.length; i++) if (dist[i] > 0) {
    if (!nonzero) first = i;
    nonzero++;
  }
  if (nonzero <= 1) return nonzero ? first : argmax(dist); // a point mass: no noise can move it
  const u = fastRow(seed, pos, dist.length);
  const noise = u === null ? gumbelNoise(seed, pos, dist.length) : null;
  let best = -1, bestScore = -Infinity;
  for (let i = 0; i < dist.length; i++) {
    if (!(dist[i] > 0)) continue; // log 0 = -inf: never the argmax while some id has mass
    const g = noise !== null ? noise[i] : -Math.log(-Math.log(1.0 - u![i]));
    const score = Math.log(dist[i]) + g;
    if (score > bestScore || best < 0) { // the lowest id on a tie, as numpy's argmax
      bestScore = score;
      best = i;
    }
  }
  return best;
}

/** coupled_sample over a distribution known by its likeliest tokens `top` (token -> q, renormalised over
 * them): the token, or null when a token outside `top` could still win (its q is at most the smallest in
 * `top`, its noise is known). `complete`: `top` is the whole support (a top-k cut), nothing else can win. */
export function coupledTop(top: Map<number, number>, vocab: number, seed: bigint | number, pos: number, complete: boolean): number | null {
  let nonzero = 0, first = -1, smallest = Infinity;
  for (const [t, p] of top) if (p > 0) {
    nonzero++;
    if (first < 0 || t < first) first = t;
    smallest = Math.min(smallest, p);
  }
  if (nonzero === 0) return null;
  if (nonzero === 1 && complete) return first; // a point mass
  const u = fastRow(seed, pos, vocab);
  if (u === null) return null;
  const gumbel = (x: number): number => -Math.log(-Math.log(1.0 - x));
  let best = -1, bestScore = -Infinity;
  for (const [t, p] of top) {
    if (!(p > 0)) continue;
    const score = Math.log(p) + gumbel(u[t]);
    if (score > bestScore || (score === bestScore && t < best)) {
      bestScore = score;
      best = t;
    }
  }
  if (complete) return best;
  let umin = 2; // the smallest draw outside `top`: the noise -log(-log(1 - u)) decreases as u grows
  for (let i = 0; i < vocab; i++) if (u[i] < umin && !top.has(i)) umin = u[i];
  return umin > 1 || Math.log(smallest) + gumbel(umin) < bestScore ? best : null;
}

function argmax(a: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < a.length; i++) if (a[i] > a[best]) best = i;
  return best;
}
