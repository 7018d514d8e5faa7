"""Adafactor over NVMe before / after its read pass (offload_nvme.py [Note: a read pass writes
nothing]): the step's bytes and time with pass 1 declared a read pass (now) and declared writing
(before: the unchanged master written behind), alternated step by step on one optimizer (the
rule's `nvme_read_passes` is read at every step's begin()), so the disk's drift hits both alike.
One process, stage 2, fp32, a GPT preset, grads from one backward kept.

    PYTHONPATH=. python benchmarks/adafactor_nvme_read_pass.py [small|20m] [--reps 8] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("size", nargs="?", default="20m")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--dir", default=None, help="offload_path (default: a temporary dir)")
    a = ap.parse_args()
    import zerokern as zk
    from zerokern.rules.adafactor import AdafactorRule
    from zerokern.tools.gpt import PRESETS, build_gpt

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29543")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    cfg = PRESETS[a.size]
    model = build_gpt(a.size, seed=0)
    opt = zk.ZeroAdafactor(model, stage=2, precision="fp32", offload="nvme",
                           offload_path=a.dir or tempfile.mkdtemp(prefix="zk_ada_nvme_"))
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq + 1))
    logits = model(idx[:, :-1])
    opt.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   idx[:, 1:].reshape(-1)))
    declared = AdafactorRule.nvme_read_passes
    variants = {"read pass (now)": declared, "both passes write (before)": ()}
    out = {k: {"ms": [], "bytes": []} for k in variants}
    off = opt.offloader
    try:
        for rep in range(a.reps + 1):
            for name in (list(variants) if rep % 2 else list(variants)[::-1]):
                AdafactorRule.nvme_read_passes = variants[name]
                b0, t0 = off.bytes_moved, time.perf_counter()
                opt.step()
                dt, nb = time.perf_counter() - t0, off.bytes_moved - b0
                if rep:  # the first round warms up
                    out[name]["ms"].append(dt * 1e3)
                    out[name]["bytes"].append(nb)
    finally:
        AdafactorRule.nvme_read_passes = declared
    n = sum(p.numel() for p in model.parameters())
    res = {"size": a.size, "params": n, "reps": a.reps, "direct": off.direct,
           "variants": {k: {"median_ms": statistics.median(v["ms"]), "ms": v["ms"],
                            "bytes_per_step": v["bytes"][0],
                            "bytes_per_param": v["bytes"][0] / n} for k, v in out.items()}}
    print(json.dumps(res, indent=1))
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
