"""Collectives over torch.distributed with byte accounting (DESIGN §5): `GroupComm` wraps one
process group, `Comm` names the groups an optimizer uses by role (shard, replicate, world)."""

from .collectives import CommStats, GroupComm
from .groups import Comm

__all__ = ["Comm", "CommStats", "GroupComm"]
