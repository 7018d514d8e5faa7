"""offload="nvme"'s per-buffer state: the master and each of the rule's states in a file of its
own (`DiskState`; `names(rule)`: "master" then the rule's state names, zerokern.rules), made
without ever holding them in memory. The step that streams them is offload_nvme.py.

Each file has two halves of `align_up(numel * itemsize)` bytes (a step reads one half and
writes the other, offload_nvme.py [Note: all or nothing]); numel and itemsize are the state's
(zerokern.rules.StateSpec: the master and AdamW's moments S fp32 elements, S = the buffer's
state elements; 8-bit AdamW's codes S bytes, its absmax S/128 fp32). `master` and
`states[name]` are shared mmap views of the current half, in the state's dtype (Note: where
the state is visible).

[Note: any StateSpec in a file, aligned]
A step moves chunks of `chunk` param elements (offload_nvme.py); chunk lo of a state with
block b and itemsize i starts at byte lo / b * i of its half. O_DIRECT needs that offset to be a
multiple of 4096 (aligned_io.ALIGN), so the chunk is a multiple of every state's `granule`,
4096 * b / i param elements: 1024 for fp32 per element, 4096 for uint8 codes, 131072 for an
fp32 absmax per 128 elements (`granule(rule)`, the least common multiple). Each state's half is
padded up to 4096 bytes, so the last chunk's request (its length rounded up to 4096) stays
inside the half, and in the host pool every state's region of a set starts 4096-aligned
(nvme_pool.py). The padding is zeros that no view reaches. 8-bit AdamW moves 12.125 bytes per
element per step instead of AdamW's 24; its step over NVMe took 4.4 s against 3.6 s on the device
(median, 23.2M GPT, 1 process, stage 2, bf16, 2 loaded cores; benchmarks/results/
nvme-rules-step.md): the same cpu kernel plus the I/O.

[Note: where the state is visible]
The buffer's master and states (its DiskState's, nvme_state.py) are shared mmap
views of the current half of the files (re-pointed at each flip), so state_dict(),
zerokern.checkpoint (save reads them, load writes them), model_sync and stage 3's write-back
read and write the files themselves, with no RAM copy. The step never touches the mappings:
it reads and writes with O_DIRECT, which writes back dirty mapped pages before it reads a
range and invalidates cached pages of a range it writes, so the two paths stay coherent and
the page cache holds no second copy of the state.
Pages that a checkpoint or state_dict() touched through the mappings would stay mapped (in
RSS, up to the whole state); each flip therefore maps the files afresh and drops their clean
cached pages (fadvise DONTNEED), so they leave RSS and the page cache at the next step.

[Note: lazy state under offload="nvme"]
The state of a model larger than the host's memory (2B params: 24 GB of fp32 master, m and v)
must never be whole in RAM, not even while the optimizer is built. So no buffer allocates it
and hands it over: `DiskState.create` preallocates the files (fallocate: zeros, which is
every rule state's initial value, and both halves, so a full disk fails here and not in a
step), then writes the master from the params' original values one chunk (CHUNK_NUMEL elements, 16
MiB) at a time through one bounded buffer, with O_DIRECT where the file system takes it (no page
cache either), else buffered and dropped from the cache. Peak host memory while building is
the params plus that one chunk, not 12 bytes per param (tests/state/test_offload_nvme.py
measures it in a fresh process).
"""

from __future__ import annotations

import math
import os
from typing import List, Tuple

import torch

from zerokern.rules import Rule, RuleState
from zerokern.state import aligned_io as aio

WRITE_CHUNK = 1 << 22  # elements per master write at creation (16 MiB; aligned_io's Note)
_F32 = torch.float32


def names(rule: Rule) -> Tuple[str, ...]:
    """The files of one buffer, in order: the master, then the rule's states."""
    return ("master", *rule.state_names)


def specs(rule: Rule) -> List[Tuple[str, torch.dtype, int]]:
    """(name, dtype, block) of each file of one buffer, in `names` order."""
    return [("master", _F32, 1)] + [(s.name, s.dtype, s.block) for s in rule.states]


def half_bytes(state_numel: int, dtype: torch.dtype, block: int) -> int:
    """Bytes of one half of a state's file (Note: any StateSpec in a file, aligned)."""
    return aio.align_up(state_numel // block * dtype.itemsize)


def granule(rule: Rule) -> int:
    """The param elements every chunk is a multiple of, so every state's chunk offset is
    4096-aligned (Note: any StateSpec in a file, aligned)."""
    g = 1
    for _, dt, b in specs(rule):
        g = math.lcm(g, aio.ALIGN * b // dt.itemsize)
    return g


def region_bytes(rule: Rule, chunk: int) -> List[int]:
    """Bytes of each state's region in a pool set of `chunk` param elements (4096-aligned)."""
    return [half_bytes(chunk, dt, b) for _, dt, b in specs(rule)]


def passes(rule: Rule) -> List[Tuple[int, ...]]:
    """The file indices each pass of a buffer's step streams, in order: all of them once for a
    per-piece rule; a phased rule's `nvme_passes` (offload_nvme.py [Note: a phased rule over
    NVMe])."""
    nms = names(rule)
    if not rule.phased:
        return [tuple(range(len(nms)))]
    return [tuple(nms.index(n) for n in p) for p in rule.nvme_passes]


def writes(rule: Rule) -> List[bool]:
    """Per pass of `passes(rule)`, whether its chunks are written back: all but a phased rule's
    `nvme_read_passes` (offload_nvme.py [Note: a read pass writes nothing])."""
    if not rule.phased:
        return [True]
    return [i not in rule.nvme_read_passes for i in range(len(rule.nvme_passes))]


class DiskState(RuleState):
    """One buffer's master and rule states in files (`names(rule)`); steps (n_buckets,) int64
    on the host. `n` state elements; `halves[i]` bytes per half of file i (`half`: the
    master's)."""

    def __init__(self, buf, index: int, rank: int, root: str, tag: str, rule: Rule) -> None:
        self.n = buf.state_numel
        self.rule = rule
        self.specs = specs(rule)
        # bytes; O_DIRECT offsets of half 1 stay aligned
        self.halves = [half_bytes(self.n, dt, b) for _, dt, b in self.specs]
        self.half = self.halves[0]
        self.names = names(rule)
        self.index_states(rule)
        self.paths = [os.path.join(root, f"zerokern-{tag}-rank{rank}-buf{index}-{nm}.bin")
                      for nm in self.names]
        self.fds: List[int] = []
        self.maps: List[torch.Tensor] = []
        self.master = None
        self.states = {}
        self.steps = torch.zeros(buf.layout.n_buckets, dtype=torch.int64)

    def device_tensors(self):
        return {}  # on disk: offload_nvme's disk_bytes

    def create(self, buf, direct: bool) -> None:
        """Create and preallocate the three files and write the master (Note: lazy state).
        Raises OSError naming the file."""
        for i, p in enumerate(self.paths):
            fd = aio.open_state(p, False, create=True)
            self.fds.append(fd)
            try:
                os.posix_fallocate(fd, 0, 2 * self.halves[i])  # zeros, both halves
            except OSError as e:
                raise OSError(e.errno, e.strerror, p) from e
            if direct:  # the master's writes bypass the page cache too
                os.close(fd)
                fd = self.fds[-1] = aio.open_state(p, True, create=False)
            if i == 0:
                self._write_master(buf, fd, p)
            if not direct:
                aio.drop_cache(fd)  # the buffered writes went through the page cache

    def _write_master(self, buf, fd: int, path: str) -> None:
        chunk = min(WRITE_CHUNK, aio.align_up(self.n, aio.ALIGN // 4))
        raw = aio.aligned_empty(chunk * 4, pin=False)  # 4096-aligned: O_DIRECT
        vals = raw.view(_F32)
        mv = memoryview(raw.numpy())
        for lo in range(0, self.n, chunk):
            m = min(chunk, self.n - lo)
            vals.zero_()  # padding (and the tail of the last request) stays 0, as in RAM
            buf.fill_master_(vals[:m], lo)
            aio.pwrite_full(fd, mv[:aio.align_up(m * 4)], lo * 4, path)

    def point(self, cur: int, remap: bool = False) -> None:
        """master and the states become views of half `cur`. remap: map the files
        afresh and drop their clean cached pages (offload_nvme.py [Note: where the state is
        visible])."""
        if remap or not self.maps:
            self.maps = [torch.from_file(p, shared=True, size=2 * h // dt.itemsize, dtype=dt)
                         for p, h, (_, dt, _b) in zip(self.paths, self.halves, self.specs)]
        if remap:
            for fd in self.fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        views = []
        for m, h, (_, dt, b) in zip(self.maps, self.halves, self.specs):
            off = cur * h // dt.itemsize
            views.append(m[off:off + self.n // b])
        self.master = views[0]
        self.states = dict(zip(self.names[1:], views[1:]))

    def passes(self) -> List[Tuple[int, ...]]:
        """The file indices each pass of this buffer's step streams (`passes(rule)`)."""
        return passes(self.rule)

    def writes(self) -> List[bool]:
        """Per pass, whether its chunks are written back (`writes(rule)`)."""
        return writes(self.rule)

    def release(self) -> None:
        """Drop the mappings (the files are removed by offload_nvme's cleanup)."""
        self.maps = []
        self.master = torch.empty(0, dtype=_F32)
        self.states = {nm: torch.empty(0, dtype=dt) for nm, dt, _ in self.specs[1:]}


def cleanup(files: List[DiskState], pool, pid: int) -> None:
    """Close and remove every state file (idempotent; runs at close, GC and exit). Only in the
    process that created them: a forked child that exits (sys.exit runs atexit) must not remove
    its parent's state."""
    if os.getpid() != pid:
        return
    pool.shutdown(wait=True)
    for f in files:
        for fd in f.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        f.fds = []
        for p in f.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def file_bytes(state_numel: int, dtype: torch.dtype = _F32, block: int = 1) -> int:
    """Bytes of one state file (two halves), as DiskState preallocates it."""
    return 2 * half_bytes(state_numel, dtype, block)


def check_free_space(path: str, need: int) -> None:
    """A ValueError naming `path` when its file system has less than `need` bytes free, before
    the model is touched. The files are preallocated at construction all the same, which
    catches what this misses (other writers, file systems that count blocks differently)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ValueError(f"offload_path {path!r}: No space left for the offload files: they "
                         f"take {need} bytes on this rank, the file system has {free} free")
