"""Muon's element-wise halves on one rank's flat state pieces (torch.optim.Muon's arithmetic).

A Muon step over a flat buffer is three phases; only the middle one needs whole matrices:
1. `momentum_`: buf <- lerp(buf, g, 1 - momentum); the update is lerp(g, buf, momentum)
   (Nesterov) or buf, element by element on this rank's pieces;
2. orthogonalize the update, one owner per matrix (muon_orthogonalize.ShardedOrthogonalizer);
3. `apply_`: p <- p·(1 - lr·wd) - adjusted_lr(shape)·O, per param segment of the pieces
   (the lr scale depends on the matrix's shape, so it is applied segment by segment).
The same ops as torch.optim.Muon in the same order, so a piece's result is torch's bit for bit
where the inputs are (tests/rules/test_muon_pieces.py).

Skipped steps (fp16 overflow) change nothing, without a host sync: the new values are
selected with `torch.where(found_inf, old, new)` on the device, as the fused kernels do.

[Note: selected in place]
The selection writes straight into the state (`torch.where(..., out=buf)`: elementwise, so the
output may alias an input) instead of into a temporary copied back, and phase 1 returns its
fresh `new` without a clone: two passes fewer per phase. momentum_ + apply_ on 2^22 elements,
one thread, interleaved 9 times on the loaded 2-core VM: median 46.4 ms before, 29.7 ms after
(the bench --kernels Muon rows had measured these parts at 0.24-0.57x plain torch ops).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from zerokern.rules.muon_orthogonalize import adjusted_lr


def momentum_(buf: torch.Tensor, grad: torch.Tensor, *, momentum: float, nesterov: bool,
              grad_scale: Optional[torch.Tensor] = None,
              found_inf: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Phase 1 on a piece, in place on `buf`; returns the (S,) fp32 update to orthogonalize.

    Args:
        buf: (S,) fp32 momentum buffer piece.
        grad: (S,) grad piece, any float dtype (the reduced, rank-averaged sum).
        momentum, nesterov: torch.optim.Muon's.
        grad_scale: 0-d fp32 device tensor (1/loss_scale · clip coefficient), or None.
        found_inf: 0-d bool device tensor: True leaves `buf` unchanged (the returned update is
            then not used).
    """
    g = grad.float()
    if grad_scale is not None:
        g = g * grad_scale
    new = buf.lerp(g, 1 - momentum)
    # [Note: selected in place] where(..., out=buf): one pass, no temporary and no copy back
    # (elementwise, so the output may be an input); `new` is ours to return uncloned.
    if found_inf is None:
        buf.copy_(new)
    else:
        torch.where(found_inf, buf, new, out=buf)
    return g.lerp(new, momentum) if nesterov else new


def apply_(master: torch.Tensor, ortho: torch.Tensor,
           segments: Sequence[Tuple[int, int, Sequence[int]]], *, lr: float,
           weight_decay: float, adjust_lr_fn: Optional[str],
           found_inf: Optional[torch.Tensor] = None) -> None:
    """Phase 3 on a piece, in place on `master`.

    Args:
        master: (S,) fp32 params (or their fp32 master) piece.
        ortho: (S,) orthogonalized update, same coordinates.
        segments: (start, end, matrix shape) within the piece, one per param it holds.
        lr, weight_decay, adjust_lr_fn: the group's.
        found_inf: 0-d bool device tensor: True leaves `master` unchanged.
    """
    for lo, hi, shape in segments:
        p = master[lo:hi]
        new = p.mul(1 - lr * weight_decay)
        new.add_(ortho[lo:hi], alpha=-adjusted_lr(lr, adjust_lr_fn, shape))
        if found_inf is None:
            p.copy_(new)
        else:  # [Note: selected in place]
            torch.where(found_inf, p, new, out=p)
