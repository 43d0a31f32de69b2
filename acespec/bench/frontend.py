"""`acespec bench frontend`: how many sessions and verdicts one `acespec serve` front end carries.

    acespec bench frontend [--sessions 10000] [--rates 2000,4000,6000,8000,10000] [--seconds 8]
                           [--variants uvloop,asyncio,gc-default] [--json OUT]

One `acespec serve --engine noop` process (verdicts computed instantly: every draft accepted by the
session's real rule, no model pass), so what is measured is the front end alone: the asyncio loop,
the frame codec, auth, the session table. This process plays thousands of edges over loopback:

1. it opens `--sessions` sessions (HELLO -> WELCOME, one connection each) and keeps them all open,
   reading the server's memory (VmRSS) before and after: memory per session;
2. at each rate in `--rates`, for `--seconds`, it sends DRAFTs open-loop at that rate spread over
   the sessions (one block in flight per session, as an edge-led edge in sync mode has), and times
   each DRAFT -> VERDICT: verdicts per second achieved, p50 / p99 / max frame latency, the
   server's CPU use, and the cores anything else on the machine kept busy meanwhile (from /proc/stat:
   a run that shared its cores with other work is flagged, since its figures are not the front end's).

Each `--variants` entry is a fresh server with one standard remedy on or off, measured the same way
one after the other: `uvloop` (the default server: uvloop, and the garbage collector kept off the
loop's path, `--gc-full`), `asyncio` (asyncio's own loop), `gc-default` (uvloop, Python's collector
as it is). The highest rate whose verdicts kept up (at least 97% of it) with p99 <= 50 ms is what one front
end sustains. The load generator runs on the other core; the server has one (it is one asyncio loop).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from acespec import wire
from acespec.argtypes import pos_float, pos_int
from acespec.bench import write_result
from acespec.bench.children import spawn, stop_process, wait_for_line

HOST = "127.0.0.1"
VARIANTS = {  # name -> `acespec serve` arguments
    "uvloop": ("--loop", "uvloop"),
    "asyncio": ("--loop", "asyncio"),
    "gc-default": ("--loop", "uvloop", "--gc-full", "0"),
}
P99_BUDGET_MS = 50.0  # the latency a front end may add at the sustained rate
KEEP_UP = 0.97  # a rate is sustained when at least this share of it came back as verdicts
OTHER_CPU_WARN = 0.2  # cores busy with other work during a rate above which its figures are flagged


@dataclass
class FrontendConfig:
    sessions: int = 10000  # sessions held open at once
    rates: tuple[int, ...] = (2000, 4000, 6000, 8000, 10000)  # DRAFT rates to try (per second)
    seconds: float = 8.0  # how long each rate runs
    k: int = 2  # draft tokens per block
    prompt_len: int = 16  # tokens in each session's prompt
    open_concurrency: int = 256  # handshakes in flight while opening
    target: str = "toy:vocab=64,seed=1"  # what the noop engine's sessions say they run
    server_cpu: int | None = 0  # pin the server to this core (None: no pinning), the load generator to the others
    variants: tuple[str, ...] = ("uvloop",)  # server set-ups to measure, from VARIANTS


@dataclass
class RateResult:
    rate: int
    sent: int = 0
    verdicts: int = 0
    per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    server_cpu: float = 0.0  # the server's CPU seconds per wall second during the run
    other_cpu: float = 0.0  # cores busy with anything but the server and this load generator (the machine was shared)
    errors: int = 0
    sustained: bool = False


@dataclass
class FrontendResult:
    config: dict
    variant: str = "uvloop"
    opened: int = 0
    open_s: float = 0.0
    rss_idle_mib: float = 0.0
    rss_open_mib: float = 0.0
    bytes_per_session: float = 0.0
    rates: list[RateResult] = field(default_factory=list)
    sustained_per_s: float = 0.0
    sustained_p99_ms: float = 0.0


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        xs = [int(x) for x in f.readline().split()[1:]]
    return (sum(xs[:8]) - xs[3] - xs[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


class _Edge:
    """One simulated edge: a connection holding one session, one block in flight at most."""

    __slots__ = ("reader", "writer", "sid", "committed", "seq", "sent_at", "busy", "decoder")

    def __init__(self, reader, writer, sid: int, committed: int, decoder) -> None:
        self.reader, self.writer, self.sid, self.committed, self.decoder = reader, writer, sid, committed, decoder
        self.seq = 0
        self.sent_at = 0.0
        self.busy = False


async def _open(port: int, i: int, cfg: FrontendConfig, model_id: str) -> _Edge:
    reader, writer = await asyncio.open_connection(HOST, port)
    prompt = tuple(1 + (i + j) % 60 for j in range(cfg.prompt_len))
    writer.write(
        wire.encode(
            wire.Hello(
                model_id=model_id,
                max_tokens=4096,
                prompt=prompt,
                auth=b"",
                temperature=0.0,
                rule="greedy",
                seed=i,
                mode=wire.Mode.SPECULATIVE,
            )
        )
    )
    dec = wire.FrameDecoder()
    while True:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("closed during the handshake")
        frames = dec.feed(data)
        if frames:
            w = frames[0]
            if not isinstance(w, wire.Welcome):
                raise ConnectionError(f"refused: {w}")
            return _Edge(reader, writer, w.session, w.committed, dec)


async def _reader(e: _Edge, lat: list, errors: list) -> None:
    while True:
        try:
            data = await e.reader.read(65536)
        except (ConnectionError, OSError):
            errors.append(1)
            return
        if not data:
            return
        now = time.perf_counter()
        for f in e.decoder.feed(data):
            if isinstance(f, wire.Verdict):
                lat.append(now - e.sent_at)
                e.committed = f.committed
                e.busy = False
            elif isinstance(f, wire.Error):
                errors.append(1)


async def _measure(port: int, cfg: FrontendConfig, pid: int, log) -> FrontendResult:
    model_id = f"toy:vocab={64}"
    res = FrontendResult(config=asdict(cfg))
    res.rss_idle_mib = _rss_mib(pid)
    t0 = time.perf_counter()
    edges: list[_Edge] = []
    sem = asyncio.Semaphore(cfg.open_concurrency)

    async def one(i):
        async with sem:
            edges.append(await _open(port, i, cfg, model_id))

    for start in range(0, cfg.sessions, 1000):
        await asyncio.gather(*(one(i) for i in range(start, min(cfg.sessions, start + 1000))))
        log(f"  opened {len(edges)} sessions, server RSS {_rss_mib(pid):.0f} MiB")
    res.opened = len(edges)
    res.open_s = round(time.perf_counter() - t0, 2)
    await asyncio.sleep(1.0)
    res.rss_open_mib = _rss_mib(pid)
    res.bytes_per_session = round((res.rss_open_mib - res.rss_idle_mib) * 2**20 / max(1, res.opened))
    log(
        f"  {res.opened} sessions open in {res.open_s} s; server RSS {res.rss_idle_mib:.0f} -> {res.rss_open_mib:.0f} MiB "
        f"({res.bytes_per_session / 1024:.1f} KiB per session)"
    )

    # the load generator's own heap (10,000 connections and their tasks) must not pause it for a
    # full garbage collection mid-measurement: its pauses would be counted as the server's latency

    gc.collect()
    gc.freeze()
    gc.disable()
    lat: list[float] = []
    errors: list[int] = []
    readers = [asyncio.create_task(_reader(e, lat, errors)) for e in edges]
    rng = random.Random(0)
    try:
        for rate in cfg.rates:
            lat.clear()
            errors.clear()
            r = RateResult(rate)
            cpu0, own0, busy0, w0 = _cpu_s(pid), _cpu_s(os.getpid()), _machine_busy_s(), time.perf_counter()
            tick = 0.002  # send in 2 ms batches: rate * tick drafts each
            owed = 0.0
            end = w0 + cfg.seconds
            order = list(range(len(edges)))
            rng.shuffle(order)
            cursor = 0
            next_t = w0
            while True:
                now = time.perf_counter()
                if now >= end:
                    break
                owed += rate * tick
                n = int(owed)
                owed -= n
                sent = 0
                tries = 0
                while sent < n and tries < len(order):
                    e = edges[order[cursor]]
                    cursor = (cursor + 1) % len(order)
                    tries += 1
                    if e.busy:
                        continue
                    e.busy = True
                    e.seq += 1
                    e.sent_at = time.perf_counter()
                    toks = tuple(1 + (e.committed + j) % 60 for j in range(cfg.k))
                    e.writer.write(wire.encode(wire.Draft(session=e.sid, seq=e.seq, base=e.committed, tokens=toks)))
                    sent += 1
                r.sent += sent
                next_t += tick
                await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
            await asyncio.sleep(0.5)  # the stragglers
            wall = time.perf_counter() - w0
            server_s = _cpu_s(pid) - cpu0
            r.server_cpu = round(server_s / wall, 2)
            r.other_cpu = round(max(0.0, _machine_busy_s() - busy0 - server_s - (_cpu_s(os.getpid()) - own0)) / wall, 2)
            r.verdicts = len(lat)
            r.per_s = round(r.verdicts / (wall - 0.5), 1)
            if lat:
                xs = sorted(lat)
                r.p50_ms = round(1e3 * xs[len(xs) // 2], 2)
                r.p99_ms = round(1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 2)
                r.max_ms = round(1e3 * xs[-1], 2)
            r.errors = len(errors)
            r.sustained = (
                r.verdicts >= KEEP_UP * r.sent
                and r.sent >= KEEP_UP * rate * cfg.seconds
                and r.p99_ms <= P99_BUDGET_MS
                and r.errors == 0
            )
            res.rates.append(r)
            log(
                f"  {rate:6d}/s asked: {r.per_s:8.1f} verdicts/s, p50 {r.p50_ms:6.2f} ms, p99 {r.p99_ms:7.2f} ms, "
                f"max {r.max_ms:7.1f} ms, server CPU {r.server_cpu:.2f}, other CPU {r.other_cpu:.2f}, errors {r.errors}"
                f"{'  (sustained)' if r.sustained else ''}"
            )
            if r.other_cpu > OTHER_CPU_WARN:
                log(
                    f"    warning: other work kept {r.other_cpu:.2f} cores busy during this rate; its figures are not the front end's alone"
                )
            if r.sustained and r.per_s > res.sustained_per_s:
                res.sustained_per_s, res.sustained_p99_ms = r.per_s, r.p99_ms
            await asyncio.sleep(1.0)
    finally:
        gc.enable()
        gc.unfreeze()
        for e in edges:
            e.writer.close()
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return res


def run_frontend(
    cfg: FrontendConfig, log=print, serve_args: tuple[str, ...] = (), python: tuple[str, ...] = ()
) -> FrontendResult:
    """`python`: arguments for the server's interpreter before `-m acespec.cli` (e.g. a profiler's)."""
    n = cfg.sessions + 16
    cmd = [
        sys.executable,
        *python,
        "-m",
        "acespec.cli",
        "serve",
        "--engine",
        "noop",
        "--target",
        cfg.target,
        "--port",
        "0",
        "--max-sessions",
        str(n),
        "--max-connections",
        str(n),
        "--max-connections-per-addr",
        str(n),
        "--auth-failures-per-min",
        "0",
        "--idle-timeout",
        "600",
        *serve_args,
    ]
    if cfg.server_cpu is not None and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        cmd = ["taskset", "-c", str(cfg.server_cpu), *cmd]
        others = os.sched_getaffinity(0) - {cfg.server_cpu}
        os.sched_setaffinity(0, others)
    proc = spawn(cmd)
    try:
        port = int(wait_for_line(proc, r"listening on \S+:(\d+)", 120, "acespec serve").group(1))
        try:
            import resource  # heavy: Unix only

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 1024)), hard))
        except (ImportError, ValueError, OSError):
            pass
        return asyncio.run(_measure(port, cfg, proc.pid, log))
    finally:
        stop_process(proc)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = FrontendConfig()
    p = bench_subparsers.add_parser(
        "frontend", help="one serve front end (noop engine): sessions held, verdicts/s, p99 frame latency"
    )
    p.add_argument("--sessions", type=pos_int, default=d.sessions, help="sessions held open at once (default 10000)")
    p.add_argument(
        "--rates", default=",".join(map(str, d.rates)), help="DRAFT rates to try, per second (comma-separated)"
    )
    p.add_argument("--seconds", type=pos_float, default=d.seconds, help="seconds at each rate (default 8)")
    p.add_argument("--k", type=pos_int, default=d.k, help="draft tokens per block (default 2)")
    p.add_argument(
        "--variants",
        default=",".join(d.variants),
        help=f"server set-ups, measured one after the other: {', '.join(VARIANTS)} (default uvloop)",
    )
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # one variant of a run of several: no table
    p.set_defaults(func=cmd_bench_frontend)
    return p


def cmd_bench_frontend(args: argparse.Namespace) -> int:
    try:
        rates = tuple(int(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--rates: expected integers, got {args.rates!r}") from None
    if not rates or min(rates) < 1:
        raise ValueError("--rates: give at least one rate >= 1")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if not variants or any(v not in VARIANTS for v in variants):
        raise ValueError(f"--variants: choose from {', '.join(VARIANTS)}")
    cfg = FrontendConfig(sessions=args.sessions, rates=rates, seconds=args.seconds, k=args.k, variants=variants)
    if not args.quiet:
        print(
            f"bench frontend: one acespec serve (noop engine), {cfg.sessions} sessions over loopback, "
            f"DRAFT rates {', '.join(map(str, rates))}/s for {cfg.seconds:g} s each, k = {cfg.k}",
            flush=True,
        )
    results = []
    if len(variants) == 1:
        [v] = variants
        print(f"{v} (acespec serve {' '.join(VARIANTS[v])}):", flush=True)
        res = run_frontend(cfg, log=lambda s: print(s, flush=True), serve_args=VARIANTS[v])
        res.variant = v
        results.append(asdict(res))
    else:  # each in a fresh load generator too: its heap after one variant would slow the next one's edges
        for v in variants:
            with tempfile.TemporaryDirectory() as tmp:
                out = f"{tmp}/{v}.json"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "acespec.cli",
                        "bench",
                        "frontend",
                        "--sessions",
                        str(cfg.sessions),
                        "--rates",
                        ",".join(map(str, rates)),
                        "--seconds",
                        str(cfg.seconds),
                        "--k",
                        str(cfg.k),
                        "--variants",
                        v,
                        "--json",
                        out,
                        "--quiet",
                    ],
                    check=True,
                )
                results += json.load(open(out))["variants"]
    if args.quiet:
        write_result(args.json, {"variants": results})
        return 0
    print(
        f"\n{'variant':>11} {'sessions':>9} {'MiB':>6} {'KiB/session':>12} {'sustained verdicts/s':>21} {'p99 ms':>7} "
        f"{'other CPU':>10}"
    )
    for r in results:
        other = max((x["other_cpu"] for x in r["rates"]), default=0.0)
        print(
            f"{r['variant']:>11} {r['opened']:9d} {r['rss_open_mib']:6.0f} {r['bytes_per_session'] / 1024:12.1f} "
            f"{r['sustained_per_s']:21.0f} {r['sustained_p99_ms']:7.1f} {other:10.2f}"
        )
    print(
        f"(sustained: the highest rate tried that came back at least {KEEP_UP:.0%} as verdicts with p99 <= "
        f"{P99_BUDGET_MS:g} ms; the server on one core, the load generator on the other; other CPU: the most cores "
        f"that anything else kept busy during one rate, 0 on a quiet machine)"
    )
    write_result(args.json, {"variants": results})
    return 0
