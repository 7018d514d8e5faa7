"""Checks of single DeepSpeed config values (engine/config.py, engine/optimizer_types.py): each
raises a ValueError naming the key, before anything is built."""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict


class ConfigError(ValueError, AssertionError):
    """A DeepSpeed config zerokern rejects (naming the key), before anything is built. A
    ValueError, and an AssertionError too because that is what DeepSpeed raises for most bad
    configs (its batch-size, precision and optimizer checks are asserts; code and tests
    written for DeepSpeed catch it), as NoOptimizerError is."""


def _check_auto(d: Dict[str, Any], prefix: str = "") -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _check_auto(v, f"{prefix}{k}.")
        elif isinstance(v, str) and v == "auto":
            raise ConfigError(f"config key {prefix}{k!s} is 'auto': only the Hugging Face "
                             "integration fills 'auto' values; zerokern.initialize needs a value")


def _int(key: str, v: Any, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or v != int(v) or int(v) < lo:
        raise ConfigError(f"config key {key} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _num(key: str, v: Any, lo: float = 0.0) -> float:
    # finite only: an infinite fp16.loss_scale (DeepSpeed rejects it, its issue #7852) would
    # overflow every step, an infinite lr or clip norm means nothing
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= lo or \
            not math.isfinite(v):
        raise ConfigError(f"config key {key} must be a finite number >= {lo}, got {v!r}")
    return float(v)


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"config key {key} must be true or false, got {v!r}")
    return v


def _unknown(d: Dict[str, Any], allowed, prefix: str) -> None:
    for k in d:
        if k not in allowed:
            raise ConfigError(f"config key {prefix}{k} is not supported by zerokern "
                             f"(supported here: {sorted(allowed)})")
