"""Network profiles for the WAN emulator, and the parsers the CLI needs (rates, "host:port").

Conventions (the rest of `acespec.net` relies on them):

* `rtt_ms` is the base round-trip time; each direction adds half of it as one-way delay.
* `jitter_ms` is the spread of the round trip: each direction adds a uniform sample from
  `[-jitter_ms/2, +jitter_ms/2]` to its one-way delay (clamped so a delay is never negative), so a
  round trip lands in `rtt_ms +- jitter_ms` with mean `rtt_ms`. Jitter never reorders bytes.
* Rates are bits per second, decimal SI (1 kbit = 1000 bit). `0` means "unlimited" (no
  serialisation delay at all); the `up` direction is edge -> cloud, `down` is cloud -> edge.
* `loss_pct` is per-segment (MSS-sized) loss probability in percent. TCP never loses bytes, it
  retransmits, so a loss shows up as a stall: the chunk, and everything queued behind it on that
  connection, arrives `rto_ms` later.
* A profile with `switch_s > 0` varies in time: it is itself for `switch_s` seconds, then its
  `alternate` for `switch_s` seconds, and so on (`at(t)` gives the fixed profile in force `t` seconds
  after the link came up). The emulator applies it per chunk, so a chunk read in the bad phase pays
  the bad phase's delay and rate. Its own fields are the good phase's, so code that reads a profile's
  fields sees the good link.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["WanProfile", "PROFILES", "MIN_RTO_MS", "parse_rate", "format_rate", "parse_hostport", "profile_from_args"]

# Linux's minimum retransmission timeout (TCP_RTO_MIN). A stall caused by a lost segment is
# max(MIN_RTO_MS, 2 * rtt): with an RTT-scale srtt and rttvar the kernel's RTO is about srtt + 4*rttvar,
# which for a steady path is close to 2 RTT, and never below the 200 ms floor.
MIN_RTO_MS = 200.0


@dataclass(frozen=True)
class WanProfile:
    """One emulated path. The defaults are an ideal link: no delay, no jitter, no rate limit, no loss."""

    rtt_ms: float = 0.0  # base round-trip time; each direction adds rtt_ms / 2
    jitter_ms: float = 0.0  # round-trip spread: each direction adds U(-jitter/2, +jitter/2) ms
    up_bps: float = 0.0  # edge -> cloud rate in bits/s; 0 = unlimited
    down_bps: float = 0.0  # cloud -> edge rate in bits/s; 0 = unlimited
    loss_pct: float = 0.0  # per-segment loss in percent, emulated as a retransmission stall of rto_ms
    seed: int = 0  # seeds the jitter and loss samples, so runs are reproducible
    switch_s: float = 0.0  # > 0: alternate with `alternate` every switch_s seconds (this profile first)
    alternate: WanProfile | None = None  # the other phase of a varying link (itself a fixed profile)

    def __post_init__(self) -> None:
        for name in ("rtt_ms", "jitter_ms", "up_bps", "down_bps", "loss_pct"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"WanProfile.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"WanProfile.{name} must be finite and >= 0, got {value!r}")
        if self.loss_pct > 100:
            raise ValueError(f"WanProfile.loss_pct must be within [0, 100], got {self.loss_pct!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"WanProfile.seed must be an int, got {self.seed!r}")
        if (
            isinstance(self.switch_s, bool)
            or not isinstance(self.switch_s, (int, float))
            or not math.isfinite(self.switch_s)
            or self.switch_s < 0
        ):
            raise ValueError(f"WanProfile.switch_s must be finite and >= 0, got {self.switch_s!r}")
        if (self.switch_s > 0) != (self.alternate is not None):
            raise ValueError("a varying WanProfile needs both switch_s > 0 and an alternate profile")
        if self.alternate is not None and (not isinstance(self.alternate, WanProfile) or self.alternate.varies):
            raise ValueError("WanProfile.alternate must be a fixed WanProfile (one level of switching)")

    @property
    def varies(self) -> bool:
        return self.switch_s > 0

    def at(self, elapsed_s: float) -> WanProfile:
        """The fixed profile in force `elapsed_s` seconds after the link came up: this one (without its
        switching) in even periods, the alternate in odd ones. A fixed profile is always itself."""
        if not self.varies:
            return self
        if int(max(0.0, elapsed_s) // self.switch_s) % 2 and self.alternate is not None:
            return self.alternate
        return dataclasses.replace(self, switch_s=0.0, alternate=None)

    @property
    def rto_ms(self) -> float:
        """Extra delay of a chunk that lost a segment: max(200 ms, 2 * rtt)."""
        return max(MIN_RTO_MS, 2.0 * self.rtt_ms)

    @property
    def is_passthrough(self) -> bool:
        """True when the profile adds no delay of any kind (bytes are forwarded as they come)."""
        return (
            self.rtt_ms == 0
            and self.jitter_ms == 0
            and self.up_bps == 0
            and self.down_bps == 0
            and self.loss_pct == 0
            and (self.alternate is None or self.alternate.is_passthrough)
        )

    def describe(self) -> str:
        """One line for status output, e.g. `rtt=100ms jitter=20ms up=5Mbit/s down=20Mbit/s loss=0% seed=0`."""
        return (
            f"rtt={_fmt_num(self.rtt_ms)}ms jitter={_fmt_num(self.jitter_ms)}ms "
            f"up={format_rate(self.up_bps)} down={format_rate(self.down_bps)} "
            f"loss={_fmt_num(self.loss_pct)}% seed={self.seed}"
            + (
                f", switching every {_fmt_num(self.switch_s)}s with {self.alternate.describe()}"
                if self.varies and self.alternate is not None
                else ""
            )
        )


_MBIT = 1_000_000.0

PROFILES: dict[str, WanProfile] = {
    "lan": WanProfile(rtt_ms=1, jitter_ms=0, up_bps=1000 * _MBIT, down_bps=1000 * _MBIT),
    "wan": WanProfile(rtt_ms=100, jitter_ms=20, up_bps=5 * _MBIT, down_bps=20 * _MBIT),
    "transcontinental": WanProfile(rtt_ms=250, jitter_ms=25, up_bps=5 * _MBIT, down_bps=20 * _MBIT),
    "lte": WanProfile(rtt_ms=60, jitter_ms=30, up_bps=2 * _MBIT, down_bps=10 * _MBIT),
    # The seed design's range in one link: every 10 s it goes from a good WAN (80 ms) to a bad one
    # (250 ms, uplink down to 64 kbit/s, as on a congested cellular uplink) and back, so a draft depth
    # chosen for one phase is wrong for the other, and a controller has to follow the link.
    "varying": WanProfile(
        rtt_ms=80,
        jitter_ms=10,
        up_bps=5 * _MBIT,
        down_bps=20 * _MBIT,
        switch_s=10.0,
        alternate=WanProfile(rtt_ms=250, jitter_ms=25, up_bps=64_000, down_bps=1 * _MBIT),
    ),
}


def _fmt_num(x: float) -> str:
    return f"{x:g}"


def format_rate(bps: float) -> str:
    """Human form of a rate in bits/s (`0` prints as `unlimited`)."""
    if bps == 0:
        return "unlimited"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit/s"


# number, optional SI prefix, optional "bit", optional "/s". Byte units ("MB/s") and the "bps" family are
# deliberately not accepted: tc reads "mbps" as megaBYTES per second while most people mean megabits,
# and a silent factor of 8 in a network profile is worse than an error.
_RATE_RE = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<prefix>[kmg]?)(?P<bit>bit)?(?P<per>/s)?\s*$", re.IGNORECASE
)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(value: str | int | float) -> float:
    """Parse a link rate into bits per second.

    Accepts plain numbers (bits/s) and strings like "20mbit", "5Mbit/s", "500kbit", "1gbit", "2.5m",
    "1e6"; "0" or "unlimited" mean no rate limit (returns 0.0). Raises ValueError on anything else,
    including negative, non-finite, or ambiguous byte-based units such as "5MB/s" or "20mbps".
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid rate {value!r}: expected bits/s or a string like '20mbit'")
    if isinstance(value, (int, float)):
        rate = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.lower() in ("unlimited", "none"):
            return 0.0
        m = _RATE_RE.match(text)
        if m is None:
            hint = ""
            if re.search(r"(bps|b/s|byte)", text, re.IGNORECASE):
                hint = " (byte units and 'bps' are ambiguous; write bits, e.g. '20mbit' or '20Mbit/s')"
            raise ValueError(
                f"invalid rate {value!r}: expected e.g. '20mbit', '5Mbit/s', '500kbit', '1gbit' or bits/s{hint}"
            )
        rate = float(m.group("num")) * _PREFIX[m.group("prefix").lower()]
    else:
        raise ValueError(f"invalid rate {value!r}: expected a number or a string, got {type(value).__name__}")
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"invalid rate {value!r}: must be finite and >= 0 (0 = unlimited)")
    return rate


def parse_hostport(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """Parse "HOST:PORT" (also "[v6addr]:PORT" and ":PORT", which means `default_host`).

    Port 0 is allowed (pick a free port when listening). Raises ValueError with the offending text.
    """
    if not isinstance(value, str):
        raise ValueError(f"invalid address {value!r}: expected 'HOST:PORT'")
    text = value.strip()
    if text.startswith("["):  # bracketed IPv6, the only unambiguous way to give a v6 address a port
        close = text.find("]")
        if close < 0 or text[close + 1 : close + 2] != ":":
            raise ValueError(f"invalid address {value!r}: expected '[IPV6]:PORT'")
        host, port_text = text[1:close], text[close + 2 :]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"invalid address {value!r}: expected 'HOST:PORT' (missing ':PORT')")
        if ":" in host:
            raise ValueError(f"invalid address {value!r}: write IPv6 addresses as '[ADDR]:PORT'")
    host = host or default_host
    if not port_text.isdigit():
        raise ValueError(f"invalid address {value!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"invalid address {value!r}: port {port} is out of range 0..65535")
    return host, port


def _parse_ms(name: str, value: str | int | float) -> float:
    """Milliseconds from a number or a string such as "100", "100ms" or "0.1s"."""
    if isinstance(value, bool):
        raise ValueError(f"invalid {name} {value!r}: expected milliseconds")
    if isinstance(value, str):
        text = value.strip().lower()
        scale = 1.0
        if text.endswith("ms"):
            text = text[:-2]
        elif text.endswith("s"):
            text, scale = text[:-1], 1000.0
        try:
            ms = float(text) * scale
        except ValueError:
            raise ValueError(f"invalid {name} {value!r}: expected milliseconds, e.g. '100' or '100ms'") from None
    elif isinstance(value, (int, float)):
        ms = float(value)
    else:
        raise ValueError(f"invalid {name} {value!r}: expected milliseconds")
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"invalid {name} {value!r}: must be finite and >= 0")
    return ms


def _parse_pct(value: str | int | float) -> float:
    if isinstance(value, bool):
        raise ValueError(f"invalid loss {value!r}: expected a percentage")
    text = value.strip().rstrip("%") if isinstance(value, str) else value
    try:
        pct = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"invalid loss {value!r}: expected a percentage such as '1' or '0.5%'") from None
    if not math.isfinite(pct) or not 0 <= pct <= 100:
        raise ValueError(f"invalid loss {value!r}: must be within [0, 100] percent")
    return pct


def profile_from_args(
    name: str | None, rtt=None, jitter=None, up=None, down=None, loss=None, seed: int | None = None, switch=None
) -> WanProfile:
    """A named profile (see PROFILES; None = ideal link) with any given field overridden.

    rtt/jitter are milliseconds (numbers or strings like "80", "80ms", "0.08s"), up/down are rates as
    accepted by `parse_rate`, loss is a percentage ("1", "0.5%"). On a varying profile they override
    the good phase; `switch` (seconds, e.g. "10", "2.5s", "500ms") sets how long each phase lasts.
    Raises ValueError on an unknown name or a bad value.
    """
    if name is None:
        base = WanProfile()
    else:
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in PROFILES:
            raise ValueError(f"unknown WAN profile {name!r}; choose one of {', '.join(sorted(PROFILES))}")
        base = PROFILES[key]
    changes: dict[str, Any] = {}  # field -> value, each checked as it is parsed
    if rtt is not None:
        changes["rtt_ms"] = _parse_ms("rtt", rtt)
    if jitter is not None:
        changes["jitter_ms"] = _parse_ms("jitter", jitter)
    if up is not None:
        changes["up_bps"] = parse_rate(up)
    if down is not None:
        changes["down_bps"] = parse_rate(down)
    if loss is not None:
        changes["loss_pct"] = _parse_pct(loss)
    if seed is not None:
        if isinstance(seed, bool):
            raise ValueError(f"invalid seed {seed!r}")
        try:
            changes["seed"] = int(seed)
        except (TypeError, ValueError):
            raise ValueError(f"invalid seed {seed!r}: expected an integer") from None
    if switch is not None:
        if not base.varies:
            raise ValueError(f"switch applies to a varying profile (e.g. 'varying'), not {name!r}")
        if isinstance(switch, str):  # seconds unless it says otherwise: "10", "2.5s", "500ms"
            text = switch.strip().lower()
            changes["switch_s"] = _parse_ms("switch", text if text.endswith("s") else f"{text}s") / 1000.0
        else:
            changes["switch_s"] = _parse_ms("switch", switch)  # a number of seconds (validated as such)
        if changes["switch_s"] <= 0:
            raise ValueError(f"invalid switch {switch!r}: must be > 0")
    return dataclasses.replace(base, **changes)
