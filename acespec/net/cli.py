"""`acespec wan`: run the WAN emulator between an edge and a cloud server (hooked in by acespec.cli).

    acespec wan --listen 127.0.0.1:9100 --upstream 127.0.0.1:9000 --profile wan --loss 0.5
    acespec wan --listen 127.0.0.1:9100 --upstream 127.0.0.1:9000 --profile varying   # 80 <-> 250 ms every 10 s

Point the edge at the listen address. While it runs: `kill -USR1 <pid>` resets every connection,
`kill -USR2 <pid>` stalls the path for 2 s; Ctrl-C or SIGTERM stops it and prints the counters.
"""

from __future__ import annotations

import argparse
import asyncio

# Bad input raises ValueError, which the `acespec` command prints as one error line (exit status 2).
from acespec.net.profile import PROFILES, profile_from_args
from acespec.net.wan import run_wan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "wan",
        help="WAN emulator: TCP proxy adding delay, jitter, bandwidth limits and loss stalls",
        description=__doc__.split("\n", 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--listen", required=True, help="HOST:PORT to accept edge connections on (port 0 = any)")
    p.add_argument("--upstream", required=True, help="HOST:PORT of the cloud server")
    p.add_argument("--profile", default="wan", choices=sorted(PROFILES), help="named profile (default: wan)")
    p.add_argument("--rtt", help="override the round-trip time, ms (e.g. 80, 80ms, 0.08s)")
    p.add_argument("--jitter", help="override the round-trip jitter, ms")
    p.add_argument("--up", help="override the edge->cloud rate (e.g. 5mbit, 500kbit, 0 = unlimited)")
    p.add_argument("--down", help="override the cloud->edge rate (e.g. 20Mbit/s)")
    p.add_argument("--loss", help="override the per-segment loss, percent (each loss = one RTO stall)")
    p.add_argument("--seed", help="seed for the jitter and loss samples")
    p.add_argument("--switch", help="varying profiles: seconds each phase lasts (e.g. 10, 2.5s, 500ms)")
    p.set_defaults(func=cmd_wan)


def cmd_wan(args: argparse.Namespace) -> int:
    profile = profile_from_args(
        args.profile,
        rtt=args.rtt,
        jitter=args.jitter,
        up=args.up,
        down=args.down,
        loss=args.loss,
        seed=args.seed,
        switch=args.switch,
    )
    try:
        asyncio.run(run_wan(args.listen, args.upstream, profile))
    except KeyboardInterrupt:  # only when SIGINT arrives before run_wan has installed its handler
        pass
    return 0
