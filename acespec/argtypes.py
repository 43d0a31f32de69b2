"""Command-line value parsers shared by every `acespec` subcommand (argparse `type=` callables).

Each raises `argparse.ArgumentTypeError` with a short reason, which the CLI prints as one line.
"""

from __future__ import annotations

import argparse
import math


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def nonneg_int(text: str) -> int:
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def pos_int(text: str) -> int:
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def nonneg_float(text: str) -> float:
    v = _number(text, float)
    if not (v >= 0.0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return v


def pos_float(text: str) -> float:
    v = _number(text, float)
    if not (v > 0.0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return v


def pos_float_or_inf(text: str) -> float:
    """A number > 0, where `inf` means no limit."""
    v = _number(text, float)
    if not v > 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0 (or inf)")
    return v


def unit_float(text: str) -> float:
    v = _number(text, float)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return v


def parse_rtts(text: str) -> list[float]:
    """ "0,50,100,200" -> [0.0, 50.0, 100.0, 200.0] (milliseconds, >= 0, no duplicates)."""
    out: list[float] = []
    for part in str(text).split(","):
        part = part.strip().lower().removesuffix("ms")
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--rtt: {part!r} is not a number of milliseconds") from None
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"--rtt: {part!r} must be a finite number >= 0")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError("--rtt: give at least one RTT, e.g. 0,50,100")
    return out
