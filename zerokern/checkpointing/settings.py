"""What `configure` sets, and the DeepSpeed config section `activation_checkpointing` it can be
read from (the same parser serves `zerokern.initialize`'s config).

[Note: the activation_checkpointing keys]
DeepSpeed's section, each key with DeepSpeed's default:
- partition_activations (false): split each checkpointed input over the tensor-parallel ranks
  (ZeRO-R's Pa; zerokern/checkpointing/partition.py);
- cpu_checkpointing (false): keep the checkpointed inputs in host memory (Pa+cpu; host_pool.py).
  Unlike DeepSpeed's it works without partition_activations too (at tp = 1);
- contiguous_memory_optimization (false): write the checkpoints into one preallocated buffer
  per input slot (MD; contiguous.py). Unlike DeepSpeed's it does not need partition_activations;
- number_checkpoints (null): the buffers' number of slots; when absent, derived from the first
  forward (DeepSpeed raises IndexError there);
- synchronize_checkpoint_boundary (false): synchronize the device before and after each
  checkpointed forward and recompute (a no-op on CPU);
- profile (false): log the time of each checkpointed forward and recompute (and keep the
  totals in `zerokern.checkpointing.stats()`).
Any other key raises naming it, as every zerokern config key does.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Type

SECTION = "activation_checkpointing"
# config key -> Settings field
KEYS = {"partition_activations": "partition_activations",
        "cpu_checkpointing": "checkpoint_in_cpu",
        "contiguous_memory_optimization": "contiguous_checkpointing",
        "number_checkpoints": "num_checkpoints",
        "synchronize_checkpoint_boundary": "synchronize",
        "profile": "profile"}


@dataclass(frozen=True)
class Settings:
    """The options of `configure`, by their `configure` names ([Note: the
    activation_checkpointing keys] gives the config keys)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False

    def replace(self, **kw: Any) -> Settings:
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        vals.update({k: v for k, v in kw.items() if v is not None})
        return Settings(**vals)


def check_value(name: str, v: Any, error: Type[Exception] = ValueError) -> Any:
    """One option's value, checked (`name` as the caller spells it)."""
    if name.endswith(("num_checkpoints", "number_checkpoints")):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise error(f"{name} must be an integer >= 1 or null, got {v!r}")
        return int(v)
    if not isinstance(v, bool):
        raise error(f"{name} must be true or false, got {v!r}")
    return v


def parse_section(sec: Any, error: Type[Exception] = ValueError,
                  prefix: str = SECTION + ".") -> Dict[str, Any]:
    """The section as `configure` keywords ({field: value}, only the keys given).

    Raises:
        error: the section is not a dict, a key is unknown (named), or a value is invalid.
    """
    if not isinstance(sec, dict):
        raise error(f"config key {SECTION} must be a dict, got {sec!r}")
    out: Dict[str, Any] = {}
    for k, v in sec.items():
        if k not in KEYS:
            raise error(f"config key {prefix}{k} is not supported by zerokern "
                        f"(supported here: {sorted(KEYS)})")
        out[KEYS[k]] = check_value(f"config key {prefix}{k}", v, error)
    return out


def section_of(config: Any) -> Optional[Dict[str, Any]]:
    """The `activation_checkpointing` section of a DeepSpeed config (a dict, or a path to a
    JSON file), or None when it has none."""
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        import json

        with open(config) as fh:
            config = json.load(fh)
    if not isinstance(config, dict):
        raise ValueError(f"deepspeed_config must be a dict or a path to a JSON file, got "
                         f"{type(config).__name__}")
    return config.get(SECTION)
