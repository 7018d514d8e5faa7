"""Checkpoints: save at one world size and stage, resume at another, export to safetensors.

    # 1. train on 2 ranks at stage 2, save (collective: every rank writes its shard)
    torchrun --nproc-per-node 2 examples/checkpoint_reshard.py --stage 2 --save ckpt/a
    # 2. resume on 1 rank at stage 3: zerokern reshards at load, no conversion step
    python examples/checkpoint_reshard.py --stage 3 --resume ckpt/a --save ckpt/b
    # 3. one full state dict for inference or the Hub, without any GPU or process group
    zerokern consolidate ckpt/b model.safetensors --dtype bf16
    python examples/checkpoint_reshard.py --check model.safetensors

A checkpoint is a directory (meta.json, one fp32 file per rank with that rank's master, m and v,
extra.bin for buffers), written under a temporary name and swapped in atomically, checksummed
per 1 MiB block. A load at another world size, stage or precision reads only the byte ranges
each rank needs. Another model's checkpoint, a missing rank file or a bad checksum raise a
CheckpointError naming the file or the param, on every rank, before anything changes.
"""

import argparse
import os

import torch
import torch.distributed as dist

import zerokern as zk
from zerokern.tools.gpt import build_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save", help="checkpoint directory to write after training")
    ap.add_argument("--resume", help="checkpoint directory to load before training")
    ap.add_argument("--check", help="a consolidated .safetensors/.pt file: load it into a fresh "
                                    "model with strict=True and print its loss")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        zk.init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    # one GPU per rank (LOCAL_RANK), the CPU without CUDA: the model and the batches go there
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")

    model = build_gpt("tiny", seed=0).to(device)
    cfg = model.config
    start = torch.randint(0, cfg.vocab, (4, 8, 1), generator=torch.Generator().manual_seed(rank))
    data = ((start + torch.arange(cfg.seq + 1)) % cfg.vocab).to(device)  # counting sequences

    if args.check:   # a consolidated file is a plain state dict: no zerokern needed to use it
        if args.check.endswith(".safetensors"):
            from safetensors.torch import load_file
            sd = load_file(args.check)
        else:
            sd = torch.load(args.check)
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
        with torch.no_grad():
            loss = model.loss(data[0][:, :-1], data[0][:, 1:])
        print(f"step 0 loss {loss.item():.4f} (the consolidated weights, {len(sd)} tensors)")
        return

    opt = zk.ZeroAdamW(model, lr=3e-3, stage=args.stage, precision="fp32")
    first = 0
    if args.resume:
        # Collective. Restores params, fp32 masters, m, v, step counters and the loss scale,
        # resharded for this world size and stage.
        info = zk.checkpoint.load(args.resume, model, opt)
        first = info["step"]
        if rank == 0:
            print(f"resumed {info['path']}: saved at world size {info['world_size']}, stage "
                  f"{info['stage']}, step {first}", flush=True)
    for step in range(first, first + args.steps):
        lr_scale = min(1.0, (step + 1) / 5)       # warm-up, from the restored step count
        for group in opt.param_groups:
            group["lr"] = 3e-3 * lr_scale
        tokens = data[step % len(data)]
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if args.save:
        path = zk.checkpoint.save(args.save, model, opt)   # collective
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if rank == 0:
            print(f"saved {path} (world size {world_size}, stage {args.stage})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
