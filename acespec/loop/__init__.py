"""The draft -> verify loop (written once), the target-side verifier, and the single-process path (`local.generate`).

The loop is three parts: the protocol core (`loop.SpecLoop`), its scheduler (`schedule.Scheduler`,
timing) and its cache planner (`planner.CachePlanner`); `transport` declares what a link must offer.
"""

from acespec.loop.local import SpecConfig, generate
from acespec.loop.loop import LoopConfig, LoopResult, Round, SpecLoop
from acespec.loop.records import Block, Disconnected, InFlight, LinkSample, Outcome
from acespec.loop.stats import RunStats
from acespec.loop.transport import LocalTransport, Transport
from acespec.loop.verifier import BlockVerdict, TargetVerifier

__all__ = [
    "SpecConfig",
    "generate",
    "Block",
    "Disconnected",
    "InFlight",
    "LinkSample",
    "Outcome",
    "LocalTransport",
    "LoopConfig",
    "LoopResult",
    "Round",
    "SpecLoop",
    "Transport",
    "RunStats",
    "TargetVerifier",
    "BlockVerdict",
]
