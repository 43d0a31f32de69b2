"""The draft -> verify loop (written once), the target-side verifier, and the single-process engine."""

from acespec.engine.local import SpecConfig, generate
from acespec.engine.loop import Block, LocalTransport, LoopConfig, LoopResult, SpecLoop, Transport
from acespec.engine.stats import RunStats
from acespec.engine.verifier import TargetVerifier, Verdict

__all__ = [
    "SpecConfig", "generate", "Block", "LocalTransport", "LoopConfig", "LoopResult", "SpecLoop", "Transport",
    "RunStats", "TargetVerifier", "Verdict",
]
