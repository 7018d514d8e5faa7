"""ZeRO-R's Pa: a checkpointed input split over the tensor-parallel ranks, and all-gathered
back before the recompute.

[Note: partitioned checkpoints]
The input of a checkpointed transformer layer is replicated over the TP ranks (each computes
it whole after the row-parallel all-reduce), so every TP rank would hold the same checkpoint.
With partition_activations each rank keeps one 1/tp piece of it instead: the flattened tensor
in `tp` pieces of ceil(numel / tp) elements (the last padded with zeros), rank r keeping piece
r. Before the recompute the pieces are all-gathered over the TP group and the padding cut off;
every TP rank recomputes from the same, whole input. Checkpoint bytes per rank: 1/tp (plus at
most tp - 1 padding elements). As DeepSpeed, only floating tensors with at least tp elements
are split; the rest are kept whole. The backward of every TP rank unpacks the same checkpoints
in the same order (they run the same graph), so the all-gathers pair up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import TPGroup


def splittable(t: torch.Tensor, tp: TPGroup) -> bool:
    return tp.size > 1 and t.is_floating_point() and t.numel() >= tp.size


def piece_numel(numel: int, tp: TPGroup) -> int:
    return -(-numel // tp.size)


def my_piece(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's piece of `t` (a view where no padding is needed, else a padded copy)."""
    flat = t.detach().reshape(-1)
    c = piece_numel(flat.numel(), tp)
    lo = tp.rank * c
    hi = min(lo + c, flat.numel())
    if hi - lo == c:
        return flat[lo:hi]
    out = flat.new_zeros(c)
    if hi > lo:
        out[: hi - lo].copy_(flat[lo:hi])
    return out


def gather(piece: torch.Tensor, numel: int, shape: torch.Size, tp: TPGroup) -> torch.Tensor:
    """The whole tensor from every rank's piece (one all-gather over the TP group)."""
    piece = piece.contiguous()
    out = piece.new_empty(piece.numel() * tp.size)
    flat_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        flat_gather(out, piece, group=tp.group)
    except (RuntimeError, NotImplementedError):  # a backend without the flat all-gather
        dist.all_gather(list(out.chunk(tp.size)), piece, group=tp.group)
    return out[:numel].view(shape)
