// A drafter's distribution q after temperature, top-k and top-p, as the Python side's
// acespec.verify.sampling.probs_from_logits computes it (ties at a cut broken by token id), for a backend
// that hands over the whole softmax row instead of sampling itself (the WebAssembly drafter). The rows
// here only steer a coupled pick: the coupled rule's text is the cloud's whatever q is, so a q that
// differs from Python's by rounding costs acceptance, never exactness.

import type { Sampling } from "./chain.js";

/** q from `p1`, the model's softmax at temperature 1 (its logits up to a constant, as log p1). */
export function tempered(p1: Float64Array, s: Sampling): Float64Array {
  const n = p1.length;
  const x = new Float64Array(n);
  for (let i = 0; i < n; i++) x[i] = p1[i] > 0 ? Math.log(p1[i]) / s.temperature : -Infinity;
  if (s.topK > 0 && s.topK < n) {
    const order = byDescending(x);
    for (let r = s.topK; r < n; r++) x[order[r]] = -Infinity;
  }
  let max = -Infinity;
  for (let i = 0; i < n; i++) if (x[i] > max) max = x[i];
  const q = new Float64Array(n);
  let sum = 0;
  for (let i = 0; i < n; i++) {
    q[i] = x[i] === -Infinity ? 0 : Math.exp(x[i] - max);
    sum += q[i];
  }
  for (let i = 0; i < n; i++) q[i] /= sum;
  if (s.topP < 1) {
    // keep a token if the mass strictly before it is < top_p (so at least one survives)
    const order = byDescending(q);
    let before = 0;
    let kept = 0;
    const keep = new Uint8Array(n);
    for (const i of order) {
      if (q[i] === 0) break;
      if (before < s.topP) {
        keep[i] = 1;
        kept += q[i];
      }
      before += q[i];
    }
    for (let i = 0; i < n; i++) q[i] = keep[i] ? q[i] / kept : 0;
  }
  return q;
}

/** Indices of `v`, largest first; equal values in id order (numpy's stable argsort of -v). */
function byDescending(v: Float64Array): Uint32Array {
  const order = new Uint32Array(v.length);
  for (let i = 0; i < v.length; i++) order[i] = i;
  return order.sort((a, b) => (v[b] - v[a]) || a - b);
}
