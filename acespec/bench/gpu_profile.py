"""`python -m acespec.bench.gpu_profile`: what verifying costs on an accelerator, as a device profile file.

    bash scripts/gpu-check.sh                  # on a CUDA machine: 1.5B and 7B shapes, writes $OUT/gpu-profile.json
    python -m acespec.bench.gpu_profile --shapes tiny --device cpu --out /tmp/p.json   # a dry run anywhere

The cloud's cost model is a function of the batch: one pass over B sessions, each bringing T new
tokens (T = K + 1 for a verify of K drafts, T = 1 for a cloud-only step), on top of a prefix already in
the KV cache. This measures that pass for the real Qwen2.5-1.5B and -7B shapes with random weights (cost
depends on the shapes, not the values; the machine has no network to download weights), for B up to 64
and K up to 8, and writes what the simulator reads: t_v(K) of one session, the batched cost t(B, T),
and the cloud-only step time at N = 1..64 sessions.

The lent GPU machine has no network and receives at most 64 MiB, so vLLM (hundreds of MB of wheels)
cannot be brought there; the passes run on transformers with its dynamic KV cache, eager, in bf16. That
is an upper bound on what vLLM's fused kernels and CUDA graphs cost for the same pass, and the file says
which engine measured it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

BATCHES = (1, 2, 4, 8, 16, 32, 64)  # sessions in one pass
NEW_TOKENS = (1, 2, 3, 5, 9)  # T = K + 1 for K = 0, 1, 2, 4, 8


def measure(shape: str, *, device: str, dtype: str, prefix: int = 256, reps: int = 10,
            batches=BATCHES, new_tokens=NEW_TOKENS, say=print) -> dict:
    import torch
    from transformers import DynamicCache

    from acespec.models.synthetic import random_qwen2

    model = random_qwen2(shape, dtype=dtype, device=device, head_scale=1.0)
    V = model.config.vocab_size
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    import inspect

    # transformers 5 renamed the KV argument (`past_key_values` -> `cache`); the GPU image may have either
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for B in batches:
        ids = torch.randint(0, V, (B, prefix), generator=g).to(device)
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids=ids, use_cache=True, **{kw: cache})
            for T in new_tokens:
                new = torch.randint(0, V, (B, T), generator=g).to(device)
                times = []
                for r in range(reps + 2):
                    sync()
                    t0 = time.perf_counter()
                    model(input_ids=new, use_cache=True, **{kw: cache})
                    sync()
                    if r >= 2:  # two warm-up passes per shape
                        times.append(time.perf_counter() - t0)
                    cache.crop(-T)  # drop what this pass appended (the negative form works on transformers 4 and 5)
                rows.append({"batch": B, "new_tokens": T, "total_tokens": B * T, "seconds": statistics.median(times)})
                say(f"  {shape}: B={B:3d} T={T}: {1e3 * rows[-1]['seconds']:.2f} ms")
        del cache
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    one = {r["new_tokens"]: r["seconds"] for r in rows if r["batch"] == 1}
    return {
        "shape": shape, "prefix_tokens": prefix, "dtype": dtype, "passes": rows,
        # one session: t_v(K) for the K measured (K = T - 1)
        "verify_s": {str(t - 1): s for t, s in sorted(one.items())},
        # cloud-only: one decode step for N sessions at once
        "decode_step_s": {str(r["batch"]): r["seconds"] for r in rows if r["new_tokens"] == 1},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m acespec.bench.gpu_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1.5b,7b", help="model shapes (acespec.models.synthetic.SHAPES; default 1.5b,7b)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix", type=int, default=256, help="tokens already in each session's KV cache (default 256)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--out", required=True, help="the profile file to write (JSON)")
    args = ap.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here", file=sys.stderr)
        return 2
    batches = tuple(int(b) for b in args.batches.split(","))
    say = lambda s: print(s, flush=True)  # noqa: E731
    started = time.time()
    profile = {
        "format": "acespec-device-profile", "version": 1, "engine": "transformers (eager, dynamic KV cache)",
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
        "models": {},
    }
    for shape in args.shapes.split(","):
        say(f"gpu_profile: {shape} on {profile['device']} ({args.dtype})")
        profile["models"][shape] = measure(shape, device=args.device, dtype=args.dtype, prefix=args.prefix, reps=args.reps,
                                           batches=batches, say=say)
    profile["seconds"] = round(time.time() - started, 1)
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
    say(f"gpu_profile: wrote {args.out} in {profile['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
