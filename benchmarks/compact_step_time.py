"""Step-time cost of master="compact" (zerokern/compact_master.py): the 23.2M-param GPT ("20m"),
2 gloo ranks, stage 2, bf16; both optimizers alive on their own model copy and timed
interleaved (fp32 master, compact, compact, fp32, ...) so machine noise hits both alike.
Times opt.step() only (the expand / kernel / compact lives there), max over ranks per step.

    PYTHONPATH=. python benchmarks/compact_step_time.py [--steps 20] [--chunk 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _rank(rank, ws, steps, chunk_log2, stage):
    import zerokern as zk
    from zerokern.state import compact_master
    from zerokern.tools.gpt import build_gpt

    compact_master.CHUNK_NUMEL = 1 << chunk_log2
    runs = {}
    for master in ("fp32", "compact"):
        torch.manual_seed(0)
        m = build_gpt("20m")
        runs[master] = (m, zk.ZeroAdamW(m, stage=stage, precision="bf16", master=master,
                                         max_grad_norm=1.0))
    g = torch.Generator().manual_seed(rank)
    times = {k: [] for k in runs}
    order = ["fp32", "compact"]
    for s in range(steps):
        idx = torch.randint(0, 8192, (2, 129), generator=g)  # the same batch for both
        for master in (order if s % 2 == 0 else order[::-1]):
            m, opt = runs[master]
            torch.nn.functional.cross_entropy(m(idx[:, :-1]).float().flatten(0, 1),
                                              idx[:, 1:].flatten()).backward()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            opt.zero_grad()
            if s > 0:  # the first step builds things
                times[master].append(dt.item() * 1e3)
    same = all(torch.equal(p, q) for p, q in zip(runs["fp32"][0].parameters(),
                                                 runs["compact"][0].parameters()))
    return times, same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=20, help="log2 of CHUNK_NUMEL")
    ap.add_argument("--stage", type=int, default=2)
    a = ap.parse_args()
    from zerokern.tools.spawn import spawn_ranks

    times, same = spawn_ranks(_rank, 2, a.steps, a.chunk, a.stage, threads=1, timeout=900)[0]
    f, c = times["fp32"], times["compact"]
    diffs = [y - x for x, y in zip(f, c)]
    print(f"stage {a.stage}, chunk 2^{a.chunk}, {len(f)} steps each, params bitwise equal: "
          f"{same}")
    print(f"  step ms  fp32 master: median {statistics.median(f):.1f}  "
          f"compact: median {statistics.median(c):.1f}  "
          f"paired diff: median {statistics.median(diffs):+.1f} "
          f"(min {min(diffs):+.1f}, max {max(diffs):+.1f})")


if __name__ == "__main__":
    main()
