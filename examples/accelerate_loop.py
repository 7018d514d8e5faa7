"""An Accelerate training loop on zerokern: `ZeroAccelerator` for `Accelerator`, nothing else.

    python examples/accelerate_loop.py --zero-stage 2
    torchrun --nproc-per-node 2 examples/accelerate_loop.py --zero-stage 3   # or accelerate launch

`prepare` swaps the torch AdamW for a ZeroAdamW with the same groups and hyperparameters (the
scheduler follows it) and does not wrap the model in DDP; `backward`, `accumulate`,
`clip_grad_norm_` (the global norm over every shard) go through it.
"""

import argparse

import torch
import torch.nn.functional as F

# was: from accelerate import Accelerator
from zerokern.integrations.accelerate import ZeroAccelerator
from zerokern.tools.gpt import build_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    args = ap.parse_args()

    accelerator = ZeroAccelerator(zero_stage=args.zero_stage,            # was: Accelerator(
                                  mixed_precision=args.mixed_precision,
                                  gradient_accumulation_steps=2,
                                  cpu=not torch.cuda.is_available())
    model = build_gpt("tiny", seed=0)
    cfg = model.config
    decay = [p for p in model.parameters() if p.dim() >= 2]    # no decay for biases and norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))

    # Counting sequences (x, x+1, ... mod vocab); the prepared loader shards them over ranks.
    g = torch.Generator().manual_seed(0)
    tokens = (torch.randint(0, cfg.vocab, (64, 1), generator=g)
              + torch.arange(cfg.seq + 1)) % cfg.vocab
    loader = torch.utils.data.DataLoader(tokens, batch_size=8, shuffle=True, drop_last=True,
                                         generator=g)

    # prepare puts the model on accelerator.device (the rank's GPU; the CPU with cpu=True)
    # before it builds the ZeroAdamW, and the prepared loader moves every batch there.
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step, micro = 0, 0
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):       # no_sync() on the first micro-batch
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
                accelerator.backward(loss)             # / accumulation steps, loss-scaled
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()                       # steps at the accumulation boundary
                scheduler.step()
                optimizer.zero_grad()
            micro += 1
            if accelerator.sync_gradients:
                step += 1
                if accelerator.is_main_process:
                    print(f"step {step} loss {loss.item():.4f} grad_norm {float(norm):.3f}",
                          flush=True)
                if step == args.steps:
                    break
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)   # full weights (gathered at stage 3)
    if accelerator.is_main_process:
        print(f"full state dict: {len(state)} tensors")


if __name__ == "__main__":
    main()
