"""Load-independent evidence for `zerokern bench --step` (issue 20): per provider and phase
(forward, backward, step, zero_grad), rank 0's top-level aten ops per iteration (calls, and the
bytes of their first tensor argument; view ops count no bytes), the time the main thread spends
blocked in collective handles' wait() (and where), the bytes of grad reductions launched after
the last grad hook of a backward began (`tail`: what no backward compute can hide), and the
process's CPU time (every thread: compute, ring, gloo; user and sys).

    PYTHONPATH=. nice python benchmarks/step_profile.py --stages 0 1 2 --iters 3

Op counts, bytes and the tail do not depend on the machine's load; waits and times do (compare
runs alternated between checkouts, `--no-ops` to leave the profiler out). The 20m GPT, 2 gloo
ranks, fp32, batch 2x32, the benchmark's zerokern providers (zerokern.bench.step) and DDP +
fused AdamW built as it builds them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# The zerokern imported is PYTHONPATH's (run it against any checkout: PYTHONPATH=<checkout>)

PHASES = ("forward", "backward", "step", "zero_grad")
# Ops that only make a view: no bytes moved
VIEWS = {"aten::" + n for n in (
    "slice", "view", "reshape", "as_strided", "t", "detach", "select", "chunk", "split",
    "unbind", "permute", "expand", "alias", "transpose", "unsqueeze", "squeeze", "_unsafe_view",
    "split_with_sizes", "narrow", "empty", "empty_like", "lift_fresh", "contiguous", "numpy_T",
    "_reshape_alias", "unflatten", "flatten", "resize_")}


def _nbytes(shapes, dtypes) -> int:
    tot = 0
    for s, d in zip(shapes or (), dtypes or ()):
        if not s or not isinstance(s, (list, tuple)) or any(not isinstance(x, int) for x in s):
            continue
        n = 1
        for x in s:
            n *= x
        size = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
                "int": 4, "bool": 1}.get(d, 4)
        tot += n * size
    return tot


class Waits:
    """Patch the handles' wait() to time how long the main thread blocks in them."""

    def __init__(self) -> None:
        self.total = 0.0
        from zerokern.comm import ring
        orig = ring.FutureWork.wait
        me = self

        self.where = collections.Counter()

        def wait(h):
            t0 = time.perf_counter()
            try:
                return orig(h)
            finally:
                dt = time.perf_counter() - t0
                me.total += dt
                f = sys._getframe(1)
                me.where[f"{f.f_code.co_name}<{f.f_back.f_code.co_name}"] += dt
        ring.FutureWork.wait = wait
        # Bytes of grad reductions launched at or after the start of the last grad hook of a
        # backward: the tail no backward compute can hide (load-independent).
        from zerokern.comm.groups import Comm
        from zerokern.grads.grad_sync import GradSync
        self.launches, self.last_hook = [], 0.0
        for meth, arg in (("all_reduce_grads_", 0), ("reduce_grads_", 1)):
            orig_c = getattr(Comm, meth)

            def launch(c, *a, _orig=orig_c, _arg=arg, **kw):
                t = a[_arg]
                me.launches.append((time.perf_counter(), t.numel() * t.element_size()))
                return _orig(c, *a, **kw)
            setattr(Comm, meth, launch)
        orig_g = GradSync._on_grad

        def on_grad(gs, *a):
            me.last_hook = time.perf_counter()
            return orig_g(gs, *a)
        GradSync._on_grad = on_grad

    def tail_bytes(self) -> int:
        if os.environ.get("PROFILE_DEBUG"):
            print([(round((t - self.last_hook) * 1e3, 1), b) for t, b in self.launches])
        out = sum(b for t, b in self.launches if t >= self.last_hook)
        self.launches = []
        return out


def _worker(rank: int, world: int, args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerokern.bench import step as bench_step
    from zerokern.tools.gpt import build_gpt
    bargs = bench_step.parse_args(["--stages", *map(str, args.stages), "--no-fsdp2",
                                   "--no-peers"])
    provs = bench_step._make_providers(bargs, rank, world)
    ddps = {}
    if args.ddp:  # as bench/step.py builds its DDP peer
        m = build_gpt(bargs.model_size)
        ddps["DDP + AdamW(fused)"] = DDP(m, gradient_as_bucket_view=True,
                                         bucket_cap_mb=bargs.bucket_mb)
        provs["DDP + AdamW(fused)"] = (None, torch.optim.AdamW(
            m.parameters(), fused=True, lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
            weight_decay=0.01), None, m)
    keep = list(provs)
    waits = Waits()
    out = {}
    gen = torch.Generator().manual_seed(7 + rank)
    data = torch.randint(0, 1000, (2, 33), generator=gen)
    for name in keep:
        _, opt, _, model = provs[name]
        ddp = ddps.get(name)

        def phase_fns(model=model, opt=opt, ddp=ddp):
            box = {}

            def fwd():
                if ddp is None:
                    box["loss"] = model.loss(data[:, :-1], data[:, 1:])
                else:
                    box["loss"] = bench_step._ddp_loss(ddp, data)
            return [("forward", fwd), ("backward", lambda: box["loss"].backward()),
                    ("step", opt.step), ("zero_grad", opt.zero_grad)]
        for _ in range(2):  # warm up
            for _, fn in phase_fns():
                fn()
        waits.where.clear()
        waits.tail_bytes()
        per = {ph: {"ms": 0.0, "wait_ms": 0.0, "ops": collections.Counter(),
                    "bytes": collections.Counter()} for ph in PHASES}
        for _ in range(args.iters):
            for ph, fn in phase_fns():
                dist.barrier()
                w0 = waits.total
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                             record_shapes=True) if args.ops
                      else contextlib.nullcontext()) as prof:
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                per[ph]["ms"] += dt * 1e3 / args.iters
                per[ph]["wait_ms"] += (waits.total - w0) * 1e3 / args.iters
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                # CPU time of every thread of this rank (compute, ring, gloo): the work done
                per[ph]["cpu_ms"] = per[ph].get("cpu_ms", 0) + (
                    r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1e3 / args.iters
                per[ph]["sys_ms"] = per[ph].get("sys_ms", 0) + (
                    r1.ru_stime - r0.ru_stime) * 1e3 / args.iters
                tail = waits.tail_bytes()
                if ph == "backward":
                    per[ph]["tail_MB"] = per[ph].get("tail_MB", 0) + tail / 1e6 / args.iters
                for ev in (prof.events() if args.ops else ()):
                    par = ev.cpu_parent
                    while par is not None and not par.name.startswith("aten::"):
                        par = par.cpu_parent
                    if not ev.name.startswith("aten::") or par is not None:
                        continue  # top-level aten ops only (no double counting)
                    per[ph]["ops"][ev.name] += 1 / args.iters
                    if ev.name in VIEWS:
                        continue
                    # bytes of the first tensor argument (the output of in-place ops)
                    per[ph]["bytes"][ev.name] += _nbytes(ev.input_shapes[:1],
                                                         getattr(ev, "input_dtypes", [])[:1]
                                                         ) / args.iters
        out[name + " waits"] = {k: round(v * 1e3 / args.iters, 1)
                                 for k, v in waits.where.items()}
        waits.where.clear()
        out[name] = {ph: {"ms": round(v["ms"], 1), "wait_ms": round(v["wait_ms"], 1),
                          "tail_MB": round(v.get("tail_MB", 0), 1),
                          "cpu_ms": round(v.get("cpu_ms", 0), 1),
                          "sys_ms": round(v.get("sys_ms", 0), 1),
                          "ops": {k: round(c, 2) for k, c in v["ops"].most_common()},
                          "MB": {k: round(b / 1e6, 1) for k, b in v["bytes"].most_common()}}
                     for ph, v in per.items()}
    return out if rank == 0 else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-ddp", dest="ddp", action="store_false")
    p.add_argument("--no-ops", dest="ops", action="store_false",
                   help="no torch.profiler (wall and CPU times without its overhead)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    from zerokern.tools.spawn import spawn_ranks
    res = spawn_ranks(_worker, 2, a, backend="gloo", threads=1)[0]
    for name, phases in res.items():
        print(f"== {name}")
        if name.endswith("waits"):
            print("  ", phases)
            continue
        for ph, v in phases.items():
            n = sum(v["ops"].values())
            mb = sum(v["MB"].values())
            top = ", ".join(f"{k[6:]} {v['ops'][k]:g}x/{v['MB'].get(k, 0):.0f}MB"
                            for k in list(v["MB"])[:8])
            print(f"  {ph:9s} {v['ms']:7.1f} ms  wait {v['wait_ms']:6.1f} ms  "
                  f"tail {v['tail_MB']:5.1f} MB  cpu {v['cpu_ms']:6.1f} ms "
                  f"(sys {v['sys_ms']:5.1f})  "
                  f"ops {n:6.0f}  {mb:7.0f} MB  [{top}]")
    if a.out is not None:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
