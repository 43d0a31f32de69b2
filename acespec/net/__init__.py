"""WAN emulation between edge and cloud: delay, jitter, bandwidth, loss stalls, and injected faults.

`WanProxy` (asyncio) / `WanProxyThread` (synchronous callers) forward TCP from a listening port to an
upstream address through an emulated path described by a `WanProfile`; `run_wan` is the CLI entry
point. Only the standard library is used, and no other acespec module.
"""

from acespec.net.cli import run_wan
from acespec.net.link import MSS, LinkQueue, StreamClock
from acespec.net.profile import (
    MIN_RTO_MS,
    PROFILES,
    WanProfile,
    format_rate,
    parse_hostport,
    parse_rate,
    profile_from_args,
)
from acespec.net.wan import SIGNAL_BLACKHOLE_S, WanCounters, WanProxy, WanProxyThread

__all__ = [
    "WanProfile",
    "PROFILES",
    "MIN_RTO_MS",
    "parse_rate",
    "format_rate",
    "parse_hostport",
    "profile_from_args",
    "MSS",
    "LinkQueue",
    "StreamClock",
    "WanCounters",
    "WanProxy",
    "WanProxyThread",
    "run_wan",
    "SIGNAL_BLACKHOLE_S",
]
