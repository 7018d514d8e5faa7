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

[Note: engine checkpoint layout] `save_dir/<tag>/zero/` is a zerokern checkpoint whose
client_state holds the engine's counters, scheduler state and the caller's client_state, so
they commit atomically with the model and optimizer (before, rank 0 wrote
`<tag>/engine_state.pt` beside it, after the commit: a crash in between left a checkpoint
without its counters; such older checkpoints still load). `save_dir/latest` is rewritten
(tmp + rename) by rank 0 right after the commit, inside the save's agreement, so it never
names an uncommitted tag. load_checkpoint without a tag reads `latest` as DeepSpeed does and
falls back to scanning (zerokern.checkpoint.latest) when the file is missing or names a tag
that is not a complete checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import checkpoint as zk_checkpoint

log = logging.getLogger("zerokern.engine")
_ENGINE_STATE = "engine_state.pt"  # the engine state of checkpoints written before it
_ENGINE_KEY = "zerokern.engine"  # moved into the checkpoint's client_state
_ZERO_DIR = "zero"


def _latest_tag(load_dir: str) -> Optional[str]:
    """[Note: engine checkpoint layout]: the tag `load_dir/latest` names if that checkpoint
    is complete, else the newest complete one (zerokern.checkpoint.latest), else None."""
    latest = os.path.join(load_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        try:
            found = zk_checkpoint.latest(load_dir, subdir=_ZERO_DIR, verify=False,
                                         only=[tag]) if tag else None
        except Exception:  # noqa: BLE001 - the scan below says why
            found = None
        if found is not None:
            return tag
        log.warning("load_checkpoint: %s names %r, which is not a complete checkpoint; "
                    "scanning %s for the newest complete one", latest, tag, load_dir)
    found = zk_checkpoint.latest(load_dir, subdir=_ZERO_DIR)
    return None if found is None else os.path.basename(found)


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
