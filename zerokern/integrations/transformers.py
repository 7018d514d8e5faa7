"""transformers.Trainer with ZeroAdamW: `ZeroTrainer` (two changed lines in a Trainer script).

    from zerokern.integrations.transformers import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=training_args, train_dataset=ds,
                          zero_stage=3)                   # was: Trainer(model=..., ...)
    trainer.train(resume_from_checkpoint=...)
    trainer.save_model(out)                               # from_pretrained(out) loads it

How it hooks in (public Trainer extension points only):
- `create_accelerator_and_postprocess`: Trainer's own Accelerator becomes a
  `zerokern.integrations.accelerate.ZeroAccelerator`, so `prepare` replaces Trainer's AdamW
  (built as usual from TrainingArguments: lr, weight decay with Trainer's no-decay groups,
  betas, eps) by a ZeroAdamW with the same groups, does not wrap the model in DDP nor move it
  after the optimizer exists, routes `accelerator.backward` / `no_sync` (gradient accumulation)
  / `clip_grad_norm_` (`max_grad_norm`, and the logged `grad_norm` is the real global norm)
  through ZeroAdamW; bf16/fp16 become ZeroAdamW's precision.
- `save_model`: at stage 3 the full params are gathered on every rank (collective), then
  saved as usual, so `from_pretrained` loads them.
- `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`: a zerokern checkpoint
  (`<checkpoint>/zerokern/`) instead of one rank's `optimizer.pt`, so
  `resume_from_checkpoint` works at any world size and stage.
TrainingArguments.optim: the names in OPTIM_NAMES are replaced (AdamW -> ZeroAdamW, 8-bit
AdamW -> ZeroAdamW(state_bits=8), 32-bit Lion -> ZeroLion, with Trainer's own hyperparameters
and groups); any other name is a ValueError naming it at construction, before anything is
built.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
from transformers import Trainer

from .. import checkpoint as zk_checkpoint
from .accelerate import ZeroAccelerator

# Trainer builds these (torch AdamW; bitsandbytes' AdamW, 8-bit -> ZeroAdamW(state_bits=8), and
# 32-bit Lion) and ZeroAccelerator.prepare
# converts them (zerokern.engine.convert.zero_from_torch).
OPTIM_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "adamw_bnb_8bit",
               "paged_adamw_8bit", "paged_adamw_32bit", "lion_32bit", "paged_lion_32bit")
_ZERO_DIR = "zerokern"
_SCHEDULER = "scheduler.pt"


class ZeroTrainer(Trainer):
    """`transformers.Trainer` training with ZeroAdamW at `zero_stage` (0-3).

    Args:
        zero_stage: the ZeRO stage.
        zero_options: further ZeroAdamW keyword arguments (bucket_mb, offload, units, ...).
        activation_checkpointing: ZeroAdamW's activation_checkpointing (None, "full",
            "selective", "offload") on the model's units (its decoder layers), in place of
            TrainingArguments.gradient_checkpointing (both at once is a ValueError).
        *args: as `transformers.Trainer`.
        **kwargs: as `transformers.Trainer` (TrainingArguments' bf16/fp16 become ZeroAdamW's
            precision, max_grad_norm its global clipping).

    Raises:
        ValueError: --deepspeed / --fsdp enabled too, or TrainingArguments.optim other than
            AdamW (adamw_torch, adamw_torch_fused).
    """

    def __init__(self, *args, zero_stage: int = 2, zero_options: Optional[Dict[str, Any]] = None,
                 activation_checkpointing: Optional[str] = None, **kwargs) -> None:
        from ..stage3.activation_policy import check_mode

        self.zero_stage = zero_stage
        self.zero_options = dict(zero_options or {})
        mode = check_mode(activation_checkpointing)  # ValueError before anything is built
        if mode is not None:
            self.zero_options["activation_checkpointing"] = mode
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ZeroTrainer replaces DeepSpeed/FSDP: remove --deepspeed/--fsdp")
        if self.zero_options.get("activation_checkpointing") and \
                self.args.gradient_checkpointing:
            raise ValueError("ZeroTrainer: activation_checkpointing and TrainingArguments."
                             "gradient_checkpointing both checkpoint the layers; use one")
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if self.optimizer is None and optim not in OPTIM_NAMES:
            raise ValueError(f"ZeroTrainer: TrainingArguments.optim={optim!r} has no zerokern "
                             f"optimizer; use one of {sorted(OPTIM_NAMES)}")

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's hook: its Accelerator becomes a ZeroAccelerator."""
        super().create_accelerator_and_postprocess()
        ZeroAccelerator.adopt(self.accelerator, self.zero_stage, self.zero_options)

    @property
    def zero_optimizer(self):
        """The ZeroAdamW, once training has built it (None before)."""
        return self.accelerator.zero_optimizer

    # ---- saving ---------------------------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """As Trainer's; at stage 3 collective (every rank gathers the full params), so
        `from_pretrained(output_dir)` loads them.

        Args:
            output_dir: default TrainingArguments.output_dir.
            _internal_call: Trainer's.
        """
        z = self.zero_optimizer
        if z is None or z.stage != 3:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state_dict = self.accelerator.get_state_dict(self.model)  # collective
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        z = self.zero_optimizer
        if z is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        zk_checkpoint.save(os.path.join(output_dir, _ZERO_DIR), self.model, z)  # collective
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        z = self.zero_optimizer
        if checkpoint is None or z is None or \
                not os.path.isdir(os.path.join(checkpoint, _ZERO_DIR)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        # masters, moments and params, resharded to this world size and stage (collective)
        zk_checkpoint.load(os.path.join(checkpoint, _ZERO_DIR), self.model, z)
        path = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
