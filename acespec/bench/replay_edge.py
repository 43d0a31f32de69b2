"""A replay edge: one edge of `acespec bench tenants` (and of the demo's capacity table and the vLLM
bench), speaking the real wire protocol over a real socket, its drafter replaced by a recorded trace.

Replaying a greedy trace is exact (see `sim/trace.py`): the drafter's greedy chain from committed
position s is the trace's target output `y` for the first `a_s` positions and wrong after that, so a
replayed block is accepted exactly as the real drafter's would be; a pipelined block carries its
guessed bonus as the first token, right iff the chain still holds there. A coupled trace (`bench sim
--record --temperature T`) is exact the same way for its prompts' seeds: each edge then runs its
trace's seed, streams the trace's `y`, and its chain is the drafter's coupled choices. Each block
waits its recorded drafting time before it goes up, so the cores go to the cloud as they would with
real devices.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field

from acespec import wire
from acespec.loop.backoff import UplinkBackoff
from acespec.loop.follow import FollowConfig
from acespec.loop.stats import RunStats

LEAD = 12  # cloud-led: tokens the replayed chain runs ahead of the stream
K = 4  # draft depth of the replayed blocks (the trace's recording depth)
WINDOW = 2  # acespec mode: blocks in flight


@dataclass
class EdgeRun:
    prompt_id: str
    tokens: list[int] = field(default_factory=list)  # committed output
    wall_s: float = 0.0
    rounds: int = 0  # verdicts that verified a block (not dropped)
    dropped: int = 0
    latencies: list[float] = field(default_factory=list)  # blocks sent after the first verdict (steady state)
    first_s: float = float("nan")  # HELLO -> first verdict (cloud-only: first token), prompt prefill included
    error: str = ""
    finished: bool = False
    stats: RunStats = field(default_factory=RunStats)  # the passes, acceptance and commit times the ceiling reads


class ReplayEdge:
    """One edge: HELLO, then replayed blocks (or a cloud-only stream), over a real socket."""

    def __init__(
        self,
        port: int,
        trace,
        mode: str,
        *,
        rule: str,
        temperature: float,
        seed: int,
        max_tokens: int,
        draft_s: float,
        model_id: str,
        vocab: int,
        deadline: float,
        auth: bytes = b"",
        rtt_s: float = 0.0,
    ) -> None:
        self.port, self.tr, self.mode = port, trace, mode
        # a coupled trace holds the text and the drafter's choices of one seed: the session runs that one
        self.rule, self.temperature, self.seed = rule, temperature, seed if trace.seed is None else trace.seed
        self.max_tokens = max_tokens
        self.draft_s = draft_s
        self.model_id, self.vocab = model_id, vocab
        self.deadline = deadline
        self.auth = auth
        self.rtt_s = rtt_s  # the link's round trip: when an uploaded chain can have reached the cloud
        self.y = list(trace.tokens)
        self.P = len(trace.prompt_tokens)
        self.run = EdgeRun(trace.id)

    # the drafter's chain (greedy, or coupled for a coupled trace) from committed position s (absolute):
    # right for a_s tokens, then wrong
    def chain(self, s: int, q: int) -> int:
        j, i = s - self.P, q - self.P
        if 0 <= j < len(self.y) and 0 <= i < len(self.y) and i - j < self.tr.accept[j]:
            return self.y[i]
        right = self.y[i] if 0 <= i < len(self.y) else 0
        return (right + 1) % self.vocab

    def go(self) -> EdgeRun:
        t0 = time.perf_counter()
        try:
            self._go()
        except Exception as e:  # reported in the table, never hidden
            self.run.error = f"{type(e).__name__}: {e}"
        self.run.wall_s = time.perf_counter() - t0
        return self.run

    def _go(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        inbox: queue.Queue = queue.Queue()

        def reader():
            dec = wire.FrameDecoder()
            try:
                while True:
                    data = sock.recv(65536)
                    if not data:
                        break
                    for f in dec.feed(data):
                        inbox.put((time.perf_counter(), f))
            except (OSError, wire.WireError) as e:
                inbox.put((time.perf_counter(), e))
            inbox.put((time.perf_counter(), None))

        sock.settimeout(None)
        threading.Thread(target=reader, daemon=True).start()
        mode = {"cloud-only": wire.Mode.CLOUD_ONLY, "cloud-led": wire.Mode.CLOUD_LED}.get(
            self.mode, wire.Mode.SPECULATIVE
        )
        hello = wire.Hello(
            model_id=self.model_id,
            max_tokens=self.max_tokens,
            prompt=tuple(self.tr.prompt_tokens),
            auth=self.auth,
            temperature=self.temperature,
            top_k=0,
            top_p=1.0,
            rule=self.rule,
            seed=self.seed,
            mode=mode,
        )
        self.hello_at = time.perf_counter()
        sock.sendall(wire.encode(hello))

        def next_frame():
            left = self.deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError("the run's time cap passed")
            try:
                t, f = inbox.get(timeout=left)
            except queue.Empty:
                raise TimeoutError("the run's time cap passed") from None
            if isinstance(f, wire.Error):
                raise RuntimeError(f"cloud error {f.code.name}: {f.message}")
            if f is None or isinstance(f, Exception):
                raise ConnectionError(f"connection lost: {f}")
            return t, f

        try:
            _, w = next_frame()
            if not isinstance(w, wire.Welcome):
                raise RuntimeError(f"expected WELCOME, got {type(w).__name__}")
            if mode == wire.Mode.CLOUD_ONLY:
                self._stream(next_frame)
            elif mode == wire.Mode.CLOUD_LED:
                self._follow(sock, w.session, w.committed, inbox, next_frame)
            else:
                self._speculate(sock, w.session, w.committed, next_frame)
            sock.sendall(wire.encode(wire.Close(reason=wire.CloseReason.NORMAL)))
        except TimeoutError:
            pass  # capped: what was committed so far counts
        finally:
            sock.close()

    def _committed(self, t: float, n: int, drafted: int | None = None, accepted: int = 0, verify_us: int = 0) -> None:
        """`n` tokens committed at `t`; `drafted` (not None): by a pass that verified that many drafts."""
        st = self.run.stats
        st.emitted += n
        st.token_times.extend([t - self.hello_at] * n)
        if drafted is not None:
            st.observe_block(drafted, accepted)
            st.observe_pass(drafted, verify_us / 1e6)

    def _stream(self, next_frame) -> None:
        last = self.hello_at
        while True:
            t, f = next_frame()
            if isinstance(f, wire.Tokens):
                self.run.tokens.extend(f.tokens)
                self._committed(t, len(f.tokens))
                if self.run.first_s != self.run.first_s:
                    self.run.first_s = t - last
                else:
                    self.run.latencies.append(t - last)
                self.run.rounds += len(f.tokens)
                last = t
                if f.finished:
                    self.run.finished = True
                    return

    def _follow(self, sock, sid: int, committed: int, inbox: queue.Queue, next_frame) -> None:
        """Cloud-led: follow the stream, keep the replayed chain LEAD tokens ahead of it and upload it as
        it grows; a streamed token the chain got wrong restarts it after that token. While the cloud
        verifies none of its drafts the uplink backs off as the edge's does (`UplinkBackoff`)."""
        C = s = end = committed  # committed length, the chain's start, its end
        last = self.hello_at
        sent_end, sent_s, sent_at = -1, -1, 0.0  # the uploaded chain: its end, its start, when it went up
        rate = 0.0  # EWMA of the stream's tokens per second (a drafter slower than it never gets ahead)
        fc = FollowConfig()
        up = UplinkBackoff(fc.idle_after, fc.idle_gap_max)
        while True:
            if up.may_send() and end < C + LEAD and len(self.run.tokens) < self.max_tokens:
                n = min(2, C + LEAD - end)
                time.sleep(self.draft_s * n)
                self.run.stats.draft_s += self.draft_s * n
                self.run.stats.draft_tokens += n
                end += n
            if up.may_send() and end > C and end >= sent_end + 2:
                sock.sendall(
                    wire.encode(
                        wire.Draft(session=sid, seq=0, base=C, tokens=tuple(self.chain(s, q) for q in range(C, end)))
                    )
                )
                sent_end, sent_s, sent_at = end, s, time.perf_counter()
                up.sent()
            while True:  # everything streamed so far, without waiting unless the chain is full (or resting)
                if up.may_send() and end < C + LEAD and inbox.empty():
                    break
                t, f = next_frame()
                if not isinstance(f, wire.Tokens):
                    continue
                # the same test as the edge's (`UplinkBackoff`): only a step that broke the chain, passed
                # over an upload that had reached the cloud, or outran the drafter counts against it
                held = sent_s == s and f.start < sent_end and sent_at <= t - self.rtt_s
                broke = False
                for i, tok in enumerate(f.tokens[C - f.start :]):
                    pos = C + i
                    if pos >= end or tok != self.chain(s, pos):
                        broke = broke or pos < end
                        s = end = sent_end = pos + 1  # the drafter redrafts after the token it got wrong
                self.run.tokens.extend(f.tokens[C - f.start :])
                self._committed(t, len(f.tokens) - (C - f.start), f.drafted, f.accepted, f.verify_us)
                if t > last:
                    r = len(f.tokens) / (t - last)
                    rate = r if rate == 0 else 0.8 * rate + 0.2 * r
                slow = self.draft_s > 0 and 1 / self.draft_s <= rate
                # a step's TOKENS say how many it drafted and kept
                up.step(f.drafted or 0, telling=held or broke or slow, kept=f.accepted)
                C = f.start + len(f.tokens)
                end = max(end, C)
                if self.run.first_s != self.run.first_s:
                    self.run.first_s = t - last
                else:
                    self.run.latencies.append(t - last)
                last = t
                self.run.rounds += 1
                if f.finished:
                    self.run.finished = True
                    return

    def _speculate(self, sock, sid: int, committed: int, next_frame) -> None:
        window = WINDOW if self.mode == "acespec" else 1
        C = committed
        s = tip = C  # chain start (the last resync) and the next position to draft
        seq = 0
        inflight: dict[int, tuple[int, list[int], float]] = {}  # seq -> (base, tokens, sent at), in order
        started = float("inf")  # when the first verdict came
        while True:
            while len(inflight) < window:
                if inflight:  # pipelined: the guessed bonus at `tip`, then K fresh tokens
                    base, toks = tip, [self.chain(s, q) for q in range(tip, tip + 1 + K)]
                else:
                    base, toks = C, [self.chain(s, q) for q in range(C, C + K)]
                time.sleep(self.draft_s * (base + len(toks) - tip))  # the drafter's time for its new tokens
                self.run.stats.draft_s += self.draft_s * (base + len(toks) - tip)
                self.run.stats.draft_tokens += base + len(toks) - tip
                tip = base + len(toks)
                sock.sendall(wire.encode(wire.Draft(session=sid, seq=seq, base=base, tokens=tuple(toks))))
                inflight[seq] = (base, toks, time.perf_counter())
                seq += 1
            t, f = next_frame()
            if not isinstance(f, wire.Verdict) or f.seq not in inflight:
                continue
            base, toks, sent = inflight.pop(f.seq)
            if self.run.first_s != self.run.first_s:  # nan: this is the first verdict
                self.run.first_s, started = t - self.hello_at, t
            elif sent >= started:  # blocks sent before the first verdict waited on the prompt's prefill
                self.run.latencies.append(t - sent)
            if f.dropped:
                self.run.dropped += 1
            else:
                self.run.rounds += 1
                o = C - base  # the block's leading tokens that were already committed
                self.run.tokens.extend(toks[o : o + f.accepted] + [f.next_token])
                self._committed(t, f.accepted + 1, len(toks) - o, f.accepted, f.verify_us)
                all_in = o + f.accepted == len(toks)
                C = f.committed
                nxt = next(iter(inflight.values()), None)
                # the speculation holds iff the whole block went in and the next block starts with the
                # bonus the cloud chose; otherwise redraft from the committed prefix (stale blocks drop)
                if not (all_in and nxt is not None and nxt[0] == C - 1 and nxt[1][0] == f.next_token):
                    s = tip = C
            if f.finished:
                self.run.finished = True
                return
