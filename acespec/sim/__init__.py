"""Trace-driven simulation of edge-cloud runs under device and network profiles (DESIGN.md, "Measuring").

Record real per-position acceptance from the real model pair once (`trace`), then replay it through a
discrete-event model of the protocol (`model`) under device profiles (`profiles`) and network profiles
(`acespec.net.profile.WanProfile`); `report` runs grids, prints tables and compares with live runs.
`acespec bench sim` is the command.
"""

from acespec.sim.model import FrameSizer, SimConfig, SimResult, parse_mode, simulate
from acespec.sim.profiles import DEVICE_PROFILES, DeviceProfile, device_profile
from acespec.sim.trace import PromptTrace, TraceSet, record_prompt, record_traces

__all__ = [
    "FrameSizer", "SimConfig", "SimResult", "parse_mode", "simulate", "DEVICE_PROFILES", "DeviceProfile",
    "device_profile", "PromptTrace", "TraceSet", "record_prompt", "record_traces",
]
