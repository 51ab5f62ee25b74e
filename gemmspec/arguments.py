"""Command-line value types that `gemmspec` and `gemmspec bench` share (argparse `type=`
callables: each returns the value or raises argparse.ArgumentTypeError)."""

from __future__ import annotations

import argparse
import re


def digits(text: str) -> bool:
    """Whether `text` is ASCII digits only: str.isdigit() also takes superscripts, which
    int() refuses."""
    return re.fullmatch(r"[0-9]+", text) is not None


def positive_int(text: str) -> int:
    if not digits(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)
