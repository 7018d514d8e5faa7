"""ZeRO-Infinity: optimizer state (fp32 master, m, v) and the stage-3 param shards on disk.

    python examples/zero_infinity.py --path /nvme/zk --model tiny           # seconds (CI)
    python examples/zero_infinity.py --path /nvme/zk --model 2b --steps 4   # 2.13B params:
        # 25.6 GB of optimizer state, more than a 24 GiB machine's RAM; ~47 GiB on disk
    torchrun --nproc-per-node 8 examples/zero_infinity.py --path /nvme/zk --model 2b

`offload="nvme"` keeps master/m/v in files under `offload_path` (two halves each: a step reads
one, writes the other, and flips only when every rank's writes landed) and streams them through
a bounded pool of host buffers around the C++ Adam kernel. `offload_params="nvme"` (stage 3)
keeps each unit's 16-bit param shard in a file too, fetched with the unit's all-gather and
released after: between steps the device holds no param bytes. Check the disk before you start:
`zerokern estimate --model 2b --stage 3 --offload nvme --offload-params nvme` prints the bytes
per rank on the device, the host and the disk; the optimizer refuses (ValueError naming the
path) a directory without that much free space, before the model is touched.
"""

import argparse
import os

import torch
import torch.distributed as dist

import zerokern as zk
from zerokern.tools.gpt import build_gpt


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True, help="a directory on a fast local disk (NVMe)")
    ap.add_argument("--model", default="tiny", help="zerokern.tools.gpt preset: tiny ... 2b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        zk.init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    # one GPU per rank (LOCAL_RANK), the CPU without CUDA: the model and the batches go there
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    os.makedirs(args.path, exist_ok=True)

    # Build the model in bf16: a 2B model's fp32 weights (8.5 GB) never exist in RAM.
    torch.set_default_dtype(torch.bfloat16)
    model = build_gpt(args.model, seed=0).to(device)
    torch.set_default_dtype(torch.float32)

    opt = zk.ZeroAdamW(model, lr=args.lr, stage=3, precision="bf16",
                       offload="nvme", offload_path=args.path,   # master, m, v on disk
                       offload_params="nvme",                    # param shards on disk
                       free_grads=True)                          # no grad memory between steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    cfg = model.config
    g = torch.Generator().manual_seed(rank)
    start = torch.randint(0, cfg.vocab, (4, args.batch, 1), generator=g)
    data = ((start + torch.arange(cfg.seq + 1)) % cfg.vocab).to(device)  # counting sequences
    try:
        for step in range(args.steps):
            tokens = data[step % len(data)]
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            opt.backward(loss)
            opt.step()        # reads master/m/v (and the param shard) from disk, writes them back
            opt.zero_grad()
            sched.step()
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            r = opt.memory_report()   # what this rank holds, measured; = zerokern estimate
            print(f"rank 0 holds between steps: device {mib(r['measured_total'])}, "
                  f"host {mib(r['host_measured_total'])}, disk {mib(r['disk_measured_total'])}")
    finally:
        opt.close()   # removes this rank's state and param files
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
