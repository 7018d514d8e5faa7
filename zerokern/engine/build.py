"""What `zerokern.initialize` builds from a DeepSpeed config besides the engine: the optimizer
(a config type, a client optimizer converted, or a given zerokern one checked), the mesh and
Megatron-mpu keywords, the LR scheduler."""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.optimizers.adamw import ZeroAdamW
from zerokern.optimizers.lion import ZeroLion
from zerokern.optimizers.muon import ZeroMuon
from zerokern.options.args import PRECISIONS

from .config import STAGE3_KEYS, EngineConfig
from .convert import groups_for_model, rebind_scheduler, zero_from_torch
from .optimizer_types import optimizer_kind, optimizer_settings
from .parallel import MpuGroups, hpz_mesh
from .schedulers import build_scheduler

log = logging.getLogger("zerokern.engine")


def _world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _parallel_kw(cfg: EngineConfig, mpu: Optional[MpuGroups], model) -> Dict[str, Any]:
    """ZeroAdamW's process_group= (the mpu's dp group) or mesh=/hpz= (zero_hpz_partition_size);
    [Note: the mpu path] and [Note: hpz_partition_size] in engine/parallel.py."""
    if mpu is not None:
        return {"process_group": mpu.dp_group}
    p = next(model.parameters(), None)
    dev = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else \
        (p.device.type if p is not None else "cpu")
    mesh = hpz_mesh(cfg.hpz_partition_size, cfg.stage, cfg.world_size, dev)
    return {} if mesh is None else {"mesh": mesh, "hpz": True}


def _build_optimizer(model, cfg: EngineConfig, optimizer, model_parameters,
                     mpu: Optional[MpuGroups] = None) -> ZeroOptimizer:
    # free_grads: the grads (and staging) are freed at the engine's zero_grad after each step,
    # as DeepSpeed's engine does: held memory between steps is params + optimizer state only
    # (engine-20m-n2.md: 1.23-1.41x DeepSpeed's held memory at stages 1-2 with them kept);
    # except the staging pool and, where DeepSpeed holds as much, the grad shard
    # (_engine_owned: [Note: the engine keeps its staging], [Note: the engine keeps its grad
    # shard]).
    zero_kw = dict(stage=cfg.stage, precision=cfg.precision, loss_scale=cfg.loss_scale,
                   offload=cfg.offload, bucket_mb=cfg.bucket_mb, reduce_dtype=cfg.reduce_dtype,
                   free_grads=True, offload_params=cfg.offload_params,
                   quantized_weights=cfg.quantized_weights,
                   quantized_gradients=cfg.quantized_gradients,
                   **_parallel_kw(cfg, mpu, model))
    # master="compact" for bf16 on the device (stages 0-2): the same fp32 master, bit for bit,
    # in 2.125 bytes per state element instead of 4 (zerokern/compact_master.py), for issue
    # 12's target of <= 0.9x DeepSpeed's held memory at stages 1-2. Measured on the 23.2M GPT,
    # 2 ranks, bf16 (benchmarks/results/engine-20m-n2-compact{,-run2}.md): held 156 MiB per
    # rank vs DeepSpeed's 177 (0.88x) at stages 1 and 2 (2Ψ + 12Ψ/N = 177 with an fp32 master);
    # the step costs about 5-20 ms more (compact_master.py [Note: chunk size and cost]).
    # Whether the optimizer's rules take a compact master is theirs to say (zerokern.rules
    # [Note: what a rule supports]); the built-in ones all do (Muon through map_piece_).
    if cfg.precision == "bf16" and cfg.offload is None and cfg.stage <= 2 and \
            _rules_take(cfg, optimizer, master="compact"):
        zero_kw["master"] = "compact"
    if cfg.offload == "nvme":
        zero_kw["offload_path"] = cfg.offload_path
    if optimizer is not None:
        if cfg.optimizer is not None and _world()[0] == 0:
            # [Note: client objects win] DeepSpeed 0.19.8 uses the client's optimizer and
            # lr_scheduler when the config names one too (engine.py _configure_optimizer,
            # _configure_lr_scheduler); so does zerokern (issue 21 item 10), and says so.
            log.warning("optimizer= is given: config key optimizer (%s) is not used, as in "
                        "DeepSpeed", cfg.optimizer["type"])
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            params = model_parameters if model_parameters is not None else model.parameters()
            optimizer = optimizer(params)
        if isinstance(optimizer, ZeroOptimizer):  # ZeroAdamW, ZeroLion, a custom rule's
            _check_given(optimizer, mpu, cfg)
            if cfg.stage3_keys_given:  # (else its own keep_for_backward_mb stands)
                _use_stage3_keys(optimizer, cfg)  # (its free_grads stands)
            return optimizer
        return _engine_owned(zero_from_torch(optimizer, model, **zero_kw), cfg)
    if cfg.optimizer is None:
        return None  # [Note: forward-only engine]
    hyper = optimizer_settings(cfg.optimizer)
    groups = groups_for_model(model, model_parameters, hyper)
    cls = {"adamw": ZeroAdamW, "lion": ZeroLion,
           "muon": ZeroMuon}[optimizer_kind(cfg.optimizer)]
    return _engine_owned(cls(model, **hyper, **zero_kw, param_groups=groups), cfg)


def _engine_owned(opt: ZeroOptimizer, cfg: EngineConfig) -> ZeroOptimizer:
    """An optimizer the engine built: DeepSpeed's stage-3 keys, its staging kept, and its grad
    shard where DeepSpeed holds as much (`_keeps_grad_shard`).

    [Note: the engine keeps its staging] The engine builds with free_grads=True (held memory
    between steps as DeepSpeed's), but keeps the staging pool of stages 2-3 (the buffers grads
    are copied into for their reduce-scatter; stage 2: MAX_IN_FLIGHT buckets): a fresh
    anonymous mapping per step costs its page faults and zeroing again, and on this 2-core VM
    freeing the pool and the grad shards together cost more than both apart. Measured on the
    20m GPT, stage 2 fp32, 2 gloo ranks, CPU time per iteration over the bare model's (medians
    of 8, load ~20, 2026-11-29): 161 ms freeing both at 25 MiB buckets, 90 ms keeping the pool
    (50 MiB held), 116 ms freeing both at 6 MiB buckets, 102 ms keeping a pool of 6 MiB buckets
    (12 MiB held; ZK_STAGE2_BUCKET_MB_DEFAULT in config.py). Stage 1 keeps nothing: its grad
    buffer is the model's size. Where the shared-memory exchange reads the grads in place (gloo
    ranks on one host: comm/pieces.py [Note: grads read where they lie]) no staging buffer is
    ever allocated, so there is no pool to keep; over NCCL or the TCP ring there is."""
    if opt.stage >= 2 and hasattr(opt.grad_sync, "keep_staging"):
        opt.grad_sync.keep_staging = True
    if _keeps_grad_shard(opt):
        opt.grad_sync.free_on_zero = False
    return _use_stage3_keys(opt, cfg)


def _keeps_grad_shard(opt: ZeroOptimizer) -> bool:
    """[Note: the engine keeps its grad shard] Whether the engine's optimizer keeps its grad
    shard (Ψ/N elements of the reduce dtype) between steps instead of freeing it at zero_grad.
    Freed, the next backward's first reduce-scatter writes into fresh pages, and the kernel
    zeroes them first: on the 20m GPT, stage 2 fp32, 2 gloo ranks, 46 MB of 2 MiB pages per
    step, 11.6 ms of the ring thread's CPU in clear_page (perf, 2026-11-29, of ~95 ms that
    zerokern adds to the bare model's iteration). It is kept where DeepSpeed holds as much:
    - stage 3: DeepSpeed's stage 3 allocates its grad partitions once and keeps them
      (stage3.py, grad_partitions_flat_buffer), and its bucket besides;
    - stage 2 when the flat params are the master (fp32, no offload): DeepSpeed's stage 1-2
      frees its grad partitions at each step but holds an fp32 copy of this rank's params
      (its fp32 partition, 4Ψ/N bytes) that zerokern does not; the fp32 grad shard takes that
      room, so the state between steps is DeepSpeed's 4Ψ + 12Ψ/N (`bench --engine`: 249 MiB
      per rank against DeepSpeed's 293).
    Elsewhere (stage 2 with a separate or compact master, e.g. bf16: 0.86x DeepSpeed's held
    memory with the shard freed, 0.97x with it kept, over issue 12's 0.9; stage 1, whose
    buffer is Ψ; offload) the grads are freed at each step as before. The numbers do not
    change: the first reduction after zero_grad overwrites the shard either way."""
    if opt.offload is not None or getattr(opt, "offload_params", None) is not None or \
            not hasattr(opt.grad_sync, "keep_staging"):
        return False
    if opt.stage == 3:
        return True
    # fp32 on the device: no master besides the params (shard_buffer.py `master`; not read
    # here: reading a compact master's `master` expands it)
    return opt.stage == 2 and opt.precision == "fp32"


def _use_stage3_keys(opt: ZeroOptimizer, cfg: EngineConfig) -> ZeroOptimizer:
    """At stage 3, DeepSpeed's four schedule keys (or their defaults) decide the units kept for
    the backward and the forward's prefetch ([Note: DeepSpeed's stage-3 keys] in
    zerokern/stage3/ds_schedule.py); the same on every rank, before the first forward."""
    sync = opt.grad_sync
    if opt.stage == 3 and hasattr(sync, "use_schedule"):
        sync.use_schedule(cfg.stage3_keys)
        if _world()[0] == 0:
            keys = ", ".join(f"{k}={getattr(cfg.stage3_keys, f)}" for k, f in STAGE3_KEYS.items())
            log.info("stage 3 schedule (%s): %d of %d units kept gathered for the backward, "
                     "forward prefetch up to %d elements", keys, len(set(sync.kept_units)),
                     len(sync.active_units), cfg.stage3_keys.prefetch_numel)
    return opt


def _rules_take(cfg: EngineConfig, optimizer, **kw) -> bool:
    """Every rule the config's optimizer section builds runs with `kw` (offload=, master=):
    ZeroMuon's Muon and AdamW rules, ZeroLion's, ZeroAdamW's (zerokern.rules [Note: what a
    rule supports]). A client optimizer (optimizer=) is converted with the AdamW or Lion rule."""
    from zerokern.rules.adamw import ADAMW
    from zerokern.rules.lion import LION
    from zerokern.rules.muon import MUON

    rules = [ADAMW]
    if optimizer is None and cfg.optimizer is not None:
        rules = {"adamw": [ADAMW], "lion": [LION],
                 "muon": [MUON, ADAMW]}[optimizer_kind(cfg.optimizer)]
    return all(r.unsupported(**kw) is None for r in rules)


def _check_given(opt: ZeroOptimizer, mpu: Optional[MpuGroups], cfg: EngineConfig) -> None:
    """A ZeroAdamW built by the caller must shard over the groups the engine would use."""
    want = None if mpu is None else sorted(dist.get_process_group_ranks(mpu.dp_group))
    g = opt.comm.world.group
    have = sorted(dist.get_process_group_ranks(g if g is not None else dist.group.WORLD)) \
        if dist.is_initialized() else [0]
    if want is not None and have != want:
        raise ValueError(f"optimizer= is a ZeroAdamW over ranks {have}"
                         f" but mpu's data-parallel group is {want}: build it with "
                         "process_group=mpu.get_data_parallel_group()")
    if cfg.hpz_partition_size > 1 and opt.comm.hpz is None:
        raise ValueError("optimizer= is a ZeroAdamW without hpz but the config sets "
                         "zero_optimization.zero_hpz_partition_size: pass one or the other")


def _attach_mpu(opt: ZeroOptimizer, mpu: MpuGroups) -> None:
    """[Note: model-parallel grad stats] (grads/model_parallel.py) on the engine's optimizer."""
    from ..grads.model_parallel import ModelParallelStats

    opt.plan.attach_model_parallel(  # ValueError with DTensor params, before any change
        ModelParallelStats(mpu.mp_group, mpu.tp_rank == 0, opt.flat_groups),
        tp=mpu.tp_size, pp=mpu.pp_size)


def _forward_only(model: nn.Module, cfg: EngineConfig,
                  mpu: Optional[MpuGroups] = None) -> None:
    """[Note: forward-only engine]: the model in the config's precision, as DeepSpeed, with
    the data-parallel group's first rank's params and buffers on every rank (DeepSpeed's
    initialize broadcasts them with or without an optimizer; zerokern's optimizer does it at
    construction: zerokern.core.model_sync [Note: ranks start from the first rank's weights])."""
    if dist.is_available() and dist.is_initialized():
        from zerokern.core.model_sync import model_tensors, sync_from_first_rank

        group = mpu.dp_group if mpu is not None else dist.group.WORLD
        sync_from_first_rank(model_tensors((), model), group)
    if cfg.stage == 3 and _world()[0] == 0:
        log.warning("zerokern.initialize with no optimizer: stage 3 does not shard the model "
                    "here (zerokern shards through ZeroAdamW); every rank holds all of it")
    if cfg.precision != "fp32":
        model.to(PRECISIONS[cfg.precision])


def _build_scheduler(cfg: EngineConfig, opt, lr_scheduler, client_opt):
    """The client's lr_scheduler if given, else the config's ([Note: client objects win]).
    A scheduler object must drive `opt`: one built on the client's torch optimizer (which
    zerokern replaced by a ZeroAdamW) is rebound to it, group for group."""
    if lr_scheduler is None:
        return build_scheduler(cfg.scheduler, opt) if cfg.scheduler is not None else None
    if cfg.scheduler is not None and _world()[0] == 0:
        log.warning("lr_scheduler= is given: config key scheduler (%s) is not used, as in "
                    "DeepSpeed", cfg.scheduler["type"])
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(opt)
    bound = getattr(lr_scheduler, "optimizer", None)
    if bound is opt:
        return lr_scheduler
    if bound is not None and bound is client_opt:
        if len(bound.param_groups) != len(opt.param_groups):
            raise ValueError(f"lr_scheduler is bound to the client optimizer's "
                             f"{len(bound.param_groups)} param groups, the ZeroAdamW has "
                             f"{len(opt.param_groups)} (groups without trainable params are "
                             "dropped); pass a callable (optimizer -> scheduler)")
        rebind_scheduler(lr_scheduler, bound, opt)
        return lr_scheduler
    raise ValueError("lr_scheduler is bound to another optimizer than optimizer=; pass a "
                     "callable (optimizer -> scheduler) so it drives zerokern's ZeroAdamW")
