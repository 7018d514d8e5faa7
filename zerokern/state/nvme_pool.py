"""offload="nvme"'s bounded host pool: the buffer sets a step streams state chunks through
(offload_nvme.py), and their sizes (estimate and memory_report read `set_bytes`)."""

from __future__ import annotations

from typing import List, Tuple

import torch

from zerokern.state import aligned_io as aio
from zerokern.state.pinned import host_empty

_F32 = torch.float32


def pool_chunk(state_numels: List[int], chunk_numel: int) -> int:
    """The chunk actually used: never more than the largest buffer needs (small models)."""
    return min(chunk_numel, aio.align_up(max(state_numels), aio.ALIGN // 4))


def step_plan(state_numels: List[int], chunk: int) -> List[Tuple[int, int, int]]:
    """The chunks one step streams, in order: (buffer index, lo, hi) state elements, every
    buffer's whole range in `chunk`-element requests (offload_nvme.py; zerokern.bench.disk_probe
    replays the same list)."""
    return [(gi, lo, min(lo + chunk, n)) for gi, n in enumerate(state_numels)
            for lo in range(0, n, chunk)]


def request_span(half_bytes: int, half: int, lo: int, hi: int) -> Tuple[int, int]:
    """(file offset, bytes) of one file's request for state elements [lo, hi) in half `half`:
    4096-aligned both (O_DIRECT), the last request rounded up into the half's padding."""
    return half * half_bytes + lo * 4, aio.align_up((hi - lo) * 4)


def set_bytes(chunk: int, grad_e: int, param_e: int, n_files: int) -> int:
    """Host bytes of one buffer set: one fp32 chunk per state file (the master and the rule's
    states), a grad chunk, a param chunk (0 at fp32)."""
    return n_files * chunk * 4 + chunk * grad_e + chunk * param_e


class _Set:
    """One pooled buffer set and the chunk it holds: state[0] the master, state[1:] the rule's
    states, in file order."""

    def __init__(self, chunk: int, grad_dtype, dtype, pin: bool, n_files: int) -> None:
        self.raw = aio.aligned_empty(n_files * chunk * 4, pin)  # 4096-aligned: O_DIRECT
        f = self.raw.view(_F32)
        self.state = [f[i * chunk:(i + 1) * chunk] for i in range(n_files)]
        mv = memoryview(self.raw.numpy())
        self.mv = [mv[i * chunk * 4:(i + 1) * chunk * 4] for i in range(n_files)]
        self.grad = host_empty(chunk, grad_dtype, pin)
        self.param = None if dtype == _F32 else host_empty(chunk, dtype, pin)
        self.job = None   # (gi, lo, hi): the chunk's state range in buffer gi
        self.futs = []    # in-flight reads or writes
        self.h2d = None   # CUDA event: the param copy out of self.param has landed

    def tensors(self):
        return [t for t in (self.raw, self.grad, self.param) if t is not None]
