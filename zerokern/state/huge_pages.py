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

[Note: freed mappings kept lazily]
Huge pages removed the fault per 4 KiB, not the cost of a fresh mapping: the kernel still
zeroes every page of it (clear_page: 5-21% of a stage-1 iteration in two perf recordings) and
may compact memory to find 2 MiB pages (one 92 MB mapping took 137 ms here, the next 8 ms). With
free_grads=True that is paid again at every step: stage 1 fp32 on the 20m GPT, 2 gloo ranks,
spent 322 ms of CPU per iteration over the bare model with its Ψ grad buffer freed and 95 with
it kept (benchmarks/results/engine-20m-n2-issue40-20261129-r3-stage1-phases.md). Keeping the
buffer would hold it between steps (0.96x DeepSpeed's memory, over issue 12's 0.9x).
So a grad-side buffer's mapping (`reuse=True`: the grad buffer, grad shards, staging and
accumulators, made again at every step) whose last tensor dies is not unmapped at once: it is
advised MADV_FREE and kept in `POOL` for the next buffer of the same size. Other buffers are not
pooled: pooling construction's temporaries too (stage 3's whole flat group, freed once sharded)
left 378 MiB per rank in the pool on the 20m GPT, never asked for again. MADV_FREE hands the
pages back to the kernel lazily: it reclaims them when it needs memory, without writing them
anywhere, and until then the next write reuses them without a fault. The memory is free in the
kernel's accounting (it counts them as reclaimable; RSS still shows them until reclaimed), so
`free_grads` still frees. A reused buffer's old bytes (or zeros, if reclaimed) are cleared with
one memset on warm pages; the full grad buffer skips even that (`maybe_zeros`: each param's view is
written or zeroed before it is read, [Note: no per-step memset], and its padding is zeroed).
Measured (92 MB, a copy into it, load ~4.7, 5 repetitions): a fresh buffer 111-176 ms, a
pooled one 51-89 ms plus 1.4 ms for the madvise, a kept one 73-115 ms.
The pool keeps at most POOL_PER_SIZE mappings of one size and POOL_MAX_BYTES in all
($ZEROKERN_HOST_POOL_MB); `POOL.bytes` is what it holds (the benchmarks report it as
reclaimable, not as held). No MADV_FREE (not Linux >= 4.5): no pool, as before.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

# Smaller buffers are served from malloc's heap (glibc raises its mmap threshold to 32 MiB
# after the first free), where a memset is cheap and 2 MiB pages would round them up.
MIN_BYTES = 4 << 20

_ANON = getattr(mmap, "MAP_ANONYMOUS", None)
_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)
_LAZY = getattr(mmap, "MADV_FREE", None)

# [Note: freed mappings kept lazily]: one step's freed buffers are a handful of sizes (the grad
# buffer per group, the grad shards, a staging bucket or two), so 4 per size covers a step;
# 8 GiB bounds what a job of changing sizes could leave advised in the pool.
POOL_PER_SIZE = 4
POOL_MAX_BYTES = int(float(os.environ.get("ZEROKERN_HOST_POOL_MB", 8192)) * 2**20)


class LazyPool:
    """Freed anonymous mappings, advised MADV_FREE, by size ([Note: freed mappings kept
    lazily]). Thread-safe: a tensor may die on the async writer's or a ring's thread."""

    def __init__(self, per_size: int = POOL_PER_SIZE, max_bytes: int = POOL_MAX_BYTES):
        self.per_size, self.max_bytes = per_size, max_bytes
        self._free: Dict[int, List[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self.bytes = 0      # held in the pool now (reclaimable by the kernel)
        self.reused = 0     # buffers served from the pool (tests, benchmarks)
        self.enabled = True  # False: take nothing, keep nothing (the benchmarks' before)

    def take(self, nbytes: int) -> Optional[mmap.mmap]:
        with self._lock:
            free = self._free.get(nbytes)
            if not free or not self.enabled:
                return None
            self.bytes -= nbytes
            self.reused += 1
            return free.pop()

    def give(self, mm: mmap.mmap) -> None:
        """The last tensor over `mm` is being freed: keep it, advised, or let it unmap."""
        n = len(mm)
        with self._lock:
            free = self._free.get(n, [])
            if not self.enabled or len(free) >= self.per_size or \
                    self.bytes + n > self.max_bytes:
                return  # not kept: unmapped once its last reference (the array's) is gone
            try:
                mm.madvise(_LAZY)
            except (OSError, ValueError):
                return
            self._free.setdefault(n, free).append(mm)
            self.bytes += n

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.bytes = 0


POOL = LazyPool()


def _mapping(nbytes: int, reuse: bool) -> tuple:
    """(an anonymous mapping of nbytes, whether it is fresh: zero without a memset)."""
    mm = POOL.take(nbytes) if reuse and _LAZY is not None else None
    if mm is not None:
        return mm, False
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _ANON)
    if _HUGE is not None:
        try:
            mm.madvise(_HUGE)
        except OSError:  # THP compiled out: 4 KiB pages, still zero
            pass
    return mm, True


def zeros(numel: int, dtype: torch.dtype, device, *, reuse: bool = False) -> torch.Tensor:
    """A zeroed 1-D tensor; on the CPU, large ones on their own huge-page mapping.

    reuse: a buffer made again at every step (the grads' side: freed at zero_grad or after
    its reduction): its mapping comes from and goes back to the lazy pool ([Note: freed
    mappings kept lazily]). Long-lived buffers (params, master, states) and construction's
    temporaries are not pooled: their pages go back to the kernel when they die."""
    t, fresh = _buffer(numel, dtype, device, reuse)
    if not fresh:
        t.zero_()
    return t


def maybe_zeros(numel: int, dtype: torch.dtype, device, *,
                reuse: bool = False) -> Tuple[torch.Tensor, bool]:
    """As `zeros`, without the memset of a reused mapping: (the tensor, whether it is zero).
    A reused one holds the pool's old bytes. For a buffer whose user writes or zeroes every
    element before reading it (the full grad buffer: [Note: no per-step memset] in
    grads/full_grads.py); a fresh mapping is left untouched (zeroing even its padding would
    fault in a 2 MiB page per padded spot).

    Args:
        numel: elements.
        dtype: element type.
        device: where (CPU buffers of at least MIN_BYTES come from a mapping).
        reuse: take and give back the mapping through the lazy pool.
    """
    return _buffer(numel, dtype, device, reuse)


def _buffer(numel: int, dtype: torch.dtype, device, reuse: bool) -> tuple:
    """(a 1-D tensor, whether it is zero): `zeros` and `maybe_zeros`."""
    device = torch.device(device)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or _ANON is None:
        return torch.zeros(numel, dtype=dtype, device=device), True
    mm, fresh = _mapping(nbytes, reuse)
    if _LAZY is None or not reuse:
        return torch.frombuffer(mm, dtype=dtype), True  # the tensor keeps the mapping alive
    # the tensor keeps the array alive and the array the mapping; when the array dies (the
    # last tensor over the mapping is gone) the mapping goes back to the pool
    arr = np.frombuffer(mm, dtype=np.uint8)
    # not at interpreter exit: a buffer still alive then (an atexit save reading it) must not
    # be advised free under its user
    weakref.finalize(arr, POOL.give, mm).atexit = False
    return torch.from_numpy(arr).view(dtype), fresh


def zeros_like(t: torch.Tensor, *, reuse: bool = False) -> torch.Tensor:
    return zeros(t.numel(), t.dtype, t.device, reuse=reuse).view(t.shape)
