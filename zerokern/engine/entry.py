"""`zerokern.initialize`, DeepSpeed's entry point: the config parsed and checked, the optimizer
and scheduler built, and the engine chosen -- `ZeroEngine` (engine.py), or `PipelineEngine`
(pipeline_engine.py, a ZeroEngine with DeepSpeed's train_batch / eval_batch) for a
PipelineModule. A module of its own so that both engines are imported at its top: the choice
between them no longer makes engine.py import its own subclass (issue 35: no import loop).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerokern.options.args import check_not_deepspeed_partitioned
from zerokern.platform.device import handle

from .build import _attach_mpu, _build_optimizer, _build_scheduler, _forward_only, _world
from .config import parse_config
from .config_values import ConfigError
from .engine import ZeroEngine, _env_int, init_distributed
from .parallel import mpu_groups
from .pipeline_engine import PipelineEngine
from .pipeline_module import (
    agree_across_ranks,
    apply_pipeline_section,
    attach_pipeline_stats,
    is_pipeline_module,
    read_pipeline_module,
)

log = logging.getLogger("zerokern.engine")


def initialize(args=None, model: Optional[nn.Module] = None, optimizer=None,
               model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required: Optional[bool] = None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """DeepSpeed's `initialize` over ZeroAdamW: returns (engine, optimizer, loader, scheduler).

    config (or config_params, or args.deepspeed_config / deepscale_config): a DeepSpeed
    config dict, JSON/hjson path or base64 JSON;
    see zerokern/engine/config.py for the keys. The process group is started from the
    launcher's environment when there is none (dist_init_required=False: never).
    training_data: a Dataset; the loader then has a DistributedSampler and the micro-batch
    size. optimizer: a torch Adam/AdamW (converted), a ZeroAdamW, or a callable(params).
    lr_scheduler: a callable(optimizer), or a scheduler on the ZeroAdamW given or on the
    torch optimizer given (rebound to the ZeroAdamW). A client optimizer or lr_scheduler is
    used even when the config names one, as in DeepSpeed ([Note: client objects win]).
    With no optimizer at all the engine is forward-only ([Note: forward-only engine]).
    As DeepSpeed's, every data-parallel rank (mpu's data-parallel group, else the world)
    starts from the first rank's params and buffers: the optimizer copies them at
    construction (`broadcast_params`, zerokern.core.model_sync [Note: ranks start from the first
    rank's weights]), the forward-only engine here; a ZeroAdamW given as optimizer= with
    broadcast_params=False has checked that they agree instead.

    [Note: activation_checkpointing in initialize] A config with an `activation_checkpointing`
    section configures `zerokern.checkpointing` with it and with `mpu` (checked before the
    model is touched, in effect once the engine is built), as Megatron-DeepSpeed's own
    `deepspeed.checkpointing.configure(mpu, deepspeed_config=...)` call does: the model's
    `zerokern.checkpointing.checkpoint` calls then partition / offload as the section says.

    Args:
        args: an argparse namespace; its `deepspeed_config` is an alias of `config`.
        model: the nn.Module to train (required).
        optimizer: None (the config's `optimizer` section builds a ZeroAdamW), a torch
            Adam/AdamW (converted to ZeroAdamW with the same groups and hyperparameters), a
            ZeroAdamW, or a callable(params) returning one of those.
        model_parameters: the params or param groups to optimize (default: the model's).
        training_data: a Dataset; the returned loader has a DistributedSampler and the
            micro-batch size.
        lr_scheduler: a callable(optimizer) -> scheduler, or a scheduler already on the given
            ZeroAdamW; otherwise the config's `scheduler` section, if any.
        distributed_port: accepted for DeepSpeed compatibility (MASTER_PORT is used).
        mpu: Megatron's model-parallel unit (engine/parallel.py [Note: the mpu path]): ZeRO
            shards over its data-parallel group; batch sizes and the sampler count
            data-parallel ranks; the global norm and overflow skip cover the model-parallel
            ranks (params with `tensor_model_parallel` counted on every one, the others on
            tensor-parallel rank 0). Not with zero_hpz_partition_size, nor checkpoints yet.
        dist_init_required: False: never start a process group; default: start one from the
            launcher's environment when WORLD_SIZE > 1 and none exists.
        collate_fn: the loader's collate_fn.
        config: a DeepSpeed config dict or a path to its JSON file.
        mesh_param: model parallelism: not supported (ValueError when given).
        config_params: an alias of `config` (DeepSpeed's older name).

    Returns:
        (engine, optimizer, loader, scheduler): a ZeroEngine, its ZeroAdamW, the loader (None
        without training_data) and the scheduler (None without one).

    Raises:
        TypeError: an mpu without the methods zerokern reads.
        ValueError: no model or no config, different configs given twice, mesh_param, a
            model built under deepspeed.zero.Init (zerokern.options.args [Note:
            DeepSpeed-partitioned params]), or a config key zerokern cannot honour (naming
            the key), before the model is touched.
    """
    if model is None:
        raise ValueError("initialize: model is required")
    # zerokern.options.args [Note: DeepSpeed-partitioned params]: before anything is touched
    check_not_deepspeed_partitioned(model, "initialize: model")
    check_not_deepspeed_partitioned(model_parameters if isinstance(model_parameters,
                                                                   (list, tuple)) else (),
                                    "initialize: model_parameters")
    if mesh_param is not None:
        raise ValueError("initialize: mesh_param (DeepSpeed's AutoTP mesh) is not supported; "
                         "for tensor parallelism pass mpu=")
    args_config = getattr(args, "deepspeed_config", None)
    deepscale = getattr(args, "deepscale_config", None)  # DeepSpeed's deprecated spelling
    if deepscale is not None:
        log.warning("args.deepscale_config is deprecated, use args.deepspeed_config (read as "
                    "DeepSpeed does)")
        if args_config is not None:
            raise ValueError("initialize: args has both deepscale_config and deepspeed_config; "
                             "give one")
        args_config = deepscale
    sources = [c for c in (config, config_params, args_config) if c is not None]
    if not sources:
        raise ConfigError("initialize: give config= (or config_params=, or "
                         "args.deepspeed_config)")
    if len(sources) > 1 and any(s is not sources[0] and s != sources[0] for s in sources):
        raise ConfigError("initialize: config, config_params and args.deepspeed_config differ; "
                         "give one")
    if not dist.is_initialized() and dist_init_required is not False and \
            (_env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        init_distributed()
    rank, world_size = _world()
    pipe_model = is_pipeline_module(model)  # [Note: a PipelineModule in zerokern.initialize]
    if pipe_model and mpu is not None:
        raise ValueError("initialize: mpu= with a PipelineModule: the module's grid "
                         "(model.mpu()) is the mpu, as in DeepSpeed (which asserts mpu is None)")
    mp = mpu_groups(model.mpu() if pipe_model else mpu)  # TypeError/ValueError naming mpu
    dp_rank, dp_size = (rank, world_size) if mp is None else (mp.dp_rank, mp.dp_size)
    cfg = parse_config(sources[0], dp_size)  # raises before the model is touched
    pipe = read_pipeline_module(model, cfg.raw, cfg.stage) if pipe_model else None
    if pipe is not None:
        agree_across_ranks(pipe, cfg)  # the same step on every rank, or ValueError on all
        cfg.no_effect.extend(pipe.no_effect)
    elif "pipeline" in cfg.raw:
        cfg.ignored.append(("pipeline", "the model is not a DeepSpeed PipelineModule (DeepSpeed "
                                        "reads the section in its PipelineEngine only)"))
    hpz_raw = cfg.raw.get("zero_optimization", {}).get("zero_hpz_partition_size", 1)
    if mp is not None and hpz_raw > 1:
        raise ValueError("initialize: mpu= with zero_optimization.zero_hpz_partition_size is "
                         "not supported (DeepSpeed builds its hpZ groups over the whole world, "
                         "across model-parallel ranks)")
    ac_plan = None
    if cfg.activation_checkpointing is not None:  # checked now, in effect at the end
        from ..checkpointing import api as ac_api

        ac_plan = ac_api.prepare(mpu, section=cfg.activation_checkpointing, error=ConfigError)
    if deepscale is not None:  # what DeepSpeed leaves in args
        args.deepspeed_config, args.deepscale_config = deepscale, None
    if dist.is_initialized() and dist.get_backend() == "nccl":
        model.to(handle("cuda").current_device())
    opt = _build_optimizer(model, cfg, optimizer, model_parameters, mp)
    if opt is not None and mp is not None:
        _attach_mpu(opt, mp) if pipe is None else attach_pipeline_stats(opt, mp)
    if opt is None:
        if lr_scheduler is not None or cfg.scheduler is not None:
            raise ValueError("initialize: a scheduler (lr_scheduler= or config key scheduler) "
                             "needs an optimizer (config key optimizer or optimizer=)")
        _forward_only(model, cfg, mp)
    client_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    sched = None if opt is None else _build_scheduler(cfg, opt, lr_scheduler, client_opt)
    loader = None
    if pipe is not None:  # engine/pipeline_engine.py: train_batch / eval_batch
        apply_pipeline_section(model, pipe)
        engine = PipelineEngine(model, opt, cfg, pipe, sched, training_data, collate_fn)
        loader = engine.training_dataloader
    elif training_data is not None:
        sampler = torch.utils.data.distributed.DistributedSampler(
            training_data, num_replicas=dp_size, rank=dp_rank) if dp_size > 1 else None
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.micro_batch_size,
                                             sampler=sampler, collate_fn=collate_fn)
    if pipe is None:
        engine = ZeroEngine(model, opt, cfg, sched, loader)
    engine.mpu = mpu if pipe is None else model.mpu()
    if ac_plan is not None:  # [Note: activation_checkpointing in initialize]
        ac_api.apply(ac_plan)
    if rank == 0:
        log.info("zerokern.initialize: stage %d, %s, micro-batch %d x accumulation %d x %d "
                 "rank(s) = %d, bucket %.1f MiB (reduce_bucket_size %s elements)", cfg.stage,
                 cfg.precision, cfg.micro_batch_size, cfg.gradient_accumulation_steps,
                 world_size, cfg.train_batch_size, cfg.bucket_mb, cfg.reduce_bucket_elements)
        if cfg.no_effect:
            log.info("config keys with no effect in zerokern: %s",
                     "; ".join(f"{k} ({why})" for k, why in cfg.no_effect))
        for k, why in cfg.ignored:
            log.warning("config key %s is ignored: %s", k, why)
    return engine, opt, loader, sched
