"""argparse types shared by the command-line tools (the error names the flag; argparse adds it)."""

from __future__ import annotations

import argparse
import math


def int_at_least(lo: int):
    """argparse type: an int >= lo (the error names the flag, argparse adds it)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def mib_or_inf(text: str) -> float:
    """argparse type: a number of MiB >= 0, or "inf"."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (or inf), got {text}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def mesh_shape(text: str) -> tuple:
    """argparse type: a 2-D data-parallel mesh "RxS" (replicate x shard), e.g. "2x2", or a 3-D
    "PPxTPxDP" (pipeline x tensor x data parallel), e.g. "2x1x2"."""
    parts = text.lower().split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected RxS (replicate x shard ranks, e.g. 2x2) or "
                                         f"PPxTPxDP (e.g. 2x1x2), got {text!r}") from None
    if min(dims) < 1:
        raise argparse.ArgumentTypeError(f"every dim must be >= 1, got {text!r}")
    return dims
