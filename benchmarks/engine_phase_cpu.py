"""Engine overhead per phase (issue 40): process and main-thread CPU time of forward, backward
and step for the bare model, `zerokern.initialize` and `deepspeed.initialize` on the same
config as `zerokern bench --engine`, plus zerokern variants, in one pair of gloo ranks, the
contestants rotated every repetition.

    PYTHONPATH=. python3 benchmarks/engine_phase_cpu.py --stage 2 --precision fp32 \\
        --variants freed --reps 12

Variants (zerokern built the same way, then changed):
- `freed`: grad buffers freed at every step (`free_on_zero = True`): the engine before issue
  40's third round at stages 2-3 ([Note: the engine keeps its grad shard], engine/build.py);
- `kept`: grad buffers kept between steps (`free_on_zero = False`), whatever the memory;
- `plain`, `plainkept`: no compact master at bf16 (a plain fp32 one), freed / kept.
- `nopool`: the engine as built, with the lazy pool of freed host mappings off around its
  iterations (state/huge_pages.py [Note: freed mappings kept lazily]): the engine before it.

Printed per rank: medians of process CPU | main-thread CPU per phase, ms. Process minus main
thread is the ring threads' share (the collectives). The per-phase split is what the bench's
whole-iteration numbers cannot show; the overhead ratios themselves come from the bench.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

from zerokern.bench.engine import config
from zerokern.tools.spawn import spawn_ranks

PHASES = ("fwd", "bwd", "step")


def _worker(rank: int, world: int, args) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.nn.functional as F

    import zerokern
    import zerokern.engine.build as build
    from zerokern.tools.gpt import build_gpt

    torch_linear = F.linear
    cfg = config(args.stage, args.precision, args.batch)
    bare = build_gpt(args.model_size, seed=0)
    if args.precision == "bf16":
        bare.to(torch.bfloat16)
    engines = {"bare": (None, bare, torch_linear)}
    builds = [("zk", zerokern.initialize), ("ds", deepspeed.initialize)]
    builds += [(v, zerokern.initialize) for v in args.variants]
    for name, init in builds:
        model = build_gpt(args.model_size, seed=0)
        rules_take = build._rules_take
        if name.startswith("plain"):
            build._rules_take = lambda *a, **k: False  # no compact master
        try:
            eng = init(model=model, model_parameters=model.parameters(),
                       config=copy.deepcopy(cfg))[0]
        finally:
            build._rules_take = rules_take
        if name in ("freed", "plain"):
            eng.optimizer.grad_sync.free_on_zero = True
        elif name in ("kept", "plainkept"):
            eng.optimizer.grad_sync.free_on_zero = False
        engines[name] = (eng, model, F.linear)
        F.linear = torch_linear
    out = {n: {p + s: [] for p in PHASES for s in ("", "_main")} for n in engines}

    from zerokern.state.huge_pages import POOL

    def iteration(name: str, record: bool) -> None:
        eng, model, linear = engines[name]
        F.linear = linear
        POOL.enabled = name != "nopool"
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, model.config.vocab, (args.batch, args.seq + 1), generator=g)
        dist.barrier()
        marks = [(time.process_time(), time.thread_time())]
        logits = (eng or model)(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               x[:, 1:].reshape(-1))
        marks.append((time.process_time(), time.thread_time()))
        if eng is None:
            loss.backward()
        else:
            eng.backward(loss)
        marks.append((time.process_time(), time.thread_time()))
        if eng is None:
            for p in model.parameters():
                p.grad = None
        else:
            eng.step()
        marks.append((time.process_time(), time.thread_time()))
        F.linear = torch_linear
        if record:
            for j, ph in enumerate(PHASES):
                out[name][ph].append((marks[j + 1][0] - marks[j][0]) * 1e3)
                out[name][ph + "_main"].append((marks[j + 1][1] - marks[j][1]) * 1e3)

    names = list(engines)
    for rep in range(args.warmup + args.reps):
        for i in range(len(names)):
            iteration(names[(i + rep) % len(names)], rep >= args.warmup)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--variants", nargs="*", default=["freed"],
                   choices=["freed", "kept", "plain", "plainkept", "nopool"])
    p.add_argument("--model-size", default="20m")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    print("load", os.getloadavg())
    res = spawn_ranks(_worker, 2, args, threads=1)
    print("load", os.getloadavg())
    med = statistics.median
    for r, per in enumerate(res):
        print(f"rank {r}: median ms, process CPU | main-thread CPU")
        for n, d in per.items():
            cells = "  ".join(f"{ph} {med(d[ph]):6.1f}|{med(d[ph + '_main']):6.1f}"
                              for ph in PHASES)
            total = med([sum(x) for x in zip(*(d[ph] for ph in PHASES))])
            print(f"  {n:9s} {cells}  total {total:6.1f}")


if __name__ == "__main__":
    main()
