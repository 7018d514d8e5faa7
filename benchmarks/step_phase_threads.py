"""Where a training iteration's time goes, per phase (forward, backward, step + zero_grad) and per
thread (the main thread, the comm threads), for setups side by side in one pair of gloo ranks:
the breakdown behind issue 20's stage-3 ratio.

    PYTHONPATH=. python benchmarks/step_phase_threads.py --sides 2 3 3:keep-all --reps 24 \
        --json benchmarks/results/step-20m-n2-fp32-phases.json

Sides as in step_paired_sides.py (`ddp`, `0`-`3`, `3:keep-all`, `<stage>:tcp`; the 20m GPT, fp32,
batch 2x32, one torch thread per rank, the same init and data on every side), iterations rotated
so each side sees the same load. Per phase and rep: the wall time (the slower rank's), the main
thread's CPU time (`time.thread_time`) and the other threads' (`time.process_time` minus it: the
ring threads of comm/ring.py, gloo's), each the mean over the ranks; the medians over reps. On
a machine whose cores are all busy with the ranks' main threads (2 ranks on 2 cores, the CI VM)
every millisecond a comm thread works is taken from compute, so wall ~ main + comm + idle, and
`idle` (wall - main - comm) is what the ranks spent waiting for each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from step_paired_sides import _side  # (this folder: run as a script)

PHASES = ("fwd", "bwd", "step")


def _stamp():
    return time.perf_counter(), time.thread_time(), time.process_time()


def _worker(rank: int, world: int, args):
    gen = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randint(0, 8192, (2, 33), generator=gen) for _ in range(4)]
    sides = {s: _side(s) for s in args.sides}
    names = list(sides)
    rows = {s: [] for s in names}
    for rep in range(args.warmup + args.reps):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            _, opt, loss_of = sides[name]
            dist.barrier()
            marks = [_stamp()]
            loss = loss_of(data[rep % len(data)])
            marks.append(_stamp())
            loss.backward()
            marks.append(_stamp())
            opt.step()
            opt.zero_grad()
            marks.append(_stamp())
            vals = []
            for a, b in zip(marks, marks[1:]):
                wall, main, proc = b[0] - a[0], b[1] - a[1], b[2] - a[2]
                vals += [wall, main, proc - main]
            t = torch.tensor(vals, dtype=torch.float64) * 1e3
            wall = t[0::3].clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slower rank's wall time
            dist.all_reduce(t)  # CPU: the mean over ranks
            t /= world
            t[0::3] = wall
            if rep >= args.warmup:
                rows[name].append(t.tolist())
    return rows if rank == 0 else None


def summarize(rows):
    """{side: {phase: {wall, main, comm, idle}}} medians over reps, plus the iteration."""
    out = {}
    for side, reps in rows.items():
        med = [statistics.median(r[k] for r in reps) for k in range(len(reps[0]))]
        d = {}
        for p, ph in enumerate(PHASES):
            w, m, c = med[3 * p:3 * p + 3]
            d[ph] = {"wall": w, "main": m, "comm": c, "idle": w - m - c}
        tot = [statistics.median(sum(r[3 * p + k] for p in range(len(PHASES))) for r in reps)
               for k in range(3)]
        d["iteration"] = {"wall": tot[0], "main": tot[1], "comm": tot[2],
                          "idle": tot[0] - tot[1] - tot[2]}
        out[side] = d
    return out


def markdown(summary, base: str) -> str:
    lines = ["| side | phase | wall ms | main-thread CPU ms | comm-thread CPU ms | idle ms | "
             f"wall - {base}'s |", "|---|---|---:|---:|---:|---:|---:|"]
    for side, d in summary.items():
        for ph in PHASES + ("iteration",):
            x = d[ph]
            diff = x["wall"] - summary[base][ph]["wall"] if base in summary else float("nan")
            lines.append(f"| {side} | {ph} | {x['wall']:.1f} | {x['main']:.1f} | "
                         f"{x['comm']:.1f} | {x['idle']:.1f} | {diff:+.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sides", nargs="+", required=True,
                   help="ddp, 0-3, 3:keep-all or <stage>:tcp (the first is the base)")
    p.add_argument("--reps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--json", type=Path, default=None, help="append the result to this file")
    a = p.parse_args()
    if len(set(a.sides)) != len(a.sides):
        raise ValueError(f"--sides must differ, got {a.sides}")
    from zerokern.tools.spawn import spawn_ranks

    rows = spawn_ranks(_worker, 2, a, backend="gloo", threads=1)[0]
    summary = summarize(rows)
    print(markdown(summary, a.sides[0]))
    if a.json is not None:
        old = json.loads(a.json.read_text()) if a.json.exists() else []
        res = {"sides": a.sides, "reps": a.reps, "summary": summary,
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        a.json.write_text(json.dumps(old + [res], indent=1) + "\n")


if __name__ == "__main__":
    main()
