"""A DeepSpeed training script moved to zerokern: `import zerokern` for `import deepspeed`,
the same JSON config, the same engine loop, the same launcher.

    torchrun --nproc-per-node 2 examples/deepspeed_config.py \
        --config examples/configs/zero2_fp16.json
    torchrun --nproc-per-node 2 examples/deepspeed_config.py \
        --config examples/configs/zero3_offload_cpu.json --micro-batch 8

The two configs are the seeds' (the ZeRO-2 fp16 `zero_2.json` and the ZeRO-3 config with
`offload_optimizer` and `offload_param` on the CPU). The second has no optimizer and no batch
size: like the seed's script it passes a torch AdamW (zerokern converts it to ZeroAdamW with
the same groups), and `--micro-batch` adds `train_micro_batch_size_per_gpu`, which DeepSpeed
requires as well. A key zerokern cannot honour raises a ValueError naming it, before the model
is touched (see docs/guides/deepspeed.md for the key table).
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

import zerokern  # was: import deepspeed
from zerokern.tools.gpt import build_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a DeepSpeed JSON config")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="train_micro_batch_size_per_gpu, for a config without a batch size")
    ap.add_argument("--lr", type=float, default=None, help="override the config's optimizer lr")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps")
    args = ap.parse_args()

    with open(args.config) as f:
        config = json.load(f)
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu")
    if args.micro_batch is not None and not any(k in config for k in batch_keys):
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.lr is not None and "optimizer" in config:
        config["optimizer"].setdefault("params", {})["lr"] = args.lr

    # One GPU per rank (LOCAL_RANK), the CPU without CUDA. The model goes there before
    # initialize builds the optimizer on its params; the batches follow engine.device below.
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    model = build_gpt(args.model, seed=0).to(device)
    client_optimizer = client_scheduler = None
    if "optimizer" not in config:   # the seed-002 shape: the script brings its optimizer
        client_optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-3)
        # A callable(optimizer) -> scheduler, as DeepSpeed takes: it gets the ZeroAdamW.
        client_scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
            opt, lambda s: min(1.0, (s + 1) / 5))   # 5 warm-up steps

    # was: deepspeed.initialize(...). Starts the process group from torchrun's variables.
    engine, optimizer, _, _ = zerokern.initialize(
        model=model, model_parameters=model.parameters(), optimizer=client_optimizer,
        lr_scheduler=client_scheduler, config=config)

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cfg = model.config
    micro = engine.train_micro_batch_size_per_gpu()
    # Counting sequences (x, x+1, x+2, ... mod vocab), 4 micro-batches per rank, cycled.
    g = torch.Generator().manual_seed(rank)
    start = torch.randint(0, cfg.vocab, (4, micro, 1), generator=g)
    data = (start + torch.arange(cfg.seq + 1)) % cfg.vocab

    i = 0
    for step in range(args.steps):
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = data[i % len(data)].to(engine.device)
            i += 1
            logits = engine(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            engine.backward(loss)   # x loss scale x 1/gradient_accumulation_steps
            engine.step()           # the optimizer steps at the accumulation boundary
            losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {sum(losses) / len(losses):.4f} "
                  f"(loss scale {engine.loss_scale:g})", flush=True)


if __name__ == "__main__":
    main()
