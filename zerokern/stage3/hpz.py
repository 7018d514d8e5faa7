"""hpZ (ZeRO++'s hierarchical partitioning, `ZeroAdamW(stage=3, mesh=2-D, hpz=True)`): the
params are sharded over every rank of the mesh (memory: 2Ψ/N), and a secondary copy of each
unit is sharded inside the node (the mesh's dim 1, n ranks: 2Ψ/n more), so the backward
re-gather never leaves the node.

[Note: hpZ secondary, valid from a forward to its backward]
The forward gathers each unit over the whole world (the primary shards). When the forward
frees a unit that it gathered whole, this rank keeps its node piece `full[j·E/n, (j+1)·E/n)`
(j: its rank in the node group); the backward re-gather is then an all-gather of those pieces
over the node group, which rebuilds `full` bit for bit (the same values the world gather
brought). The copy is valid only until the params can change: it is dropped at the end of
backward, at every new forward, at step() and at any write-back (gathered_params(modify=True),
a frozen write-back). Between steps (gathered_params(), checkpoints, eval) gathers always come
from the primary shards, so a stale secondary can never be read. Whether a unit has a
secondary is decided by the gather/free calls alone (not by timing), the same on every rank, so
every rank issues the same collectives on each group ([Note: stage-3 collective order]).
The reduce-scatter stays over the world: the grads, and so training, are plain stage 3's.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


class HpzSecondary:
    """The node-sharded secondary copies of the units (one (E/n,) buffer per flat buffer,
    allocated at its first use and kept, as DeepSpeed keeps its secondary partition)."""

    def __init__(self, node_comm) -> None:
        self.comm = node_comm  # GroupComm over the node group (the mesh's dim 1)
        self.n, self.j = node_comm.world_size, node_comm.rank
        self.bufs: Dict[int, torch.Tensor] = {}  # id(flat) -> (E/n,) model dtype
        self.valid: set = set()  # id(flat) whose secondary holds the current params

    def keep(self, f) -> None:
        """f is about to be freed after a forward gathered it whole: keep this rank's node
        piece of it."""
        if not f.gathered:
            return
        E = f.full.numel()
        m = E // self.n
        buf = self.bufs.get(id(f))
        if buf is None:
            buf = self.bufs[id(f)] = torch.empty(m, dtype=f.full.dtype, device=f.full.device)
        buf.copy_(f.full[self.j * m:(self.j + 1) * m])
        self.valid.add(id(f))

    def route(self, f) -> Optional[Tuple[object, torch.Tensor]]:
        """(node GroupComm, this rank's secondary piece) when f's secondary is valid."""
        if id(f) in self.valid:
            return self.comm, self.bufs[id(f)]
        return None

    def invalidate(self) -> None:
        self.valid.clear()

    def held(self) -> List[torch.Tensor]:
        return list(self.bufs.values())
