"""Two training setups side by side in one pair of gloo ranks, iterations alternated, so both see
the same load: issue 20's ratios (stage s against DDP + fused AdamW, stage 3 against stage 2)
measured far more steadily than two `zerokern bench --step` rows on a shared machine.

    PYTHONPATH=. python benchmarks/step_paired_sides.py --a 2 --b 3 --pairs 30
    PYTHONPATH=. python benchmarks/step_paired_sides.py --a 2 --b 3:keep-all --pairs 30
    PYTHONPATH=. python benchmarks/step_paired_sides.py --a ddp --b 0 --pairs 30

A side is `ddp` (DDP(gradient_as_bucket_view=True, bucket_cap_mb=25) + torch AdamW(fused=True),
as `zerokern bench --step` builds it), a zerokern stage `0`-`3`, `3:keep-all` (stage 3 with
keep_for_backward_mb=inf), or `<stage>:tcp` (that stage over the send/recv rings instead of
shared memory, comm/shm.py). The 20m GPT, fp32, batch 2x32, one torch thread per rank, the same
init and data on both sides; per pair of iterations the ratio B/A, and the median over pairs with
its quartiles. `--json` appends the result to a file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _side(spec: str):
    """(model, optimizer, loss function) for one side."""
    import zerokern as zk
    from zerokern.bench.step import _ddp_loss
    from zerokern.tools.gpt import build_gpt

    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch.manual_seed(0)
    m = build_gpt("20m")
    if spec == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(m, gradient_as_bucket_view=True, bucket_cap_mb=25)
        return m, torch.optim.AdamW(m.parameters(), fused=True, **hp), (
            lambda x: _ddp_loss(ddp, x))
    stage, _, variant = spec.partition(":")
    if variant not in ("", "keep-all", "tcp") or (variant == "keep-all" and stage != "3"):
        raise ValueError(f"a side is ddp, 0-3, 3:keep-all or <stage>:tcp, got {spec!r}")
    opt = zk.ZeroAdamW(m, stage=int(stage), precision="fp32",
                       keep_for_backward_mb=math.inf if variant == "keep-all" else 0.0, **hp)
    if variant == "tcp":  # the send/recv rings, not shared memory (comm/shm.py)
        for c in (opt.comm, getattr(opt.grad_sync, "rs_comm", opt.comm)):
            for gc in c.group_comms():
                if gc.ring is not None:
                    gc.ring._shm = False
    return m, opt, (lambda x: m.loss(x[:, :-1], x[:, 1:]))


def _worker(rank: int, world: int, args):
    gen = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randint(0, 8192, (2, 33), generator=gen) for _ in range(4)]
    times = alternate({"A": _side(args.a), "B": _side(args.b)}, data, args.warmup, args.pairs)
    return times if rank == 0 else None


def alternate(sides, data, warmup: int, pairs: int):
    """Iterations of sides {"A"|"B": (model, optimizer, loss of a batch)} alternated (A, B,
    then B, A, ...), each timed on every rank between barriers (the slowest rank's time);
    the ms per side after `warmup` rounds. Also used by step_paired_ab.py."""
    times = {"A": [], "B": []}
    for rep in range(warmup + pairs):
        for name in (("A", "B") if rep % 2 == 0 else ("B", "A")):
            _, opt, loss_of = sides[name]
            x = data[rep % len(data)]
            dist.barrier()
            t0 = time.perf_counter()
            loss_of(x).backward()
            opt.step()
            opt.zero_grad()
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep >= warmup:
                times[name].append(float(dt) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="ddp, 0-3, 3:keep-all or <stage>:tcp")
    p.add_argument("--b", required=True, help="ddp, 0-3, 3:keep-all or <stage>:tcp")
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="append the result to this file")
    a = p.parse_args()
    from zerokern.tools.spawn import spawn_ranks

    t = spawn_ranks(_worker, 2, a, backend="gloo", threads=1)[0]
    ratios = sorted(b / x for x, b in zip(t["A"], t["B"]))
    q = len(ratios) // 4
    res = {"a": a.a, "b": a.b, "pairs": len(ratios), "a_ms": statistics.median(t["A"]),
           "b_ms": statistics.median(t["B"]), "b_over_a": statistics.median(ratios),
           "q1": ratios[q], "q3": ratios[-q - 1], "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                        time.gmtime())}
    print(f"A={a.a} {res['a_ms']:.1f} ms, B={a.b} {res['b_ms']:.1f} ms: B/A {res['b_over_a']:.3f}"
          f" (quartiles {res['q1']:.3f}-{res['q3']:.3f}, {len(ratios)} pairs)")
    if a.json is not None:
        old = json.loads(a.json.read_text()) if a.json.exists() else []
        a.json.write_text(json.dumps(old + [res], indent=1) + "\n")


if __name__ == "__main__":
    main()
