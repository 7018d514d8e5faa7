"""Page-locked host buffers of exactly the requested size (issue 14, defect 4).

`torch.empty(..., pin_memory=True)` goes through the CUDA caching host allocator, which rounds
every request up to a power of two (a 1.1 GiB fp32 master takes 2 GiB of page-locked RAM) and
keeps freed blocks cached for reuse. Offload's buffers are few, large and live as long as the
optimizer, so they gain nothing from that cache and the rounding made `memory_report()` under-
state pinned RAM by up to 2x. Here the memory is ordinary host memory (numpy's allocator, no
rounding), page-locked in place with cudaHostRegister, and unregistered just before it is freed.
`tensor.is_pinned()` is True for it and non_blocking copies from it are asynchronous, as for
the caching allocator's blocks.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from zerokern.platform.device import handle

# 64-byte alignment: the cpu kernel's AVX-512 loads, and 16-byte DMA alignment for the copies.
ALIGN = 64
# cudaHostRegisterPortable: pinned for every CUDA context (as torch's own pinned memory is).
_PORTABLE = 1

_lock = threading.Lock()
_stats = {"bytes": 0, "buffers": 0}


def pinned_bytes() -> int:
    """Bytes currently page-locked through `empty` (registered, exactly as requested)."""
    return _stats["bytes"]


def _unregister(ptr: int, nbytes: int) -> None:
    try:
        handle("cuda").host_unregister(ptr)
    finally:
        with _lock:
            _stats["bytes"] -= nbytes
            _stats["buffers"] -= 1


def empty(n: int, dtype: torch.dtype, align: int = ALIGN) -> torch.Tensor:
    """An uninitialised page-locked host tensor of n elements and exactly n * itemsize bytes.

    Raises RuntimeError when the pages cannot be locked (e.g. RLIMIT_MEMLOCK in a container).
    align: the address alignment (4096 for offload="nvme"'s O_DIRECT buffers).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = n * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    buf = raw[off:off + nbytes]  # a view: keeps `raw` alive as long as the tensor's storage
    ptr = buf.ctypes.data
    err = handle("cuda").host_register(ptr, nbytes, _PORTABLE)
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes failed (cudaError {err}): page-locked host "
            "memory is limited here (ulimit -l, container memlock limits); offload needs it")
    with _lock:
        _stats["bytes"] += nbytes
        _stats["buffers"] += 1
    # numpy clears weak references before it frees the data, so the pages are unregistered
    # while still mapped; views of the tensor hold the storage, which holds `raw`.
    fin = weakref.finalize(raw, _unregister, ptr, nbytes)
    fin.atexit = False  # at exit the process's memory goes anyway; CUDA may be torn down
    return torch.from_numpy(buf).view(dtype)


def host_empty(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """n elements of dtype on the host, page-locked (exactly n) when pin."""
    # Pinned: exactly n elements page-locked, not the caching host allocator's power-of-two
    # block (issue 14, defect 4; zerokern/pinned.py), so host_bytes() is what is locked.
    return empty(n, dtype) if pin else torch.empty(n, dtype=dtype)
