"""The model-parallel group checkpoints are partitioned over (`configure`'s `mpu_`).

[Note: what mpu_ may be]
- None: no model parallelism (tp = 1);
- Megatron's / DeepSpeed's `mpu` (an object with get_tensor_model_parallel_group(), else
  get_model_parallel_group()): its tensor-parallel group, as DeepSpeed reads it;
- a DTensor DeviceMesh: a 1-D mesh is the tp group; a 2-D dp x tp mesh gives its dim named
  "tp" (else its last dim, the tp dim of torch's and zerokern's meshes);
- a torch.distributed ProcessGroup: that group.
The rank and size are the group's own (dist.get_rank(group)), so they cannot disagree with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: the process group (None: tp = 1), this rank in it, its size."""

    group: Any = None
    rank: int = 0
    size: int = 1


NONE = TPGroup()


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _of_group(group: Any, what: str) -> TPGroup:
    if not _dist_on():
        raise ValueError(f"{what}: torch.distributed is not initialized (its groups are "
                         "process groups: initialize them first)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{what} does not contain this rank ({dist.get_rank()})")
    return TPGroup(group, rank, dist.get_world_size(group))


def resolve(mpu_: Any) -> TPGroup:
    """[Note: what mpu_ may be].

    Raises:
        TypeError: mpu_ is none of those.
        ValueError: torch.distributed is not initialized, or the group lacks this rank.
    """
    if mpu_ is None:
        return NONE
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DTensor
        DeviceMesh = ()  # noqa: N806
    if DeviceMesh and isinstance(mpu_, DeviceMesh):
        names = mpu_.mesh_dim_names or ()
        if mpu_.ndim == 1:
            return _of_group(mpu_.get_group(), "mpu_ (a 1-D DeviceMesh)")
        dim = "tp" if "tp" in names else mpu_.ndim - 1
        return _of_group(mpu_.get_group(dim), f"mpu_ (the DeviceMesh's dim {dim!r})")
    if isinstance(mpu_, dist.ProcessGroup):
        return _of_group(mpu_, "mpu_ (a ProcessGroup)")
    for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        f = getattr(mpu_, name, None)
        if callable(f):
            return _of_group(f(), f"mpu_.{name}()")
    raise TypeError("mpu_ must be None, Megatron's mpu (get_tensor_model_parallel_group() or "
                    "get_model_parallel_group()), a DeviceMesh or a ProcessGroup, got "
                    f"{type(mpu_).__name__}")


def tp_rank_of(group: Optional[TPGroup]) -> int:
    return 0 if group is None else group.rank
