"""ZeRO-Infinity on a small machine: train a GPT whose fp32 master + m + v are larger than RAM.

    python benchmarks/bench_infinity.py --path /some/dir [--model 2b] [--steps 4]

One process (world size 1), stage 2, bf16, ZeroAdamW(offload="nvme", free_grads=True): the bf16
params and the grads (and, during backward, the activations) live in RAM; master, m and v (12
bytes per param, double-buffered on disk) stream through a bounded pool of host buffers each
step. The model is built in bf16, so the fp32 copy of it never exists in RAM either.

Recorded per step: the loss on one fixed batch (it must fall), forward+backward time (compute),
step time, and inside the step the cpu kernel's time, the time the main thread waited for the
disk, and the bytes read and written; the disk's own O_DIRECT read+write bandwidth is measured
in the same run, under the same directory (the floor = bytes moved / that bandwidth). Peak
RSS comes from the kernel (VmHWM), with RAM (MemTotal) and the state's bytes on disk beside it.
Results: benchmarks/results/infinity-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import zerokern as zk
from zerokern.bench import common
from zerokern.bench.offload_nvme import disk_bandwidth
from zerokern.gpt import PRESETS, build_gpt

OUT = Path(__file__).resolve().parent / "results"


def _status_kib(field: str, path: str = "/proc/self/status") -> int:
    for line in open(path):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _gib(kib: int) -> float:
    return kib / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", required=True, help="directory for the state files (the disk)")
    p.add_argument("--model", default="2b", choices=list(PRESETS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default: min(128, "
                   "the preset's context))")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--disk-sample-gib", type=float, default=8.0,
                   help="file size for the disk's bandwidth (O_DIRECT: no page cache)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
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
    moved = 2 * 3 * sum(f.half for f in off.files)  # bytes a step reads + writes
    seq = args.seq or min(128, model.config.seq)
    if not 1 <= seq <= model.config.seq:
        raise SystemExit(f"--seq must be in [1, {model.config.seq}] for GPT {args.model}")
    args.seq = seq
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab, (args.batch, args.seq + 1), generator=g)
    rows = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.backward(loss)
        fb = time.perf_counter() - t0
        k0, w0, b0 = off.kernel_s, off.io_wait_s, off.bytes_moved
        t1 = time.perf_counter()
        opt.step()
        st = time.perf_counter() - t1
        opt.zero_grad()
        rows.append({"step": step, "loss": float(loss.detach()), "fwd_bwd_s": fb, "step_s": st,
                     "kernel_s": off.kernel_s - k0, "io_wait_s": off.io_wait_s - w0,
                     "GB_moved": (off.bytes_moved - b0) / 1e9,
                     "rss_GiB": _gib(_status_kib("VmRSS"))})
        print(rows[-1], flush=True)
    rep = opt.memory_report()
    disk = disk_bandwidth(args.path, int(args.disk_sample_gib * 2**30), off.chunk * 4, off.depth)
    opt.close()
    peak = _gib(_status_kib("VmHWM"))
    ram = _gib(_status_kib("MemTotal", "/proc/meminfo"))
    floor_s = moved / (disk["rw_GBps"] * 1e9)
    timed = rows[1:] or rows  # step 0 also pays first-touch allocations
    step_s = sorted(r["step_s"] for r in timed)[len(timed) // 2]
    env = common.environment(torch.device("cpu"))
    summary = {"model": args.model, "params": psi, "state_GB_fp32": 12 * psi / 1e9,
               "disk_bytes": rep.get("disk_measured_total"), "ram_GiB": ram,
               "peak_rss_GiB": peak, "rss_GiB": rss, "build_s": build_s,
               "bytes_per_step_GB": moved / 1e9, "disk": disk, "floor_s": floor_s,
               "median_step_s": step_s, "of_floor_pct": 100 * floor_s / step_s,
               "direct_io": off.direct, "rows": rows, "memory_report": rep,
               "batch": args.batch, "seq": args.seq, "lr": args.lr}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"infinity-{args.model}"
    common.write_json(stem.with_suffix(".json"), {"env": env, **summary})
    cols = [("step", "step"), ("loss", "loss"), ("fwd_bwd_s", "forward+backward s"),
            ("step_s", "optimizer step s"), ("kernel_s", "cpu kernel s"),
            ("io_wait_s", "waiting for disk s"), ("GB_moved", "GB read+written"),
            ("rss_GiB", "RSS GiB")]
    md = (f"# ZeRO-Infinity on {env.get('usable_cpus')} cores: GPT {args.model}, "
          f"{psi / 1e9:.2f}B params, offload='nvme'\n\n{common.markdown_env(env)}\n\n"
          f"- fp32 master + m + v: {12 * psi / 1e9:.1f} GB (RAM: {ram:.1f} GiB); on disk, "
          f"double-buffered: {(rep.get('disk_measured_total') or 0) / 2**30:.1f} GiB\n"
          f"- peak RSS (VmHWM): **{peak:.1f} GiB** of {ram:.1f} GiB RAM; RSS by phase: "
          + ", ".join(f"{k} {v:.1f}" for k, v in rss.items()) + " GiB\n"
          f"- disk (O_DIRECT, same directory, same run): read {disk['read_GBps']:.2f}, "
          f"write {disk['write_GBps']:.2f}, read+write {disk['rw_GBps']:.2f} GB/s; a step "
          f"moves {moved / 1e9:.1f} GB: floor {floor_s:.1f} s; median step {step_s:.1f} s = "
          f"{100 * floor_s / step_s:.0f}% of the floor\n"
          f"- optimizer built (model cast, state files written) in {build_s:.0f} s\n\n"
          f"{common.markdown_table(rows, cols)}\n")
    common.write_text(stem.with_suffix(".md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
