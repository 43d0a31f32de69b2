"""Headless Chromium for the page tests: the driver of edge-ts/scripts/browser_edge.py (the browser edge's
harness, which `bench-edges.ts --browser` runs), loaded by its path, so every browser test and the bench
start Chromium one way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "browser_edge", Path(__file__).resolve().parents[1] / "edge-ts" / "scripts" / "browser_edge.py"
)
assert _spec is not None and _spec.loader is not None
browser_edge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(browser_edge)

CHROMIUM = browser_edge.CHROMIUM
CHROMEDRIVER = browser_edge.CHROMEDRIVER
start_chromium = browser_edge.chromium
