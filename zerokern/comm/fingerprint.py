"""Telling whether a tensor is bitwise the same on every rank without moving it: an int64
fingerprint of its bits, compared across the ranks with one small all-reduce. Used where ranks
must hold equal values and a divergence would train silently wrong: the model at construction
(core/model_sync.py [Note: ranks start from the first rank's weights]) and stage 3's params
changed inside gathered_params(modify=True) (stage3/runtime.py [Note: a write on some ranks
only])."""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch

_CHUNK = 1 << 22  # elements per fingerprint pass (a 32 MiB int64 temporary)


def fingerprint(t: torch.Tensor) -> int:
    """An int64 fingerprint of t's bits: sum over elements of bits(x_i) * w(i) with int64
    wrap-around, w(i) in [1, 2^31) a pseudo-random function of the position, so a changed
    bit, a swap of two elements or a sign of zero changes it (barring a 2^-64-ish collision).
    Bitwise equal tensors give the same value on every rank (integer sums do not depend on the
    order). One pass over t on its device.

    Args:
        t: any dense tensor (a float, integer, bool or complex dtype).
    """
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    x = x.contiguous()
    es = x.element_size()
    # the bits as integers of at most 4 bytes (8-byte elements: two int32 each)
    x = x.view(torch.uint8 if es == 1 else torch.int16 if es == 2 else torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for lo in range(0, x.numel(), _CHUNK):
        v = x[lo:lo + _CHUNK].to(torch.int64)
        i = torch.arange(lo, lo + v.numel(), dtype=torch.int64, device=x.device)
        w = (i % 2147483629) * 48271 % 2147483647 + 1  # < 2^31: v * w never overflows
        total += (v * w).sum()
    return int(total)


def differ_across_ranks(values: Sequence[int], all_reduce_max: Callable[[torch.Tensor], None],
                        device=None) -> List[int]:
    """The indices i where values[i] (an int64 per rank, e.g. a fingerprint) is not the same on
    every rank: one MAX all-reduce of [v, -v] (the MAX of -v is -MIN of v, int64 wrap-around
    included). Collective over the ranks `all_reduce_max` reduces over; the same answer on each.

    Args:
        values: this rank's values, the same count on every rank.
        all_reduce_max: all-reduces an int64 tensor with MAX, in place.
        device: where the tensor goes for the all-reduce (an NCCL group's device).
    """
    v = torch.tensor(list(values), dtype=torch.int64)
    both = torch.cat([v, -v])
    if device is not None:
        both = both.to(device)
    all_reduce_max(both)
    both = both.cpu()
    k = v.numel()
    return torch.nonzero(both[:k] != -both[k:]).reshape(-1).tolist()
