"""Whether a coupled cloud-led text can differ from cloud-only's on llama.cpp's CPU kernels: pass shapes.

Generates HumanEval/6 as the never-slower grid's N = 8 cell does (cloud-only, coupled, T = 1.0, seed 6,
48 tokens, the batched engine), then rebuilds the KV of that text's first 47 tokens in passes of 1, 2,
3, 5 and 8 tokens (a speculative session verifies positions in passes of k + 1 rows) and prints, for
the 48th position, the Gumbel-perturbed scores that coupled sampling compares: log p + g, for the token
cloud-only chose and for the one a cloud-led run took (7990), and which token wins.

    .venv/bin/python scripts/pass_shape_rounding.py

Everything is the same but the shapes the history was computed in; a different winner means the rows'
rounding, not the rule, decided the token (docs/design-notes.md, cloud-led exactness). Before exact
passes (LlamaCppModel's default since 2026-12-03) 7990 won when the history was built 8 tokens a pass
(-0.917 against -0.933) and cloud-only's 421 otherwise; with them, every n prints the same bits (flash
attention changed the text itself, so cloud-only's token there is another one now). `--loose` runs the
model without exact passes, to see the difference again.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from acespec.bench.tenants import _target, bundled_traces, run_cell
from acespec.cloud.engine import make_engine
from acespec.verify import SamplingParams, gumbel_noise, probs_from_logits

PID, SEED, POS, OTHER = "HumanEval/6", 6, 47, 7990


def main() -> None:
    trace = next(t for t in bundled_traces().prompts if t.id == PID)
    if "--loose" in sys.argv[1:]:
        os.environ["ACESPEC_EXACT_PASSES"] = "0"  # the operator's switch, read when the model loads
    model = _target("batched", 4, 512)
    try:
        r = run_cell(make_engine("batched", model, slots=4), [trace], "cloud-only", 1, max_tokens=POS + 1, draft_s=0.0,
                     rule="coupled", temperature=1.0, seed=SEED)
        out, prompt = r["outputs"][PID], list(trace.prompt_tokens)
        chosen = out[POS]
        g = gumbel_noise(SEED, len(prompt) + POS, model.vocab_size)
        print(f"{PID}, token {POS + 1}: cloud-only chose {chosen}; scores log p + g after the same {POS} tokens, "
              f"computed in passes of n tokens:")
        scores = {}
        for n in (1, 2, 3, 5, 8):
            model.reset()
            model.prefill(prompt)
            for i in range(0, POS, n):
                rows = model.eval(out[i : min(i + n, POS)], last=min(n, POS - i))
            s = scores[n] = np.log(probs_from_logits(np.asarray(rows[-1], dtype=np.float64), SamplingParams(1.0))) + g
            print(f"  n = {n}: {chosen} {s[chosen]:+.3f}, {OTHER} {s[OTHER]:+.3f}; winner {int(np.argmax(s))}")
        same = all(np.array_equal(scores[n], scores[1]) for n in scores)
        print(f"every pass shape gives the same bits: {'yes' if same else 'no'}")
    finally:
        model.close()


if __name__ == "__main__":
    main()
