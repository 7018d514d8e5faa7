"""Step time of 8-bit AdamW and ZeroMuon with their state on the device, in host memory
(offload="cpu") and in files (offload="nvme"): one process, stage 2, bf16, a GPT preset.
Every optimizer lives on its own model copy with the same grads (one backward, kept), and
step() alone is timed round-robin over the six, so machine noise hits all alike.

    PYTHONPATH=. python benchmarks/nvme_rules_step_time.py [small|20m] [--reps 5] [--dir D]

Results: benchmarks/results/nvme-rules-step.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("size", nargs="?", default="small")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="offload_path (default: a temporary dir)")
    a = ap.parse_args()
    import zerokern as zk
    from zerokern.tools.gpt import PRESETS, build_gpt

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    path = a.dir or tempfile.mkdtemp(prefix="zk_nvme_bench_")
    cfgs = [(k, o) for k in ("8bit", "muon") for o in (None, "cpu", "nvme")]
    torch.manual_seed(0)
    cfg = PRESETS[a.size]
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq + 1))
    built = {}
    for kind, off in cfgs:
        m = build_gpt(a.size)
        kw = dict(stage=2, precision="bf16", offload=off, backend="cpu",
                  offload_path=path if off == "nvme" else None)
        opt = zk.ZeroAdamW(m, lr=1e-4, state_bits=8, **kw) if kind == "8bit" else \
            zk.ZeroMuon(m, lr=0.02, **kw)
        opt.backward(m.loss(idx[:, :-1], idx[:, 1:]))  # grads kept: step() alone is timed
        built[(kind, off)] = opt
    times = {c: [] for c in cfgs}
    for _ in range(a.reps + 1):
        for c in cfgs:
            t0 = time.perf_counter()
            built[c].step()
            times[c].append(time.perf_counter() - t0)
    n = sum(p.numel() for p in build_gpt(a.size).parameters())
    print(f"| {a.size} ({n / 1e6:.1f}M params) | median ms [min-max], {a.reps} steps after 1 |")
    print("|---|---|")
    for c in cfgs:
        t = sorted(x * 1e3 for x in times[c][1:])
        print(f"| {c[0]} offload={c[1]} | {statistics.median(t):.0f} [{t[0]:.0f}-{t[-1]:.0f}] |")
    for opt in built.values():
        opt.close()


if __name__ == "__main__":
    main()
