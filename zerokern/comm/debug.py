"""ZEROKERN_DEBUG_COLLECTIVES=1: check that every rank issued the same collectives.

[Note: collective fingerprints]
A rank that issues its collectives in another order than its peers does not always fail: two
collectives with equal byte counts exchange each other's data (the gloo ring, and NCCL when the
sizes match) and training goes on, wrong. In debug mode every Comm records, per collective,
(group, kind, dtype, shape, label), where the label names the buffer (e.g. "unit 3 group 0"), so
a reorder of two same-shaped units shows too. Records are compared in the order this rank issued
them over all of the optimizer's groups, not per group: NCCL asks for one order across
communicators too, and stage 3, whose gathers and reduce-scatters run on two groups, keeps one
([Note: stage-3 collective order], rule 4, in stage3/runtime.py). `check()`, called at every
step(), exchanges a 64-bit hash and the count of each rank's records
since the last check over the world group (every data-parallel rank, comm/groups.py [Note: two
groups, named by role]; with a 1-D mesh it is the shard group), with plain torch.distributed
collectives that are not recorded themselves. On a mismatch it gathers the records
(all_gather_object) and raises on every rank, naming the first position where two ranks differ.
The mode costs a host sync and an all-gather per check, so it is off by default.
"""

from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from zerokern.platform.device import handle

ENV = "ZEROKERN_DEBUG_COLLECTIVES"

Record = Tuple[str, str, str, tuple, str]  # (group tag, kind, dtype, shape, label)


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


class CollectiveLog:
    """The collectives one rank issued since the last check, over all of one optimizer's
    groups (a Comm and the Comms split from it share one log)."""

    def __init__(self) -> None:
        self.records: List[Record] = []
        self.checks = 0

    def add(self, tag: str, kind: str, t: torch.Tensor, label: Optional[str]) -> None:
        self.records.append((tag, kind, str(t.dtype).replace("torch.", ""), tuple(t.shape),
                             label or ""))

    def check(self, group, where: str = "step()") -> None:
        """Collective over `group`: raise RuntimeError on every rank if the ranks' records
        differ; then start a new record."""
        records, self.records = self.records, []
        self.checks += 1
        if group is None or dist.get_world_size(group) == 1:
            return
        mine = torch.tensor([len(records), self._digest_of(records)], dtype=torch.int64)
        n = dist.get_world_size(group)
        dev = _device_of(group)
        out = torch.zeros(n * 2, dtype=torch.int64, device=dev)
        dist.all_gather_into_tensor(out, mine.to(dev), group=group)
        pairs = out.view(n, 2).cpu()
        if bool((pairs == pairs[0]).all()):
            return
        every: List[Optional[List[Record]]] = [None] * n
        dist.all_gather_object(every, records, group=group)
        raise RuntimeError(_first_divergence(every, where, self.checks))

    @staticmethod
    def _digest_of(records: List[Record]) -> int:
        h = hashlib.blake2b(repr(records).encode(), digest_size=8).digest()
        return int.from_bytes(h, "little", signed=True)


def _device_of(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return handle("cuda").current_device()
    return torch.device("cpu")


def _fmt(r: Optional[Record]) -> str:
    if r is None:
        return "nothing (fewer collectives)"
    tag, kind, dtype, shape, label = r
    return f"{kind} {dtype}{list(shape)} on the {tag} group" + (f" ({label})" if label else "")


def _first_divergence(every: List[List[Record]], where: str, check_no: int) -> str:
    longest = max(len(r) for r in every)
    for i in range(longest):  # in issue order, over all groups ([Note: collective fingerprints])
        seen = [r[i] if i < len(r) else None for r in every]
        if all(s == seen[0] for s in seen):
            continue
        ranks = "; ".join(f"rank {k}: {_fmt(s)}" for k, s in enumerate(seen))
        return (f"zerokern ({ENV}=1): the ranks issued different collectives before {where} "
                f"(check {check_no}); the first difference is collective #{i} (over all "
                f"groups, in issue order): {ranks}. Every rank must issue the same collectives "
                "in the same order "
                "(same modules called in the same order on every rank, or units skipped "
                "through zerokern's schedule; see [Note: stage-3 collective order] in "
                "zerokern/stage3/runtime.py)")
    return f"zerokern ({ENV}=1): collective records differ across ranks before {where}"
