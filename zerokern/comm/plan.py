"""The parallel plan: which ranks play which role for one optimizer, decided once, and the one
agreement over them (issue 35).

[Note: one parallel plan]
A rank of a ZeRO job can hold several roles at once. Each role is a group of ranks:
- `shard`: the ranks ZeRO partitions over (the reduce-scatter and all-gather group);
- `replicate`: HSDP's copies of one shard (a 2-D mesh's dim 0); 1 without a mesh;
- `hpz`: hpZ's node group, over which stage 3 keeps a secondary copy of the params;
- `tp`: tensor parallelism (a DTensor model's tp mesh, or an `mpu`'s tensor group);
- `pp`: pipeline parallelism (an `mpu`'s pipe group): other ranks hold other layers;
- `cp`: context parallelism (1: not supported yet; named so the sizes have a place for it).
`dp` is the data-parallel world, shard x replicate (hpZ: the shard group is already all of it):
the optimizer's `comm.world`. The ranks outside dp that hold *other params* of the same model
are the model-parallel ranks: tp (a DTensor model) or tp x pp (an mpu's model-parallel group).

The plan is built once, from `process_group=`, `mesh=`, `hpz=`, the quantized collectives, the
params (DTensors) and, for the engine, an `mpu` attached after construction. Everything that
depends on the roles reads it: the sizes (`RoleSizes`, also what `zerokern estimate` and the
accounting compute from, through `role_sizes`, with the same validation), and the agreement.

Agreement: a value every rank must end up with (the overflow flag and the grad norm of a step,
a norm for `clip_grad_norm_`, which params no rank used, an NVMe commit, a checkpoint) is
reduced with `agree_`: over dp (SUM or MAX over `comm.world`), then over the model-parallel
ranks (the tp group, or the mpu's group). The groups are orthogonal (every dp peer holds the
same model slice), so a SUM over one then the other is the SUM over their product, and a MAX
likewise. Before that, a value summed over elements must count each element once: HSDP's
replicas hold the same shard (`comm.count_once_`), tp's replicated params are counted on tp
rank 0 (comm/tp.py, grads/model_parallel.py): the callers prepare that, the plan reduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .groups import Comm

ROLES = ("shard", "replicate", "hpz", "tp", "pp", "cp")


@dataclass(frozen=True)
class RoleSizes:
    """The size of each role's group (numbers only: what accounting reads)."""

    shard: int
    replicate: int = 1
    hpz: Optional[int] = None
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        """The data-parallel world: every rank holding the same model slice."""
        return self.shard * self.replicate

    @property
    def world(self) -> int:
        """Every rank of the job the plan spans (dp x tp x pp x cp)."""
        return self.dp * self.tp * self.pp * self.cp

    def dims(self) -> Dict[str, int]:
        """The data-parallel dims, as `Comm.dims` and `memory_report()["mesh"]` name them."""
        out = {"shard": self.shard, "replicate": self.replicate, "world": self.dp}
        if self.hpz is not None:
            out["hpz"] = self.hpz
        return out


def check_hpz_roles(hpz: Any, shape: Optional[Tuple[int, ...]], stage: int,
                    offload_params: Optional[str]) -> None:
    """hpz=True needs stage 3 and a 2-D (replicate, shard) mesh, without offload_params: the
    one statement of it, for the optimizer (a DeviceMesh's shape) and for `estimate` (a
    (R, S) tuple). Raises TypeError/ValueError naming hpz."""
    if not isinstance(hpz, bool):
        raise TypeError(f"hpz must be True or False, got {type(hpz).__name__}")
    if not hpz:
        return
    if stage != 3:
        raise ValueError(f"hpz=True is for stage 3 (its params are sharded), got stage={stage}")
    if shape is None or len(shape) != 2:
        raise ValueError("hpz=True needs mesh= a 2-D mesh (replicate, shard): params shard "
                         "over all its ranks, the secondary copy over dim 1 (the node); got "
                         f"{'no mesh' if shape is None else f'a mesh of shape {shape}'}")
    if offload_params is not None:
        raise ValueError("hpz=True does not support offload_params (the secondary copy would "
                         f"live on the device); got offload_params={offload_params!r}")


def role_sizes(shape: Optional[Tuple[int, ...]], hpz: bool, dp_world: int, *, tp: int = 1,
               pp: int = 1) -> RoleSizes:
    """The sizes of a checked data-parallel layout: no mesh (one shard group of dp_world
    ranks), a 1-D mesh, (R, S) HSDP, or (R, S) with hpZ (shard over all, hpz = S)."""
    if shape is None or len(shape) == 1:
        n = dp_world if shape is None else shape[0]
        return RoleSizes(shard=n, tp=tp, pp=pp)
    r, s = shape
    if hpz:
        return RoleSizes(shard=r * s, hpz=s, tp=tp, pp=pp)
    return RoleSizes(shard=s, replicate=r, tp=tp, pp=pp)


class ParallelPlan:
    """The roles of one optimizer ([Note: one parallel plan]).

    Args:
        comm: the data-parallel communicators (shard, replicate, world, hpz; comm/groups.py).
        sizes: the role sizes.
        tp: the DTensor tensor-parallel side (comm/tp.py `TensorParallel`), or None.
        pp: the pipeline stages' group (a world mesh's "pp" dim, comm/mesh.py [Note: a world
            mesh]) as a GroupComm, or None.
    """

    def __init__(self, comm: Comm, sizes: RoleSizes, tp=None, pp=None) -> None:
        self.comm = comm
        self.sizes = sizes
        self.tp = tp
        self.pp = pp  # the pipeline stages' GroupComm (a world mesh's "pp" dim), or None
        self.model_parallel = None  # an mpu's side (grads/model_parallel.py), attached later

    def attach_model_parallel(self, mp, tp: int = 1, pp: int = 1) -> None:
        """An `mpu` (zerokern.initialize(mpu=)): its model-parallel group (tp x pp ranks)
        joins the agreement, and its sizes the plan's. Refused with DTensor params (their
        placements already say what is split; the two would count the tp ranks twice)."""
        if self.tp is not None or self.pp is not None:
            raise ValueError("initialize: mpu= with DTensor (tensor-parallel) params or a "
                             "world mesh: the DTensor placements and the mesh already say "
                             "what is split; pass one or the other")
        self.model_parallel = mp
        s = self.sizes
        self.sizes = RoleSizes(s.shard, s.replicate, s.hpz, tp=tp, pp=pp, cp=s.cp)

    @property
    def has_model_parallel(self) -> bool:
        return self.tp is not None or self.pp is not None or self.model_parallel is not None

    def agree_(self, t: torch.Tensor, op=None, *, dp: bool = True, model: bool = True,
               label: Optional[str] = None) -> torch.Tensor:
        """Reduce t in place over the data-parallel world (`dp`), then over the
        model-parallel ranks (`model`: the tp group, or the mpu's group). SUM by default;
        `label` names the collective in the debug log."""
        op = op if op is not None else dist.ReduceOp.SUM
        if dp:
            self.comm.world.all_reduce_(t, op=op, label=label)
        if model:  # (tp and pp are orthogonal groups: over one, then the other)
            if self.tp is not None:
                self.tp.comm.all_reduce_(t, op=op, label=label)
            if self.pp is not None:
                self.pp.all_reduce_(t, op=op, label=label)
            if self.model_parallel is not None:
                self.model_parallel.all_reduce_(t, op=op)
        return t
