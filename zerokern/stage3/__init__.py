"""ZeRO stage 3: params partitioned per module unit, gathered on demand (DESIGN §2)."""

from .runtime import Stage3Runtime
from .sharded_flat import ShardedFlat
from .units import Unit, describe, find_units

__all__ = ["Stage3Runtime", "ShardedFlat", "Unit", "describe", "find_units"]
