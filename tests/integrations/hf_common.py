"""The Trainer / Accelerate scripts the integration tests run, each twice: as written (torch
AdamW, DDP at N = 2) and with the one-line zerokern change. Tiny random-init GPT-2, no
downloads."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from tests.engine import common as C

STEPS, GAS, BATCH, LR, CLIP = 10, 2, 2, 3e-3, 0.5


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(C.DATA_SEED)
        self.x = torch.randint(0, C.VOCAB, (n, C.SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def env(rank: int) -> None:
    """What torchrun sets; accelerate's state singletons start afresh for every script."""
    C.launcher_env(rank)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def _recording(cls):
    class Rec(cls):
        """The script's Trainer plus one instrument: every micro-batch's loss."""

        losses: List[float]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    Rec.losses = []
    return Rec


def trainer_run(rank: int, out_dir: str, zero_stage=None, precision: str = "fp32",
                steps: int = STEPS, save_steps=None, resume=None, weight_decay: float = 0.1,
                save_model_to=None, lora: bool = False) -> Dict[str, Any]:
    """A Trainer script; zero_stage=None is the plain Trainer (torch AdamW, DDP).
    lora: a PEFT LoRA model (frozen base weights; stage 3 shards them with their unit)."""
    from transformers import Trainer, TrainingArguments

    env(rank)
    if zero_stage is None:
        cls, kw = _recording(Trainer), {}
    else:
        from zerokern.integrations.transformers import ZeroTrainer

        cls, kw = _recording(ZeroTrainer), {"zero_stage": zero_stage}
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=GAS,
        max_steps=steps, learning_rate=LR, weight_decay=weight_decay, adam_beta1=0.8,
        adam_beta2=0.9, adam_epsilon=1e-6, max_grad_norm=CLIP, lr_scheduler_type="linear",
        warmup_steps=2, logging_steps=1, report_to=[], use_cpu=True, seed=7,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        bf16=precision == "bf16", fp16=precision == "fp16", disable_tqdm=True,
        dataloader_drop_last=True)
    model = C.gpt2()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"],
                                                 lora_dropout=0.0))
    trainer = cls(model=model, args=args, train_dataset=TokenData(), **kw)
    trainer.losses = []
    first = {}
    if resume is not None:
        from transformers import TrainerCallback

        class Snap(TrainerCallback):
            def on_step_begin(self, args, state, control, **k):
                if not first:
                    z = trainer.zero_optimizer
                    with z.gathered_params():
                        first.update({n: p.detach().float().clone()
                                      for n, p in model.named_parameters()})
        trainer.add_callback(Snap())
    trainer.train(resume_from_checkpoint=resume)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    z = getattr(trainer, "zero_optimizer", None)
    out = {"losses": trainer.losses, "norms": norms, "global_step": trainer.state.global_step,
           "first_params": first, "stage": None if z is None else z.stage,
           "ddp": type(trainer.model_wrapped).__name__}
    if save_model_to is not None:
        trainer.save_model(save_model_to)
        z = trainer.zero_optimizer
        with z.gathered_params():
            out["final"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return out


def accelerate_run(rank: int, zero_stage=None, precision: str = "no",
                   steps: int = STEPS) -> Dict[str, Any]:
    """An Accelerator loop; zero_stage=None is plain accelerate (DDP)."""
    from accelerate import Accelerator

    env(rank)
    kw = dict(mixed_precision=precision, gradient_accumulation_steps=GAS, cpu=True)
    if zero_stage is None:
        acc = Accelerator(**kw)
    else:
        from zerokern.integrations.accelerate import ZeroAccelerator

        acc = ZeroAccelerator(zero_stage=zero_stage, **kw)
    torch.manual_seed(7)
    model = C.gpt2()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR,
                            betas=(0.8, 0.9), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    g = torch.Generator().manual_seed(3)
    loader = torch.utils.data.DataLoader(TokenData(160), batch_size=BATCH, shuffle=True,
                                         generator=g, drop_last=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    losses, norms, it = [], [], iter(loader)
    for _ in range(steps * GAS):
        batch = next(it)
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    z = getattr(acc, "zero_optimizer", None)
    return {"losses": losses, "norms": norms, "stage": None if z is None else z.stage,
            "ddp": type(model).__name__}
