"""CPU time of zero_grad(), forward+backward and the whole iteration at world size 1 (20m GPT,
fp32, one thread): `PYTHONPATH=<checkout> python benchmarks/zero_grad_cpu_time.py [stages...]`.
Prints one JSON line of medians over 6 iterations after 2 warm-up ones (issue 20: the per-step
memset of the stage 0-1 grad buffer; results in
benchmarks/results/step-20m-n2-fp32-issue20-grads-cpu-time.md)."""

import json
import sys
import time

import torch


def _median(v):
    return sorted(v)[len(v) // 2]


def measure(stage: int, iters: int = 8, warmup: int = 2) -> dict:
    import zerokern as zk
    from zerokern.tools.gpt import build_gpt

    torch.manual_seed(0)
    m = build_gpt("20m")
    opt = zk.ZeroAdamW(m, stage=stage, precision="fp32", lr=1e-4)
    x = torch.randint(0, m.config.vocab, (2, 33))
    zg, bw, it = [], [], []
    for r in range(iters):
        c0 = time.process_time()
        m.loss(x[:, :-1], x[:, 1:]).backward()
        c1 = time.process_time()
        opt.step()
        c2 = time.process_time()
        opt.zero_grad()
        c3 = time.process_time()
        if r >= warmup:
            zg.append((c3 - c2) * 1e3)
            bw.append((c1 - c0) * 1e3)
            it.append((c3 - c0) * 1e3)
    return {"zero_grad_cpu_ms": _median(zg), "fwd_bwd_cpu_ms": _median(bw),
            "iter_cpu_ms": _median(it), "raw_zero_grad": zg}


if __name__ == "__main__":
    torch.set_num_threads(1)
    stages = [int(s) for s in sys.argv[1:]] or [0, 1]
    print(json.dumps({f"s{s}": measure(s) for s in stages}))
