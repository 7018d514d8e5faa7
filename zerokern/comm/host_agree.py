"""Agreement on small host-side facts (a few flags) across a group, with no device involved.

[Note: agreeing on host facts] Stage 3 must know, at the end of every synced backward, whether
any rank reduced a unit late ([Note: stage-3 collective order], rule 4, in stage3/runtime.py):
the answer decides which collectives every rank issues next. That fact lives in Python sets on
the host. Reading it through a device all-reduce would cost a host-device synchronisation per
backward on a GPU (the step path has none: optimizer.step's docstring); a gloo all-reduce of a
CPU tensor costs none, only the wait for the slowest rank's host to reach the end of its
backward. So:
- on a gloo group the flags go through that group's own collective (its ring thread keeps every
  collective of this rank in one order, [Note: gloo collectives] in ring.py, and its wait
  polls for a peer's failure, comm/abort.py). Measured on 2 quiet gloo CPU ranks, 250 calls of
  7 flags: median 720-750 us, p90 4.1 ms (a gloo group of its own, called from the main thread,
  was 510 us and 3.9 ms, but its wait would not see a peer's failure: a hang until the
  process-group timeout instead of RankAborted);
- on an NCCL group through a gloo group over the same ranks, made once per group (creating it is
  collective: every rank builds its optimizer, so every rank makes it at the same point); a
  peer's failure ends its wait at the process group's timeout, as for the NCCL collectives.
  Making it registers the exit wait of [Note: the gloo exit race] (exit_guard.py): the process
  then has gloo workers that may release their last work while Python finalizes.
The collective is recorded on the group it agrees for in debug mode (ZEROKERN_DEBUG_COLLECTIVES
checks its place in the order), but not counted in comm_stats(), which counts the data path:
the bytes DESIGN §6's formulas predict (this one is 4 bytes per unit per backward, on the host).
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .collectives import GroupComm
from .exit_guard import guard_gloo_exit

_HOST_GROUPS: dict = {}  # an NCCL process group -> a gloo group over the same ranks


class HostAgreement:
    """Every rank of `gc`'s group learns, for each position, whether any rank set its flag."""

    def __init__(self, gc: GroupComm) -> None:
        self.gc = gc
        self.group = None
        if gc.world_size > 1 and gc.backend != "gloo":
            if gc.group not in _HOST_GROUPS:
                ranks = dist.get_process_group_ranks(gc.group)
                _HOST_GROUPS[gc.group] = dist.new_group(ranks, backend="gloo",
                                                        use_local_synchronization=True)
                # this process now runs gloo workers too: [Note: the gloo exit race]
                guard_gloo_exit()
            self.group = _HOST_GROUPS[gc.group]

    def any_set(self, flags: List[bool], label: str) -> List[bool]:
        """Collective over the group (a no-op at world size 1): flags OR-ed over the ranks."""
        if self.gc.world_size == 1:
            return list(flags)
        t = torch.tensor([int(f) for f in flags] or [0], dtype=torch.int32)  # (on the host)
        self.gc.agree_(t, dist.ReduceOp.MAX, label, self.group)
        return [bool(v) for v in read_host_flags(t)[:len(flags)]]


def read_host_flags(t: torch.Tensor) -> List[int]:
    """The one host read of a tensor on the step path: a CPU tensor that never was on a device
    (tests/optimizer/test_no_host_sync.py lets this function's read through, no other)."""
    if t.device.type != "cpu":
        raise ValueError(f"read_host_flags reads host tensors only, got one on {t.device}")
    return t.tolist()
