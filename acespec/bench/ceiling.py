"""The ceiling lives in `acespec.sim.ceiling` (the simulator's report prices runs against it too, and a layer
imports only the layers below it); its names stay importable here for `acespec demo`, which reads them from
here until it moves to `acespec.sim.ceiling` too."""

from acespec.sim.ceiling import (
    MIN_PASSES,
    MODES,
    Calibration,
    against_ceiling,
    calibrate,
    ceiling,
    describe,
    expected_tokens,
    for_run,
)

__all__ = ["MIN_PASSES", "MODES", "Calibration", "against_ceiling", "calibrate", "ceiling", "describe",
           "expected_tokens", "for_run"]
