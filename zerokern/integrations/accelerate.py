"""Accelerate with ZeroAdamW: `ZeroAccelerator` is an `accelerate.Accelerator` (a one-line
change) whose `prepare` swaps the torch Adam/AdamW for a ZeroAdamW with the same param groups
and hyperparameters, and that does not wrap the model in DDP (ZeroAdamW reduces the grads).

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
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from ..engine.convert import rebind_scheduler, zero_from_torch
from ..optimizer import ZeroAdamW

_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16", None: "fp32"}


class ZeroAccelerator(Accelerator):
    """An Accelerator that trains with ZeroAdamW at `zero_stage` (0-3).

    Args:
        zero_stage: ZeRO stage of the ZeroAdamW that replaces the prepared optimizer.
        zero_options: further ZeroAdamW keyword arguments (bucket_mb, offload, units, ...).
        *args, **kwargs: as `accelerate.Accelerator`.
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
        self.zero_optimizer: Optional[ZeroAdamW] = None
        self._zero_model: Optional[torch.nn.Module] = None
        self.scaler = None  # fp16 loss scaling is ZeroAdamW's, on the device

    @classmethod
    def adopt(cls, accelerator: Accelerator, zero_stage: int = 2,
              zero_options: Optional[Dict[str, Any]] = None) -> ZeroAccelerator:
        """Turn an Accelerator another library built (e.g. Trainer's) into a ZeroAccelerator,
        keeping all of its state (same process group, plugins, gradient state)."""
        accelerator.__class__ = cls
        accelerator._zero_init(zero_stage, zero_options)
        return accelerator

    # ---- prepare ----------------------------------------------------------------------------
    def _to_zero(self, optimizer: torch.optim.Optimizer) -> ZeroAdamW:
        if isinstance(optimizer, ZeroAdamW):
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
        # evaluation_mode=True: autocast and compile only, no DDP wrapper (ZeroAdamW reduces)
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    # ---- the loop ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.zero_optimizer is None:
            return super().backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)
        self.zero_optimizer.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def no_sync(self, model=None):
        if self.zero_optimizer is None:
            return super().no_sync(model) if model is not None else contextlib.nullcontext()
        return self.zero_optimizer.no_sync()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The global norm (before clipping) over every rank's shard, as accelerate's; clips
        the coming step. `parameters` must be the model's (ZeroAdamW clips all it holds)."""
        if self.zero_optimizer is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if max_norm == float("inf"):  # Trainer asks for the norm only
            self.zero_optimizer._check_ready()
            self.zero_optimizer._prepare()
            return self.zero_optimizer.grad_norm.clone()
        return self.zero_optimizer.clip_grad_norm_(float(max_norm), norm_type)

    def unscale_gradients(self, optimizer=None):
        if self.zero_optimizer is None:
            return super().unscale_gradients(optimizer)
        # nothing to do: ZeroAdamW unscales inside its step

    @property
    def optimizer_step_was_skipped(self) -> bool:
        z = self.zero_optimizer
        if z is None:
            return super().optimizer_step_was_skipped
        return z.precision == "fp16" and bool(z.step_skipped)

    def get_state_dict(self, model, unwrap: bool = True):
        """Full state dict (collective at stage 3: every rank must call)."""
        z = self.zero_optimizer
        if z is None or z.stage != 3:
            return super().get_state_dict(model, unwrap=unwrap)
        with z.gathered_params():
            return {k: v.detach().clone() for k, v in
                    self.unwrap_model(model).state_dict().items()}
