"""Offload benchmark (`zerokern bench --offload`): what offload="cpu" and "nvme" cost and save.

One process (world size 1) trains the GPT preset with ZeroAdamW at one stage, with and without
offload, interleaved round-robin (common [Note: how a repetition is timed]); it reports the
iteration and step time of each, the device bytes offload saves (memory_report), the cpu
kernel's share of the offloaded step, and a sweep of the pipeline's chunk size over the
offloaded step alone. On a CPU-only machine "device" and host are the same memory, so the
saving is the bytes that moved out of the working set, and the step pays two extra copies.
The NVMe rows (offload="nvme" against the disk's bandwidth measured in the same run, and the
chunk x queue-depth sweep) are in bench/offload_nvme.py; `--nvme-only` runs just those.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List

import torch

from . import common, offload_nvme

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _setup(args, offload, chunk=None, **kw):
    import zerokern as zk
    from zerokern.tools.gpt import build_gpt

    torch.manual_seed(0)
    m = build_gpt(args.model_size)
    opt = zk.ZeroAdamW(m, stage=args.stage, precision=args.precision, offload=offload,
                       lr=1e-4, weight_decay=0.01, **kw)
    if offload and chunk:
        opt.offloader.chunk = chunk  # only the pipeline's loop reads it
    return m, opt


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="zerokern bench --offload", description=__doc__)
    p.add_argument("--model-size", default="20m", choices=["tiny", "small", "20m", "100m"])
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--chunks", type=int, nargs="*", default=[1 << 14, 1 << 16, 1 << 18,
                                                             1 << 20, 1 << 22])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="tiny model, 2 reps (for tests)")
    p.add_argument("--nvme-path", default=None,
                   help="directory for offload='nvme' (default: the temp dir)")
    p.add_argument("--nvme-chunks", type=int, nargs="*",
                   default=[1 << 18, 1 << 20, 1 << 22, 1 << 23])
    p.add_argument("--nvme-depths", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--no-nvme", action="store_true", help="skip the offload='nvme' rows")
    p.add_argument("--nvme-only", action="store_true", help="only the offload='nvme' rows")
    args = p.parse_args(argv)
    if args.quick:
        args.model_size, args.reps, args.chunks = "tiny", 2, [1 << 14, 1 << 20]
        args.nvme_chunks, args.nvme_depths = [1 << 12, 1 << 16], [2, 4]
    if args.reps < 1:
        p.error("--reps must be >= 1")
    torch.set_num_threads(common.usable_cpus())
    from zerokern.tools.gpt import PRESETS

    x = torch.randint(0, PRESETS[args.model_size].vocab, (args.batch, args.seq + 1),
                      generator=torch.Generator().manual_seed(1))
    nvme = None if args.no_nvme else offload_nvme.run(
        args, x, lambda off, **kw: _setup(args, off, **kw))
    if args.nvme_only:
        md = offload_nvme.report(nvme)
        env = common.environment(torch.device("cpu"))
        env.update(model_size=args.model_size, stage=args.stage, precision=args.precision,
                   batch=args.batch, seq=args.seq, params=nvme["memory_report"]["num_params"])
        stem = f"offload-nvme-{args.model_size}-s{args.stage}-{args.precision}"
        common.write_json(args.out / f"{stem}.json", {"env": env, "nvme": nvme})
        common.write_text(args.out / f"{stem}.md", "\n".join(
            [f"# offload='nvme' benchmark: GPT {args.model_size}", "",
             common.markdown_env(env), "", *md]))
        return 0
    runs = {"no offload": _setup(args, None), "offload cpu": _setup(args, "cpu")}
    iters = {k: [] for k in runs}
    steps = {k: [] for k in runs}
    for rep in range(args.reps + 1):  # rep 0 warms up (JIT build, first-touch)
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            m, opt = runs[name]
            t0 = time.perf_counter()
            opt.backward(m.loss(x[:, :-1], x[:, 1:]))
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad()
            if rep:
                iters[name].append((t2 - t0) * 1e3)
                steps[name].append((t2 - t1) * 1e3)
    off = runs["offload cpu"][1].offloader
    off.kernel_s = off.wait_s = 0.0
    m, opt = runs["offload cpu"]
    kernel_share = []
    for _ in range(args.reps):
        opt.backward(m.loss(x[:, :-1], x[:, 1:]))
        k0 = off.kernel_s
        t0 = time.perf_counter()
        opt.step()
        kernel_share.append((off.kernel_s - k0) / (time.perf_counter() - t0))
        opt.zero_grad()
    # chunk sweep: the offloaded step alone, per chunk size
    sweep = []
    for chunk in args.chunks:
        m, opt = _setup(args, "cpu", chunk)
        ms = []
        for rep in range(args.reps + 1):
            opt.backward(m.loss(x[:, :-1], x[:, 1:]))
            t0 = time.perf_counter()
            opt.step()
            if rep:
                ms.append((time.perf_counter() - t0) * 1e3)
            opt.zero_grad()
        sweep.append({"chunk_numel": chunk, "step_ms": common.summarize(ms)["median_ms"]})
    rows = []
    mem = {k: runs[k][1].memory_report() for k in runs}
    for name in runs:
        r = mem[name]
        rows.append({"config": name, "iter_ms": common.summarize(iters[name])["median_ms"],
                     "step_ms": common.summarize(steps[name])["median_ms"],
                     "device_MiB": r["measured_total"] / 2**20,
                     "host_MiB": r.get("host_measured_total", 0) / 2**20})
    saved = (mem["no offload"]["measured_total"] - mem["offload cpu"]["measured_total"]) / 2**20
    share = common.summarize([100 * s for s in kernel_share])["median_ms"]
    env = common.environment(torch.device("cpu"))
    env.update(model_size=args.model_size, params=mem["no offload"]["num_params"],
               stage=args.stage, precision=args.precision, batch=args.batch, seq=args.seq)
    cols = [("config", "config"), ("iter_ms", "iteration ms"), ("step_ms", "step ms"),
            ("device_MiB", "device model states MiB"), ("host_MiB", "host MiB")]
    title = (f"offload benchmark: GPT {args.model_size} "
             f"({mem['no offload']['num_params'] / 1e6:.1f}M params), stage {args.stage}, "
             f"{args.precision}, 1 process")
    common.print_table(rows, cols, title)
    ccols = [("chunk_numel", "chunk (elements)"), ("step_ms", "offloaded step ms")]
    common.print_table(sweep, ccols, "chunk size sweep")
    ratio = rows[1]["iter_ms"] / rows[0]["iter_ms"]
    lines = [f"- device memory saved by offload: {saved:.1f} MiB per rank",
             f"- offloaded iteration: {ratio:.2f}× the iteration without offload",
             f"- cpu kernel share of the offloaded step: {share:.0f}% (median)"]
    for ln in lines:
        print(ln)
    stem = f"offload-{args.model_size}-s{args.stage}-{args.precision}"
    common.write_json(args.out / f"{stem}.json", {"env": env, "rows": rows, "sweep": sweep,
                                                  "saved_MiB": saved, "kernel_share_pct": share,
                                                  "memory_reports": mem, "nvme": nvme})
    md = [f"# {title}", "", common.markdown_env(env), "", common.markdown_table(rows, cols), "",
          *lines, "", "## chunk size sweep", "", common.markdown_table(sweep, ccols), ""]
    if nvme is not None:
        md += offload_nvme.report(nvme)
    common.write_text(args.out / f"{stem}.md", "\n".join(md))
    return 0
