"""Trace-driven simulation of edge-cloud runs under device and network profiles (docs/design/architecture.md, "Measuring").

Record real per-position acceptance from the real model pair once (`trace`), then replay it through the
live edge's own loop on virtual time (`edge`, `kernel`): replay models (`replay`) stand in for the
drafter and the target, a simulated network (`link`) for the WAN, and a simulated accelerator (`cloud`)
prices each pass by a device profile (`profiles`). `report` runs grids, prints tables and compares
with live runs; `capacity` puts many edges on one cloud GPU. `acespec bench sim` and `acespec bench
capacity` are the commands.
"""

from acespec.sim.edge import SimConfig, SimResult, parse_mode, simulate
from acespec.sim.link import FrameSizer
from acespec.sim.profiles import DEVICE_PROFILES, DeviceProfile, device_profile
from acespec.sim.trace import PromptTrace, TraceSet, record_prompt, record_traces

__all__ = [
    "FrameSizer",
    "SimConfig",
    "SimResult",
    "parse_mode",
    "simulate",
    "DEVICE_PROFILES",
    "DeviceProfile",
    "device_profile",
    "PromptTrace",
    "TraceSet",
    "record_prompt",
    "record_traces",
]
