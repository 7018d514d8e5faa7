"""A tensor-parallel model under ZeroAdamW: its DTensor params checked against the dp mesh, and
the tensor-parallel group the grad statistics are agreed over (issue 22, item 5).

[Note: ZeRO on the dp dim of a TP model]
FSDP2's convention: the model is parallelized over the "tp" sub-mesh (`parallelize_module`), and
ZeroAdamW gets the *data-parallel* mesh (`world_mesh["dp"]`). Each rank's flat buffers then hold
its local tp shards (geometry/dtensor_params.py) and are sharded and reduced over dp only, which is
right exactly when every dp peer of a rank holds the same tp coordinate (the same slice of every
weight). So, before anything changes:
- every DTensor param lives on one 1-D mesh (the tp mesh) with Shard(d) or Replicate()
  placements, and has the precision's dtype (a DTensor's dtype is its own metadata: the optimizer
  cannot cast it in place);
- the dp group (mesh=, process_group=, or WORLD) meets the tp mesh in this rank only: a dp group
  that includes tp peers (no mesh= given, or the whole 2-D world mesh) would average different
  shards together, silently wrong;
- every dp peer has the same tp coordinate and tp size (one all-gather over the dp group at
  construction; a mismatch raises on every dp rank alike, as the gathered values are the same).
All of these raise ValueError naming the argument.

[Note: the global norm over tp and dp]
A Shard() param's elements are split over the tp ranks: each is counted on its one rank. A
Replicate() param (and a plain param of the model, which the tp ranks compute redundantly from
the same, replicated activations) holds the same gradient on every tp rank: it is counted on tp
rank 0 only. So sumsq = sum over tp of (sharded part + [tp rank 0] replicated part): one SUM
all-reduce over the tp group, after the dp one, of [found_inf, sumsq]; found_inf summed over tp
too, so the overflow skip and the clip coefficient agree on every rank of the dp x tp world.
The zero on tp ranks other than 0 is exact (x + 0), with no division.

[Note: replicated grads must agree]
Counting the replicated part on tp rank 0 only is right when every tp rank holds the same
replicated gradients. DTensor makes that so for Replicate() params (a Partial() grad is summed
over tp first, grads/grad_sync.py); a *plain* param is replicated only by the user's program
(the tp ranks compute it from the same activations). A plain param fed from sequence-sharded
activations would get a different gradient on each tp rank, and the update would diverge
silently, as it would under torch's own optimizer. ZEROKERN_DEBUG_COLLECTIVES=1 checks it at
every step: the replicated sumsq's max and min over tp (one small all-reduce and a host read,
so debug mode only), raising on every rank when they differ by more than 1e-6 relative.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from zerokern.geometry.dtensor_params import is_dtensor

from .collectives import GroupComm
from .debug import enabled as _debug_enabled

# one process group per set of tp ranks (groups are never destroyed: one per optimizer leaks)
_TP_GROUPS: dict = {}


class TensorParallel:
    """The tp side of an optimizer over a TP model: the tp group's collectives (`comm`, in
    comm_stats under dim "tp")."""

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        self.check_replicated = _debug_enabled()  # [Note: replicated grads must agree]

    @property
    def rank(self) -> int:
        return self.comm.rank

    def fold_replicated_(self, stats: torch.Tensor) -> None:
        """stats = [found_inf, sumsq (sharded part), sumsq (replicated part)] of this rank,
        already summed over dp: the replicated part counted on tp rank 0 only, into stats[1]
        ([Note: the global norm over tp and dp]); the plan's agreement then sums stats[:2]
        over tp (comm/plan.py)."""
        if self.check_replicated:
            self._check_replicated(stats[2])
        if self.comm.rank != 0:
            stats[2].zero_()
        stats[1].add_(stats[2])

    def _check_replicated(self, rep: torch.Tensor) -> None:
        """ZEROKERN_DEBUG_COLLECTIVES=1: raise on every tp rank when the replicated part's
        sumsq differs across tp (max and -min in one MAX all-reduce; a host read)."""
        both = torch.stack([rep, -rep]).double()
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.comm.group)
        hi, lo = float(both[0]), -float(both[1])
        if hi - lo > 1e-6 * max(abs(hi), 1e-30):
            raise RuntimeError(
                "zerokern: the gradients of the params replicated on tp (Replicate() DTensors "
                "and the model's plain params) differ across the tensor-parallel ranks (sum of "
                f"squares {lo!r} .. {hi!r}); the update would be silently wrong. Every tp "
                "rank must compute them from the same inputs; a plain param fed from "
                "sequence-sharded activations must be a Replicate() DTensor "
                "(SequenceParallel, or distribute_module)")


def _placement_ok(pl) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    return isinstance(pl, (Shard, Replicate))


def check_tensor_parallel(trainable: List[List[torch.Tensor]], others: List[torch.Tensor],
                          dtype: torch.dtype, precision: str, mesh,
                          process_group) -> Optional[object]:
    """Check the DTensor params against the dp group ([Note: ZeRO on the dp dim of a TP
    model]); None for a model without DTensor params, else their (tp) DeviceMesh.

    Args:
        trainable: the optimizer's params per group.
        others: the frozen params it casts (they must have the dtype too).
        dtype: the precision's dtype; precision: its name, for the message.
        mesh, process_group: ZeroAdamW's (checked already by check_mesh).
    Raises:
        ValueError: a DTensor param on another mesh or placement, of another dtype, or a dp
            group that includes tp peers or peers of another tp coordinate.
    """
    dts = [p for ps in trainable for p in ps if is_dtensor(p)] + \
        [p for p in others if is_dtensor(p)]
    if not dts:
        return None
    tp_mesh = dts[0].device_mesh
    for p in dts:
        if p.device_mesh != tp_mesh or p.device_mesh.ndim != 1:
            raise ValueError(
                "params_or_model: every DTensor param must live on one 1-D tensor-parallel "
                f"mesh; found meshes {tp_mesh} and {p.device_mesh} (a model already sharded "
                "by FSDP2's fully_shard, or parallelized over a 2-D mesh, is not supported)")
        if not all(_placement_ok(pl) for pl in p.placements):
            raise ValueError(f"params_or_model: a DTensor param has placements {p.placements}; "
                             "only Shard(d) and Replicate() params are supported")
        if p.dtype != dtype:
            raise ValueError(
                f"precision={precision!r} but a DTensor param is {p.dtype}: a DTensor's dtype "
                "cannot be changed in place; cast the model (model.to(dtype)) before "
                "parallelize_module, or pass the precision of its params")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("params_or_model has DTensor params but torch.distributed is not "
                         "initialized")
    me = dist.get_rank()
    tp_ranks = [int(r) for r in tp_mesh.mesh.flatten().tolist()]
    if mesh is not None:
        dp_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    elif process_group is not None:
        dp_ranks = dist.get_process_group_ranks(process_group)
    else:
        dp_ranks = list(range(dist.get_world_size()))
    both = sorted(set(dp_ranks) & set(tp_ranks))
    if both != [me]:
        arg = "mesh" if mesh is not None else \
            "process_group" if process_group is not None else "mesh (not given)"
        raise ValueError(
            f"{arg}: the model is tensor-parallel over ranks {tp_ranks} (its DTensor params' "
            f"mesh) and the data-parallel ranks {sorted(dp_ranks)} include its tp peers "
            f"{[r for r in both if r != me]}: ZeRO would average different tp shards. Pass the "
            "data-parallel sub-mesh, ZeroAdamW(model, mesh=world_mesh['dp']), or the world "
            "mesh with named dims (mesh=world_mesh, e.g. ('pp', 'dp', 'tp'))")
    # every dp peer holds the same tp coordinate (the same local shapes)
    coord = torch.tensor([tp_mesh.get_local_rank(), tp_mesh.size()], dtype=torch.int64)
    if process_group is not None:
        groups = [process_group]
    elif mesh is not None:  # a 2-D dp mesh: each of its dims (together: every dp peer)
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    else:
        groups = [None]  # WORLD (only with a tp size of 1: else raised above)
    for g in groups:
        n = dist.get_world_size(g)
        got = [torch.zeros_like(coord) for _ in range(n)]
        dist.all_gather(got, coord, group=g)
        if any(not torch.equal(c, coord) for c in got):
            raise ValueError(
                "mesh: the data-parallel peers of a rank must hold the same tensor-parallel "
                f"coordinate; (tp rank, tp size) over this rank's dp group: "
                f"{[tuple(c.tolist()) for c in got]}. Pass world_mesh['dp'] of the mesh the "
                "model was parallelized over")
    return tp_mesh


def make_tensor_parallel(checked: Optional[object], stats) -> Optional[TensorParallel]:
    """The TensorParallel of check_tensor_parallel's result (None stays None); its group
    shares the optimizer's CommStats (`stats`)."""
    if checked is None:
        return None
    tp_mesh = checked
    ranks = tuple(sorted(int(r) for r in tp_mesh.mesh.flatten().tolist()))
    if ranks not in _TP_GROUPS:  # our own group: DTensor's collectives keep the mesh's
        _TP_GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return TensorParallel(GroupComm(_TP_GROUPS[ranks], dim="tp", stats=stats, tag="tp"))


__all__ = ["TensorParallel", "check_tensor_parallel", "make_tensor_parallel"]
