"""Collectives over torch.distributed with byte accounting (DESIGN §5)."""

from .collectives import Comm, CommStats

__all__ = ["Comm", "CommStats"]
