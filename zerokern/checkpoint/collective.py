"""Small object collectives for save/load, and the all-ranks-agree error rule.

Every step of save and load that can fail on one rank ends in `agree(err)`: the ranks exchange
their errors (None when fine) and either all go on or all raise. So a failure is never a hang
(a peer waiting in a collective the failed rank never joins), and a failed load writes nothing
on any rank.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, List, Optional

import torch.distributed as dist

from ..comm import liveness
from ..comm.abort import CollectiveMismatch, PeerLost, explain, is_timeout, timeout_error
from ..comm.collectives import waiting_in
from .format import CheckpointError


class Collective:
    """Object collectives over the optimizer's group; local at world size 1."""

    def __init__(self, group, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    def all_gather(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        out: List[Any] = [None] * self.world_size
        t0 = time.monotonic()
        what = "a step of checkpoint save/load"
        try:  # on a helper thread, watched for a lost rank ([Note: a rank that dies]), and
            # compared with the peers' positions when it stalls ([Note: ranks stuck in
            # different collectives]: a save on rank 0 alone)
            with waiting_in(self.group, "checkpoint save/load all_gather_object") as waiting:
                liveness.watched(lambda: dist.all_gather_object(out, obj, group=self.group),
                                 what, self.group, on_poll=getattr(waiting, "poll", None))
        except (PeerLost, CollectiveMismatch):
            raise
        except Exception as e:  # noqa: BLE001 - gloo's timeout: say what to raise
            lost = explain(e, what, [r for r in _ranks(self.group)
                                              if r != dist.get_rank()])
            if lost is not None:  # a peer's connection closed: which rank was lost
                raise lost from e
            if is_timeout(e):
                raise timeout_error("the other ranks at a step of checkpoint save/load "
                                    "(one rank may still be writing or reading its files)",
                                    time.monotonic() - t0, e) from e
            raise
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's obj on every rank (an all-gather: no global-vs-group rank arithmetic)."""
        return self.all_gather(obj if self.rank == 0 else None)[0]

    def agree(self, err: Optional[BaseException]) -> None:
        """Raise on every rank if any rank failed: its own error, else the lowest failed rank's."""
        errors = self.all_gather(None if err is None else _encode(err))
        if err is not None:
            raise err
        for r, e in enumerate(errors):
            if e is not None:
                raise _decode(e, r)


def _ranks(group) -> List[int]:
    return dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))


def _encode(err: BaseException):
    try:
        pickle.dumps(type(err))
        return type(err), str(err)
    except Exception:  # noqa: BLE001 - a local class: send the message only
        return CheckpointError, f"{type(err).__name__}: {err}"


def _decode(e, rank: int) -> BaseException:
    typ, msg = e
    msg = f"rank {rank}: {msg}"
    try:
        return typ(msg)
    except Exception:  # noqa: BLE001 - a constructor with other arguments
        return CheckpointError(msg)
