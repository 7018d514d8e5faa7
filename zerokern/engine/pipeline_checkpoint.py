"""Checkpoints of a PipelineEngine: DeepSpeed's `save_checkpoint` / `load_checkpoint` for a
PipelineModule, written as zerokern's checkpoint in parts (checkpoint/parts.py).

[Note: a PipelineModule checkpoint]
DeepSpeed's PipelineEngine writes one file per layer (`layer_03-model_states.pt`, by the
layer's global index, by data-parallel rank 0 of its stage) and each rank's optimizer shard
(`zero_pp_rank_D_mp_rank_SS_optim_states.pt`); it reloads them at the same pipeline layout.
zerokern writes what engine/checkpointing.py writes for any engine (`save_dir/<tag>/zero/`
with the counters, the scheduler's state and client_state inside, `save_dir/latest` after
the commit), as a checkpoint in parts: one part per pipeline stage (`pp00000/`, `pp00001/`)
and parts.json, committed atomically by job rank 0. Params are named by the stage module's
state_dict keys, which DeepSpeed's PipelineModule already makes the global ones: a layer is
registered under its index in the whole layer list ("3.weight" for layer 3 on whichever stage
holds it), a TiedLayerSpec under "tied_modules.<key>." on every stage holding it. Those
names do not depend on the partition, so a checkpoint loads by name at another number of
stages or data-parallel ranks, or into the same layers as a plain nn.Sequential (whose keys
are the same indices) through zerokern.initialize, with the optimizer state resharded.

The engine's optimizer agrees its norm over the grid's model-parallel group (mpu path), not
over a plan `pp` role, so the stage coordinates are given to the checkpoint code alone:
`optimizer.checkpoint_pp` (`StageCoord`: the grid's pipe group, whose rank is the stage id),
read by parts.job_layout.

Tied weights (TiedLayerSpec, ZeRO 0-1: [Note: a PipelineModule in zerokern.initialize]):
every stage holding one keeps a copy under the same name ("tied_modules.<key>.weight"), equal
after every step (the gradients are summed over those stages, the norm counts it once). The
index (parts.json) lists it once, at the first stage holding it (the one DeepSpeed does not
mark `ds_pipe_replicated`: parts.check_parts lets the marked copies share its name), and
every loader reads that stage's copy, whatever its layout: a stage-1 copy at pp=2, the one
copy at pp=1. The later stages' parts still hold their own copy's bytes (equal; DeepSpeed's
per-layer files hold each stage's copy too): leaving them out needs the writer to drop a
param from a part's files, not done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageCoord:
    """The pipeline stages of a PipelineEngine as parts.job_layout reads them.

    Attributes:
        group: the grid's pipe group (one rank per stage, this data-parallel index).
        rank: this rank's stage.
        world_size: the number of stages.
    """

    group: Any
    rank: int
    world_size: int


def attach_stage_coord(optimizer, layout) -> None:
    """Give `optimizer` its stage for checkpoints ([Note: a PipelineModule checkpoint]).

    Args:
        optimizer: the stage's zerokern optimizer.
        layout: the engine's PipeLayout.
    """
    optimizer.checkpoint_pp = StageCoord(layout.pipe_group, layout.stage_id, layout.num_stages)
