"""grad_stats_ over a TP model's grad pieces: the tp-sharded and the tp-replicated elements
into separate sums, so the global norm counts each element once ([Note: the global norm over tp
and dp] in comm/tp.py).

A piece (a bucket's part of this rank's grads, flat range `state_range(k)`) interleaves params
of both kinds (a Rowwise weight, Shard(1), then its bias, Replicate()). Its runs of one kind are
found once, from the layout (host only), and each run is one grad_stats_ call: no mask, no
subtraction (the replicated sum is exact, not total minus sharded). Padding counts in neither
(it is zero, and found_inf cannot come from it).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from zerokern import kernels
from zerokern.geometry.dtensor_params import is_replicated


class TpStats:
    """Runs of one kind per (group, bucket) piece, and the stats call over them."""

    def __init__(self, groups) -> None:
        self.groups = groups  # the optimizer's flat buffers (stage 3: one per unit and group)
        self.replicated = [[is_replicated(p) for p in g.params] for g in groups]
        self._runs: Dict[Tuple[int, int], List[Tuple[int, int, bool]]] = {}

    def runs(self, gi: int, k: int) -> List[Tuple[int, int, bool]]:
        """(lo, hi, replicated) runs of piece (gi, k), relative to the piece."""
        if (gi, k) not in self._runs:
            g = self.groups[gi]
            lo, hi = g.state_range(k)
            out: List[Tuple[int, int, bool]] = []
            for i, a, b in g.layout.overlaps(lo, hi):
                rep = self.replicated[gi][i]
                if out and out[-1][2] == rep and out[-1][1] == a - lo:
                    out[-1] = (out[-1][0], b - lo, rep)
                else:
                    out.append((a - lo, b - lo, rep))
            self._runs[(gi, k)] = out
        return self._runs[(gi, k)]

    def stats_(self, gi: int, k: int, piece: torch.Tensor, stats: torch.Tensor,
               backend: str) -> None:
        """stats[0] |= found_inf, stats[1] += sumsq of the tp-sharded elements, stats[2] +=
        sumsq of the replicated ones, over piece (gi, k)."""
        lo, hi = self.groups[gi].state_range(k)
        if piece.numel() != hi - lo:
            raise RuntimeError(f"zerokern: grad piece ({gi}, {k}) has {piece.numel()} elements "
                               f"but covers flat range [{lo}, {hi})")
        flat = piece.reshape(-1)
        for a, b, rep in self.runs(gi, k):
            kernels.grad_stats_(flat[a:b], stats[0], stats[2 if rep else 1], backend=backend)


__all__ = ["TpStats"]
