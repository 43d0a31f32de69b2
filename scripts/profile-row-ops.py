"""Time the torch operations the rules' row laws are built from, on one CPU piece of the vLLM plugin
(27 rows x 151,936 float32: acespec/cloud/vllm_rules.py's CPU_CHUNK), to see which ones dominate.
Run from the vLLM profile: .venv-vllm/bin/python scripts/profile-row-ops.py"""

import statistics
import time

import torch

N, V = 27, 151936
torch.manual_seed(0)
p = torch.softmax(torch.randn(N, V) * 3, -1)
q = torch.zeros_like(p)
q[torch.arange(N), torch.randint(0, V, (N,))] = 1.0  # token-only drafts: one-hot rows
bar = 0.7 * p.amax(-1, keepdim=True)


def timed(name, f, reps=9):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    print(f"{name:28s} {1e3 * statistics.median(ts):7.2f} ms")


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {N} x {V} float32")
timed("max over rows", lambda: p.amax(-1, keepdim=True))
timed("multiply", lambda: bar * p)
timed("sum over rows", lambda: q.sum(-1))
timed("p >= bar", lambda: p >= bar)
timed("count_nonzero over rows", lambda: torch.count_nonzero(q, dim=-1))
timed("nonzero", lambda: torch.nonzero(q, as_tuple=True))
timed("where(p >= bar, q, 0)", lambda: torch.where(p >= bar, q, 0.0))
