"""argparse `type=` checks for sizes and rates: a bad value is refused in one line naming the option."""

from __future__ import annotations

import argparse
import math


def int_at_least(low: int):
    """argparse `type=` for integers >= `low` (the error names the bound, e.g. `must be an integer >= 1`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


def float_in(low: float, high: float = math.inf, low_open: bool = True, high_open: bool = False):
    """argparse `type=` for finite floats in an interval (`float_in(0)`: positive; `nan`/`inf` refused)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
        if not math.isfinite(value) or not inside:
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text!r}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
positive_float = float_in(0.0)
nonnegative_float = float_in(0.0, low_open=False)
