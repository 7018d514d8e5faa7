"""Paired A/B of issue 20's step changes inside one process, so both sides see the same load.

Two copies of the same zerokern stage (same model init, same data) train side by side in one pair
of gloo ranks, iterations alternated A, B, A, B, ...: A with the change switched off on that
optimizer's own objects (the code before it, re-created here), B as shipped. Per pair of
iterations the ratio B/A; the median over pairs and its spread are printed. On a shared machine
this is far steadier than two benchmark runs minutes apart.

    PYTHONPATH=. nice python benchmarks/step_paired_ab.py --change rs --stage 2 --pairs 60

Changes: `rs` (the ring reduce-scatter's last step into out, stages 2-3). Two others were
measured and reverted: the ring all-gather copying stage 3's shard on the ring thread
(1.014-1.035x: comm/collectives.py), and stage 0 all-reducing in quarter-bucket units (quiet
machine: paired 1.006 and 0.983, but `zerokern bench --step` put stage 0 at 1.126x DDP against
1.036x without it, 5 alternated runs: benchmarks/results/step-20m-n2-fp32-issue20-perf20.md).
"""

from __future__ import annotations

import argparse
import statistics
import types

import torch
from step_paired_sides import alternate  # (this folder: run as a script)


def _old_reduce_scatter(self, out, work):
    """comm/ring.py's reduce-scatter before [Note: the ring's last step lands in out]."""
    n, r = self.world_size, self.rank
    chunks = work.chunk(n)
    recv = torch.empty_like(chunks[0])
    for s in range(n - 1):
        self._exchange(chunks[(r - s - 1) % n], recv)
        chunks[(r - s - 2) % n].add_(recv)
    if out.data_ptr() != chunks[r].data_ptr():
        out.copy_(chunks[r])


def _switch_off(opt, change: str) -> None:
    gs = opt.grad_sync
    if change == "rs":  # the grad reductions' ring (stage 3 has its own group) and comm's
        comms = [opt.comm, getattr(gs, "rs_comm", opt.comm)]
        for ring in {id(c.shard.ring): c.shard.ring for c in comms}.values():
            ring.reduce_scatter = types.MethodType(_old_reduce_scatter, ring)
    else:
        raise ValueError(change)


def _worker(rank: int, world: int, args):
    import zerokern as zk
    from zerokern.tools.gpt import build_gpt

    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randint(0, 8192, (2, 33), generator=gen) for _ in range(4)]
    sides = {}
    for name in ("A", "B"):
        torch.manual_seed(0)
        m = build_gpt("20m")
        opt = zk.ZeroAdamW(m, stage=args.stage, **hp)
        if name == "A":
            _switch_off(opt, args.change)
        sides[name] = (m, opt, lambda x, m=m: m.loss(x[:, :-1], x[:, 1:]))
    times = alternate(sides, data, args.warmup, args.pairs)
    same = all(torch.equal(a, b) for a, b in zip(sides["A"][0].parameters(),
                                                 sides["B"][0].parameters()))
    return {"times": times, "same_params": same} if rank == 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--change", choices=("rs",), required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    from zerokern.tools.spawn import spawn_ranks
    res = spawn_ranks(_worker, 2, a, backend="gloo", threads=1)[0]
    A, B = res["times"]["A"], res["times"]["B"]
    ratios = sorted(b / x for x, b in zip(A, B))
    q = len(ratios) // 4
    print(f"change {a.change}, stage {a.stage}, {len(A)} pairs: A (off) median "
          f"{statistics.median(A):.1f} ms, B (on) {statistics.median(B):.1f} ms; B/A median "
          f"{statistics.median(ratios):.3f} (quartiles {ratios[q]:.3f}-{ratios[-q - 1]:.3f}); "
          f"params equal after training: {res['same_params']}")


if __name__ == "__main__":
    main()
