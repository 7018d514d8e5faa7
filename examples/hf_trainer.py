"""Fine-tuning with the Hugging Face Trainer on zerokern: `ZeroTrainer` for `Trainer`, plus
`zero_stage=`. Everything else is an ordinary Trainer script.

    python examples/hf_trainer.py --zero-stage 2
    torchrun --nproc-per-node 2 examples/hf_trainer.py --zero-stage 3 --bf16
    torchrun --nproc-per-node 2 examples/hf_trainer.py --zero-stage 3 --lora   # PEFT LoRA

The model is a tiny, randomly initialised GPT-2 (no download); replace `make_model()` with
`AutoModelForCausalLM.from_pretrained(...)` for a real fine-tune. Trainer builds its AdamW from
TrainingArguments as usual (lr, weight decay with its no-decay groups, betas, eps); ZeroTrainer
swaps it for a ZeroAdamW with the same groups, and does not wrap the model in DDP.
With --lora the base weights are frozen (PEFT); at stage 3 they are sharded with their unit
(1/N of them per rank) and get no gradient and no optimizer state.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from zerokern.integrations.transformers import ZeroTrainer  # was: from transformers import Trainer

VOCAB, SEQ = 128, 32


class Counting(torch.utils.data.Dataset):
    """Counting sequences (x, x+1, ... mod VOCAB): a causal LM learns them in a few steps."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.x = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}   # the model shifts the labels


def make_model(lora: bool):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ))
    if lora:
        from peft import LoraConfig, get_peft_model

        # Only the LoRA adapters train; the GPT-2 weights are frozen.
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                                 lora_dropout=0.0))
    return model


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.4f} "
                  f"grad_norm {logs.get('grad_norm', float('nan')):.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--lora", action="store_true", help="PEFT LoRA adapters, base frozen")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=None, help="default 3e-3 (LoRA: 1e-2)")
    ap.add_argument("--out", default="runs/hf_trainer", help="output directory (every rank)")
    args = ap.parse_args()

    out = args.out
    training_args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=args.lr or (1e-2 if args.lora else 3e-3),
        weight_decay=0.1, warmup_steps=3, max_grad_norm=1.0, logging_steps=1,
        bf16=args.bf16, use_cpu=not torch.cuda.is_available(), report_to=[],
        save_strategy="no", disable_tqdm=True, dataloader_drop_last=True)
    # Trainer puts the model on args.device (the rank's GPU, LOCAL_RANK; the CPU with use_cpu)
    # before ZeroTrainer builds the optimizer, and moves every batch there.
    trainer = ZeroTrainer(model=make_model(args.lora), args=training_args,  # was: Trainer(...)
                          train_dataset=Counting(), callbacks=[PrintLoss()],
                          zero_stage=args.zero_stage)
    trainer.train()
    # Collective: at stage 3 every rank gathers the full weights, rank 0 writes them;
    # from_pretrained(out) (or PeftModel.from_pretrained for LoRA) loads them.
    trainer.save_model(out)
    if trainer.is_world_process_zero():
        print(f"saved to {out}")


if __name__ == "__main__":
    main()
