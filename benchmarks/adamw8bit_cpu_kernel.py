"""The CPU 8-bit AdamW kernel (issues 23, 40) before and after, against zerokern's fp32 adam_step,
bitsandbytes' and torchao's AdamW8bit and the read-modify-write ceiling, interleaved per
repetition in one process.

    PYTHONPATH=<checkout> python benchmarks/adamw8bit_cpu_kernel.py --old-so <old cpu op .so> \
        --cases bf16 fp32 --sizes 24 26 --out benchmarks/results/adamw8bit-cpu-kernel.json

Cases (--cases): fp32 = fp32 grads, no param_out; bf16 = bf16 grads and a bf16 param_out (the
kernel benchmark's cases, zerokern/bench/kernel_cases.py). Providers (each one full step over n
fp32 params):
- `new`: this checkout's cpu op `adamw8bit_step` (ISA "auto"; `new-<isa>` rows for each forced
  ISA with --isas);
- `old`: the same op from an older build's .so (--old-so), the same arguments, run in a helper
  process driven step by step over a pipe (Python caches an extension module by its name, so
  two builds of zerokern_cpu_ops cannot live in one process); it times itself;
- `fp32`: this checkout's fp32 `adam_step` (AdamW, fp32 m and v);
- `bnb`: `bitsandbytes.optim.AdamW8bit([p]).step()` on CPU tensors (its own blocking);
- `torchao`: `torchao.optim.AdamW8bit([p]).step()` (torch.compile'd; the first, untimed step
  compiles it); both peers upcast a bf16 grad and cast the param back in the bf16 case;
- `rmw`: `x.mul_(1.0000001)` over n fp32 (8 B/elem): the ceiling of zerokern bench --kernels.
Each repetition runs every provider once, in a rotating order, with the caches flushed before
each call (common.CacheFlusher); the median of the repetitions after warm-up is reported, in
wall milliseconds and in CPU milliseconds (`time.process_time`, all threads): on a machine
shared with other jobs the wall time stretches with the load while the CPU time counts the work
done. GB/s = the 8-bit step's byte floor (kernel_rules.rule_floor: 16.125 B/elem in both cases)
/ wall median; % RMW = that over the rmw row's GB/s; x fp32 = wall time / the fp32 row's.
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

# The old op runs in a helper process (_OldProc): this process's OpenMP threads must not spin
# while the helper's run. With libgomp's default (active) wait they kept both cores busy after
# each of this process's parallel regions: the same build timed as `old` read 1.30x slower than
# as `new` (2^24, bf16, 2026-11-30), so every new/old ratio of this script before then
# overstated the gain; with passive waits 0.98x. libgomp reads it when torch loads it, so here,
# before the import (the helper inherits it). The in-process rows are unaffected (same ratio
# to fp32 either way).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


def _load_so(path: str):
    spec = importlib.util.spec_from_file_location("zerokern_cpu_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GRAD = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLOOR = 16.125  # 8 + 2 x (1 + 1 + 4/128 + 4/128) + grad + out: 4 + 0 (fp32) or 2 + 2 (bf16)
FLOOR_FP32 = 28  # the fp32-state adam_step's: 8 + 2 x 8 + grad + out, both cases


def _data(n, case):
    gen = torch.Generator().manual_seed(40)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 1e-3).to(GRAD[case])
    out = p.to(torch.bfloat16) if case == "bf16" else None
    return p, g, out


def _q8_provider(op, n, case, isa=None):
    from zerokern.kernels.quant8 import code_map, midpoints, quantize

    p, g, out = _data(n, case)
    mq, ma = quantize(torch.randn(n) * 1e-3, True)
    vq, va = quantize(torch.rand(n) * 1e-6, False)
    step, gsc, fi = torch.tensor(0), torch.tensor(1.0), torch.tensor(False)
    maps = (code_map(True, "cpu"), code_map(False, "cpu"), midpoints(True, "cpu"),
            midpoints(False, "cpu"))

    def run():
        if isa is not None:
            op.force_isa(isa)
        op.adamw8bit_step(p, mq, ma, vq, va, g, out, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, gsc,
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

    def provider(self, n: int, case: str):
        assert self.ask(f"init {n} {case}") == "ok"

        def run():
            wall, cpu = map(float, self.ask("run").split())
            return wall, cpu
        return run


def _serve_old(so: str) -> int:
    import sys

    op = _load_so(so)
    torch.set_num_threads(int(os.environ.get("ZK_BENCH_THREADS", torch.get_num_threads())))
    run = None
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "init":
            run = None
            run = _q8_provider(op, int(cmd[1]), cmd[2])
            run()
            print("ok", flush=True)
        elif cmd[0] == "run":
            c0, w0 = time.process_time(), time.perf_counter()
            run()
            print(time.perf_counter() - w0, time.process_time() - c0, flush=True)
    return 0


def _fp32_provider(op, n, case):
    p, g, out = _data(n, case)
    m, v = torch.randn(n) * 1e-3, torch.rand(n) * 1e-6 + 1e-8
    step, gsc, fi = torch.tensor(0), torch.tensor(1.0), torch.tensor(False)

    def run():
        op.adam_step(p, m, v, g, out, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, step, gsc, fi)
    return run


def _peer_provider(name, n, case):
    p, g, out = _data(n, case)
    param = torch.nn.Parameter(p)
    param.grad = g.float()
    if name == "bnb":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit([param], lr=1e-3, weight_decay=0.01, min_8bit_size=0)
    else:
        from torchao.optim import AdamW8bit

        opt = AdamW8bit([param], lr=1e-3, weight_decay=0.01)
    opt.step()  # state made (torchao: compiled) outside the timed steps
    if out is None:
        return opt.step

    def run():
        param.grad.copy_(g)   # upcast the bf16 grad
        opt.step()
        out.copy_(param)      # cast back
    return run


def _rmw_provider(n):
    x = torch.randn(n)
    return lambda: x.mul_(1.0000001)


def _md(payload) -> str:
    meta, rows = payload["meta"], payload["rows"]
    load = " / ".join(f"{v:.1f}" for v in meta["loadavg_at_start"])
    load_end = " / ".join(f"{v:.1f}" for v in meta["loadavg_at_end"])
    lines = [f"# CPU 8-bit AdamW kernel: before / after ({meta['date'][:10]})", "",
             f"Commit (new): {meta.get('commit')}; old: {meta.get('old_so')}.", "",
             f"Machine: {meta['cpu']} ({meta['nproc']} CPUs, {meta['threads']} torch threads, "
             f"ISA {meta['isa']}), torch {meta['torch']}; load average {load} (1/5/15 min) at "
             f"the start, {load_end} at the end (other jobs on the 2 cores). Median of "
             f"{meta['reps']} after {meta['warmup']} warm-up, every provider once per "
             "repetition in rotating order, caches flushed before each call. `new`: this "
             "checkout's op; `old`: the op before (its .so in a helper process; passive "
             "OpenMP waits, see the script); `fp32`: "
             "zerokern's fp32-state adam_step (its GB/s and % RMW on its own 28 B/elem floor); "
             "`rmw`: x.mul_(c), 8 B/elem. x fp32 = wall time / fp32's; x fp32 (CPU) = CPU time "
             "/ fp32's (on a loaded machine the wall time waits on descheduled threads, the CPU "
             "time less so).", "",
             "| n | case | provider | wall ms | CPU ms | GB/s | % RMW | x fp32 | x fp32 (CPU) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, row in rows.items():
        rmw = row.get("rmw", {}).get("wall_ms")
        fp32 = row.get("fp32", {}).get("wall_ms")
        fp32_cpu = row.get("fp32", {}).get("cpu_ms")
        size, case = key.split(" ")
        for name, r in row.items():
            w = r["wall_ms"]
            b = 8 if name == "rmw" else FLOOR_FP32 if name == "fp32" else FLOOR
            gbps = f"{b * (1 << int(size[2:])) / w / 1e6:.1f}"
            pct = f"{100 * rmw / w * (b / 8):.0f}%" if rmw and name != "rmw" else "-"
            ratio = f"{w / fp32:.2f}" if fp32 and name not in ("rmw", "fp32") else "-"
            cpu_ratio = (f"{r['cpu_ms'] / fp32_cpu:.2f}"
                         if fp32_cpu and name not in ("rmw", "fp32") else "-")
            lines.append(f"| {size} | {case} | {name} | {w:.1f} | {r['cpu_ms']:.1f} | {gbps} | "
                         f"{pct} | {ratio} | {cpu_ratio} |")
    lines += ["", "Per-repetition ratios (wall): each repetition runs every provider once, so "
              "a ratio of two providers within one repetition shares that moment's load; "
              "median [quartiles] over the repetitions.", "",
              "| n | case | new / fp32 | new / old |", "|---|---|---|---|"]
    for key, row in rows.items():
        size, case = key.split(" ")
        cells = [_rep_ratios(row, "new", peer) for peer in ("fp32", "old")]
        lines.append(f"| {size} | {case} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _rep_ratios(row, a, b) -> str:
    """median [q1, q3] of a's wall time over b's, repetition by repetition ('-' without b)."""
    if a not in row or b not in row:
        return "-"
    r = sorted(x / y for x, y in zip(row[a]["wall_all"], row[b]["wall_all"]))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return f"{q[1]:.2f} [{q[0]:.2f}, {q[2]:.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-so", default=None, help="the older build's cpu op (.so)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24], help="log2 n")
    ap.add_argument("--cases", nargs="+", default=["fp32"], choices=sorted(GRAD))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--isas", nargs="*", default=[], help="also time these forced ISAs")
    ap.add_argument("--no-bnb", action="store_true")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--no-flush", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for every provider (default: torch's)")
    ap.add_argument("--serve-old", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.serve_old:
        return _serve_old(a.serve_old)

    from zerokern.bench.common import CacheFlusher
    from zerokern.kernels.build import load_op

    new = load_op("cpu")
    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["ZK_BENCH_THREADS"] = str(a.threads)
    os.environ.setdefault("ZK_BENCH_THREADS", str(torch.get_num_threads()))
    flush = CacheFlusher(torch.device("cpu"), enabled=not a.no_flush)
    load0 = os.getloadavg()
    old = _OldProc(a.old_so) if a.old_so else None
    rows = {}
    for lg in a.sizes:
        n = 1 << lg
        for case in a.cases:
            provs = {"new": _q8_provider(new, n, case)}
            for isa in a.isas:
                provs[f"new-{isa}"] = _q8_provider(new, n, case, isa)
            if old is not None:
                provs["old"] = old.provider(n, case)
            provs["fp32"] = _fp32_provider(new, n, case)
            provs["rmw"] = _rmw_provider(n)
            for peer in ("bnb", "torchao"):
                if not getattr(a, f"no_{peer}"):
                    provs[peer] = _peer_provider(peer, n, case)
            names = list(provs)
            wall = {k: [] for k in names}
            cpu = {k: [] for k in names}
            for rep in range(a.warmup + a.reps):
                for i in range(len(names)):
                    k = names[(i + rep) % len(names)]
                    flush()
                    c0, w0 = time.process_time(), time.perf_counter()
                    own = provs[k]()  # the old op's helper returns its own (wall, cpu) seconds
                    dw, dc = own if isinstance(own, tuple) else (time.perf_counter() - w0,
                                              time.process_time() - c0)
                    if rep >= a.warmup:
                        wall[k].append(dw * 1e3)
                        cpu[k].append(dc * 1e3)
            row = {k: {"wall_ms": statistics.median(wall[k]),
                       "cpu_ms": statistics.median(cpu[k]),
                       "wall_all": wall[k], "cpu_all": cpu[k]} for k in names}
            rows[f"2^{lg} {case}"] = row
            del provs
            print(f"n=2^{lg} {case}: " + "  ".join(
                f"{k} {row[k]['wall_ms']:.1f}/{row[k]['cpu_ms']:.1f}" for k in names)
                + "  (wall/cpu ms, median)", flush=True)
    versions = {}
    for mod in ("bitsandbytes", "torchao"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except ImportError:
            versions[mod] = None
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": _cpu_name(), "nproc": os.cpu_count(),
            "threads": torch.get_num_threads(), "isa": new.selected_isa(),
            "torch": torch.__version__, **versions,
            "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(), "reps": a.reps,
            "warmup": a.warmup, "flush": not a.no_flush, "old_so": a.old_so,
            "floor_bytes_per_elem": FLOOR, "commit": _commit()}
    payload = {"meta": meta, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(payload, indent=1))
    a.out.with_suffix(".md").write_text(_md(payload))
    return 0


def _commit() -> str:
    """The checkout's commit (with -dirty when its tracked files differ), or None."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "csrc", "zerokern"],
                               cwd=here).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    raise SystemExit(main())
