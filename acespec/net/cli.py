"""`acespec wan`: run the WAN emulator between an edge and a cloud server (hooked in by acespec.cli).

    acespec wan --listen 127.0.0.1:9100 --upstream 127.0.0.1:9000 --profile wan --loss 0.5
    acespec wan --listen 127.0.0.1:9100 --upstream 127.0.0.1:9000 --profile varying   # 80 <-> 250 ms every 10 s

Point the edge at the listen address. While it runs: `kill -USR1 <pid>` resets every connection,
`kill -USR2 <pid>` stalls the path for 2 s; Ctrl-C or SIGTERM stops it and prints the counters.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

# Bad input raises ValueError, which the `acespec` command prints as one error line (exit status 2).
from acespec.net.profile import PROFILES, WanProfile, parse_hostport, profile_from_args
from acespec.net.wan import SIGNAL_BLACKHOLE_S, WanCounters, WanProxy


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


async def run_wan(
    listen: str,
    upstream: str,
    profile: WanProfile,
    *,
    on_ready: Callable[[WanProxy], None] | None = None,
    out: TextIO | None = None,
) -> WanCounters:
    """Run a WAN proxy from `listen` ("HOST:PORT") to `upstream` until cancelled, SIGINT or SIGTERM.

    Prints one status line when listening and the counters when it stops; returns the final counters.
    While running, SIGUSR1 resets every connection and SIGUSR2 blackholes the path for
    SIGNAL_BLACKHOLE_S seconds (stall, then deliver). Signal handlers are only installed when running
    on the main thread (elsewhere, cancel the task to stop it); previous handlers are restored on exit.
    `on_ready(proxy)` is called once listening (for embedding and tests).
    """
    listen_host, listen_port = parse_hostport(listen)
    up_host, up_port = parse_hostport(upstream)
    stream = out if out is not None else sys.stdout

    def say(line: str) -> None:
        print(f"acespec wan: {line}", file=stream, flush=True)

    proxy = WanProxy(listen_host, listen_port, up_host, up_port, profile)
    await proxy.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_usr1() -> None:
        say(f"SIGUSR1: reset {proxy.reset_connections()} connection(s)")

    def on_usr2() -> None:
        proxy.blackhole(SIGNAL_BLACKHOLE_S)
        say(f"SIGUSR2: blackhole for {SIGNAL_BLACKHOLE_S:g} s")

    handlers: dict[int, Callable[[], None]] = {signal.SIGINT: stop.set, signal.SIGTERM: stop.set}
    if hasattr(signal, "SIGUSR1"):
        handlers[signal.SIGUSR1] = on_usr1
        handlers[signal.SIGUSR2] = on_usr2
    installed: dict[int, Any] = {}  # signal -> the handler signal.getsignal gave (a callable, an int or None)
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            previous = signal.getsignal(sig)
            try:
                loop.add_signal_handler(sig, handler)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # e.g. Windows: faults stay available through the API
            installed[sig] = previous
    try:
        say(
            f"listening on {listen_host}:{proxy.port} -> {up_host}:{up_port} | {profile.describe()} | "
            f"pid {os.getpid()}: SIGUSR1 = reset connections, SIGUSR2 = {SIGNAL_BLACKHOLE_S:g} s blackhole"
        )
        if on_ready is not None:
            on_ready(proxy)
        await stop.wait()
    finally:
        for sig, previous in installed.items():
            loop.remove_signal_handler(sig)
            if previous is not None:
                signal.signal(sig, previous)  # remove_signal_handler leaves SIG_DFL; put back what was there
        await proxy.stop()
        say(f"stopped | {proxy.counters}")
    return proxy.counters
