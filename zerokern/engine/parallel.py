"""The engine's process groups: Megatron's `mpu` and DeepSpeed's `zero_hpz_partition_size`.

[Note: the mpu path] `zerokern.initialize(mpu=...)` takes the model-parallel unit DeepSpeed
takes (Megatron-LM's `mpu` module, DeepSpeed's PipelineModule topology): ZeRO shards over
`mpu.get_data_parallel_group()` (ZeroAdamW's `process_group=`), the batch sizes and the
DistributedSampler use the data-parallel world size and rank (as DeepSpeed 0.19.8's engine),
and the global norm / overflow agreement covers the model-parallel ranks
(zerokern/grads/model_parallel.py [Note: model-parallel grad stats]). Methods read, with
DeepSpeed's fallbacks (deepspeed/utils/bwc.py):
- get_data_parallel_group() (required); get_data_parallel_world_size() / _rank() if present
  (checked against the group);
- get_model_parallel_group(), else get_tensor_model_parallel_group() (the stats all-reduce);
- get_tensor_model_parallel_rank(), else get_slice_parallel_rank(), else
  get_model_parallel_rank(): rank 0 counts the params replicated over tensor-parallel ranks.
A missing or inconsistent method is a TypeError/ValueError naming `mpu`, before the model is
touched.

[Note: hpz_partition_size] DeepSpeed's `zero_optimization.zero_hpz_partition_size = h` (> 1)
keeps stage 3's params sharded over all ranks plus a secondary copy sharded inside groups of h
consecutive ranks (deepspeed/utils/groups.py `_create_zero_param_parallel_group`: [0..h-1],
[h..2h-1], ...): zerokern's hpZ on the 2-D mesh (replicate = world / h, shard = h), whose dim 1
is exactly those consecutive ranks. DeepSpeed reads it at stage 3 only (stages 1-2 never do):
below stage 3 it is ignored with a warning; h >= world size is one node, the secondary would be
the primary (no effect, logged); h not dividing the world size raises (DeepSpeed asserts it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from .config_values import ConfigError

_MESHES: dict = {}  # (device type, R, S) -> DeviceMesh (hpz_mesh)


@dataclass
class MpuGroups:
    """What the engine takes from an mpu.

    Attributes:
        dp_group: the data-parallel process group (ZeRO shards over it).
        dp_rank: this rank's rank in it.
        dp_size: its size.
        mp_group: the model-parallel group (the stats all-reduce), or None.
        tp_rank: this rank's tensor-parallel rank (0 counts the replicated params).
        tp_size: the tensor-parallel size (the plan's tp role; comm/plan.py).
        pp_size: the pipeline-parallel size (the plan's pp role).
    """

    dp_group: Any
    dp_rank: int
    dp_size: int
    mp_group: Any
    tp_rank: int
    tp_size: int = 1
    pp_size: int = 1


def _call(mpu, names, what: str, required: bool = True):
    for n in names:
        f = getattr(mpu, n, None)
        if callable(f):
            return f()
    if required:
        raise TypeError(f"mpu has no {' / '.join(n + '()' for n in names)}: zerokern needs "
                        f"{what} (Megatron's mpu interface, as DeepSpeed)")
    return None


def mpu_groups(mpu) -> Optional[MpuGroups]:
    """Read and check an mpu ([Note: the mpu path]); None for None.

    Raises:
        TypeError: a method is missing.
        ValueError: torch.distributed is not initialized, or the mpu's sizes or ranks disagree
            with its groups.
    """
    if mpu is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("mpu given but torch.distributed is not initialized (the mpu's groups "
                         "are process groups: initialize them first)")
    dp = _call(mpu, ("get_data_parallel_group",), "the data-parallel group")
    mp = _call(mpu, ("get_model_parallel_group", "get_tensor_model_parallel_group"),
               "the model-parallel group")
    tp_rank = _call(mpu, ("get_tensor_model_parallel_rank", "get_slice_parallel_rank",
                          "get_model_parallel_rank"), "the tensor-parallel rank")
    dp_size, dp_rank = dist.get_world_size(dp), dist.get_rank(dp)
    if dp_rank < 0:
        raise ValueError(f"mpu.get_data_parallel_group() does not contain this rank "
                         f"({dist.get_rank()})")
    for name, got, want in (("get_data_parallel_world_size", None, dp_size),
                            ("get_data_parallel_rank", None, dp_rank)):
        got = _call(mpu, (name,), "", required=False)
        if got is not None and int(got) != want:
            raise ValueError(f"mpu.{name}() = {got} but its data-parallel group says {want}")
    if mp is not None and dist.get_rank(mp) < 0:
        raise ValueError(f"mpu's model-parallel group does not contain this rank "
                         f"({dist.get_rank()})")
    if not isinstance(tp_rank, int) or tp_rank < 0:
        raise ValueError(f"mpu's tensor-parallel rank must be an int >= 0, got {tp_rank!r}")
    # the plan's tp and pp sizes (comm/plan.py; sizes only: the stats all-reduce runs over
    # the model-parallel group whatever its split): the mpu's own answers where it has them
    mp_size = 1 if mp is None else dist.get_world_size(mp)
    pp_size = _call(mpu, ("get_pipeline_model_parallel_world_size",
                          "get_pipe_parallel_world_size"), "", required=False)
    pp_size = max(1, int(pp_size or 1))
    tp_size = _call(mpu, ("get_tensor_model_parallel_world_size",
                          "get_slice_parallel_world_size"), "", required=False)
    tp_size = max(1, int(tp_size) if tp_size is not None else mp_size // pp_size)
    return MpuGroups(dp, dp_rank, dp_size, mp, tp_rank, tp_size, pp_size)


def hpz_setting(h: int, out) -> None:
    """Set out.hpz_partition_size (an EngineConfig) from zero_hpz_partition_size = h, or note
    why it has no effect ([Note: hpz_partition_size]); ValueError naming the key."""
    key = "zero_optimization.zero_hpz_partition_size"
    if h <= 1:
        return
    if out.stage != 3:
        out.ignored.append((f"{key}={h}", f"only stage 3 has hpZ; ignored at stage "
                                          f"{out.stage}, as DeepSpeed does"))
    elif h >= out.world_size:
        out.no_effect.append((f"{key}={h}", f"one hpZ group spans all {out.world_size} ranks: "
                                            "the secondary copy would be the primary"))
    elif out.world_size % h:
        raise ConfigError(f"config key {key}={h} must divide the world size "
                         f"({out.world_size}): the secondary copies are sharded over groups "
                         "of h consecutive ranks")
    elif out.offload_params is not None:
        raise ConfigError(f"config key {key}={h} does not support "
                         "zero_optimization.offload_param (the secondary copy lives on the "
                         "device)")
    else:
        out.hpz_partition_size = h


def hpz_mesh(hpz_size: int, stage: int, world_size: int, device_type: str):
    """The 2-D (replicate, shard) mesh of [Note: hpz_partition_size], or None when hpZ is off.
    (The config parser has checked h against the stage and the world size.)"""
    if stage != 3 or hpz_size <= 1 or hpz_size >= world_size:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, world_size // hpz_size, hpz_size)
    if key not in _MESHES:  # its process groups are made once, not at every initialize
        _MESHES[key] = init_device_mesh(device_type, key[1:],
                                        mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]
