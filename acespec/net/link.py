"""The timing model of the emulated path: when does a chunk of bytes come out of the far end?

Pure arithmetic over a clock and a seeded RNG, no I/O, so it can be tested without sockets and reused
by anything that wants the same delays (the proxy in `wan.py` is its only caller today).

For a chunk of `n` bytes that the proxy read at time `arrival`, on direction `d` of one connection:

    sent      = max(arrival, link.busy_until) + 8 n / rate_d      # serialisation behind the link queue
    delay     = max(0, rtt/2 + U(-jitter/2, +jitter/2))            # propagation + jitter, one way
              + (rto if a segment of the chunk was "lost" else 0)  # retransmission stall
    delivery  = max(previous delivery on this connection+direction, sent + delay)

The final `max` is what keeps TCP semantics: jitter and stalls delay bytes but never reorder them, and a
stalled chunk holds back everything behind it on its connection (head-of-line blocking), as a real
retransmission does. The link queue is shared by every connection in one direction, because they share
one access link: a bulk transfer on one connection delays small messages on another.
"""

from __future__ import annotations

import math
import random

from acespec.net.profile import WanProfile

__all__ = ["MSS", "LinkQueue", "StreamClock"]

# Bytes of payload per TCP segment on a 1500-byte-MTU path with timestamps; loss is drawn per segment so
# a big chunk is proportionally more likely to hit a loss than a small one.
MSS = 1448


class LinkQueue:
    """Serialisation state of one direction of the link (shared by all connections in that direction)."""

    def __init__(self) -> None:
        self.busy_until = -math.inf  # when the link finishes sending what it already accepted

    def transmit(self, arrival: float, nbytes: int, rate_bps: float) -> float:
        """Queue `nbytes` arriving at `arrival`; return when its last bit leaves the link."""
        if rate_bps <= 0 or nbytes <= 0:
            return arrival  # unlimited rate (or nothing to send): no serialisation, no queueing
        start = max(arrival, self.busy_until)
        self.busy_until = start + nbytes * 8.0 / rate_bps
        return self.busy_until


class StreamClock:
    """Delivery times for one direction of one connection: jitter, loss stalls, and in-order delivery."""

    def __init__(self, link: LinkQueue, rng: random.Random) -> None:
        self.link = link
        self.rng = rng
        self.last_delivery = -math.inf

    def schedule(self, profile: WanProfile, direction: str, arrival: float, nbytes: int) -> tuple[float, bool]:
        """Return (delivery time in the clock of `arrival`, whether the chunk suffered a loss stall).

        `direction` is "up" (edge -> cloud, limited by `up_bps`) or "down" (limited by `down_bps`).
        `nbytes == 0` schedules an end-of-stream marker: it travels with the delay but costs no link time
        and is never lost (a lost FIN is retransmitted like data, but modelling it buys nothing).
        """
        if direction == "up":
            rate = profile.up_bps
        elif direction == "down":
            rate = profile.down_bps
        else:
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        sent = self.link.transmit(arrival, nbytes, rate)
        delay_ms = profile.rtt_ms / 2.0
        if profile.jitter_ms > 0:
            half = profile.jitter_ms / 2.0
            delay_ms = max(0.0, delay_ms + self.rng.uniform(-half, half))
        stalled = False
        if profile.loss_pct > 0 and nbytes > 0:
            segments = -(-nbytes // MSS)
            p_chunk = 1.0 - (1.0 - profile.loss_pct / 100.0) ** segments  # P(at least one segment lost)
            if self.rng.random() < p_chunk:
                stalled = True
                delay_ms += profile.rto_ms  # one stall per chunk: further losses overlap with the first
        delivery = max(self.last_delivery, sent + delay_ms / 1000.0)
        self.last_delivery = delivery
        return delivery, stalled
