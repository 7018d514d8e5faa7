"""ZeroAdamW's stage-3 construction: the checks on the units (before the model is touched) and
the buffers, param homes and runtime built from them (after)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .runtime import Stage3Runtime
from .sharded_flat import ShardedFlat
from .units import Unit, find_units


def check_stage3(model: torch.nn.Module, units, trainable: List[List[torch.nn.Parameter]],
                 dtype: torch.dtype, world_size: int, offload: Optional[str], offload_path,
                 offload_params: Optional[str], rule=None) -> List[Unit]:
    """The units of `model` under the `units` policy; raises before anything changes on a bad
    policy, frozen params on another device, or (offload="nvme") a disk too small for the
    files."""
    unit_list = find_units(model, units)  # raises on a bad policy
    dev = trainable[0][0].device
    for u in unit_list:
        for p in u.frozen:
            if p.device != dev:
                raise ValueError(f"all params must be on one device; found {dev} and "
                                 f"{p.device} (a frozen param of unit {u.name or '<root>'!r})")
    if offload == "nvme":
        from .param_offload_checks import check_space

        check_space(offload_path, unit_list, trainable, dtype, world_size, offload_params,
                    rule)
    return unit_list


def build_stage3(d, placement) -> Tuple[List[ShardedFlat], Stage3Runtime, Optional[object]]:
    """One ShardedFlat per (unit, param group) with params, the frozen buffers, the param
    homes (offload_params, else None) and the runtime over them, as the optimizer's decision
    `d` says (core/decision.py [Note: construction is a decision]: its units, trainable params,
    dtypes, offload and keep options, and each group's slot alignment: rules.slot_align of its
    rule, partition.py [Note: block-aligned slots])."""
    trainable, dtype, comm, unit_list = d.trainable, d.dtype, d.comm, d.units
    offload_params = d.offload_params
    group_of = {id(p): gi for gi, ps in enumerate(trainable) for p in ps}
    make, homes = ShardedFlat, None
    if offload_params is not None:  # the shards' homes: host or files
        from .param_homes import ParamHomes

        homes = ParamHomes(offload_params, trainable[0][0].device, d.offload is not None,
                           d.offload_path, comm.world.rank)  # file names: unique per rank
        make = homes.make
    shard = comm.shard  # the layout: sharded over the shard group
    aligns = d.slot_aligns
    buffers = [make(ps, dtype, shard.world_size, shard.rank, gi, u.index, placement=placement,
                    slot_align=aligns[gi])
               for u in unit_list for gi in range(len(trainable))
               for ps in [[p for p in u.params if group_of[id(p)] == gi]] if ps]
    # Frozen params: sharded with their unit, cast to the precision, no grads and no
    # optimizer state (units.py); group_index -1: in no param group.
    frozen = [make(u.frozen, dtype, shard.world_size, shard.rank, -1, u.index, trainable=False)
              for u in unit_list if u.frozen]
    if homes is not None:
        homes.finalize()
    runtime = Stage3Runtime(buffers, unit_list, comm, d.reduce_dtype, d.model, frozen,
                            d.keep_for_backward_bytes)
    return buffers, runtime, homes
