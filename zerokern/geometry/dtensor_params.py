"""Params that are DTensors (torch tensor parallelism): the optimizer works on their local shards.

[Note: a DTensor param is its local tensor] (issue 22, item 5)
`parallelize_module` (ColwiseParallel, RowwiseParallel, ...) turns a Linear's weight and bias
into `nn.Parameter(DTensor)` over the tensor-parallel mesh: `Shard(d)` or `Replicate()`. ZeRO
then runs on the data-parallel mesh only (FSDP2's convention), and every rank of a dp group holds
the same tp coordinate, so its local shards have the same shapes as its dp peers': a flat buffer
of *local* tensors is an ordinary flat buffer, sharded and reduced over dp exactly as plain
params are. What changes is only how a param's values and gradient are reached:
- values: the DTensor's `_local_tensor` becomes the view into the flat buffer (`p.data = view`
  would replace the DTensor by a plain tensor); the DTensor's own metadata (global shape,
  placements, dtype) stays as it is, so the dtype cannot change (precision must match);
- gradients arrive as DTensors with the param's placements (DTensor autograd all-reduces the
  grad of a `Replicate()` param over tp, as `from_local`'s backward does); a grad with other
  placements (a `Partial()` one) is redistributed to the param's first, so the local tensor is
  always this rank's part of the true gradient;
- what p.grad shows (stage 0's reduced views, stages 1-3's ReleasedGrad) is wrapped as a DTensor
  with the param's spec, so the user sees a grad of the param's kind.
Everything here reads host metadata only.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch


@functools.cache
def _dtensor_cls():
    """DTensor, or None (torch without distributed). Cached: asked for every param at every
    gather, free and grad (576 times per stage-3 iteration of the 20m GPT); the import
    statement took 0.32 us a call, the cached lookup 0.03 us."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return None
    return DTensor


def is_dtensor(t) -> bool:
    """True for a DTensor (or a Parameter wrapping one)."""
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (its values on this rank, no copy); t itself otherwise."""
    return t._local_tensor if is_dtensor(t) else t


def local_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """The shape of this rank's part of p (p's shape for a plain tensor)."""
    return tuple(local(p).shape)


def set_local_(p: torch.Tensor, t: torch.Tensor) -> None:
    """Make t (a plain tensor of p's local shape, or stage 3's 0-element stand-in of a freed
    param, whose any use then fails on shape as a plain freed param's) hold p's values from
    now on: the DTensor's local tensor, or `p.data` for a plain param."""
    if is_dtensor(p):
        if t.dtype != p.dtype:  # the DTensor's dtype is fixed metadata
            raise RuntimeError(f"zerokern: a DTensor param's local tensor must keep its dtype "
                               f"{p.dtype}; got {t.dtype}")
        p._local_tensor = t
    else:
        p.data = t


def is_replicated(p: torch.Tensor) -> bool:
    """True where every tp rank holds all of p (Replicate() placements, or a plain param of
    a tensor-parallel model); False for a tp-sharded DTensor (a Shard(d) placement)."""
    return not is_dtensor(p) or not any(pl.is_shard() for pl in p.placements)


def like_param(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t (local-shaped) shown as a tensor of p's kind: a DTensor with p's mesh and placements
    (sharing t, no copy) for a DTensor p; t itself otherwise."""
    if not is_dtensor(p):
        return t
    return _dtensor_cls()(t, p._spec, requires_grad=False)


__all__ = ["is_dtensor", "is_replicated", "local", "local_shape", "set_local_", "like_param"]
