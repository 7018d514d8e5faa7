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
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerokern import checkpoint as zk_checkpoint
from zerokern.core.optimizer import ZeroOptimizer
from zerokern.platform.device import accelerator

from .build import _world
from .checkpointing import (
    _ENGINE_KEY,
    _ENGINE_STATE,
    _ZERO_DIR,
    _dir_error,
    _latest_tag,
    _raise_first,
)
from .config import EngineConfig

log = logging.getLogger("zerokern.engine")


class NoOptimizerError(RuntimeError, AssertionError):
    """A training call on a forward-only engine (built with no optimizer). An AssertionError
    too, because that is what DeepSpeed raises there (its tests catch it)."""


class NoSyncError(RuntimeError, AssertionError):
    """`engine.step()` inside `no_sync()`, or `no_sync()` re-entered ([Note: no_sync in the
    engine]). An AssertionError too, because that is what DeepSpeed raises there."""


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
    acc = accelerator()
    backend = dist_backend or acc.backend
    if backend == acc.backend and acc.is_accelerator:
        acc.set_device(local if local is not None else rank % acc.device_count())
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=timeout)


class ZeroEngine(nn.Module):
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
        self._in_no_sync = False  # [Note: no_sync in the engine]
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary
        self._destroyed = False

    def __getattr__(self, name: str):
        """DeepSpeed's pass-through: an attribute the engine does not have is the model's
        (`engine.config` stays the engine's EngineConfig; the model's is `engine.module.config`).
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None:
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute "
                                 f"'{name}'") from None

    # ---- DeepSpeed's accessors ----------------------------------------------------------------
    def _need_optimizer(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"{what}: this engine was destroyed (engine.destroy()); build a "
                               "new one with zerokern.initialize")
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

    def gradient_clipping(self) -> float:
        """The config's gradient_clipping (the global norm `step()` clips to; 0: off;
        DeepSpeed 0.19's default 1.0 when the key is absent)."""
        return self.config.gradient_clipping

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the coming `step()` is an optimizer step: every
        gradient_accumulation_steps-th micro-step, or what `set_gradient_accumulation_boundary`
        set last."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual boundary: from now on `is_gradient_accumulation_boundary()` is
        `is_boundary` (not the micro-step count), until set again. Backward passes while it is
        False accumulate without communication; the backward and `step()` with it True reduce
        and step, e.g. gradient_accumulation_steps - 1 backward passes with False, then one
        with True and a single `step()`.

        Args:
            is_boundary: whether the coming backward/step is at the accumulation boundary.

        Raises:
            TypeError: is_boundary not a bool.
        """
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary: is_boundary must be a bool, "
                            f"got {type(is_boundary).__name__}")
        self._boundary = is_boundary

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release the gathered params stage 3 holds between passes (every unit
        no forward/backward still needs is freed to its shard). Stages 0-2 hold whole params
        by design and cache nothing, as in DeepSpeed, whose stage 1-2 optimizers have no
        partition cache."""
        if self.optimizer is not None and self.optimizer.stage == 3:
            self.optimizer.grad_sync._free_unreferenced()

    def destroy(self) -> None:
        """DeepSpeed's: release what the engine holds beyond the model (the optimizer's
        `close()`: offload files, param homes). Idempotent. The engine cannot train or save
        afterwards (RuntimeError naming destroy); its module stays usable for forward passes
        at stages 0-2."""
        if not self._destroyed and self.optimizer is not None:
            self.optimizer.close()
        self._destroyed = True

    @contextlib.contextmanager
    def no_sync(self):
        """The optimizer's `no_sync()`: backward passes inside do not communicate; the first
        backward at an accumulation boundary outside it (or the step) reduces everything.

        [Note: no_sync in the engine] As DeepSpeed's: `step()` inside raises, and so does a
        second `no_sync()` inside the first (NoSyncError, an AssertionError), before anything
        changes. Unlike DeepSpeed, zerokern allows it at stages 2-3 (DeepSpeed forbids it
        there: its gradient partitioning needs the reduction; zerokern keeps a full local
        accumulator meanwhile, optimizer_api.no_sync).

        Raises:
            NoSyncError: already inside this engine's no_sync().
            NoOptimizerError: a forward-only engine.
        """
        self._need_optimizer("no_sync")
        if self._in_no_sync:
            raise NoSyncError("no_sync context manager reentry is unsupported (as in "
                              "DeepSpeed): this engine is already inside no_sync()")
        self._in_no_sync = True
        try:
            with self.optimizer.no_sync():
                yield
        finally:
            self._in_no_sync = False

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

        Raises:
            NoSyncError: inside `no_sync()` (the engine's or the optimizer's), before anything
                changes ([Note: no_sync in the engine]).
        """
        self._need_optimizer("step")
        if self._in_no_sync or not self.optimizer.grad_sync.sync:
            raise NoSyncError("It is illegal to call engine.step() inside no_sync context "
                              "manager (as in DeepSpeed): call it after the with block; "
                              "nothing was stepped")
        t0 = time.perf_counter()
        if self.is_gradient_accumulation_boundary():
            self._optimizer_step(lr_kwargs)
        self.micro_steps += 1
        self._times["step"] += time.perf_counter() - t0

    def _optimizer_step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """The boundary's work (also the pipeline engine's, engine/pipeline_engine.py): clip,
        step, schedule, zero the grads, count."""
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

    # -- checkpoints (engine/checkpointing.py: [Note: checkpoint tags], [Note: engine checkpoint
    # layout]) ----------------------------------------------------------------------------------

    def _no_mpu(self, what: str) -> None:
        # With an mpu every model-parallel slice would write the same rank-numbered files
        # (ranks are numbered in the data-parallel group): refused until checkpoints learn
        # DeepSpeed's mp_rank_XX layout, rather than overwrite each other.
        if getattr(self, "mpu", None) is not None:
            raise NotImplementedError(f"{what} with mpu= (model parallelism) is not supported "
                                      "yet; nothing written or read")

    def _gather(self, item) -> list:
        if self.world_size == 1:
            return [item]
        seen = [None] * self.world_size
        dist.all_gather_object(seen, item)
        return seen

    def _agreed_tag(self, save_dir, tag: str) -> str:
        """[Note: checkpoint tags]: raises on every rank, or returns the tag every rank uses."""
        seen = self._gather((_dir_error(save_dir), tag))
        _raise_first(seen)
        tags = [t for _, t in seen]
        if len(set(tags)) == 1:
            return tag
        msg = (f"save_checkpoint: the tag is not the same on every rank ({tags}); a rank's tag "
               "must not hold rank-specific parts")
        mode = self.config.tag_validation
        if mode == "FAIL":
            raise ValueError(f"{msg} (config checkpoint.tag_validation 'Fail'); nothing written")
        if mode == "WARN" and (self.global_rank == 0 or tag != tags[0]):
            log.warning("%s; writing under rank 0's tag %r on every rank (a zerokern "
                        "checkpoint is one directory; config checkpoint.tag_validation "
                        "'Ignore' silences this)", msg, tags[0])
        return tags[0]

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[Dict[str, Any]] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None) -> bool:
        """Collective. `save_dir/tag/zero/` holds a zerokern checkpoint (any world size loads
        it) with the engine's counters, scheduler state and client_state inside it
        ([Note: engine checkpoint layout]).

        Args:
            save_dir: the directory (the same on every rank).
            tag: the sub-directory; default `global_step<N>`.
            client_state: a picklable dict, returned by `load_checkpoint`.
            save_latest: write `save_dir/latest` with the tag (once the checkpoint committed).
            exclude_frozen_parameters: as DeepSpeed: leave out the values of the frozen params
                (`requires_grad=False`; e.g. a LoRA run's base weights), so the checkpoint
                holds the trained params, their optimizer state and the buffers. Its metadata
                lists the params left out (name, shape, dtype, crc32 of the values);
                `load_checkpoint(..., load_module_strict=False)` keeps the model's current
                values for them (DeepSpeed needs load_module_strict=False too), and
                `zerokern consolidate` leaves them out with a warning
                (zerokern/checkpoint/format.py [Note: excluded frozen params]).
            async_save: stage the state and write it in the background
                (zerokern/checkpoint/async_save.py [Note: asynchronous saves]); None: the
                config's `checkpoint.writer.decoupled` (DeepSpeed 0.19's decoupled checkpoint
                engine; default False). `latest` names the tag once it committed;
                `zerokern.checkpoint.wait()` waits for it, and the next save or load does.

        Returns:
            True.

        Raises:
            ValueError: save_dir None or "" on any rank, or (tag_validation "Fail") tags that
                differ across ranks: on every rank, before anything is written.
            CheckpointError, OSError: the previous async save failed (raised once, here).
        """
        self._need_optimizer("save_checkpoint")
        self._no_mpu("save_checkpoint")
        zk_checkpoint.wait()  # the previous async save's error, if any, before anything else
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        tag = self._agreed_tag(save_dir, tag)
        save_dir = os.fspath(save_dir)
        path = os.path.join(save_dir, tag)
        if self.global_rank == 0:
            os.makedirs(path, exist_ok=True)
        if self.world_size > 1:
            dist.barrier()
        state = {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                 "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
                 "lr_scheduler": (self.lr_scheduler.state_dict()
                                  if self.lr_scheduler is not None else None),
                 "client_state": dict(client_state or {})}

        def write_latest() -> None:  # rank 0, after the commit (writer.py on_commit)
            if save_latest:
                tmp = os.path.join(save_dir, f"latest.tmp-{os.getpid()}")
                with open(tmp, "w") as f:
                    f.write(tag)
                os.replace(tmp, os.path.join(save_dir, "latest"))

        if async_save is None:
            async_save = self.config.async_save
        zk_checkpoint.save(os.path.join(path, _ZERO_DIR), self.module, self.optimizer,
                           exclude_frozen_parameters=bool(exclude_frozen_parameters),
                           async_save=bool(async_save), client_state={_ENGINE_KEY: state},
                           on_commit=write_latest)
        return True

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Collective. Returns (path, client_state), or (None, None) when there is no tag and
        no complete checkpoint under load_dir (DeepSpeed: no `latest` file).

        Args:
            load_dir: the directory `save_checkpoint` wrote (any world size or stage).
            tag: the sub-directory; default the one named in `load_dir/latest`, or when that
                file is missing or names an incomplete or corrupt checkpoint, the newest
                complete one ([Note: engine checkpoint layout]).
            load_module_strict: True: the checkpoint must hold every tensor of the model.
                False: the frozen params that `save_checkpoint(...,
                exclude_frozen_parameters=True)` left out keep the model's current values
                (DeepSpeed's meaning for them; a warning names those whose values differ from
                the ones saved). Every other tensor must match either way: the optimizer state
                loads with the module (DeepSpeed's False also tolerates other missing or
                unexpected keys; zerokern raises for them).
            load_optimizer_states: must be True (the module and optimizer load together).
            load_lr_scheduler_states: also restore the scheduler's state.
            load_module_only: must be False.

        Raises:
            ValueError: load_dir None or "" on any rank, load_optimizer_states False or
                load_module_only True; on every rank.
            CheckpointError: as `zerokern.checkpoint.load`, on every rank before anything
                changes; among them a ModelMismatchError for a checkpoint without frozen
                params' values and load_module_strict=True (DeepSpeed raises a RuntimeError
                for the missing keys), or whose left-out params are trainable here or have
                another shape (each named).
        """
        self._need_optimizer("load_checkpoint")
        self._no_mpu("load_checkpoint")
        # a bad load_dir on one rank raises on every rank ([Note: checkpoint tags])
        _raise_first(self._gather((_dir_error(load_dir, "load_checkpoint: load_dir"),)))
        if not load_optimizer_states or load_module_only:
            raise ValueError("load_checkpoint: zerokern loads the module and the optimizer "
                             "together (load_optimizer_states True, load_module_only False); "
                             "for weights only use zerokern.checkpoint.consolidate")
        zk_checkpoint.wait()  # a pending async save commits first (or raises)
        if tag is None:
            tag = _latest_tag(os.fspath(load_dir))
            if tag is None:
                log.warning("load_checkpoint: no complete checkpoint under %s and no tag; "
                            "nothing loaded", load_dir)
                return None, None
        path = os.path.join(load_dir, str(tag))
        loaded = zk_checkpoint.load(os.path.join(path, _ZERO_DIR), self.module, self.optimizer,
                                    strict=bool(load_module_strict))
        state = (loaded["client_state"] or {}).get(_ENGINE_KEY)
        if state is None:  # written before the engine state moved into the checkpoint
            state = torch.load(os.path.join(path, _ENGINE_STATE), weights_only=False)
        self.global_steps = state["global_steps"]
        self.micro_steps = state["micro_steps"]
        self.global_samples = state["global_samples"]
        self.skipped_steps = state["skipped_steps"]
        if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"]:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        return path, state["client_state"]

    def consolidated_16bit_state_dict(self) -> Dict[str, torch.Tensor]:
        """The full model state dict in the training dtype (collective at stage 3; DeepSpeed's
        `_zero3_consolidated_16bit_state_dict`). Every rank gets it."""
        if self.optimizer is None:  # a forward-only engine holds the whole model
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        with self.optimizer.gathered_params():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def _zero3_consolidated_16bit_state_dict(self) -> Dict[str, torch.Tensor]:
        return self.consolidated_16bit_state_dict()

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Collective. At stage 3 only with stage3_gather_16bit_weights_on_model_save (False
        otherwise, as DeepSpeed); rank 0 writes `save_dir/save_filename`.

        Args:
            save_dir: the directory to write into.
            save_filename: the file name (torch.save of the 16-bit state dict).

        Returns:
            True when written.
        """
        self._no_mpu("save_16bit_model")
        if self.zero_optimization_stage() == 3 and not self.config.gather_16bit_on_save:
            log.warning("save_16bit_model: stage 3 needs zero_optimization."
                        "stage3_gather_16bit_weights_on_model_save=true; nothing saved")
            return False
        sd = self.consolidated_16bit_state_dict()
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(sd, os.path.join(save_dir, save_filename))
        if self.world_size > 1:
            dist.barrier()
        return True

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of `save_16bit_model`.

        Args:
            save_dir: as `save_16bit_model`.
            save_filename: as `save_16bit_model`.
        """
        return self.save_16bit_model(save_dir, save_filename)
