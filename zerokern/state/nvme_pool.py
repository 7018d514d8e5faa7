"""offload="nvme"'s bounded host pool: the buffer sets a step streams state chunks through
(offload_nvme.py), and their sizes (estimate and memory_report read `set_bytes`)."""

from __future__ import annotations

from typing import List, Sequence

import torch

from zerokern.rules import Rule
from zerokern.state import aligned_io as aio
from zerokern.state.nvme_state import region_bytes, specs
from zerokern.state.pinned import host_empty

_F32 = torch.float32


def pool_chunk(state_numels: List[int], chunk_numel: int, gran: int = aio.ALIGN // 4) -> int:
    """The chunk actually used: never more than the largest buffer needs (small models), a
    multiple of `gran` (nvme_state.granule: every state's chunk offset stays aligned)."""
    return min(chunk_numel, aio.align_up(max(state_numels), gran))


def state_set_bytes(rules: Sequence[Rule], chunk: int) -> int:
    """Bytes of a set's state regions: enough for the largest file set among `rules` (one
    region per file, each 4096-aligned: nvme_state [Note: any StateSpec in a file, aligned])."""
    return max(sum(region_bytes(r, chunk)) for r in rules)


def set_bytes(chunk: int, grad_e: int, param_e: int, rules: Sequence[Rule]) -> int:
    """Host bytes of one buffer set: the state regions (the master and the rule's states, in
    their dtypes), a grad chunk, a param chunk (0 at fp32)."""
    return state_set_bytes(rules, chunk) + chunk * grad_e + chunk * param_e


class _Set:
    """One pooled buffer set and the chunk it holds. `state`/`mv`: per file of the chunk's
    buffer (the master, then the rule's states, in file order), carved from `raw` by `carve`
    for the buffer's rule when a job is assigned."""

    def __init__(self, chunk: int, grad_dtype, dtype, pin: bool, rules: Sequence[Rule]) -> None:
        self.chunk = chunk
        self.raw = aio.aligned_empty(state_set_bytes(rules, chunk), pin)  # 4096-aligned
        self._mv = memoryview(self.raw.numpy())
        self.grad = host_empty(chunk, grad_dtype, pin)
        self.param = None if dtype == _F32 else host_empty(chunk, dtype, pin)
        self.job = None   # (gi, lo, hi, files): the chunk's state range in buffer gi
        self.state: List[torch.Tensor] = []
        self.mv: List[memoryview] = []
        self.rule = None  # the rule `state` is carved for
        self.futs = []    # in-flight reads or writes
        self.h2d = None   # CUDA event: the param copy out of self.param has landed

    def carve(self, rule: Rule) -> None:
        """Views of `raw` for `rule`'s files: region i holds state i's chunk, in its dtype."""
        if self.rule is rule:
            return
        self.state, self.mv, off = [], [], 0
        for (_, dt, b), n in zip(specs(rule), region_bytes(rule, self.chunk)):
            self.state.append(self.raw[off:off + n].view(dt)[:self.chunk // b])
            self.mv.append(self._mv[off:off + n])
            off += n
        self.rule = rule

    def tensors(self):
        return [t for t in (self.raw, self.grad, self.param) if t is not None]
