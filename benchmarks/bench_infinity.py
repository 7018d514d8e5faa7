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
Results: benchmarks/results/infinity-<model>.json and .md.
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
from zerokern.gpt import PRESETS, build_gpt

OUT = Path(__file__).resolve().parent / "results"
COLS = [("what", "what"), ("loss", "loss"), ("fwd_bwd_s", "forward+backward s"),
        ("seconds", "step or probe s"), ("kernel_s", "cpu kernel s"),
        ("io_wait_s", "waiting for disk s"), ("GB", "GB read+written"), ("GBps", "GB/s"),
        ("rss_GiB", "RSS GiB")]


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
    dp.check_same(dp.pattern_for(pattern.numels, off.rule, direct=off.direct), pattern)
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
    summary = _summary(args, rows, pattern, psi, rep, rss, build_s)
    _write(args, env, summary)
    return 0


def _summary(args, rows, pattern, psi, rep, rss, build_s) -> dict:
    steps = [r for r in rows if r["what"].startswith("step")]
    probes = [r for r in rows if r["what"] == "disk probe"]
    frac = dp.fraction([r["GBps"] for r in steps], [r["GBps"] for r in probes], pattern.direct)
    return {"model": args.model, "params": psi, "state_GB_fp32": 12 * psi / 1e9,
            "disk_bytes": rep.get("disk_measured_total"),
            "ram_GiB": _gib(_status_kib("MemTotal", "/proc/meminfo")),
            "peak_rss_GiB": _gib(_status_kib("VmHWM")), "rss_GiB": rss, "build_s": build_s,
            "bytes_per_step_GB": pattern.bytes_per_step / 1e9, "direct_io": pattern.direct,
            "pattern": {"buffers": len(pattern.numels), "files_per_buffer": len(pattern.names),
                        "request_MiB": pattern.chunk * 4 / 2**20, "buffer_sets": pattern.depth,
                        "in_flight_max": pattern.in_flight},
            "probe_GBps": dp.spread([r["GBps"] for r in probes]),
            "probe_GBps_first_last": [probes[0]["GBps"], probes[-1]["GBps"]],
            "step_s": dp.spread([r["seconds"] for r in steps]),
            "step_GBps": dp.spread([r["GBps"] for r in steps]),
            "kernel_s": dp.spread([r["kernel_s"] for r in steps]),
            "io_wait_s": dp.spread([r["io_wait_s"] for r in steps]),
            "step_of_probe": frac, "rows": rows, "memory_report": rep,
            "warmup": args.warmup, "batch": args.batch, "seq": args.seq, "lr": args.lr}


def _rng(s: dict, fmt: str = ".2f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}}, n={s['n']})"


def _write(args, env: dict, s: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"infinity-{args.model}"
    common.write_json(stem.with_suffix(".json"), {"env": env, **s})
    pat, f = s["pattern"], s["step_of_probe"]
    io = ("O_DIRECT" if s["direct_io"] else "buffered + fadvise(DONTNEED): O_DIRECT is "
          "unavailable under --path, the page cache may serve some reads")
    verdict = (f"**{f['median_pct']:.0f}%** (range {f['min_pct']:.0f}-{f['max_pct']:.0f}%)"
               if f["median_pct"] <= 100 else
               f"not a fraction of the disk's ceiling ({f['median_pct']:.0f}%)")
    md = (f"# ZeRO-Infinity on {env.get('usable_cpus')} cores: GPT {args.model}, "
          f"{s['params'] / 1e9:.2f}B params, offload='nvme'\n\n{common.markdown_env(env)}\n"
          f"- load average (1, 5, 15 min) before / after the timed part: "
          f"{', '.join(f'{v:.2f}' for v in env['loadavg_before'])} / "
          f"{', '.join(f'{v:.2f}' for v in env['loadavg_after'])}\n\n"
          f"- fp32 master + m + v: {s['state_GB_fp32']:.1f} GB (RAM: {s['ram_GiB']:.1f} GiB); "
          f"on disk, double-buffered: {(s['disk_bytes'] or 0) / 2**30:.1f} GiB\n"
          f"- peak RSS (VmHWM): **{s['peak_rss_GiB']:.1f} GiB** of {s['ram_GiB']:.1f} GiB RAM; "
          "RSS by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in s["rss_GiB"].items())
          + " GiB\n"
          f"- the step's I/O: {pat['buffers']} buffers x {pat['files_per_buffer']} files, "
          f"{pat['request_MiB']:.0f} MiB requests, {pat['buffer_sets']} buffer sets (at most "
          f"{pat['in_flight_max']} requests in flight), {io}; "
          f"{s['bytes_per_step_GB']:.1f} GB read+written per step\n"
          f"- disk probe (that I/O replayed on the step's own files, no compute), GB/s, median "
          f"(min-max): {_rng(s['probe_GBps'])}; first / last probe "
          f"{s['probe_GBps_first_last'][0]:.2f} / {s['probe_GBps_first_last'][1]:.2f}\n"
          f"- optimizer step: {_rng(s['step_s'], '.1f')} s = {_rng(s['step_GBps'])} GB/s; cpu "
          f"kernel {_rng(s['kernel_s'], '.1f')} s, waiting for the disk "
          f"{_rng(s['io_wait_s'], '.1f')} s\n"
          f"- the step's GB/s as a fraction of the probe's: {verdict}"
          + (f"; {f['note']}" if f["note"] else "") + "\n"
          f"- optimizer built (model cast, state files written) in {s['build_s']:.0f} s; "
          f"{s['warmup']} warm-up steps, then probe and step interleaved\n\n"
          f"{common.markdown_table(s['rows'], COLS)}\n")
    common.write_text(stem.with_suffix(".md"), md)
    print(md)


if __name__ == "__main__":
    raise SystemExit(main())
