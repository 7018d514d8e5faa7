"""Accelerate with ZeroAdamW: `ZeroAccelerator` is an `accelerate.Accelerator` (a one-line
change) whose `prepare` swaps the torch Adam/AdamW for a ZeroAdamW (lion-pytorch's Lion for a
ZeroLion) with the same param groups and hyperparameters, and that does not wrap the model in
DDP (ZeroAdamW reduces the grads).

    accelerator = ZeroAccelerator(zero_stage=2, mixed_precision="bf16",   # was: Accelerator(...)
                                  gradient_accumulation_steps=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):          # no_sync() on the other micro-batches
            accelerator.backward(model(**batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # ZeroAdamW's global norm
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

What changes against accelerate's DDP path, and why:
- prepare: the model is placed on the device first and never wrapped in DDP (ZeroAdamW's
  hooks reduce); mixed precision's autocast is kept. mixed_precision "bf16"/"fp16" become
  ZeroAdamW's precision (16-bit params, fp32 masters), "no" is fp32.
- backward: loss / gradient_accumulation_steps, as accelerate, through `ZeroAdamW.backward`
  (fp16: the loss scale; no GradScaler).
- no_sync / accumulate: `ZeroAdamW.no_sync()`.
- clip_grad_norm_: `ZeroAdamW.clip_grad_norm_` (the global norm over every shard); p.grad is
  released at stages 1-3, so torch's own would raise.
- optimizer_step_was_skipped: the fp16 overflow skip (a host read, fp16 only).
- save_state / load_state: the model and ZeroAdamW go to a zerokern checkpoint
  (`<dir>/zerokern/`, every rank's shard, loadable at any world size and stage); accelerate
  saves the rest (schedulers, RNG, dataloaders, custom objects, model.safetensors)
  [Note: Accelerate state through zerokern.checkpoint].
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Dict, Optional

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from zerokern.core.optimizer import ZeroOptimizer

from .. import checkpoint as zk_checkpoint
from ..engine.convert import rebind_scheduler, zero_from_torch

_ZERO_DIR = "zerokern"  # the zerokern checkpoint inside an accelerate state folder
_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16", None: "fp32"}


class ZeroAccelerator(Accelerator):
    """An Accelerator that trains with ZeroAdamW at `zero_stage` (0-3).

    Args:
        zero_stage: ZeRO stage of the ZeroAdamW that replaces the prepared optimizer.
        zero_options: further ZeroAdamW keyword arguments (bucket_mb, offload, units, ...).
        *args: as `accelerate.Accelerator`.
        **kwargs: as `accelerate.Accelerator` (mixed_precision "bf16"/"fp16" becomes
            ZeroAdamW's precision; gradient_accumulation_steps runs the other micro-batches
            under `no_sync()`).

    Raises:
        ValueError: zero_stage not in 0-3, or DeepSpeed / FSDP enabled as well.
    """

    def __init__(self, *args, zero_stage: int = 2, zero_options: Optional[Dict[str, Any]] = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._zero_init(zero_stage, zero_options)

    def _zero_init(self, zero_stage: int, zero_options) -> None:
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        if str(self.distributed_type) in ("DistributedType.DEEPSPEED", "DEEPSPEED",
                                          "DistributedType.FSDP", "FSDP"):
            raise ValueError("ZeroAccelerator replaces DeepSpeed/FSDP; do not enable them too")
        self.zero_stage = zero_stage
        self.zero_options = dict(zero_options or {})
        self.zero_optimizer: Optional[ZeroOptimizer] = None
        self._zero_model: Optional[torch.nn.Module] = None
        self.scaler = None  # fp16 loss scaling is ZeroAdamW's, on the device

    @classmethod
    def adopt(cls, accelerator: Accelerator, zero_stage: int = 2,
              zero_options: Optional[Dict[str, Any]] = None) -> ZeroAccelerator:
        """Turn an Accelerator another library built (e.g. Trainer's) into a ZeroAccelerator,
        keeping all of its state (same process group, plugins, gradient state).

        Args:
            accelerator: the accelerate.Accelerator to convert (in place).
            zero_stage: the ZeRO stage, 0-3.
            zero_options: further ZeroAdamW keyword arguments.

        Returns:
            The same object, now a ZeroAccelerator.
        """
        accelerator.__class__ = cls
        accelerator._zero_init(zero_stage, zero_options)
        return accelerator

    # ---- prepare ----------------------------------------------------------------------------
    def _to_zero(self, optimizer: torch.optim.Optimizer) -> ZeroOptimizer:
        if isinstance(optimizer, ZeroOptimizer):
            return optimizer
        if self._zero_model is None:
            raise ValueError("ZeroAccelerator.prepare needs the model (in the same prepare() "
                             "call, or an earlier one) to build ZeroAdamW")
        if self.zero_optimizer is not None:
            raise ValueError("ZeroAccelerator trains one model with one optimizer")
        opts = {"stage": self.zero_stage,
                "precision": _PRECISION[str(getattr(self, "mixed_precision", "no"))],
                **self.zero_options}
        return zero_from_torch(optimizer, self._zero_model, **opts)

    def prepare(self, *args, device_placement=None):
        """As accelerate's, but a torch Adam/AdamW becomes a ZeroAdamW (same groups and
        hyperparameters; a scheduler in the same call follows it) and the model is not
        wrapped in DDP (ZeroAdamW reduces the gradients itself).

        Args:
            *args: the model, optimizer, loaders and schedulers, as accelerate's.
            device_placement: as accelerate's.

        Raises:
            ValueError: more than one model, or an optimizer without its model.
        """
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        if len(models) > 1 or (models and self._zero_model is not None
                               and models[0] is not self._zero_model):
            raise ValueError("ZeroAccelerator trains one model")
        if models:
            self._zero_model = models[0]
            models[0].to(self.device)  # before ZeroAdamW lays the params out (stage 3)
        out = list(args)
        for i, a in enumerate(args):
            if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer):
                z = self._to_zero(a)
                for s in args:
                    rebind_scheduler(s, a, z)
                out[i] = z
                self.zero_optimizer = z
        if device_placement is None:
            # the model is placed above; the optimizer's state already lives with the params
            device_placement = [not isinstance(a, (torch.nn.Module, torch.optim.Optimizer))
                                and self.device_placement for a in out]
        return super().prepare(*out, device_placement=device_placement)

    def prepare_model(self, model: torch.nn.Module, device_placement=None,
                      evaluation_mode: bool = False):
        """Autocast and compile as accelerate's, never the DDP wrapper.

        Args:
            model: the model.
            device_placement: ignored (`prepare` placed the model).
            evaluation_mode: ignored (always prepared as for evaluation: no DDP).
        """
        # evaluation_mode=True: autocast and compile only, no DDP wrapper (ZeroAdamW reduces)
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    # ---- the loop ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss / gradient_accumulation_steps, through ZeroAdamW's loss scale.

        Args:
            loss: the micro-batch's 0-d loss.
            **kwargs: passed to `torch.Tensor.backward`.
        """
        if self.zero_optimizer is None:
            return super().backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)
        self.zero_optimizer.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def no_sync(self, model=None):
        """ZeroAdamW's `no_sync()`: backward passes inside do not communicate.

        Args:
            model: accepted as accelerate's (ZeroAdamW covers its one model).
        """
        if self.zero_optimizer is None:
            return super().no_sync(model) if model is not None else contextlib.nullcontext()
        return self.zero_optimizer.no_sync()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The global norm (before clipping) over every rank's shard, as accelerate's; clips
        the coming step. `parameters` must be the model's (ZeroAdamW clips all it holds).

        Args:
            parameters: the model's parameters.
            max_norm: the largest norm (inf: return the norm, clip nothing).
            norm_type: 2 (default), any p > 0, or inf.

        Returns:
            The global norm, a 0-d device tensor.
        """
        if self.zero_optimizer is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if max_norm == float("inf"):  # Trainer asks for the norm only
            self.zero_optimizer._check_ready()
            self.zero_optimizer._prepare()
            return self.zero_optimizer.grad_norm.clone()
        return self.zero_optimizer.clip_grad_norm_(float(max_norm), norm_type)

    def unscale_gradients(self, optimizer=None):
        """Nothing to do: ZeroAdamW unscales inside its step.

        Args:
            optimizer: accepted as accelerate's.
        """
        if self.zero_optimizer is None:
            return super().unscale_gradients(optimizer)
        # nothing to do: ZeroAdamW unscales inside its step

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last fp16 step was skipped for an inf/NaN gradient (a host read)."""
        z = self.zero_optimizer
        if z is None:
            return super().optimizer_step_was_skipped
        return z.precision == "fp16" and bool(z.step_skipped)

    def get_state_dict(self, model, unwrap: bool = True):
        """Full state dict (collective at stage 3: every rank must call).

        Args:
            model: the prepared model.
            unwrap: as accelerate's.

        Returns:
            {name: tensor}, full (gathered at stage 3), on every rank.
        """
        z = self.zero_optimizer
        if z is None or z.stage != 3:
            return super().get_state_dict(model, unwrap=unwrap)
        with z.gathered_params():
            return {k: v.detach().clone() for k, v in
                    self.unwrap_model(model).state_dict().items()}

    # ---- save_state / load_state --------------------------------------------------------------
    # [Note: Accelerate state through zerokern.checkpoint] (issue 21, item 6)
    # accelerate's own save_state writes optimizer.state_dict() from the main process only:
    # with ZeroAdamW that is rank 0's shard, so the other ranks' masters and moments were lost,
    # and load_state then raised on the ranks whose shard did not match while rank 0 trained
    # on into a collective (a hang); at stage 3 it read model.state_dict() outside
    # gathered_params. Here the model and ZeroAdamW go through zerokern.checkpoint (collective:
    # every rank writes its shard; load reshards to any world size and stage, all-or-nothing,
    # checked on every rank before anything changes) and accelerate saves everything else.
    # The model also stays in accelerate's save (model.safetensors, for whoever reads the
    # folder: 2-4 bytes/param more on disk, and a gather at stage 3); on load the zerokern
    # checkpoint is the one source of params, masters and moments.
    @contextlib.contextmanager
    def _zero_hidden(self, hide_model: bool):
        z = self.zero_optimizer
        models, opts = self._models, self._optimizers
        if hide_model:
            self._models = [m for m in models if self.unwrap_model(m) is not self._zero_model]
        self._optimizers = [o for o in opts if getattr(o, "optimizer", o) is not z]
        try:
            yield
        finally:
            self._models, self._optimizers = models, opts

    def save_state(self, output_dir=None, safe_serialization: bool = True, **kwargs):
        """accelerate's save_state, with the model and ZeroAdamW saved by zerokern.checkpoint
        into `<output_dir>/zerokern` (collective: every rank must call).

        Args:
            output_dir: as accelerate's (None: its automatic checkpoint naming).
            safe_serialization: as accelerate's (the files it writes itself).
            **kwargs: passed to accelerate's save_state.

        Returns:
            The folder written, as accelerate's save_state returns it.
        """
        z = self.zero_optimizer
        if z is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization,
                                      **kwargs)
        with self._zero_hidden(hide_model=False):
            location = super().save_state(output_dir, safe_serialization=safe_serialization,
                                          **kwargs)
        zk_checkpoint.save(os.path.join(location, _ZERO_DIR), self._zero_model, z)
        return location

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        """accelerate's load_state, with the model and ZeroAdamW restored from the zerokern
        checkpoint (any world size and stage; collective). The zerokern checkpoint is loaded
        first: if it is missing or does not fit, every rank raises and nothing has changed.

        Args:
            input_dir: as accelerate's (None: its latest automatic checkpoint).
            load_kwargs: as accelerate's.
            **kwargs: passed to accelerate's load_state.

        Returns:
            What accelerate's load_state returns.

        Raises:
            ValueError: input_dir has no zerokern checkpoint (not written by
                ZeroAccelerator.save_state).
        """
        z = self.zero_optimizer
        if z is None:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        input_dir = self._state_dir(input_dir)
        path = os.path.join(input_dir, _ZERO_DIR)
        if not os.path.isdir(path):
            raise ValueError(
                f"ZeroAccelerator.load_state: input_dir={input_dir!r} has no zerokern "
                f"checkpoint ({_ZERO_DIR}/): it was not written by ZeroAccelerator.save_state "
                "(accelerate's own save_state keeps only rank 0's optimizer shard)")
        zk_checkpoint.load(path, self._zero_model, z)
        with self._zero_hidden(hide_model=True):
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)

    def _state_dir(self, input_dir) -> str:
        """The folder accelerate's load_state would read (its automatic naming included)."""
        if input_dir is not None:
            input_dir = os.path.expanduser(str(input_dir))
            if not os.path.isdir(input_dir):
                raise ValueError(f"Tried to find {input_dir} but folder does not exist")
            return input_dir
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = sorted(os.listdir(root),
                         key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))
        return os.path.join(root, folders[-1])
