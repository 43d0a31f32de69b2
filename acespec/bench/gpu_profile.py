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

It also times one study cell (`--rules`, default strict,cactus): a speculative step of `--cell-batch`
sessions x K = `--cell-k` drafts under each rule, i.e. that pass plus the rejection sampling that AceSpec's
vLLM plugin runs for the rule (`acespec.cloud.vllm_rules.apply_rules`, the rules' one definition in
torch, on the pass's own logits), each next to the reference strict sampler: vLLM's own
`rejection_sample` where vLLM is installed, else the plugin's `strict` on the same path (the file says
which). Drafts are the target's argmax on most rows and random on the rest, so both the accepting and
the recovering paths run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

BATCHES = (1, 2, 4, 8, 16, 32, 64)  # sessions in one pass
NEW_TOKENS = (1, 2, 3, 5, 9)  # T = K + 1 for K = 0, 1, 2, 4, 8


def _cache_kw(model) -> str:
    """The forward argument that takes the KV cache: transformers 5 renamed `past_key_values` to `cache`,
    and the GPU image may have either."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def measure(
    shape: str,
    *,
    device: str,
    dtype: str,
    prefix: int = 256,
    reps: int = 10,
    batches=BATCHES,
    new_tokens=NEW_TOKENS,
    say=print,
) -> dict:
    import torch  # heavy: the hf extra
    from transformers import DynamicCache  # heavy: the hf extra

    from acespec.models.synthetic import random_qwen2

    model = random_qwen2(shape, dtype=dtype, device=device, head_scale=1.0)
    V = model.config.vocab_size
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kw = _cache_kw(model)
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
        "shape": shape,
        "prefix_tokens": prefix,
        "dtype": dtype,
        "passes": rows,
        # one session: t_v(K) for the K measured (K = T - 1)
        "verify_s": {str(t - 1): s for t, s in sorted(one.items())},
        # cloud-only: one decode step for N sessions at once
        "decode_step_s": {str(r["batch"]): r["seconds"] for r in rows if r["new_tokens"] == 1},
    }


def _vllm_strict():
    """vLLM's own `rejection_sample` and a metadata maker, or None where vLLM is not installed."""
    try:
        from acespec.cloud import vllm_plugin

        rs = vllm_plugin.cpu_sampler()
    except Exception:  # noqa: BLE001 - no vLLM (the lent GPU machine), or one the plugin does not know
        return None
    return vllm_plugin._state["original"] or rs.rejection_sample, vllm_plugin.sampling_metadata


def study_cell(
    shape: str,
    *,
    device: str,
    dtype: str,
    rules: list[str],
    batch: int = 16,
    k: int = 4,
    prefix: int = 256,
    reps: int = 10,
    say=print,
) -> dict:
    """One speculative step of `batch` sessions x `k` drafts under each rule: the target's pass over k + 1
    new tokens per session, and the rejection sampling of its rows under the rule (seconds, medians of
    `reps`, interleaved), with each rule's step as a multiple of the reference strict sampler's."""
    import types

    import torch  # heavy: the hf extra
    from transformers import DynamicCache  # heavy: the hf extra

    from acespec.cloud.vllm_rules import apply_rules
    from acespec.models.synthetic import random_qwen2
    from acespec.verify import RuleSpec

    specs = {r: RuleSpec.parse(r) for r in ["strict", *rules]}
    model = random_qwen2(shape, dtype=dtype, device=device)  # a peaked head, as a trained model's rows
    V = model.config.vocab_size
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kw = _cache_kw(model)
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        cache: Any = DynamicCache()  # None once done: one_pass, which reads it, is not called again
        model(input_ids=torch.randint(0, V, (batch, prefix), generator=g).to(device), use_cache=True, **{kw: cache})
        new = torch.randint(0, V, (batch, k + 1), generator=g).to(device)

        def one_pass():
            out = model(input_ids=new, use_cache=True, **{kw: cache}).logits  # [batch, k + 1, V]
            cache.crop(-(k + 1))
            return out

        logits = one_pass().float()
    target = logits[:, :k].reshape(batch * k, V).contiguous()  # [batch * k, V]: the draft rows
    bonus = torch.argmax(logits[:, k], dim=-1, keepdim=True)  # [batch, 1]
    draft = torch.argmax(target, dim=-1)
    mix = torch.rand(batch * k, generator=g) < 0.3  # a third of the drafts anything: rejections, recovered tokens
    draft[mix.to(device)] = torch.randint(0, V, (int(mix.sum()),), generator=g).to(device)
    draft = draft.to(torch.int32)
    counts = [k] * batch
    meta = types.SimpleNamespace(generators={})
    # vLLM's own sampler as a CPU worker sets it up (the dry run in the vLLM profile); the lent GPU machine has no vLLM
    vllm = _vllm_strict() if device == "cpu" else None
    reference = "vLLM's rejection_sample (strict)" if vllm else "the plugin's strict (vLLM is not installed here)"

    every = {r: {i: spec for i in range(batch)} for r, spec in specs.items()}  # each request of the step under r

    def sample(rule):
        if rule is None:
            if vllm:
                fn, make = vllm
                cu = torch.arange(k, batch * k + 1, k, dtype=torch.int32, device=device)
                return fn(draft, counts, k, cu, None, target.clone(), bonus, make(batch, {}))
            rule = "strict"
        return apply_rules(every[rule], list(range(batch)), draft, counts, k, None, target, bonus, meta)

    names = ["reference"] + rules
    times: dict[str, list[float]] = {n: [] for n in ["pass", *names]}
    with torch.no_grad():
        for r in range(reps + 2):
            for n in ["pass", *names]:  # interleaved: drift falls on every one alike
                sync()
                t0 = time.perf_counter()
                one_pass() if n == "pass" else sample(None if n == "reference" else n)
                sync()
                if r >= 2:
                    times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    step = {n: med["pass"] + med[n] for n in names}
    for n in names:
        say(
            f"  {shape} study cell, B={batch} K={k}: {n:10s} sampler {1e3 * med[n]:8.2f} ms, step {1e3 * step[n]:8.2f} ms "
            f"= {step[n] / step['reference']:.3f}x the reference strict step"
        )
    cache = None  # drops the KV memory
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "batch": batch,
        "k": k,
        "prefix_tokens": prefix,
        "reference": reference,
        "pass_s": med["pass"],
        "sampler_s": {n: med[n] for n in names},
        "step_s": step,
        "step_vs_reference": {n: step[n] / step["reference"] for n in names},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m acespec.bench.gpu_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", default="1.5b,7b", help="model shapes (acespec.models.synthetic.SHAPES; default 1.5b,7b)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix", type=int, default=256, help="tokens already in each session's KV cache (default 256)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument(
        "--rules",
        default="strict,cactus",
        help="rules of the study cell, against the reference strict sampler "
        "(default strict,cactus; empty: no study cell)",
    )
    ap.add_argument("--cell-batch", type=int, default=16, help="sessions in the study cell's step (default 16)")
    ap.add_argument("--cell-k", type=int, default=4, help="drafts per session in the study cell's step (default 4)")
    ap.add_argument("--out", required=True, help="the profile file to write (JSON)")
    args = ap.parse_args(argv)
    import torch  # heavy: the hf extra

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here", file=sys.stderr)
        return 2
    batches = tuple(int(b) for b in args.batches.split(","))
    try:
        rules = [r.strip() for r in args.rules.split(",") if r.strip()]
        from acespec.verify import RuleSpec

        for r in rules:
            RuleSpec.parse(r)
    except Exception as e:  # noqa: BLE001 - a bad rule, or the rules' array_api_compat missing here
        print(f"gpu_profile: --rules {args.rules!r}: {e}", file=sys.stderr)
        return 2
    if args.cell_batch < 1 or args.cell_k < 1:
        print("gpu_profile: --cell-batch and --cell-k must be at least 1", file=sys.stderr)
        return 2

    def say(s: str) -> None:
        print(s, flush=True)

    started = time.time()
    profile: dict[str, Any] = {
        "format": "acespec-device-profile",
        "version": 1,
        "engine": "transformers (eager, dynamic KV cache)",
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "models": {},
    }
    for shape in args.shapes.split(","):
        say(f"gpu_profile: {shape} on {profile['device']} ({args.dtype})")
        profile["models"][shape] = measure(
            shape, device=args.device, dtype=args.dtype, prefix=args.prefix, reps=args.reps, batches=batches, say=say
        )
        if rules:
            profile["models"][shape]["study_cell"] = study_cell(
                shape,
                device=args.device,
                dtype=args.dtype,
                rules=rules,
                batch=args.cell_batch,
                k=args.cell_k,
                prefix=args.prefix,
                reps=args.reps,
                say=say,
            )
    profile["seconds"] = round(time.time() - started, 1)
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
    say(f"gpu_profile: wrote {args.out} in {profile['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
