"""CPU time per training iteration (forward, backward, step, zero_grad), summed over the ranks:
`zerokern bench --step`'s providers, interleaved per repetition, on whatever checkout is first
on PYTHONPATH.

    PYTHONPATH=<checkout> python benchmarks/step_cpu_time.py --out run.json -- --stages 0 1 2 3

Why CPU time: on a machine shared with other jobs (load average far above the core count),
wall time per iteration stretches 10-20x and its spread swamps a few-percent change, while the
CPU seconds a rank's process consumes (`time.process_time`: every thread, gloo's included)
count the work done and barely move with the load. Wall time is recorded beside it. A process
waiting in a collective sleeps, so CPU time does not charge communication waits; the wall-time
`zerokern bench --step` remains the measure of overlap.

The providers are `zerokern.bench.step._make_providers`, so an older checkout runs its own
code under the same harness (alternate checkouts run by run; see step_before_after.py for wall
time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _worker(rank: int, world: int, args, reps: int, warmup: int):
    from zerokern.bench import step

    provs = step._make_providers(args, rank, world)
    names = list(provs)
    cpu = {n: [] for n in names}
    wall = {n: [] for n in names}
    for rep in range(warmup + reps):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            provs[name][0]()
            dt = torch.tensor([(time.process_time() - c0) * 1e3,
                               (time.perf_counter() - w0) * 1e3], dtype=torch.float64)
            dist.all_reduce(dt[:1])                       # CPU: summed over ranks
            dist.all_reduce(dt[1:], op=dist.ReduceOp.MAX)  # wall: the slowest rank
            if rep >= warmup:
                cpu[name].append(float(dt[0]))
                wall[name].append(float(dt[1]))
    return {"cpu_ms": cpu, "wall_ms": wall} if rank == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench --step flags")
    a = p.parse_args(argv)
    from zerokern.bench import common, step
    from zerokern.tools.spawn import spawn_ranks

    bargs = step.parse_args([x for x in a.bench_args if x != "--"])
    res = spawn_ranks(_worker, bargs.nproc, bargs, a.reps, a.warmup, backend="gloo",
                      threads=max(1, common.usable_cpus() // bargs.nproc))[0]
    env = common.environment(torch.device("cpu"))
    env.update(world_size=bargs.nproc, model_size=bargs.model_size, precision=bargs.precision,
               batch=bargs.batch, seq=bargs.seq, reps=a.reps,
               zerokern_path=str(Path(step.__file__).resolve().parents[2]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"env": env, **res}, indent=1))
    for n in res["cpu_ms"]:
        c, w = sorted(res["cpu_ms"][n]), sorted(res["wall_ms"][n])
        print(f"{n:32s} cpu {c[len(c) // 2]:8.0f} ms   wall {w[len(w) // 2]:8.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
