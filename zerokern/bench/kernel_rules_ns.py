"""Muon's matrix part in the kernel benchmark: Newton-Schulz per matrix shape, and one whole
single-matrix Muon step, zerokern against torch.optim.Muon (issue 23).

[Note: what the Newton-Schulz rows time]
- "newton_schulz": zerokern's `newton_schulz` (rules/muon_orthogonalize.py) against torch's
  `torch.optim._muon._zeropower_via_newtonschulz` on the same fp32 matrix, 5 steps, bf16 as
  torch runs it. FLOPs per step for an (A, B) matrix with m = min(A, B), k = max(A, B):
  X X^T (2 m^2 k) + the quintic's gram @ gram (2 m^3) + poly @ X (2 m^2 k), so
  steps x (4 m^2 k + 2 m^3); GFLOP/s = that / median time. Compute-bound: there is no byte
  floor to compare with, the machine's bf16 matmul rate is the ceiling.
- "muon_step": one Muon step of one (A, B) param, end to end: zerokern's pieces (momentum_,
  newton_schulz, apply_, as its group step runs them on one rank that owns the matrix) against
  `torch.optim.Muon([p]).step()`. "% NS" is the median Newton-Schulz time of the same shape
  over the step's median: the part of a Muon step that element-wise fusion cannot touch.
Both sides run the same ops, so "vs torch" near 1.0 is the expected outcome; the rows are here
to show the cost per shape and catch a regression.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from . import common

Shape = Tuple[int, int]
DEFAULT_SHAPES: Tuple[Shape, ...] = ((256, 256), (512, 512), (512, 2048), (1024, 1024))
QUICK_SHAPES: Tuple[Shape, ...] = ((64, 64), (64, 256))
NS_STEPS = 5
COLUMNS = [("op", "op"), ("shape", "shape"), ("provider", "provider"),
           ("median_ms", "median ms"), ("p20_ms", "p20 ms"), ("p80_ms", "p80 ms"),
           ("gflops", "GFLOP/s"), ("pct_ns", "% NS"), ("speedup", "vs torch")]


def ns_flops(shape: Shape, steps: int = NS_STEPS) -> int:
    """FLOPs of `steps` quintic Newton-Schulz iterations on an (A, B) matrix (module Note)."""
    m, k = min(shape), max(shape)
    return steps * (4 * m * m * k + 2 * m ** 3)


def _timed(shape: Shape, device: torch.device) -> List[Tuple[str, str, Callable[[], None]]]:
    from torch.optim._muon import _zeropower_via_newtonschulz

    from ..rules.muon_orthogonalize import EPS, NS_COEFFICIENTS, newton_schulz
    from ..rules.muon_pieces import apply_, momentum_

    gen = torch.Generator(device=device).manual_seed(77 + shape[0] * 3 + shape[1])
    g = torch.randn(shape, generator=gen, device=device)
    out = []
    out.append(("newton_schulz", "zk", lambda: newton_schulz(g, NS_COEFFICIENTS, NS_STEPS, EPS)))
    out.append(("newton_schulz", "torch",
                lambda: _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, NS_STEPS, EPS)))
    # one Muon step each, on their own param and momentum, the same grad
    p_zk = torch.randn(shape, generator=gen, device=device)
    buf = torch.zeros(shape, device=device).view(-1)
    p_t = p_zk.clone().requires_grad_(True)
    p_t.grad = g.clone()
    opt = torch.optim.Muon([p_t], lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    flat, seg = p_zk.view(-1), [(0, p_zk.numel(), shape)]

    def zk_step():
        upd = momentum_(buf, g.view(-1), momentum=0.95, nesterov=True)
        o = newton_schulz(upd.view(shape), NS_COEFFICIENTS, NS_STEPS, EPS)
        apply_(flat, o.reshape(-1).float(), seg, lr=0.02, weight_decay=0.01, adjust_lr_fn=None)
    out.append(("muon_step", "zk", zk_step))
    out.append(("muon_step", "torch", opt.step))
    return out


def run(shapes: Sequence[Shape], device: torch.device, reps: int, warmup: int,
        flush) -> List[dict]:
    """Rows of both ops for every shape (one round-robin per shape)."""
    rows: List[dict] = []
    for shape in shapes:
        timed = _timed(shape, device)
        keys = [(f"{op}/{prov}", fn) for op, prov, fn in timed]
        times: Dict[str, List[float]] = common.round_robin(keys, device, reps, warmup, flush)
        med = {}
        for op, prov, _ in timed:
            s = common.summarize(times[f"{op}/{prov}"])
            med[(op, prov)] = s["median_ms"]
            rows.append(dict(op=op, shape=f"{shape[0]}x{shape[1]}", provider=prov, **s,
                             gflops=ns_flops(shape) / s["median_ms"] / 1e6))
        for r in rows[-len(timed):]:
            r["speedup"] = med[(r["op"], "torch")] / r["median_ms"]
            if r["op"] == "muon_step":
                r["pct_ns"] = 100 * med[("newton_schulz", r["provider"])] / r["median_ms"]
                r["gflops"] = None  # the step's rate is the NS row's; here time matters
    return rows


def title() -> str:
    return (f"Newton-Schulz ({NS_STEPS} steps, bf16, as torch.optim.Muon) and one Muon step of "
            "one matrix; vs torch = torch's time / time; % NS = NS time / step time")
