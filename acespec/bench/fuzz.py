"""`acespec bench fuzz`: mutated frames through the decoder and through a live server.

    acespec bench fuzz [--frames 1000000] [--server-frames 1000000] [--batch 64] [--seed 0] [--json OUT]

1. **Decoder.** `--frames` mutations of valid frames of every type (bytes flipped, cut, inserted or
   appended, length prefixes and type bytes replaced) go through `decode` and, in random chunks,
   through a `FrameDecoder`. Anything but a frame or a `WireError` is a crash.
2. **Live server.** An `acespec serve` child process (toy target by default, `--frame-timeout 1`).
   Each connection opens a session with a valid HELLO, then sends up to `--batch` - 1 valid frames of
   that session (DRAFT, PING), one mutated frame (any type, so every mutated frame reaches the
   server's decoder) and a PING, and half-closes (one batch in 1000 keeps the line open instead, so
   the server's frame deadline is what must end a frame that promises more bytes). The server must
   answer with the PONG (all taken) or with ERROR + CLOSE, within the frame timeout and a margin:
   otherwise it is a hang. An ERROR with code INTERNAL is a crash (a server bug, not a refusal).
   Meanwhile an honest session, opened before, steps every 100 batches and once at the end, and the
   server's resident memory (VmRSS) is read at the start (idle, after one session) and at the end.

Prints the counts, then `crashes` and `hangs` last. Exit status 0 when both are 0, the server is
still alive, and its memory stayed within 2x of its idle footprint.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from acespec import wire
from acespec.argtypes import pos_int
from acespec.bench import write_result
from acespec.bench.children import spawn, stop_process, wait_for_line

HOST = "127.0.0.1"


def sample_frames(rng: random.Random, vocab: int = 64) -> list:
    """One valid frame of every type, with random fields."""
    toks = tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 8)))
    return [
        wire.Hello(
            model_id=f"toy:vocab={vocab}",
            max_tokens=rng.randrange(1, 64),
            prompt=toks or (1,),
            rule="coupled",
            temperature=0.8,
            seed=rng.randrange(1 << 32),
        ),
        wire.Welcome(
            session=rng.randrange(1 << 21), committed=rng.randrange(100), max_draft_tokens=64, secret=rng.randbytes(32)
        ),
        wire.Draft(session=rng.randrange(1 << 21), seq=rng.randrange(1000), base=rng.randrange(100), tokens=toks),
        wire.Draft(session=1, seq=1, base=8, tokens=toks, q=tuple(((t, 0.5),) for t in toks)),
        wire.Verdict(seq=rng.randrange(1000), accepted=min(len(toks), 3), next_token=5, verify_us=100, committed=20),
        wire.Resume(
            session=rng.randrange(1 << 21),
            committed=rng.randrange(100),
            secret=rng.randbytes(32),
            digest=rng.randbytes(32),
        ),
        wire.Ping(nonce=rng.randrange(1 << 64), sent_us=rng.randrange(1 << 40)),
        wire.Pong(nonce=rng.randrange(1 << 64), sent_us=rng.randrange(1 << 40)),
        wire.Error(code=wire.ErrorCode.BUSY, message="x" * rng.randrange(20)),
        wire.Close(reason=wire.CloseReason.NORMAL),
        wire.Tokens(start=rng.randrange(100), tokens=toks),
    ]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random mutation of an encoded frame."""
    b = bytearray(data)
    op = rng.randrange(7)
    if op == 0 and b:  # flip bits of a few bytes
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1 and b:  # cut
        del b[rng.randrange(len(b)) :]
    elif op == 2:  # insert junk
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randrange(1, 6))
    elif op == 3:  # append junk
        b += rng.randbytes(rng.randrange(1, 10))
    elif op == 4 and b:  # a random length prefix
        b[0] = rng.randrange(256)
    elif op == 5 and len(b) > 1:  # a random type byte
        b[1] = rng.randrange(256)
    elif b:  # a random byte
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


@dataclass
class FuzzResult:
    decoder_frames: int = 0
    decoder_crashes: int = 0
    server_frames: int = 0  # mutated frames sent to the live server (one per batch)
    server_valid_frames: int = 0  # valid frames sent ahead of them
    server_busy: int = 0  # HELLOs answered BUSY (refused sessions hold a slot for the resume grace)
    server_batches: int = 0
    server_refusals: int = 0  # batches answered ERROR + CLOSE
    server_crashes: int = 0  # ERROR INTERNAL, or the server process gone
    server_hangs: int = 0  # batches answered neither way in time
    rss_idle_kb: int = 0
    rss_end_kb: int = 0
    honest_ok: bool = False
    wall_s: float = 0.0
    crash_examples: tuple = ()


def fuzz_decoder(n: int, rng: random.Random, res: FuzzResult) -> None:
    examples: list[str] = []
    pool = [wire.encode(f) for f in sample_frames(rng)]
    for i in range(n):
        if i % 1000 == 0:
            pool = [wire.encode(f) for f in sample_frames(rng)]
        data = mutate(rng.choice(pool), rng)
        try:
            wire.decode(data)
        except wire.WireError:
            pass
        except Exception as e:  # noqa: BLE001 - a crash is what this counts
            res.decoder_crashes += 1
            if len(examples) < 3:
                examples.append(f"decode({data!r}): {type(e).__name__}: {e}")
        dec = wire.FrameDecoder()
        try:
            pos = 0
            while pos < len(data):
                step = rng.randrange(1, 8)
                dec.feed(data[pos : pos + step])
                pos += step
        except wire.WireError:
            pass
        except Exception as e:  # noqa: BLE001 - anything but a WireError is a decoder crash, counted
            res.decoder_crashes += 1
            if len(examples) < 3:
                examples.append(f"FrameDecoder({data!r}): {type(e).__name__}: {e}")
        res.decoder_frames += 1
    res.crash_examples += tuple(examples)


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _recv_until(sock: socket.socket, dec, want, deadline: float):
    """Frames until one satisfies `want` (returned), the connection ends ("closed"), or the deadline ("hang")."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "hang", []
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return "hang", []
        except OSError:
            return "closed", []
        if not data:
            return "closed", []
        try:
            frames = dec.feed(data)
        except wire.WireError as e:
            return "badreply", [e]
        for f in frames:
            if want(f):
                return "ok", frames
            if isinstance(f, wire.Error):
                return "error", frames


def fuzz_server(n: int, batch: int, rng: random.Random, res: FuzzResult, target: str, frame_timeout: float) -> None:
    vocab = 64
    cmd = [
        sys.executable,
        "-m",
        "acespec.cli",
        "serve",
        "--target",
        target,
        "--port",
        "0",
        "--max-sessions",
        "256",
        "--frame-timeout",
        str(frame_timeout),
        "--handshake-timeout",
        "5",
        "--resume-grace",
        "0.2",
        "--idle-timeout",
        "30",
        "--max-connections-per-addr",
        "256",
        "--auth-failures-per-min",
        "0",
    ]
    srv = spawn(cmd)
    try:
        port = int(wait_for_line(srv, r"listening on \S+:(\d+)", 120, "acespec serve").group(1))
        prompt = (3, 1, 4, 1, 5, 9, 2, 6)

        def open_session(
            max_tokens: int = 4000,
        ) -> tuple[Any, Any, Any]:  # (socket, decoder, WELCOME) or (why, None, None)
            s = socket.create_connection((HOST, port), timeout=10)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(
                wire.encode(
                    wire.Hello(
                        model_id=f"toy:vocab={vocab}",
                        max_tokens=max_tokens,
                        prompt=prompt,
                        rule="coupled",
                        temperature=0.8,
                        seed=7,
                    )
                )
            )
            dec = wire.FrameDecoder()
            how, frames = _recv_until(s, dec, lambda f: isinstance(f, wire.Welcome), time.monotonic() + 10)
            if how != "ok":
                s.close()
                busy = any(isinstance(f, wire.Error) and f.code == wire.ErrorCode.BUSY for f in frames)
                return ("busy" if busy else how), None, None
            w = next(f for f in frames if isinstance(f, wire.Welcome))
            return s, dec, w

        def honest_steps(s, dec, w, committed, seq, steps):
            for _ in range(steps):
                s.sendall(wire.encode(wire.Draft(session=w.session, seq=seq, base=committed, tokens=())))
                how, frames = _recv_until(s, dec, lambda f: isinstance(f, wire.Verdict), time.monotonic() + 10)
                if how != "ok":
                    return None, seq
                v = next(f for f in frames if isinstance(f, wire.Verdict))
                committed, seq = v.committed, seq + 1
            return committed, seq

        honest = open_session(max_tokens=40)
        warm = open_session(max_tokens=40)
        if not isinstance(warm[0], str):
            honest_steps(*warm, len(prompt), 0, 5)
            warm[0].close()
        time.sleep(0.5)
        res.rss_idle_kb = _rss_kb(srv.pid)
        h_committed, h_seq = honest_steps(*honest, len(prompt), 0, 10) if not isinstance(honest[0], str) else (None, 0)

        sent = 0
        while sent < n:
            if srv.poll() is not None:
                res.server_crashes += 1
                break
            s, dec, w = open_session()
            if isinstance(s, str):
                if s == "busy":
                    res.server_busy += 1
                    time.sleep(0.02)  # refused sessions wait out their resume grace
                else:
                    res.server_hangs += s == "hang"
                    res.server_crashes += s != "hang"
                continue
            committed, seq, open_ = len(prompt), 0, True
            while open_ and sent < n:
                # up to `batch` - 1 valid frames of the session, then one mutated frame (so every mutated
                # frame reaches the server's decoder), then a PING that says whether it was taken
                chunk = bytearray()
                for _ in range(rng.randrange(batch)):
                    kind = rng.random()
                    frame: wire.Frame
                    if kind < 0.75:
                        frame = wire.Draft(
                            session=w.session,
                            seq=seq,
                            base=committed,
                            tokens=tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 6))),
                        )
                        seq += 1
                    else:
                        frame = wire.Ping(nonce=rng.randrange(1 << 64), sent_us=1)
                    chunk += wire.encode(frame)
                    res.server_valid_frames += 1
                kind = rng.random()
                if kind < 0.6:
                    frame = wire.Draft(
                        session=w.session,
                        seq=seq,
                        base=committed,
                        tokens=tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 6))),
                    )
                elif kind < 0.7:
                    frame = wire.Ping(nonce=1, sent_us=1)
                else:
                    frame = rng.choice(sample_frames(rng, vocab))
                chunk += mutate(wire.encode(frame), rng)
                sent += 1
                res.server_frames += 1
                nonce = rng.randrange(1 << 64)
                chunk += wire.encode(wire.Ping(nonce=nonce, sent_us=0))
                res.server_batches += 1
                if res.server_batches % 100 == 0 and h_committed is not None:  # the honest session keeps going
                    h_committed, h_seq = honest_steps(*honest, h_committed, h_seq, 1)
                # Half-close after the batch, so a mutated length prefix that promises more bytes ends in
                # BAD_FRAME at once; one batch in 1000 keeps the line open, so the server's frame deadline
                # (`--frame-timeout`) is what must end it.
                half_close = res.server_batches % 1000 != 0
                try:
                    s.sendall(bytes(chunk))
                    if half_close:
                        s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # refused meanwhile: the reply says how
                how, frames = _recv_until(
                    s,
                    dec,
                    lambda f, nonce=nonce: isinstance(f, wire.Pong) and f.nonce == nonce,
                    time.monotonic() + frame_timeout + 10,
                )
                for f in frames:
                    if isinstance(f, wire.Verdict) and not f.dropped:
                        committed = max(committed, f.committed)
                    if isinstance(f, wire.Error) and f.code == wire.ErrorCode.INTERNAL:
                        res.server_crashes += 1
                        if len(res.crash_examples) < 6:
                            res.crash_examples += (f"server INTERNAL: {f.message}",)
                if how == "ok" and not half_close:
                    continue
                open_ = False
                if how == "ok":
                    break
                if how == "hang":
                    res.server_hangs += 1
                    if len(res.crash_examples) < 6:
                        res.crash_examples += (f"hang after {bytes(chunk)!r}",)
                else:
                    res.server_refusals += 1
            try:
                s.close()
            except OSError:
                pass
        time.sleep(1.5)  # refused sessions wait out their resume grace (1 s) before the memory reading
        res.rss_end_kb = _rss_kb(srv.pid)
        if honest[0] is not None and h_committed is not None:
            done, _ = honest_steps(*honest, h_committed, h_seq, 1)
            res.honest_ok = done is not None and srv.poll() is None
            honest[0].close()
    finally:
        stop_process(srv)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("fuzz", help="mutated frames through the decoder and a live server")
    p.add_argument("--frames", type=int, default=1_000_000, help="mutated frames through the decoder (default 10^6)")
    p.add_argument(
        "--server-frames", type=int, default=1_000_000, help="mutated frames sent to the live server (default 10^6)"
    )
    p.add_argument("--batch", type=pos_int, default=8, help="most valid frames ahead of each mutated one")
    p.add_argument(
        "--target", default="toy:vocab=64,seed=1", help="the server's target (a toy with vocab 64 by default)"
    )
    p.add_argument("--frame-timeout", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT")
    p.set_defaults(func=cmd_bench_fuzz)
    return p


def run_fuzz(
    frames: int,
    server_frames: int,
    *,
    batch: int = 8,
    seed: int = 0,
    target: str = "toy:vocab=64,seed=1",
    frame_timeout: float = 1.0,
) -> FuzzResult:
    rng = random.Random(seed)
    res = FuzzResult()
    t0 = time.perf_counter()
    if frames > 0:
        fuzz_decoder(frames, rng, res)
    if server_frames > 0:
        fuzz_server(server_frames, batch, rng, res, target, frame_timeout)
    res.wall_s = round(time.perf_counter() - t0, 1)
    return res


def cmd_bench_fuzz(args: argparse.Namespace) -> int:
    if args.frames < 0 or args.server_frames < 0:
        raise ValueError("--frames and --server-frames must be >= 0")
    if not 0 < args.frame_timeout < 60:
        raise ValueError("--frame-timeout must be in (0, 60) s")
    res = run_fuzz(
        args.frames,
        args.server_frames,
        batch=args.batch,
        seed=args.seed,
        target=args.target,
        frame_timeout=args.frame_timeout,
    )
    write_result(args.json, asdict(res))
    ratio = res.rss_end_kb / res.rss_idle_kb if res.rss_idle_kb else float("nan")
    print(f"decoder: {res.decoder_frames} mutated frames, {res.decoder_crashes} crashes")
    print(
        f"server: {res.server_frames} mutated frames (after {res.server_valid_frames} valid ones), {res.server_refusals} refused with "
        f"ERROR + CLOSE, memory {res.rss_idle_kb} kB idle -> {res.rss_end_kb} kB ({ratio:.2f}x), "
        f"honest session {'ok' if res.honest_ok else 'FAILED'}; {res.wall_s} s"
    )
    for e in res.crash_examples:
        print(f"  {e}")
    crashes = res.decoder_crashes + res.server_crashes
    print(f"crashes: {crashes}")
    print(f"hangs: {res.server_hangs}")
    ok = crashes == 0 and res.server_hangs == 0 and (args.server_frames == 0 or (res.honest_ok and ratio <= 2.0))
    return 0 if ok else 1
