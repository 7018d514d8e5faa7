"""offload="nvme"'s bounded host pool: the buffer sets a step streams state chunks through
(offload_nvme.py), their sizes, and what the NVMe placement reports it holds (`NvmeBytes`:
estimate and memory_report read it; placement.py [Note: each placement reports its own
bytes]). The pool's chunk and depth, measured: aligned_io.py [Note: direct I/O, chunk and
depth, measured]."""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

from zerokern.rules import Rule
from zerokern.state import aligned_io as aio
from zerokern.state.nvme_state import file_bytes, granule, names, region_bytes, specs
from zerokern.state.pinned import host_empty

CHUNK_NUMEL = 1 << 22  # elements per request and file (aligned_io.py's Note)
QUEUE_DEPTH = 4        # buffer sets
_F32 = torch.float32


def rules_granule(rules) -> int:
    """The chunk granule that aligns every state of every rule (nvme_state.granule)."""
    g = 1
    for r in rules:
        g = math.lcm(g, granule(r))
    return g


def pool_chunk(state_numels: List[int], chunk_numel: int, gran: int = aio.ALIGN // 4) -> int:
    """The chunk actually used: never more than the largest buffer needs (small models), a
    multiple of `gran` (nvme_state.granule: every state's chunk offset stays aligned)."""
    return min(chunk_numel, aio.align_up(max(state_numels), gran))


def step_plan(buffers: Sequence[Tuple[int, Sequence[Tuple[int, ...]], Sequence[bool]]],
              chunk: int) -> List[Tuple[int, int, int, Tuple[int, ...], bool]]:
    """The chunks one step streams, in order: (buffer, lo, hi, files, write) for `buffers`
    given as (state elements, passes: the file indices each pass streams, DiskState.passes,
    and per pass whether it writes its chunks back, DiskState.writes), every pass over the
    buffer's whole range in `chunk`-element requests (offload_nvme.py; zerokern.bench.disk_probe
    replays the same list)."""
    return [(gi, lo, min(lo + chunk, n), files, write)
            for gi, (n, passes, writes) in enumerate(buffers)
            for files, write in zip(passes, writes) for lo in range(0, n, chunk)]


def request_span(half_bytes: int, half: int, lo: int, hi: int, dtype: torch.dtype,
                 block: int) -> Tuple[int, int]:
    """(file offset, bytes) of one state file's request for param elements [lo, hi) in half
    `half`: both 4096-aligned (O_DIRECT; nvme_state [Note: any StateSpec in a file, aligned]),
    the last request rounded up into the half's padding."""
    return (half * half_bytes + lo // block * dtype.itemsize,
            aio.align_up((hi - lo) // block * dtype.itemsize))


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
        self.job = None   # (gi, lo, hi, files, write): the chunk's state range in buffer gi
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

    def cut(self, x: int, y: int) -> List[torch.Tensor]:
        """Every carved state's part for the set's param elements [x, y) (whole blocks: x and
        y are bucket-piece or chunk bounds, multiples of 128)."""
        return [t[x // b:y // b] for t, (_, _, b) in zip(self.state, specs(self.rule))]


class NvmeBytes:
    """What the NVMe placement holds: measured (`host_bytes`, `disk_bytes`, from its pool and
    files) and predicted for a layout (`layout_bytes`, `fixed_bytes`, `disk_need`)."""

    def host_bytes(self) -> dict:
        pool = sum(t.untyped_storage().nbytes() for s in self.pool for t in s.tensors())
        return {**dict.fromkeys(self.names, 0),
                "host_staging": pool + self.scalars.untyped_storage().nbytes()}

    def disk_bytes(self) -> dict:
        out = dict.fromkeys(self.names, 0)
        for f in self.files:
            for nm, h in zip(f.names, f.halves):
                out[nm] += 2 * h
        return out

    # -- placement.py [Note: each placement reports its own bytes] ------------------------------
    @staticmethod
    def layout_bytes(rule: Rule, state_numel: int, state_padding: int, dtype: torch.dtype,
                     grad_dtype: torch.dtype, master: str = "fp32") -> dict:
        """One buffer's files: the master and each rule state, two aligned halves each."""
        return {"device": {}, "host": dict.fromkeys(names(rule), 0),
                "disk": {nm: file_bytes(state_numel, dt, b) for nm, dt, b in specs(rule)}}

    @staticmethod
    def fixed_bytes(rule: Rule, state_numels, dtype: torch.dtype,
                    grad_dtype: torch.dtype) -> dict:
        """The I/O pool (QUEUE_DEPTH sets at the default chunk) and the 2 host scalars.
        `rule` may be a MixedRules (ZeroMuon): a set holds the largest of its rules' file sets."""
        rules = list(getattr(rule, "rules", (rule,)))
        chunk = pool_chunk(list(state_numels), CHUNK_NUMEL, rules_granule(rules))
        param_e = 0 if dtype == torch.float32 else dtype.itemsize
        pool = QUEUE_DEPTH * set_bytes(chunk, grad_dtype.itemsize, param_e, rules)
        return {"device": {}, "host": {"host_staging": pool + 2 * 4}, "disk": None}

    @classmethod
    def disk_need(cls, rule, state_numels) -> int:
        """Disk bytes of the state files for buffers of these state sizes (free-space check);
        `rule` one Rule for all, or a list of one per buffer."""
        state_numels = list(state_numels)
        rules = list(rule) if isinstance(rule, (list, tuple)) else [rule] * len(state_numels)
        return sum(sum(cls.layout_bytes(r, n, 0, _F32, _F32)["disk"].values())
                   for r, n in zip(rules, state_numels))
