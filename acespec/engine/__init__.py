"""The draft -> verify loop (written once), the target-side verifier, and the single-process engine.

The loop is three parts: the protocol core (`loop.SpecLoop`), its scheduler (`schedule.Scheduler`,
timing) and its cache planner (`planner.CachePlanner`); `transport` declares what a link must offer.
"""

from acespec.engine.local import SpecConfig, generate
from acespec.engine.loop import LoopConfig, LoopResult, Round, SpecLoop
from acespec.engine.records import Block, Disconnected, InFlight, LinkSample, Outcome
from acespec.engine.stats import RunStats
from acespec.engine.transport import LocalTransport, Transport
from acespec.engine.verifier import BlockVerdict, TargetVerifier

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
