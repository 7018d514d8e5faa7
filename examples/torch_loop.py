"""A plain PyTorch training loop with zerokern.ZeroAdamW in place of torch.optim.AdamW.

    python examples/torch_loop.py --stage 2                      # one process (world size 1)
    torchrun --nproc-per-node 2 examples/torch_loop.py --stage 3  # one rank per GPU, or gloo on CPU

Everything zerokern needs is the optimizer line: no DistributedDataParallel wrapper (ZeroAdamW
reduces the gradients itself), the same loss / backward / step / zero_grad loop.
"""

import argparse
import os

import torch
import torch.distributed as dist

import zerokern as zk
from zerokern.tools.gpt import build_gpt


def batch(step: int, rank: int, size: int, seq: int, vocab: int, device):
    """Counting sequences (x, x+1, x+2, ... mod vocab): learnable in a few steps. Each rank
    draws its own data, as a DistributedSampler would give it."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--model", default="tiny",
                    help="zerokern.tools.gpt preset: tiny, small, 20m, 100m")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    # torchrun (or the deepspeed launcher, or mpirun) sets RANK / WORLD_SIZE; start the group
    # from them: NCCL with one GPU per rank, gloo on CPUs. A plain `python` run is world size 1.
    if "WORLD_SIZE" in os.environ:
        zk.init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    # One GPU per rank (torchrun's LOCAL_RANK), the CPU without CUDA. The model and every batch
    # go there: the optimizer is built on the params where they are (NCCL takes CUDA tensors).
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")

    model = build_gpt(args.model, seed=0).to(device)  # the same initial weights on every rank
    # The one changed line (was: torch.optim.AdamW(model.parameters(), lr=..., ...)).
    # Stage 3 needs the model itself (it shards the params per nn.ModuleList child); stages 0-2
    # also take model.parameters(). precision casts the model's params in place; the fp32
    # master weights and Adam's m and v stay fp32.
    opt = zk.ZeroAdamW(model, lr=args.lr, weight_decay=0.1, stage=args.stage,
                       precision=args.precision, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))  # warm-up

    cfg = model.config
    for step in range(args.steps):
        x, y = batch(step % 4, rank, args.batch, cfg.seq, cfg.vocab, device)  # 4 batches, cycled
        loss = model.loss(x, y)
        opt.backward(loss)   # = loss.backward(), through the loss scale with fp16
        opt.step()           # reduce-scatter / update / all-gather; no host-device sync
        opt.zero_grad()
        sched.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    if rank == 0:
        mem = opt.memory_report()["measured"]
        print(f"model states on rank 0: {sum(mem.values()) / 2**20:.2f} MiB "
              f"(stage {args.stage}, {dist.get_world_size() if dist.is_initialized() else 1} "
              f"rank(s))")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
