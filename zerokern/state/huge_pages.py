"""Zeroed host buffers on 2 MiB pages, for the large buffers made again at every step.

With `free_grads=True` (what `zerokern.initialize` sets, to hold DeepSpeed's memory profile)
the grad buffer (stages 0-1: Ψ elements), the grad shards and the staging buckets (stages 2-3)
are freed at `zero_grad()` and allocated again by the next backward. A fresh buffer that large
is a fresh anonymous mapping from malloc, so its first touch takes one page fault per 4 KiB
(22,528 for the 20m GPT's 88 MiB fp32 grads), and `torch.zeros` writes it once more on top.
Measured on the 2-core CI VM (88 MiB fp32, one thread, then `buf += grad`): `torch.zeros`
80 ms, an anonymous mapping advised MADV_HUGEPAGE 26 ms, adding into a warm buffer 19 ms.

So a CPU buffer of at least MIN_BYTES comes from its own anonymous mapping, advised to use
transparent huge pages (honoured when THP is `always` or `madvise`, the usual Linux default;
otherwise it is an ordinary mapping, still zero without a memset). Its pages read as zero, so
no memset is needed; the mapping is unmapped when the last tensor viewing it is freed, so
`free_grads` really returns the memory. Anything else (CUDA, meta, small buffers, no mmap)
is `torch.zeros`.

[Note: streams at one page offset]
The update kernels stream over several buffers in lockstep: the grads, the master (or the flat
params at fp32), the rule's states. The grads came from here (page-aligned) and the others from
torch's allocator, whose large blocks start 64 bytes into a page; so at stage 0 each iteration's
grad load (16 fp32 lanes = 64 bytes) had the low 12 address bits of the previous iteration's
stores, and a load that matches a pending store's low 12 bits waits for it (4K aliasing).
Measured on this 2-core AMD EPYC, the 20m GPT's fp32 stage-0 update (4 buckets, one thread):
18.7 ms on the optimizer's buffers, 14.1-15.5 ms with only the grads swapped for copies at
another offset; shifting the grad buffer by 64 bytes alone took step() from 23.0 to 20.0 ms.
At stages 1-2 the master pieces sit in the full flat buffer, a multiple of 512 bytes (ALIGN
fp32 elements) from the grad-shard and state pieces (on the 20m GPT: 0 mod 4 KiB at N = 2, 4,
8; 1-3 KiB at N = 3, a store 16 or more iterations back). So the flat param
buffer (layout/flat_group.py), the master and the states (placement.py) and stage 3's param
shards (sharded_flat.py) come from here too: every large stream starts on a page (and gets
2 MiB pages, fewer TLB misses). step() at world size 1: 23.0 -> 17.0 ms (torch's fused AdamW
over the same params: 15.7 ms); paired in one pair of gloo ranks against the previous
allocation (30 pairs): the iteration 0.969x at stage 0, 0.962x at stage 2.
"""

from __future__ import annotations

import mmap

import torch

# Smaller buffers are served from malloc's heap (glibc raises its mmap threshold to 32 MiB
# after the first free), where a memset is cheap and 2 MiB pages would round them up.
MIN_BYTES = 4 << 20

_ANON = getattr(mmap, "MAP_ANONYMOUS", None)
_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)


def zeros(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed 1-D tensor; on the CPU, large ones on their own huge-page mapping."""
    device = torch.device(device)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or _ANON is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _ANON)
    if _HUGE is not None:
        try:
            mm.madvise(_HUGE)
        except OSError:  # THP compiled out: 4 KiB pages, still zero
            pass
    return torch.frombuffer(mm, dtype=dtype)  # the tensor keeps the mapping alive


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    return zeros(t.numel(), t.dtype, t.device).view(t.shape)
