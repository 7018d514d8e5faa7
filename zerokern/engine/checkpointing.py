"""The engine's checkpoints: DeepSpeed's `save_checkpoint` / `load_checkpoint` /
`save_16bit_model` over `zerokern.checkpoint` (a mixin of ZeroEngine).

[Note: checkpoint tags] A zerokern checkpoint is one directory that every rank writes
collectively (`zerokern.checkpoint.save`), so all ranks must write under the same tag. Before
anything is written the ranks exchange (save_dir is valid, tag) once (`all_gather_object`, a
few bytes), so that every rank takes the same decision:
- a save_dir that is None or "" on any rank: ValueError on every rank (DeepSpeed 0.19 raises
  ValueError for it too; before, zerokern wrote into the current directory or raised TypeError);
  load_checkpoint's load_dir the same (before: "" read the current directory's `latest`);
- tags that differ: `checkpoint.tag_validation` decides as in DeepSpeed -- "Fail" raises on
  every rank; "Warn" (DeepSpeed's default) warns; "Ignore" says nothing. Under Warn and Ignore
  DeepSpeed writes each rank's files under that rank's tag, which leaves no loadable
  checkpoint; zerokern writes under rank 0's tag instead (the warning says so), the one choice
  that leaves a checkpoint that loads.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import checkpoint as zk_checkpoint

log = logging.getLogger("zerokern.engine")
_ENGINE_STATE = "engine_state.pt"
_ZERO_DIR = "zero"


def _dir_error(d, what: str = "save_checkpoint: save_dir") -> Optional[Tuple[str, str]]:
    """(exception name, message), or None for a usable directory argument."""
    if d is None or (isinstance(d, str) and d == ""):
        return "ValueError", f"{what} must be a non-empty path, got {d!r}"
    if not isinstance(d, (str, os.PathLike)):
        return "TypeError", f"{what} must be a path (str), got {type(d).__name__}"
    return None


def _raise_first(seen, errors_at: int = 0) -> None:
    """Every rank raises the first rank's error (the same on all, so none waits)."""
    errors = [(r, item[errors_at]) for r, item in enumerate(seen) if item[errors_at] is not None]
    if errors:
        r, (kind, e) = errors[0]
        raise {"TypeError": TypeError, "ValueError": ValueError}[kind](
            f"{e} (on rank {r}); nothing done")


class CheckpointMixin:
    """save_checkpoint / load_checkpoint / save_16bit_model for ZeroEngine."""

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
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Collective. `save_dir/tag/` holds a zerokern checkpoint (any world size loads it)
        and the engine's counters, scheduler state and client_state.

        Args:
            save_dir: the directory (the same on every rank).
            tag: the sub-directory; default `global_step<N>`.
            client_state: a picklable dict, returned by `load_checkpoint`.
            save_latest: write `save_dir/latest` with the tag.
            exclude_frozen_parameters: as DeepSpeed: leave out the values of the frozen params
                (`requires_grad=False`; e.g. a LoRA run's base weights), so the checkpoint
                holds the trained params, their optimizer state and the buffers. Its metadata
                lists the params left out (name, shape, dtype, crc32 of the values);
                `load_checkpoint(..., load_module_strict=False)` keeps the model's current
                values for them (DeepSpeed needs load_module_strict=False too), and
                `zerokern consolidate` leaves them out with a warning
                (zerokern/checkpoint/format.py [Note: excluded frozen params]).

        Returns:
            True.

        Raises:
            ValueError: save_dir None or "" on any rank, or (tag_validation "Fail") tags that
                differ across ranks: on every rank, before anything is written.
        """
        self._need_optimizer("save_checkpoint")
        self._no_mpu("save_checkpoint")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        tag = self._agreed_tag(save_dir, tag)
        save_dir = os.fspath(save_dir)
        path = os.path.join(save_dir, tag)
        if self.global_rank == 0:
            os.makedirs(path, exist_ok=True)
        if self.world_size > 1:
            dist.barrier()
        zk_checkpoint.save(os.path.join(path, _ZERO_DIR), self.module, self.optimizer,
                           exclude_frozen_parameters=bool(exclude_frozen_parameters))
        if self.global_rank == 0:
            state = {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                     "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
                     "lr_scheduler": (self.lr_scheduler.state_dict()
                                      if self.lr_scheduler is not None else None),
                     "client_state": dict(client_state or {})}
            torch.save(state, os.path.join(path, _ENGINE_STATE) + ".tmp")
            os.replace(os.path.join(path, _ENGINE_STATE) + ".tmp",
                       os.path.join(path, _ENGINE_STATE))
            if save_latest:
                with open(os.path.join(save_dir, "latest"), "w") as f:
                    f.write(tag)
        if self.world_size > 1:
            dist.barrier()
        return True

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Collective. Returns (path, client_state), or (None, None) when there is no
        `latest` and no tag (as DeepSpeed).

        Args:
            load_dir: the directory `save_checkpoint` wrote (any world size or stage).
            tag: the sub-directory; default the one named in `load_dir/latest`.
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
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                log.warning("load_checkpoint: no %s and no tag; nothing loaded", latest)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, str(tag))
        zk_checkpoint.load(os.path.join(path, _ZERO_DIR), self.module, self.optimizer,
                           strict=bool(load_module_strict))
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
