"""CPU time of zero_grad(), forward+backward and the whole iteration at world size 1 (20m GPT,
fp32, one thread): PYTHONPATH=<checkout> python benchmarks/zero_grad_cpu_time.py [stages...].
Prints one JSON line of medians over 6 iterations after 2 warm-up ones (issue 20: the per-step
memset of the stage 0-1 grad buffer)."""
import json
import sys
import time

import torch

torch.set_num_threads(1)
import zerokern as zk
from zerokern.gpt import build_gpt

out = {}
STAGES = [int(x) for x in sys.argv[1:]] or [0, 1]
for stage in STAGES:
    torch.manual_seed(0)
    m = build_gpt("20m"); opt = zk.ZeroAdamW(m, stage=stage, precision="fp32", lr=1e-4)
    x = torch.randint(0, m.config.vocab, (2, 33))
    zg, bw, it = [], [], []
    for r in range(8):
        c0 = time.process_time(); loss = m.loss(x[:, :-1], x[:, 1:]); loss.backward(); c1 = time.process_time()
        opt.step(); c2 = time.process_time(); opt.zero_grad(); c3 = time.process_time()
        if r >= 2:
            zg.append((c3 - c2) * 1e3); bw.append((c1 - c0) * 1e3); it.append((c3 - c0) * 1e3)
    med = lambda v: sorted(v)[len(v) // 2]
    out[f"s{stage}"] = {"zero_grad_cpu_ms": med(zg), "fwd_bwd_cpu_ms": med(bw), "iter_cpu_ms": med(it), "raw_zero_grad": zg}
print(json.dumps(out))
