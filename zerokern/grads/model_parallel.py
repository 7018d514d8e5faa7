"""The grad statistics of a ZeRO optimizer whose data-parallel ranks hold one slice of a model
split over model-parallel ranks (Megatron's `mpu`, `zerokern.initialize(mpu=...)`).

[Note: model-parallel grad stats] ZeRO shards over the mpu's data-parallel group, so the
optimizer's world (its agreement group) is that group: its found_inf/sumsq all-reduce covers
one model-parallel slice of the model. The global norm and the overflow skip must cover the
whole model, as DeepSpeed's (0.19.8 stage_1_and_2.py get_grad_norm_direct, stage3.py):
1. a param split over the tensor-parallel ranks (attribute `tensor_model_parallel` or
   `model_parallel` true, DeepSpeed's `is_model_parallel_parameter`) is counted on every
   model-parallel rank (each holds different elements);
2. any other param is replicated over the tensor-parallel ranks and counted on tensor-parallel
   rank 0 only (each element once), the others count its found_inf but not its sumsq;
3. after the data-parallel all-reduce, [found_inf, sumsq] is all-reduced (SUM) over the mpu's
   model-parallel group, so every rank of the job skips and clips alike.
Item 2 is exact: the counted sub-ranges of each shard piece are precomputed from the layout
(the same slot ranges the checkpoint uses), and `grad_stats_` runs over them, so no element
is counted and then subtracted.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


def is_model_parallel_param(p: torch.nn.Parameter) -> bool:
    """DeepSpeed's `is_model_parallel_parameter`: split over the tensor-parallel ranks."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


class ModelParallelStats:
    """[Note: model-parallel grad stats] for one optimizer.

    Args:
        group: the model-parallel process group (tensor x pipeline ranks), or None for 1.
        counts_replicated: True on tensor-parallel rank 0 (counts the replicated params).
        flat_groups: the optimizer's flat groups (`.params`, `.layout`, `.state_range(k)`).
    """

    def __init__(self, group, counts_replicated: bool, flat_groups) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.counts_replicated = counts_replicated
        # (gi, k) -> sub-ranges of the grad piece to count in sumsq; None: the whole piece
        self._spans: Dict[Tuple[int, int], Optional[List[Tuple[int, int]]]] = {}
        if counts_replicated:
            return
        for gi, g in enumerate(flat_groups):
            split = [is_model_parallel_param(p) for p in g.params]
            L = g.layout
            for k in range(L.n_buckets):
                lo, hi = g.state_range(k)
                spans = [(a - lo, b - lo) for i, a, b in L.overlaps(lo, hi) if split[i]]
                self._spans[(gi, k)] = spans

    def counted(self, piece: torch.Tensor, gi: int, k: int) -> List[torch.Tensor]:
        """The parts of grad piece (gi, k) this rank counts in a norm."""
        spans = self._spans.get((gi, k))
        return [piece] if spans is None else [piece[a:b] for a, b in spans]

    def stats_(self, piece: torch.Tensor, gi: int, k: int, found: torch.Tensor,
               sumsq: torch.Tensor, grad_stats_: Callable) -> None:
        """found |= any non-finite in piece; sumsq += the counted elements' squares."""
        if self._spans.get((gi, k)) is None:
            grad_stats_(piece, found, sumsq)
            return
        grad_stats_(piece, found, torch.zeros_like(sumsq))  # overflow: every element
        scratch = torch.zeros_like(found)
        for part in self.counted(piece, gi, k):
            grad_stats_(part, scratch, sumsq)

    def all_reduce_(self, stats: torch.Tensor, op=None) -> None:
        """Combine the data-parallel-reduced stats over the model-parallel ranks."""
        if self.size > 1:
            dist.all_reduce(stats, op=op or dist.ReduceOp.SUM, group=self.group)
