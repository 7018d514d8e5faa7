"""`zerokern.initialize`: DeepSpeed's engine shape over ZeroAdamW.

    engine, optimizer, loader, scheduler = zerokern.initialize(model=model,
        model_parameters=model.parameters(), config=ds_config)
    loss = engine(**batch).loss
    engine.backward(loss)   # x loss scale x 1/gradient_accumulation_steps; no_sync off-boundary
    engine.step()           # the optimizer steps only at the accumulation boundary

[Note: the accumulation boundary] DeepSpeed counts micro-steps: step() after every
backward, and the boundary is every gradient_accumulation_steps-th. A backward that is not at
a boundary runs under `opt.no_sync()` (no communication, torch's/DDP's meaning); the one at the
boundary reduces everything. The gradient is the mean over ranks of the sum over micro-batches
of loss/gas, as in DeepSpeed. On an fp16 overflow the step is skipped and so is the scheduler's
step (DeepSpeed's rule), which costs one host read of `opt.step_skipped` per step, fp16 only.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..optimizer import ZeroOptimizer
from ..optimizer_adamw import ZeroAdamW
from ..optimizer_args import PRECISIONS
from ..optimizer_lion import ZeroLion
from ..optimizer_muon import ZeroMuon
from .checkpointing import CheckpointMixin
from .config import EngineConfig, optimizer_kind, optimizer_settings, parse_config
from .convert import groups_for_model, rebind_scheduler, zero_from_torch
from .parallel import MpuGroups, hpz_mesh, mpu_groups
from .schedulers import build_scheduler

log = logging.getLogger("zerokern.engine")


class NoOptimizerError(RuntimeError, AssertionError):
    """A training call on a forward-only engine (built with no optimizer). An AssertionError
    too, because that is what DeepSpeed raises there (its tests catch it)."""


def _env_int(*names: str) -> Optional[int]:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return None


def init_distributed(dist_backend: Optional[str] = None, timeout=datetime.timedelta(minutes=30),
                     init_method: Optional[str] = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start the default process group from the launcher's environment, as
    `deepspeed.init_distributed`: torchrun and DeepSpeed's launcher (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or mpirun (OMPI_COMM_WORLD_*). NCCL when CUDA is
    available, gloo otherwise. Does nothing if a group exists already.

    Args:
        dist_backend: "nccl", "gloo", ...; default NCCL with CUDA, gloo without.
        timeout: the process group's collective timeout.
        init_method: default "env://" (MASTER_ADDR / MASTER_PORT, default 127.0.0.1:29500).
        rank: this process's rank; default from the environment.
        world_size: the number of ranks; default from the environment.

    Raises:
        RuntimeError: no RANK / WORLD_SIZE in the environment (not launched by torchrun,
            deepspeed or mpirun) and none given.
    """
    if dist.is_initialized():
        return
    rank = rank if rank >= 0 else _env_int("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    world_size = world_size if world_size > 0 else _env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE",
                                                            "PMI_SIZE")
    if rank is None or world_size is None:
        raise RuntimeError("zerokern.init_distributed: no RANK/WORLD_SIZE in the environment; "
                           "launch with torchrun, deepspeed or mpirun")
    local = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(local if local is not None else rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local if local is not None else rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=timeout)


def _world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ZeroEngine(CheckpointMixin, nn.Module):
    """DeepSpeed's engine surface over a model and its ZeroAdamW (build it with initialize).

    Attributes: `module`, `optimizer`, `lr_scheduler`, `training_dataloader`, `config` (the
    EngineConfig), `global_rank`, `world_size`, `local_rank`, `micro_steps`, `global_steps`,
    `global_samples`, `skipped_steps`.

    [Note: forward-only engine] With no optimizer (none given, no config key `optimizer`),
    DeepSpeed builds an engine for forward passes: the model in the config's precision on the
    device, and backward/step raise. zerokern does the same (`optimizer` is None;
    backward, step, checkpoints raise NoOptimizerError). At stage 3 DeepSpeed also partitions
    the params; zerokern shards only through ZeroAdamW, so its forward-only engine keeps the
    whole model on every rank at every stage (a warning says so at stage 3): the outputs are
    the same, the memory is not sharded.

    Args:
        model: the nn.Module (kept as `engine.module`).
        optimizer: its zerokern optimizer (ZeroAdamW, ZeroLion, ...), or None for a
            forward-only engine.
        cfg: the parsed config (`parse_config`).
        lr_scheduler: the scheduler stepped at each accumulation boundary, or None.
        training_dataloader: the loader `initialize` built, or None.
    """

    def __init__(self, model: nn.Module, optimizer: Optional[ZeroOptimizer], cfg: EngineConfig,
                 lr_scheduler=None, training_dataloader=None) -> None:
        super().__init__()
        self.module = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.config = cfg
        self.global_rank, self.world_size = _world()
        self.local_rank = _env_int("LOCAL_RANK") or 0
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._times: Dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._last_loss = None

    # ---- DeepSpeed's accessors ----------------------------------------------------------------
    def _need_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise NoOptimizerError(f"{what}: this engine has no optimizer (forward only: "
                                   "give config key optimizer or optimizer= to train)")

    @property
    def device(self) -> torch.device:
        """The device the model's params live on."""
        if self.optimizer is not None:
            return self.optimizer.flat_groups[0].device
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's gradient_accumulation_steps)."""
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch per rank."""
        return self.config.micro_batch_size

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (micro x accumulation x world size)."""
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.optimizer.stage if self.optimizer is not None else self.config.stage

    def get_lr(self):
        """The current learning rate of each param group (a list of floats)."""
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float:
        """The last step's global gradient norm (a host read)."""
        self._need_optimizer("get_global_grad_norm")
        return float(self.optimizer.grad_norm)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host read; 1.0 unless fp16 or a static scale)."""
        return 1.0 if self.optimizer is None else float(self.optimizer.loss_scale)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the coming `step()` is an optimizer step."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def no_sync(self):
        """The optimizer's `no_sync()`: backward passes inside do not communicate."""
        self._need_optimizer("no_sync")
        return self.optimizer.no_sync()

    def zero_grad(self) -> None:
        """Clear the gradients (`step()` does it at each boundary)."""
        if self.optimizer is None:
            self.module.zero_grad()
        else:
            self.optimizer.zero_grad()

    # ---- the loop -----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The model's forward (`engine(*args, **kwargs)`), timed for wall_clock_breakdown.

        Args:
            *args: passed to the model.
            **kwargs: passed to the model.
        """
        t0 = time.perf_counter()
        out = self.module(*args, **kwargs)
        self._times["forward"] += time.perf_counter() - t0
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """loss x loss scale (x 1/gradient_accumulation_steps) backward, no_sync() off the
        accumulation boundary. Returns the loss as given.

        Args:
            loss: the micro-batch's 0-d loss.
            retain_graph: as torch's backward.
            scale_wrt_gas: divide by gradient_accumulation_steps (DeepSpeed's default).
        """
        self._need_optimizer("backward")
        t0 = time.perf_counter()
        self._last_loss = loss.detach()
        gas = self.config.gradient_accumulation_steps
        scaled = loss / gas if (scale_wrt_gas and gas > 1) else loss
        ctx = (contextlib.nullcontext() if self.is_gradient_accumulation_boundary()
               else self.optimizer.no_sync())
        with ctx:
            self.optimizer.backward(scaled, retain_graph=retain_graph)
        self._times["backward"] += time.perf_counter() - t0
        return loss

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Count a micro-step; at the boundary: clip, step, schedule, zero the grads.

        Args:
            lr_kwargs: keyword arguments for the scheduler's step().
        """
        self._need_optimizer("step")
        t0 = time.perf_counter()
        if self.is_gradient_accumulation_boundary():
            opt = self.optimizer
            if self.config.gradient_clipping > 0:
                opt.clip_grad_norm_(self.config.gradient_clipping)
            opt.step()
            skipped = opt.precision == "fp16" and bool(opt.step_skipped)  # Note: fp16 only
            self.skipped_steps += int(skipped)
            if self.lr_scheduler is not None and not skipped:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            opt.zero_grad()
            self.global_steps += 1
            self.global_samples += self.config.train_batch_size
            self._report()
        self.micro_steps += 1
        self._times["step"] += time.perf_counter() - t0

    def _report(self) -> None:
        n = self.config.steps_per_print
        if self.global_rank != 0 or self.global_steps % n != 0:
            return
        log.info("step=%d, skipped=%d, lr=%s, loss_scale=%s", self.global_steps,
                 self.skipped_steps, self.get_lr(), self.loss_scale)
        if self.config.wall_clock_breakdown:
            t = self._times
            log.info("time (ms) over the last %d steps | forward: %.2f | backward: %.2f | "
                     "step: %.2f", n, t["forward"] * 1e3, t["backward"] * 1e3, t["step"] * 1e3)
        for k in self._times:
            self._times[k] = 0.0


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
    # (engine-20m-n2.md: 1.23-1.41x DeepSpeed's held memory at stages 1-2 with them kept).
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
            return optimizer
        return zero_from_torch(optimizer, model, **zero_kw)
    if cfg.optimizer is None:
        return None  # [Note: forward-only engine]
    hyper = optimizer_settings(cfg.optimizer)
    groups = groups_for_model(model, model_parameters, hyper)
    cls = {"adamw": ZeroAdamW, "lion": ZeroLion,
           "muon": ZeroMuon}[optimizer_kind(cfg.optimizer)]
    return cls(model, **hyper, **zero_kw, param_groups=groups)


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

    if getattr(opt, "tp", None) is not None:
        raise ValueError("initialize: mpu= with DTensor (tensor-parallel) params: the DTensor "
                         "placements already say what is split; pass one or the other")

    opt.model_parallel = ModelParallelStats(mpu.mp_group, mpu.tp_rank == 0, opt.flat_groups)


def _forward_only(model: nn.Module, cfg: EngineConfig) -> None:
    """[Note: forward-only engine]: the model in the config's precision, as DeepSpeed."""
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
        ValueError: no model or no config, different configs given twice, mesh_param, or
            a config key zerokern cannot honour (naming the key), before the model is
            touched.
    """
    if model is None:
        raise ValueError("initialize: model is required")
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
        raise ValueError("initialize: give config= (or config_params=, or "
                         "args.deepspeed_config)")
    if len(sources) > 1 and any(s is not sources[0] and s != sources[0] for s in sources):
        raise ValueError("initialize: config, config_params and args.deepspeed_config differ; "
                         "give one")
    if not dist.is_initialized() and dist_init_required is not False and \
            (_env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        init_distributed()
    rank, world_size = _world()
    mp = mpu_groups(mpu)  # TypeError/ValueError naming mpu, before the model is touched
    dp_rank, dp_size = (rank, world_size) if mp is None else (mp.dp_rank, mp.dp_size)
    cfg = parse_config(sources[0], dp_size)  # raises before the model is touched
    hpz_raw = cfg.raw.get("zero_optimization", {}).get("zero_hpz_partition_size", 1)
    if mp is not None and hpz_raw > 1:
        raise ValueError("initialize: mpu= with zero_optimization.zero_hpz_partition_size is "
                         "not supported (DeepSpeed builds its hpZ groups over the whole world, "
                         "across model-parallel ranks)")
    if deepscale is not None:  # what DeepSpeed leaves in args
        args.deepspeed_config, args.deepscale_config = deepscale, None
    if dist.is_initialized() and dist.get_backend() == "nccl":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    opt = _build_optimizer(model, cfg, optimizer, model_parameters, mp)
    if opt is not None and mp is not None:
        _attach_mpu(opt, mp)
    if opt is None:
        if lr_scheduler is not None or cfg.scheduler is not None:
            raise ValueError("initialize: a scheduler (lr_scheduler= or config key scheduler) "
                             "needs an optimizer (config key optimizer or optimizer=)")
        _forward_only(model, cfg)
    client_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    sched = None if opt is None else _build_scheduler(cfg, opt, lr_scheduler, client_opt)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.distributed.DistributedSampler(
            training_data, num_replicas=dp_size, rank=dp_rank) if dp_size > 1 else None
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.micro_batch_size,
                                             sampler=sampler, collate_fn=collate_fn)
    engine = ZeroEngine(model, opt, cfg, sched, loader)
    engine.mpu = mpu
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
