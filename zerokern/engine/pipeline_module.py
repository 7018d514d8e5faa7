"""DeepSpeed's `PipelineModule` as `zerokern.initialize` reads it: which ranks are which stage,
the tied layers, the config's `pipeline` section, and what zerokern refuses (before anything
is touched).

[Note: a PipelineModule in zerokern.initialize]
DeepSpeed's `PipelineModule(layers=..., num_stages=P, loss_fn=...)` is built on every rank after
`init_distributed`: it lays the ranks out with its topology (`PipeDataParallelTopology`: axes
(pipe, data), rank = stage * dp + data index, so stage s holds ranks [s*dp, (s+1)*dp)),
partitions the layers by its `partition_method` ('parameters', 'uniform', 'type:regex'), builds
only this stage's layers (with `seed_layers`), and broadcasts the tied weights. zerokern takes
that module as it is, and its grid (`model.mpu()`) as the mpu (engine/parallel.py [Note: the
mpu path]), as DeepSpeed's initialize does:
- ZeRO shards each stage over its data-parallel group (the grid's), at any stage 0-3;
- the batch triple counts data-parallel ranks: train_batch_size = micro x accumulation x dp,
  and accumulation is the number of micro-batches of one `train_batch`;
- the global grad norm and the fp16 overflow skip are agreed over the grid's model-parallel
  group (every stage), each tied weight counted once (on the first stage that holds it, the one
  without DeepSpeed's `ds_pipe_replicated` mark), as DeepSpeed's ZeRO-1 norm;
- the gradients of a TiedLayerSpec's weights are summed over the stages holding them before the
  step (DeepSpeed's ReduceTiedGrads), at ZeRO stages 0-1: there each rank keeps the whole
  accumulated gradient until the step, so the sum runs on it in place. At stages 2-3 the
  gradient lives in a shard laid out per stage and zerokern refuses tied layers
  (NotImplementedError naming TiedLayerSpec).
Refused, with the feature named: a topology with a tensor-slicing ('model') or any other axis
beyond pipe and data, DeepSpeed's DualPipeVModule, a `get_additional_losses` override, and
`mpu=` (DeepSpeed asserts mpu is None: the module's grid is the mpu).

[Note: the pipeline config section]
DeepSpeed 0.19.8 (runtime/config.py get_pipeline_config, runtime/pipe/engine.py) reads
`pipeline.activation_checkpoint_interval` (> 0 replaces the module's), `pipeline.use_reentrant`
(False: DeepSpeed's non-reentrant checkpoint function), and `pipe_partitioned` /
`grad_partitioned` (only with a 'model' axis); it parses `stages`, `partition` and `seed_layers`
but its engine never reads them (the module's constructor arguments decide). zerokern honours
the first two, accepts the others with no effect (logged; `stages` and `seed_layers` must agree
with the module, or ValueError, since a config that says otherwise than the module is a mistake
DeepSpeed would hide), and refuses any other key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from zerokern.grads.model_parallel import ModelParallelStats

from .config_values import ConfigError, _bool, _int, _unknown

PIPE_MODULE = "deepspeed.runtime.pipe.module"
PIPELINE_NO_EFFECT = {
    "partition": "DeepSpeed's engine does not read it either: the PipelineModule's "
                 "partition_method decides",
    "pipe_partitioned": "splits activations over tensor-slicing ranks only; zerokern refuses "
                        "a 'model' axis",
    "grad_partitioned": "splits gradients over tensor-slicing ranks only; zerokern refuses "
                        "a 'model' axis",
    "stages": "the PipelineModule's num_stages decides (checked to agree)",
    "seed_layers": "the PipelineModule's seed_layers decides (checked to agree)",
}
PIPELINE_KEYS = ("activation_checkpoint_interval", "use_reentrant", *PIPELINE_NO_EFFECT)


def is_pipeline_module(model: Any) -> bool:
    """True for DeepSpeed's PipelineModule (read only when deepspeed.pipe is imported: a
    PipelineModule cannot exist otherwise, and zerokern never imports deepspeed itself)."""
    mod = sys.modules.get(PIPE_MODULE)
    return mod is not None and isinstance(model, mod.PipelineModule)


@dataclass
class PipeLayout:
    """Where this rank sits in the pipeline, and what the step needs from the module.

    Attributes:
        num_stages: the pipeline stages P.
        stage_id: this rank's stage, 0..P-1.
        dp_size: the data-parallel ranks of each stage.
        dp_rank: this rank's index among them.
        prev_rank: the global rank of the previous stage (same data index), or None.
        next_rank: that of the next stage, or None.
        last_rank: the global rank of the last stage (same data index): it computes the loss.
        pipe_group: the process group of this pipeline (one rank per stage).
        dp_group: the process group of this stage's data-parallel ranks.
        tied: (weight, process group over the stages holding it) per tied weight here.
        activation_checkpoint_interval: the config's value when it replaces the module's.
        use_reentrant: the config's pipeline.use_reentrant, or None when not given.
        no_effect: (key, why) of the pipeline keys accepted with no effect.
    """

    num_stages: int
    stage_id: int
    dp_size: int
    dp_rank: int
    prev_rank: Optional[int]
    next_rank: Optional[int]
    last_rank: int
    pipe_group: Any
    dp_group: Any
    tied: List[Tuple[Any, Any]] = field(default_factory=list)
    activation_checkpoint_interval: Optional[int] = None
    use_reentrant: Optional[bool] = None
    no_effect: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1


def _section(raw: Dict[str, Any], module, out: PipeLayout) -> None:
    """[Note: the pipeline config section]."""
    sec = raw.get("pipeline", {})
    if not isinstance(sec, dict):
        raise ConfigError(f"config key pipeline must be a dict, got {sec!r}")
    _unknown(sec, set(PIPELINE_KEYS), "pipeline.")
    if "activation_checkpoint_interval" in sec:
        n = _int("pipeline.activation_checkpoint_interval", sec["activation_checkpoint_interval"],
                 0)
        out.activation_checkpoint_interval = n if n > 0 else None  # 0: the module's, as DS
    if "use_reentrant" in sec and sec["use_reentrant"] is not None:
        out.use_reentrant = _bool("pipeline.use_reentrant", sec["use_reentrant"])
    for k in ("pipe_partitioned", "grad_partitioned", "seed_layers"):
        if k in sec:
            _bool(f"pipeline.{k}", sec[k])
    stages = sec.get("stages", "auto")
    if stages != "auto" and _int("pipeline.stages", stages) != out.num_stages:
        raise ConfigError(f"config key pipeline.stages={stages} but the PipelineModule has "
                          f"{out.num_stages} stages (DeepSpeed ignores the key; the module's "
                          "num_stages / topology decides): make them agree or drop the key")
    if sec.get("seed_layers", module.seed_layers) != module.seed_layers:
        raise ConfigError(f"config key pipeline.seed_layers={sec['seed_layers']} but the "
                          f"PipelineModule was built with seed_layers={module.seed_layers} "
                          "(DeepSpeed ignores the key; the module's argument decides)")
    if "partition" in sec and not isinstance(sec["partition"], str):
        raise ConfigError(f"config key pipeline.partition must be a string, got "
                          f"{sec['partition']!r}")
    out.no_effect = [(f"pipeline.{k}", why) for k, why in PIPELINE_NO_EFFECT.items()
                     if k in sec]


def read_pipeline_module(model, raw: Dict[str, Any], stage: int) -> PipeLayout:
    """Read and check a PipelineModule and the config's pipeline section ([Note: a
    PipelineModule in zerokern.initialize]); nothing is changed.

    Args:
        model: DeepSpeed's PipelineModule, built on every rank.
        raw: the config dict.
        stage: the ZeRO stage.

    Returns:
        The PipeLayout.

    Raises:
        ValueError: a pipeline config key zerokern rejects (naming the key).
        NotImplementedError: a feature zerokern does not honour, named.
    """
    mod = sys.modules[PIPE_MODULE]
    dual = sys.modules.get("deepspeed.runtime.pipe.dualpipev")
    if dual is not None and isinstance(model, dual.DualPipeVModule):
        raise NotImplementedError("initialize: DeepSpeed's DualPipeVModule (the DualPipeV "
                                  "schedule) is not supported by zerokern; use PipelineModule")
    topo = model.topology()
    extra = [a for a in topo.get_axis_names() if a not in ("pipe", "data")]
    if any(topo.get_dim(a) > 1 for a in extra):
        raise NotImplementedError(
            f"initialize: a PipelineModule topology with axes {extra} (tensor slicing inside "
            "the stages, e.g. PipeModelDataParallelTopology with num_mp > 1) is not supported "
            "by zerokern's pipeline engine; use PipeDataParallelTopology (pipe x data)")
    if type(model).get_additional_losses is not mod.PipelineModule.get_additional_losses:
        raise NotImplementedError(
            f"initialize: {type(model).__name__}.get_additional_losses (losses reported besides "
            "the loss) is not supported by zerokern's pipeline engine")
    grid = model.mpu()
    P, s = grid.get_pipe_parallel_world_size(), grid.get_stage_id()
    out = PipeLayout(
        num_stages=P, stage_id=s, dp_size=grid.get_data_parallel_world_size(),
        dp_rank=grid.get_data_parallel_rank(),
        prev_rank=grid.stage_to_global(s - 1) if s > 0 else None,
        next_rank=grid.stage_to_global(s + 1) if s < P - 1 else None,
        last_rank=grid.stage_to_global(P - 1), pipe_group=grid.get_pipe_parallel_group(),
        dp_group=grid.get_data_parallel_group())
    for key, comm in sorted(model.tied_comms.items()):
        for attr in comm["weight_attr"]:
            w = model.tied_modules[key]
            for part in attr.split("."):
                w = getattr(w, part)
            if w.requires_grad:
                out.tied.append((w, comm["group"]))
    # every rank decides alike (a stage without the tied layer too, or it would wait for
    # the others): from the layer specs every rank holds
    keys = sorted({spec.key for spec in model._layer_specs
                   if isinstance(spec, mod.TiedLayerSpec)})
    if keys and P > 1 and stage >= 2:
        raise NotImplementedError(
            f"initialize: TiedLayerSpec ({keys}) with "
            f"zero_optimization.stage {stage}: the tied weights' gradients must be summed over "
            "the stages holding them, which zerokern does at stages 0-1 only (DeepSpeed "
            "allows pipelining at stages 0-1 only)")
    _section(raw, model, out)
    return out


def agree_across_ranks(layout: PipeLayout, cfg) -> None:
    """Every rank of the job must run the same pipeline step: the same stages, micro-batches,
    micro-batch size, ZeRO stage, precision and clipping. A config that differs between ranks
    would make the stages wait on each other's messages forever; instead every rank raises
    the same ConfigError naming the key (one all_gather_object at initialize).

    Args:
        layout: this rank's PipeLayout.
        cfg: this rank's parsed EngineConfig.

    Raises:
        ValueError: a setting differs between ranks (ConfigError, naming it and the ranks).
    """
    import torch.distributed as dist

    mine = {"num_stages": layout.num_stages,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "zero_optimization.stage": cfg.stage, "fp16/bf16": cfg.precision,
            "gradient_clipping": cfg.gradient_clipping}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for key in mine:
        seen = {r: d[key] for r, d in enumerate(every)}
        if len(set(seen.values())) > 1:
            raise ConfigError(f"config key {key} differs between the ranks of the pipeline "
                              f"({seen}): every rank must run the same pipeline step")


def apply_pipeline_section(model, layout: PipeLayout) -> None:
    """Put the pipeline section's activation checkpointing into the module, as DeepSpeed's
    PipelineEngine does at construction (after every check has passed)."""
    if layout.use_reentrant is False:
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

        model.activation_checkpoint_func = ds_ckpt.non_reentrant_checkpoint
    if layout.activation_checkpoint_interval is not None:
        model.activation_checkpoint_interval = layout.activation_checkpoint_interval
    if model.activation_checkpoint_interval > 0:
        model._precompute_checkpointable_values()


def reentrant_checkpointing(model) -> bool:
    """The module checkpoints activations with a reentrant function: the first stage's
    floating inputs must then require grad (or the first checkpointed block is cut off from
    autograd), as DeepSpeed's engine makes them."""
    if model.activation_checkpoint_interval <= 0:
        return False
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    return model.activation_checkpoint_func is not ds_ckpt.non_reentrant_checkpoint


class TiedOnceStats(ModelParallelStats):
    """grads/model_parallel.py [Note: model-parallel grad stats] for a pipeline: every param
    counts on its stage (no tensor slicing: zerokern refuses a 'model' axis), except a tied
    weight, which counts once: not where DeepSpeed marked it `ds_pipe_replicated` (every
    stage holding it but the first), as DeepSpeed's ZeRO-1 norm skips it there.

    Args:
        group: the grid's model-parallel group (every stage of this data index).
        flat_groups: the optimizer's flat groups.
    """

    def __init__(self, group, flat_groups) -> None:
        super().__init__(group, True, flat_groups)
        for gi, g in enumerate(flat_groups):
            counted = [not getattr(p, "ds_pipe_replicated", False) for p in g.params]
            if all(counted):
                continue
            L = g.layout
            for k in range(L.n_buckets):
                lo, hi = g.state_range(k)
                self._spans[(gi, k)] = [(a - lo, b - lo) for i, a, b in L.overlaps(lo, hi)
                                        if counted[i]]


def attach_pipeline_stats(opt, mp) -> None:
    """The optimizer's global norm and overflow agreement over every pipeline stage
    (TiedOnceStats), as engine/build.py's _attach_mpu does for an mpu."""
    opt.plan.attach_model_parallel(TiedOnceStats(mp.mp_group, opt.flat_groups),
                                   tp=mp.tp_size, pp=mp.pp_size)
