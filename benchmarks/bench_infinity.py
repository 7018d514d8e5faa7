"""ZeRO-Infinity on a small machine: train a GPT whose fp32 master + m + v are larger than RAM.

    python benchmarks/bench_infinity.py --path /some/dir [--model 2b] [--steps 4]

One process (world size 1), stage 2, bf16, ZeroAdamW(offload="nvme", free_grads=True): the bf16
params and the grads (and, during backward, the activations) live in RAM; master, m and v (12
bytes per param, double-buffered on disk) stream through a bounded pool of host buffers each
step. The model is built in bf16, so the fp32 copy of it never exists in RAM either.

Recorded per step: the loss on one fixed batch (it must fall), forward+backward time, step time,
and inside the step the cpu kernel's time, the time the main thread waited for the disk, and the
bytes read and written. The disk is measured with the step's own I/O (zerokern.bench.disk_probe:
the same files, requests, buffer sets, threads and O_DIRECT, no compute), interleaved with the
timed steps: probe, step, probe, ..., step, probe, after `--warmup` steps that write both halves
of every file. Reported: median and min-max of the probe's GB/s and of the step's, and the
step's GB/s as a fraction of the probe's with its range. Peak RSS comes from the kernel (VmHWM),
with RAM (MemTotal), the load average and the state's bytes on disk beside it.
Results: benchmarks/results/infinity-<model>.json and .md (or --name).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import zerokern as zk
from zerokern.bench import common
from zerokern.bench import disk_probe as dp
from zerokern.bench import infinity as report
from zerokern.tools.gpt import PRESETS, build_gpt

OUT = Path(__file__).resolve().parent / "results"


def _status_kib(field: str, path: str = "/proc/self/status") -> int:
    for line in open(path):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _gib(kib: int) -> float:
    return kib / 2**20


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", required=True, help="directory for the state files (the disk)")
    p.add_argument("--model", default="2b", choices=list(PRESETS))
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2: both "
                   "halves of every file written before the probe reads them)")
    p.add_argument("--steps", type=int, default=4, help="timed steps (probes: steps + 1)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default: min(128, "
                   "the preset's context))")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--name", default=None, help="result file stem (default infinity-<model>)")
    args = p.parse_args()
    if args.warmup < 2 or args.steps < 1:
        raise SystemExit("--warmup must be >= 2 and --steps >= 1")
    return args


def main() -> int:
    args = _args()
    torch.set_num_threads(common.usable_cpus())
    rss = {"start": _gib(_status_kib("VmRSS"))}
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # no fp32 copy of the model, ever
    model = build_gpt(args.model, seed=0)
    torch.set_default_dtype(torch.float32)
    psi = sum(p.numel() for p in model.parameters())
    rss["model built"] = _gib(_status_kib("VmRSS"))
    opt = zk.ZeroAdamW(model, lr=args.lr, stage=2, precision="bf16", offload="nvme",
                       offload_path=args.path, free_grads=True)
    build_s = time.perf_counter() - t0
    rss["optimizer built (state files written)"] = _gib(_status_kib("VmRSS"))
    off = opt.offloader
    pattern = dp.pattern_of(off)
    # the probe replays the defaults' pattern: refuse a step that runs another one
    dp.check_same(dp.pattern_for(pattern.numels, list(pattern.rules), direct=off.direct),
                  pattern)
    seq = args.seq or min(128, model.config.seq)
    if not 1 <= seq <= model.config.seq:
        raise SystemExit(f"--seq must be in [1, {model.config.seq}] for GPT {args.model}")
    args.seq = seq
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab, (args.batch, args.seq + 1), generator=g)
    rows = []

    def step(what: str) -> None:
        t0 = time.perf_counter()
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.backward(loss)
        fb = time.perf_counter() - t0
        k0, w0, b0 = off.kernel_s, off.io_wait_s, off.bytes_moved
        t1 = time.perf_counter()
        opt.step()
        st = time.perf_counter() - t1
        opt.zero_grad()
        moved = off.bytes_moved - b0
        rows.append({"what": what, "loss": float(loss.detach()), "fwd_bwd_s": fb, "seconds": st,
                     "kernel_s": off.kernel_s - k0, "io_wait_s": off.io_wait_s - w0,
                     "GB": moved / 1e9, "GBps": moved / st / 1e9,
                     "rss_GiB": _gib(_status_kib("VmRSS"))})
        print(rows[-1], flush=True)

    def probe() -> None:
        r = dp.replay(files, pattern)
        rows.append({"what": "disk probe", "seconds": r["seconds"], "GB": r["bytes"] / 1e9,
                     "GBps": r["GBps"], "rss_GiB": _gib(_status_kib("VmRSS"))})
        print(rows[-1], flush=True)

    for i in range(args.warmup):
        step(f"warm-up step {i}")
    load0, busy = os.getloadavg(), common.OtherLoad()
    files = dp.ProbeFiles.borrow(off)
    for i in range(args.steps):
        probe()
        step(f"step {i}")
    probe()
    env = common.environment(torch.device("cpu"))
    env["other_cpu_load_during"] = busy.fraction()
    env["loadavg_before"], env["loadavg_after"] = load0, os.getloadavg()
    rep = opt.memory_report()
    opt.close()
    s = report.summary(args, rows, pattern, psi, rep, rss, build_s,
                       _gib(_status_kib("MemTotal", "/proc/meminfo")), _gib(_status_kib("VmHWM")))
    report.write(args, env, s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
