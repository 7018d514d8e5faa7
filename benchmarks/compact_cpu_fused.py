"""master="compact" on the CPU (issue 40): the fused AdamW op (csrc/cpu/compact_adam_cpu.cpp)
against the chunked three-pass chain it replaces (expand_ -> the cpu adam_step_ -> compact_,
per 2^20-element chunk, as CompactState.update_piece ran it), alternated A B A B in one
process, bf16 grads, per thread count.

    PYTHONPATH=. python3 benchmarks/compact_cpu_fused.py --sizes 20 24 --threads 1 2 --reps 9

Also the peer master="fp32" runs: the same AdamW kernel on an fp32 master in memory (28 B
per element moved against the fused op's 26). Prints per (n, threads): median ms of each
(rotated every repetition) and the ratios fused / chain and fused / fp32, with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from zerokern import kernels
from zerokern.state import compact_master as C

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _state(n: int):
    x = torch.randn(n)
    low = torch.empty(n, dtype=torch.int16)
    ties = torch.empty(n // 8, dtype=torch.uint8)
    C.compact_(low, ties, x)
    return dict(low=low, ties=ties, param=x.to(torch.bfloat16), master=x, m=torch.zeros(n),
                v=torch.zeros(n), grad=torch.randn(n).to(torch.bfloat16),
                step=torch.zeros((), dtype=torch.int64), nan=torch.zeros((), dtype=torch.bool))


def chain(s, scratch, gs, fi) -> None:
    n, step = s["low"].numel(), s["step"]
    st = step.clone()
    for lo in range(0, n, scratch.numel()):
        hi = min(n, lo + scratch.numel())
        x = scratch[:hi - lo]
        low, ties = s["low"][lo:hi], s["ties"][lo // 8:hi // 8]
        C.expand_(x, low, ties, s["param"][lo:hi])
        st.copy_(step)
        kernels.adam_step_(x, s["m"][lo:hi], s["v"][lo:hi], s["grad"][lo:hi],
                           s["param"][lo:hi], adamw=True, step=st, grad_scale=gs,
                           found_inf=fi, backend="cpu", **HYPER)
        C.compact_(low, ties, x, s["nan"])
    step.copy_(st)


def fused(s, scratch, gs, fi) -> None:
    C.compact_adam_step_(s["low"], s["ties"], s["param"], s["m"], s["v"], s["grad"], s["nan"],
                         adamw=True, step=s["step"], grad_scale=gs, found_inf=fi, **HYPER)


def fp32_master(s, scratch, gs, fi) -> None:
    """The peer: master="fp32"'s step on the same shard (the fp32 master in memory)."""
    kernels.adam_step_(s["master"], s["m"], s["v"], s["grad"], s["param"], adamw=True,
                       step=s["step"], grad_scale=gs, found_inf=fi, backend="cpu", **HYPER)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 24], help="log2 n")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    gs, fi = torch.tensor(1.0), torch.zeros((), dtype=torch.bool)
    rows = []
    for e in args.sizes:
        n = 1 << e
        s = _state(n)
        scratch = torch.empty(min(n, C.CHUNK_NUMEL))
        for th in args.threads:
            torch.set_num_threads(th)
            times = {"chain": [], "fused": [], "fp32": []}
            order = [("chain", chain), ("fused", fused), ("fp32", fp32_master)]
            for r in range(args.reps + 1):
                for name, fn in order[r % 3:] + order[:r % 3]:  # rotated
                    t0 = time.perf_counter()
                    fn(s, scratch, gs, fi)
                    if r:  # the first round warms up
                        times[name].append((time.perf_counter() - t0) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(log2n=e, threads=th, chain_ms=round(med["chain"], 3),
                       fused_ms=round(med["fused"], 3), fp32_ms=round(med["fp32"], 3),
                       ratio=round(med["fused"] / med["chain"], 3),
                       fused_vs_fp32=round(med["fused"] / med["fp32"], 3),
                       load=os.getloadavg()[0])
            rows.append(row)
            print(f"n=2^{e} threads={th}: chain {med['chain']:.2f} ms, fused "
                  f"{med['fused']:.2f} ms, fp32 master {med['fp32']:.2f} ms; fused/chain "
                  f"{row['ratio']:.2f}, fused/fp32 {row['fused_vs_fp32']:.2f} "
                  f"(load {row['load']:.2f})", flush=True)
    if args.out:
        from zerokern.bench.common import environment

        env = dict(environment(torch.device("cpu")), isa=C._native(gs).selected_isa())
        with open(args.out, "w") as fh:
            json.dump(dict(env=env, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
