"""Benchmarks: ratios measured side by side in one run (see docs/design/architecture.md, Measuring)."""

import json
from pathlib import Path


def write_result(path: str | None, result: dict) -> None:
    """Write a benchmark's full result as JSON (when `--json PATH` was given) and say where."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"wrote {path}")
