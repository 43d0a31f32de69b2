// Coupled sampling's shared noise against the vectors (spec/vectors/coupled.json): the generator bit for
// bit, the Gumbel values and the sampled tokens.

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { coupledSample, coupledTop, gumbelNoise, Pcg64, seedSequenceState } from "../src/coupled.js";
import { tempered } from "../src/sampling.js";
import { vectors, VECTORS_DIR } from "./helpers.js";

const V = vectors("coupled.json");
const skip = V === null ? `no coupled-sampling vectors at ${VECTORS_DIR}/coupled.json` : false;

describe("coupled sampling against the vectors", { skip }, () => {
  it("derives the generator's seed, state and first outputs exactly as numpy does", () => {
    for (const v of V.rng) {
      const entropy = [BigInt(v.seed), BigInt(v.pos)];
      assert.deepEqual(Array.from(seedSequenceState(entropy, 8)), v.state_words, `seed ${v.seed} pos ${v.pos}`);
      const g = Pcg64.fromEntropy(entropy);
      assert.equal(g.stateHex(), v.pcg64_state);
      assert.equal(g.incHex(), v.pcg64_inc);
      const outs = v.first_uint64.map(() => g.nextUint64().toString(16).padStart(16, "0"));
      assert.deepEqual(outs, v.first_uint64);
      const d = Pcg64.fromEntropy(entropy);
      assert.deepEqual(v.first_doubles.map(() => d.nextDouble()), v.first_doubles);
    }
  });

  it("draws the same Gumbel noise, to within the last bits of the platform's log", () => {
    // the uniform draws are exact (above); -log(-log(u)) goes through V8's log, which may differ from the
    // C library's in the last bit: a 1e-15 difference, which changes an argmax only on an exact tie
    for (const v of V.noise) {
      const g = gumbelNoise(BigInt(v.seed), Number(v.pos), v.vocab);
      assert.equal(g.length, v.vocab);
      // small vocabularies list every value; the full-size one samples a few positions (`gumbel_at`)
      const want: [number, number][] = v.gumbel ? v.gumbel.map((x: number, i: number) => [i, x])
        : Object.entries(v.gumbel_at).map(([i, x]) => [Number(i), x as number]);
      let worst = 0;
      for (const [i, x] of want) worst = Math.max(worst, Math.abs(g[i] - x) / Math.max(1, Math.abs(x)));
      assert.ok(worst < 1e-13, `seed ${v.seed} pos ${v.pos}: relative difference ${worst}`);
    }
  });

  it("samples the vectors' tokens from their distributions", () => {
    for (const v of V.samples) assert.equal(coupledSample(Float64Array.from(v.dist), BigInt(v.seed), Number(v.pos)), v.token, v.name);
  });

  it("writes the vectors' text, one position after another", () => {
    const got = V.text.steps.map((s: { dist: number[]; pos: string }) => coupledSample(Float64Array.from(s.dist), BigInt(V.text.seed), Number(s.pos)));
    assert.deepEqual(got, V.text.steps.map((s: { token: number }) => s.token));
  });
});

describe("the WebAssembly generator", () => {
  it("draws exactly the JS generator's doubles for a whole vocabulary row", async () => {
    const { uniformRow } = await import("../src/pcgwasm.js");
    for (const [seed, pos] of [[0n, 0n], [7n, 12n], [(1n << 64n) - 1n, 4294967297n], [5n, 1000n]]) {
      const js = Pcg64.fromEntropy([seed, pos]);
      const fast = Pcg64.fromEntropy([seed, pos]);
      const row = uniformRow(151936, fast.stateBig(), fast.incBig());
      for (let i = 0; i < row.length; i++) assert.equal(row[i], js.nextDouble(), `seed ${seed} pos ${pos} draw ${i}`);
    }
  });

  it("gives coupled sampling the same noise through either generator", () => {
    const g = gumbelNoise(5n, 1000, 4096);
    const js = Pcg64.fromEntropy([5n, 1000n]);
    for (let i = 0; i < g.length; i++) assert.equal(g[i], js.nextGumbel());
  });
});

describe("coupled sampling from the likeliest tokens only", () => {
  it("picks what the whole distribution picks, or says it cannot tell", () => {
    let decided = 0;
    for (let pos = 0; pos < 200; pos++) {
      // a peaked, long-tailed distribution over 4096 ids, like a language model's
      const q = new Float64Array(4096);
      let z = 0;
      for (let i = 0; i < q.length; i++) z += q[i] = Math.exp(-0.01 * ((i * 7919 + pos * 31) % 4096) - (i % 97 === pos % 97 ? -6 : 0));
      for (let i = 0; i < q.length; i++) q[i] /= z;
      const order = Array.from(q.keys()).sort((a, b) => q[b] - q[a]).slice(0, 256);
      const mass = order.reduce((s, i) => s + q[i], 0);
      const top = new Map(order.map((i) => [i, q[i] / mass]));
      const got = coupledTop(top, q.length, 3n, pos, false);
      if (got !== null) {
        decided++;
        assert.equal(got, coupledSample(q, 3n, pos), `position ${pos}`);
      }
    }
    assert.ok(decided > 100, `decided only ${decided} of 200`);
  });
});

describe("a drafter's q from a softmax row (the WebAssembly drafter's coupled picks)", { skip }, () => {
  it("is the vectors' q after temperature, top-k and top-p, ties at a cut broken by id", () => {
    const p1 = Float64Array.from(V.tempered.p1 as number[]);
    for (const c of V.tempered.cases) {
      const q = tempered(p1, { temperature: c.temperature, topK: c.top_k, topP: c.top_p });
      const want = c.q as number[];
      assert.equal(q.length, want.length);
      for (let i = 0; i < want.length; i++) {
        assert.ok(Math.abs(q[i] - want[i]) <= 1e-12 * Math.max(1, want[i]), `${JSON.stringify(c)} at ${i}: ${q[i]}`);
        assert.equal(q[i] === 0, want[i] === 0, `${JSON.stringify(c)}: what is cut at ${i}`);
      }
    }
  });
});
