"""The CPU 8-bit AdamW kernel (issue 23) before and after, against zerokern's fp32 adam_step and
bitsandbytes' CPU AdamW8bit, interleaved per repetition in one process.

    PYTHONPATH=<checkout> python benchmarks/adamw8bit_cpu_kernel.py --old-so <old cpu op .so> \
        --out benchmarks/results/adamw8bit-cpu-kernel.json

Providers (each one full step over n fp32 params, fp32 grads, no param_out):
- `new`: this checkout's cpu op `adamw8bit_step` (ISA "auto"; `new-<isa>` rows for each forced
  ISA with --isas);
- `old`: the same op from an older build's .so (--old-so), the same arguments, run in a helper
  process driven step by step over a pipe (Python caches an extension module by its name, so
  two builds of zerokern_cpu_ops cannot live in one process); it times itself;
- `fp32`: this checkout's fp32 `adam_step` (AdamW, fp32 m and v);
- `bnb`: `bitsandbytes.optim.AdamW8bit([p]).step()` on CPU tensors (its own blocking).
Each repetition runs every provider once, in a rotating order; the median of the repetitions
after warm-up is reported, in wall milliseconds and in CPU milliseconds (`time.process_time`,
all threads): on a machine shared with other jobs the wall time stretches with the load while
the CPU time counts the work done.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def _load_so(path: str):
    spec = importlib.util.spec_from_file_location("zerokern_cpu_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _q8_provider(op, n, isa=None):
    from zerokern.kernels.quant8 import code_map, midpoints, quantize

    p = torch.randn(n)
    mq, ma = quantize(torch.randn(n) * 1e-3, True)
    vq, va = quantize(torch.rand(n) * 1e-6, False)
    g = torch.randn(n)
    step, gsc, fi = torch.tensor(0), torch.tensor(1.0), torch.tensor(False)
    maps = (code_map(True, "cpu"), code_map(False, "cpu"), midpoints(True, "cpu"),
            midpoints(False, "cpu"))

    def run():
        if isa is not None:
            op.force_isa(isa)
        op.adamw8bit_step(p, mq, ma, vq, va, g, None, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, gsc,
                          fi, *maps)
        if isa is not None:
            op.force_isa("auto")
    return run


class _OldProc:
    """The old op in a helper process (this script with --serve-old): one step per request."""

    def __init__(self, so: str):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-old", so, "--out", "-"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def provider(self, n: int):
        assert self.ask(f"init {n}") == "ok"

        def run():
            wall, cpu = map(float, self.ask("run").split())
            return wall, cpu
        return run


def _serve_old(so: str) -> int:
    import sys

    op = _load_so(so)
    run = None
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "init":
            run = _q8_provider(op, int(cmd[1]))
            run()
            print("ok", flush=True)
        elif cmd[0] == "run":
            c0, w0 = time.process_time(), time.perf_counter()
            run()
            print(time.perf_counter() - w0, time.process_time() - c0, flush=True)
    return 0


def _fp32_provider(op, n):
    p, m, v, g = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)
    step, gsc, fi = torch.tensor(0), torch.tensor(1.0), torch.tensor(False)

    def run():
        op.adam_step(p, m, v, g, None, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, step, gsc, fi)
    return run


def _bnb_provider(n):
    import bitsandbytes as bnb

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = bnb.optim.AdamW8bit([p], lr=1e-3, weight_decay=0.01)
    return opt.step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-so", default=None, help="the older build's cpu op (.so)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24], help="log2 n")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--isas", nargs="*", default=[], help="also time these forced ISAs")
    ap.add_argument("--no-bnb", action="store_true")
    ap.add_argument("--serve-old", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.serve_old:
        return _serve_old(a.serve_old)

    from zerokern.kernels.build import load_op

    new = load_op("cpu")
    load0 = os.getloadavg()
    old = _OldProc(a.old_so) if a.old_so else None
    rows = {}
    for lg in a.sizes:
        n = 1 << lg
        provs = {"new": _q8_provider(new, n)}
        for isa in a.isas:
            provs[f"new-{isa}"] = _q8_provider(new, n, isa)
        if old is not None:
            provs["old"] = old.provider(n)
        provs["fp32"] = _fp32_provider(new, n)
        if not a.no_bnb:
            provs["bnb"] = _bnb_provider(n)
        names = list(provs)
        wall = {k: [] for k in names}
        cpu = {k: [] for k in names}
        for rep in range(a.warmup + a.reps):
            for i in range(len(names)):
                k = names[(i + rep) % len(names)]
                c0, w0 = time.process_time(), time.perf_counter()
                own = provs[k]()  # the old op's helper returns its own (wall, cpu) seconds
                dw, dc = own if own else (time.perf_counter() - w0, time.process_time() - c0)
                if rep >= a.warmup:
                    wall[k].append(dw * 1e3)
                    cpu[k].append(dc * 1e3)
        row = {k: {"wall_ms": statistics.median(wall[k]), "cpu_ms": statistics.median(cpu[k]),
                   "wall_all": wall[k], "cpu_all": cpu[k]} for k in names}
        rows[f"2^{lg}"] = row
        print(f"n=2^{lg}: " + "  ".join(f"{k} {row[k]['wall_ms']:.1f}/{row[k]['cpu_ms']:.1f}"
                                         for k in names) + "  (wall/cpu ms, median)", flush=True)
    try:
        import bitsandbytes
        bnb_v = bitsandbytes.__version__
    except ImportError:
        bnb_v = None
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
            "threads": torch.get_num_threads(), "isa": new.selected_isa(),
            "torch": torch.__version__, "bitsandbytes": bnb_v,
            "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(), "reps": a.reps,
            "warmup": a.warmup,
            "old_so": a.old_so}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
