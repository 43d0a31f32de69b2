"""The depth controller against every fixed K, in the simulator, on the `varying` WAN profile.

Tokens/s = all tokens / all wall time over the prompts of a trace file, for the controller's mode and
the same mode at fixed K, on the varying link's good phase, its bad phase, the link itself and a
faster-switching copy. `--long N` replays the trace's outputs back to back N times as one generation,
so that it spans the real profile's 10 s phases (a 256-token run ends within the first one).

    PYTHONPATH=. .venv/bin/python scripts/controller_vs_fixed.py [--long 3] [--fam acespec,sync,pipelined]
        [--dev edge-npu+h200,cost:docs/results/sim-validate-inputs/cost.json]

`--dev cost:FILE` is this machine as `acespec bench cost` (or `bench sim --validate`) calibrated it. With
both phases listed, it also prints the ceiling of any depth policy: the best K of each phase, switched
perfectly at every phase change (equal time in each), against the best single K over both.
`--q-topn 32` prices every drafted token with a top-32 q row on the wire, as `strict` and the relaxed
rules send (the header prints what that costs per drafted token on the bad phase's uplink);
acceptance stays the trace's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter

from acespec.net.profile import PROFILES
from acespec.sim.edge import parse_mode, simulate
from acespec.sim.link import FrameSizer
from acespec.sim.profiles import DEVICE_PROFILES, DeviceProfile
from acespec.sim.trace import TraceSet

FAMILIES = {  # controller mode, fixed-K mode
    "acespec": ("acespec", "pipelined+branches+autowin:k={}"),
    "sync": ("sync+ctrl", "sync:k={}"),
    "pipelined": ("pipelined+ctrl", "pipelined:k={}"),
}


def back_to_back(ts: TraceSet, times: int) -> TraceSet:
    """One prompt whose output is every prompt's output in turn, `times` over (acceptance runs recomputed)."""
    ps = ts.prompts * times
    rank = [r for p in ps for r in p.rank]
    accept, run = [0] * len(rank), 0
    for j in range(len(rank) - 1, -1, -1):
        run = run + 1 if rank[j] == 0 else 0
        accept[j] = run
    long_ = dataclasses.replace(ts.prompts[0], id=f"back-to-back-x{times}", tokens=[t for p in ps for t in p.tokens],
                                accept=accept, rank=rank, top_q=[q for p in ps for q in p.top_q], engine_rounds=[])
    return dataclasses.replace(ts, prompts=[long_])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="acespec/sim/traces/humaneval-n4-t256.json")
    ap.add_argument("--long", type=int, default=0, help="replay the outputs back to back this many times")
    ap.add_argument("--fam", default="acespec,sync,pipelined")
    ap.add_argument("--dev", default="edge-npu+h200,edge-cpu+gpu")
    ap.add_argument("--ks", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--nets", default="good,bad,varying,vary1s")
    ap.add_argument("--q-topn", type=int, default=0, help="q row entries per drafted token on the wire (0: token ids only)")
    a = ap.parse_args()
    sizer = FrameSizer(q_topn=a.q_topn)
    ts = TraceSet.load(a.trace)
    if a.long:
        ts = back_to_back(ts, a.long)
    var = PROFILES["varying"]
    nets = {"good": var.at(0.0), "bad": var.at(var.switch_s), "varying": var,
            "vary1s": dataclasses.replace(var, switch_s=1.0), "vary3s": dataclasses.replace(var, switch_s=3.0)}
    ks = [int(k) for k in a.ks.split(",")]
    q_bytes = (sizer.draft(1, 1, (100_000,) * 8) - FrameSizer().draft(1, 1, (100_000,) * 8)) / 8
    bad_up = nets["bad"].up_bps

    def run(mode, dev, net):
        rs = [simulate(p, dev, net, parse_mode(mode), sizer) for p in ts.prompts]
        return sum(r.n for r in rs) / sum(r.wall_s for r in rs), rs

    print(f"{a.trace}{f' back to back x{a.long}' if a.long else ''}: {sum(p.n for p in ts.prompts)} tokens"
          + (f", a top-{a.q_topn} q row per drafted token on the wire (+{q_bytes:.0f} bytes, "
             f"{8e3 * q_bytes / bad_up:.0f} ms of the bad phase's uplink)" if a.q_topn else ""))
    for dname in a.dev.split(","):
        if dname.startswith("cost:"):
            with open(dname[5:]) as f:
                dev = DeviceProfile.from_cost(json.load(f))
        else:
            dev = DEVICE_PROFILES[dname]
        for fam in a.fam.split(","):
            ctrl_mode, fixed_mode = FAMILIES[fam]
            print(f"\n{dname}, {ctrl_mode} against {fixed_mode.format('K')}  (tokens/s)")
            print(f"{'link':8s} {'ctrl':>6s} " + " ".join(f"{'K=' + str(k):>6s}" for k in ks)
                  + "   best K<=8   best K     K the controller drafted (blocks)")
            per_net = {}
            for nname in a.nets.split(","):
                rc, rs = run(ctrl_mode, dev, nets[nname])
                fixed = {k: run(fixed_mode.format(k), dev, nets[nname])[0] for k in ks}
                per_net[nname] = fixed
                k8 = max((k for k in ks if k <= 8), key=fixed.get)
                kb = max(fixed, key=fixed.get)
                hist = Counter(k for r in rs for k in r.stats.k_chosen)
                print(f"{nname:8s} {rc:6.1f} " + " ".join(f"{fixed[k]:6.1f}" for k in ks)
                      + f"   {rc / fixed[k8]:4.2f}x K={k8:<2d} {rc / fixed[kb]:4.2f}x K={kb:<2d}  "
                      + " ".join(f"{k}:{n}" for k, n in sorted(hist.items())), flush=True)
            if "good" in per_net and "bad" in per_net:
                g, b = per_net["good"], per_net["bad"]
                # equal time in each phase: the time-averaged rate is the harmonic mean of the two
                def avg(x: float, y: float) -> float:
                    return 2.0 / (1.0 / x + 1.0 / y)
                oracle = avg(max(g.values()), max(b.values()))
                single = max(avg(g[k], b[k]) for k in ks)
                print(f"ceiling: the best K per phase switched perfectly {oracle:.1f} tokens/s, "
                      f"{oracle / single:.3f}x the best single K over both phases ({single:.1f})", flush=True)


if __name__ == "__main__":
    main()
