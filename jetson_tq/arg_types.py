"""argparse ``type=`` checkers shared by every command line: finite numbers in range, known device names (exit 2)."""

from __future__ import annotations

import argparse
import math
import re


def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _within(text: str, ok, want: str) -> float:
    value = _number(text, float)
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return value


#: Largest memory size in GB a command line accepts: 1 PB, more than any one machine holds (1e300 is a typo, and
#: its byte count is not even a finite float).
MAX_GB = 1e6


def _gigabytes(text: str, ok, want: str) -> float:
    value = _within(text, ok, want)
    if value > MAX_GB:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_GB:g} GB (1 PB, more than any one machine holds), got {text!r}"
        )
    return value


def positive_float(text: str) -> float:
    """A finite float in (0, MAX_GB] (memory sizes in GB)."""
    return _gigabytes(text, lambda x: x > 0, "a number > 0")


def nonnegative_float(text: str) -> float:
    """A finite float in [0, MAX_GB] (overheads, weight overrides, in GB)."""
    return _gigabytes(text, lambda x: x >= 0, "a number >= 0")


def fraction(text: str) -> float:
    """A finite float in (0, 1] (memory utilization)."""
    return _within(text, lambda x: 0 < x <= 1, "a fraction in (0, 1]")


def positive_int(text: str) -> int:
    """An integer >= 1 (tokens, sequences, MiB)."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device_name(text: str) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N' (whether it exists here is checked when it is used)."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text
