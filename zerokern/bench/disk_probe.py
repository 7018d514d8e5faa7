"""A disk probe that replays one offload="nvme" step's own I/O with no compute: how fast this
disk moves the step's bytes, now, in the step's pattern.

`IOPattern` is what one optimizer step reads and writes (zerokern/state/offload_nvme.py): per
flat buffer one file per state (`nvme_state.specs`: the master, then the rule's states, each in
its dtype and block), two halves each (`nvme_state.file_bytes`); each pass (`nvme_state.passes`)
reads every chunk of its files' half `cur` and, unless it is a read pass (`nvme_state.writes`),
writes it to half `1 - cur`, in
`nvme_pool.step_plan` order, one request per file per chunk (`nvme_pool.request_span`),
through `depth` aligned buffer sets
(`nvme_pool._Set`), so at most depth x files requests in flight, on the offloader's thread pool
(borrowed files: its very sets and threads; `ProbeFiles.pool`), with `aligned_io.read_chunk` /
`write_chunk` (O_DIRECT where the file system takes it, else buffered + fadvise(DONTNEED): the
page cache is defeated the same way).
`replay` runs that schedule (offload_nvme's `_refill` / `_settle` order: reads run ahead into
free sets, a set's chunk is written behind as soon as its read landed, a set is reused once its
write landed) and times it: the step's I/O floor, measured on the step's own path.

[Note: why replay the step, not a sequential copy]
The first bench_infinity measured the disk with one sequential read+write file (4 requests in
flight) and divided: on 2026-11-25 that gave "185% of the floor" (1.64 GB/s that day, 3.16 two
days before), because a cloud disk's bandwidth depends on the request mix (3 files per chunk,
reads and writes interleaved, 12 requests in flight) and drifts between runs. The replay uses
the same code path, sizes, offsets, depth and threads as the step, so the only difference left
is the step's compute (the cpu kernel, grad and param copies), and the disk's drift, which the
caller measures by sampling before and after the steps (bench_infinity interleaves them).

[Note: borrowing the step's files]
`ProbeFiles.borrow` replays on the offloader's own state files between steps: same extents,
same file system, and no second copy of the state on disk (a 2B-param model's files are 51 GB).
The replay reads half `cur` (the state) and writes those same bytes into half `1 - cur`, which
the next step overwrites whole before its commit flips to it (offload_nvme.py [Note: all or
nothing]), so the optimizer's state is untouched. Half `1 - cur` of a fresh optimizer is
fallocated but unwritten, and reading an unwritten extent returns zeros with no disk I/O: borrow
only after two steps (each half written once), as bench_infinity does. `ProbeFiles.create` makes
files of its own (both halves written in full, for the same reason) for a pattern alone.
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zerokern.rules import Rule
from zerokern.rules.registry import adamw_rule
from zerokern.state import aligned_io as aio
from zerokern.state import nvme_state
from zerokern.state import offload_nvme as nv
from zerokern.state.nvme_pool import (
    CHUNK_NUMEL,
    QUEUE_DEPTH,
    _Set,
    pool_chunk,
    request_span,
    rules_granule,
    step_plan,
)

_F32 = torch.float32
_NAME = re.compile(r"-buf(\d+)-(\w+)\.bin$")


Spec = Tuple[str, torch.dtype, int]  # (file name, dtype, block): nvme_state.specs


@dataclass(frozen=True)
class IOPattern:
    """One offload="nvme" step's I/O: per buffer its state elements (`numels`, DiskState.n),
    its files (`specs`: name, dtype, block), passes (file indices per pass,
    nvme_state.passes) and whether each pass writes its chunks back (`writes`,
    nvme_state.writes); `chunk` param elements per request, `depth` buffer sets, `direct`
    O_DIRECT (else buffered, dropped from the page cache). `rules`: each buffer's rule (the
    pool sets are carved for it; not compared)."""

    numels: Tuple[int, ...]
    specs: Tuple[Tuple[Spec, ...], ...]
    passes: Tuple[Tuple[Tuple[int, ...], ...], ...]
    writes: Tuple[Tuple[bool, ...], ...]
    chunk: int
    depth: int
    direct: bool
    rules: Tuple[Rule, ...] = field(compare=False, default=())

    def halves(self, gi: int) -> Tuple[int, ...]:
        """Bytes of one half of each of buffer gi's files."""
        return tuple(nvme_state.half_bytes(self.numels[gi], dt, b) for _, dt, b in self.specs[gi])

    def file_bytes(self) -> Tuple[Tuple[int, ...], ...]:
        """Per buffer, the bytes of each of its files (both halves)."""
        return tuple(tuple(nvme_state.file_bytes(n, dt, b) for _, dt, b in sp)
                     for n, sp in zip(self.numels, self.specs))

    def plan(self) -> List[Tuple[int, int, int, Tuple[int, ...], bool]]:
        return step_plan(list(zip(self.numels, self.passes, self.writes)), self.chunk)

    def requests(self, cur: int = 0) -> Dict[str, List[Tuple[int, str, int, int]]]:
        """{"read": [...], "write": [...]}: (buffer, file name, offset, bytes) per request, in
        the order the step submits each kind."""
        out: Dict[str, List[Tuple[int, str, int, int]]] = {"read": [], "write": []}
        for gi, lo, hi, files, write in self.plan():
            halves = self.halves(gi)
            for kind, half in (("read", cur), ("write", 1 - cur))[:2 if write else 1]:
                for i in files:
                    nm, dt, b = self.specs[gi][i]
                    out[kind].append((gi, nm, *request_span(halves[i], half, lo, hi, dt, b)))
        return out

    @property
    def bytes_per_step(self) -> int:
        return sum(n for reqs in self.requests().values() for _, _, _, n in reqs)

    @property
    def in_flight(self) -> int:
        """Requests in flight at most: depth sets of the widest pass."""
        return self.depth * max(len(f) for ps in self.passes for f in ps)


def pattern_of(offloader) -> IOPattern:
    """The pattern a live NvmeOffloader's step runs (its files, chunk, depth, O_DIRECT).

    Args:
        offloader: an `NvmeOffloader` (`ZeroAdamW(offload="nvme").offloader`).

    Returns:
        Its IOPattern.

    Raises:
        ValueError: it also streams stage 3's param files (offload_params="nvme"), which the
            replay does not cover.
    """
    if offloader.extra_files:
        raise ValueError("disk_probe replays the optimizer state files only; this offloader "
                         "also writes offload_params='nvme' param files")
    fs = offloader.files
    return IOPattern(tuple(f.n for f in fs), tuple(tuple(f.specs) for f in fs),
                     tuple(tuple(f.passes()) for f in fs), tuple(tuple(f.writes()) for f in fs),
                     offloader.chunk, offloader.depth,
                     offloader.direct, tuple(f.rule for f in fs))


def pattern_for(state_numels: Sequence[int], rule=None, chunk_numel: Optional[int] = None,
                queue_depth: Optional[int] = None, direct: bool = True) -> IOPattern:
    """The pattern ZeroAdamW(offload="nvme") would run for buffers of these state sizes.

    Args:
        state_numels: state elements per flat buffer (the buffers' `state_numel`).
        rule: the update rule (its states set the files), or a list of one per buffer
            (default AdamW's m and v).
        chunk_numel: elements per request before `pool_chunk` caps it (default CHUNK_NUMEL).
        queue_depth: buffer sets (default QUEUE_DEPTH).
        direct: O_DIRECT (what `aligned_io.direct_supported` says for the directory).

    Returns:
        The IOPattern.
    """
    numels = [int(n) for n in state_numels]
    rules = list(rule) if isinstance(rule, (list, tuple)) else [rule or adamw_rule()] * len(numels)
    gran = rules_granule(list(dict.fromkeys(rules)))
    chunk = pool_chunk(numels, CHUNK_NUMEL if chunk_numel is None else chunk_numel, gran)
    return IOPattern(tuple(numels), tuple(tuple(nvme_state.specs(r)) for r in rules),
                     tuple(tuple(nvme_state.passes(r)) for r in rules),
                     tuple(tuple(nvme_state.writes(r)) for r in rules), chunk,
                     QUEUE_DEPTH if queue_depth is None else queue_depth, bool(direct),
                     tuple(rules))


def differences(probe: IOPattern, step: IOPattern) -> List[str]:
    """What differs between a probe's pattern and the step's, one line each ([] if none)."""
    out = []
    for name, what in (("numels", "state elements per buffer"), ("specs", "files per buffer"),
                       ("passes", "passes per buffer"), ("writes", "passes written back"),
                       ("chunk", "elements per request"),
                       ("depth", "buffer sets in flight"), ("direct", "O_DIRECT")):
        a, b = getattr(probe, name), getattr(step, name)
        if a != b:
            out.append(f"{what}: probe {a}, step {b}")
    return out


def check_same(probe: IOPattern, step: IOPattern) -> None:
    """Raise ValueError naming each difference when the probe would not replay the step."""
    diff = differences(probe, step)
    if diff:
        raise ValueError("the disk probe's I/O pattern is not the step's: " + "; ".join(diff))


class ProbeFiles:
    """The files a replay reads and writes, per buffer: fds[gi][k], paths[gi][k] (k over the
    pattern's names), and `cur`, the half the state is in."""

    def __init__(self, fds, paths, owned, offloader=None) -> None:
        self.fds, self.paths, self.owned, self._off = fds, paths, owned, offloader
        self._sets: dict = {}  # (chunk, depth, files) -> buffer sets kept across replays
        self._io: Optional[ThreadPoolExecutor] = None

    def pool(self, pattern: IOPattern) -> Tuple[list, ThreadPoolExecutor]:
        """The buffer sets and thread pool a replay of `pattern` uses: a borrowed offloader's
        own (its `pool` sets when the pattern is its chunk and depth, and its `io` threads:
        the very buffers and threads its step uses, already faulted in and started), else
        ones kept on this object, so only the first replay pays page faults and thread starts
        (fresh 4 x 3 x 16 MiB buffers cost ~10% of a 20m probe)."""
        off = self._off
        if off is not None and (off.chunk, off.depth) == (pattern.chunk, pattern.depth):
            return off.pool, off.io
        rules = list(dict.fromkeys(pattern.rules))
        key = (pattern.chunk, pattern.depth, tuple(pattern.specs))
        if key not in self._sets:
            self._sets[key] = [_Set(pattern.chunk, _F32, _F32, False, rules)
                               for _ in range(pattern.depth)]
        if off is not None:
            return self._sets[key], off.io
        if self._io is None:  # the offloader's size: one thread per request in flight at most
            widest = max(len(sp) for sp in pattern.specs)
            self._io = ThreadPoolExecutor(max_workers=widest * nv.MAX_DEPTH,
                                          thread_name_prefix="zk-probe")
        return self._sets[key], self._io

    @property
    def cur(self) -> int:
        """The state's half: a borrowed file's is the offloader's, read at each replay (each
        step flips it: a half captured at borrow time would make the next replay copy the
        previous state over the current one)."""
        if self._off is None:
            return 0
        if self._off.phase is not nv.StepPhase.IDLE or not self._off._finalizer.alive:
            raise ValueError("disk_probe: the offloader is inside a step or closed; probe "
                             "between steps")
        return self._off.cur

    @classmethod
    def borrow(cls, offloader) -> ProbeFiles:
        """The offloader's own state files, between steps (Note: borrowing the step's files)."""
        files = cls([list(f.fds) for f in offloader.files],
                    [list(f.paths) for f in offloader.files], False, offloader)
        files.cur  # noqa: B018 - raises inside a step
        return files

    @classmethod
    def create(cls, root: str, pattern: IOPattern) -> ProbeFiles:
        """Files of the pattern's sizes under `root`, both halves written (no unwritten extent
        reads back for free). Raises ValueError when root lacks the space or refuses O_DIRECT
        for a direct pattern."""
        root = aio.check_path(root)
        if pattern.direct and not aio.direct_supported(root):
            raise ValueError(f"disk_probe: {root!r} refuses O_DIRECT; build the pattern with "
                             "direct=False (the step then falls back to buffered I/O too)")
        nvme_state.check_free_space(root, sum(map(sum, pattern.file_bytes())))
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        files = cls([], [], True)
        zeros = memoryview(aio.aligned_empty(4 * pattern.chunk, pin=False).zero_().numpy())
        try:
            for gi, sizes in enumerate(pattern.file_bytes()):
                files.fds.append([])
                files.paths.append([])
                for (nm, _, _), size in zip(pattern.specs[gi], sizes):
                    p = os.path.join(root, f".zerokern-probe-{tag}-buf{gi}-{nm}.bin")
                    fd = aio.open_state(p, pattern.direct, create=True)
                    files.fds[gi].append(fd)
                    files.paths[gi].append(p)
                    for off in range(0, size, len(zeros)):
                        n = min(len(zeros), size - off)
                        aio.write_chunk(fd, zeros[:n], off, p, pattern.direct, None)
        except BaseException:
            files.close()
            raise
        return files

    def close(self) -> None:
        """Close and remove the files if this probe created them (borrowed ones stay)."""
        self._sets = {}
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if not self.owned:
            return
        for fds, paths in zip(self.fds, self.paths):
            for fd, p in zip(fds, paths):
                os.close(fd)
                os.unlink(p)
        self.fds, self.paths = [], []


def request_key(path: str) -> Tuple[int, str]:
    """(buffer, file name) of a state or probe file's path (traces compare by it)."""
    m = _NAME.search(path)
    if m is None:
        raise ValueError(f"not a zerokern state or probe file: {path!r}")
    return int(m.group(1)), m.group(2)


def replay(files: ProbeFiles, pattern: IOPattern) -> dict:
    """Run one step's I/O (module docstring) on `files`; returns seconds, bytes, GB/s and the
    request count."""
    plan = pattern.plan()
    cur, moved, count = files.cur, 0, 0  # (raises for a closed or mid-step offloader)
    sets, io = files.pool(pattern)
    free, loaded, writing = list(sets), collections.deque(), collections.deque()
    nxt = 0

    def submit(s: _Set, write: bool) -> None:
        nonlocal moved, count
        gi, lo, hi, which, _ = s.job
        halves, half = pattern.halves(gi), (1 - cur) if write else cur
        fn = aio.write_chunk if write else aio.read_chunk
        extra = (pattern.direct, None) if write else (pattern.direct,)
        s.futs = []
        for i in which:  # offload_nvme.NvmeOffloader._submit's requests
            _, dt, b = pattern.specs[gi][i]
            off, n = request_span(halves[i], half, lo, hi, dt, b)
            s.futs.append(io.submit(fn, files.fds[gi][i], s.mv[i][:n], off,
                                    files.paths[gi][i], *extra))
            moved += n
            count += 1

    def settle(s: _Set) -> None:
        for fu in s.futs:
            fu.result()  # an OSError names the file (aligned_io)
        s.futs = []

    def refill(need: bool = False) -> None:  # offload_nvme.NvmeOffloader._refill's order
        nonlocal nxt
        while writing and (writing[0].futs[0].done() or (need and not free)):
            s = writing.popleft()
            settle(s)
            free.append(s)
        while free and nxt < len(plan):
            s = free.pop()
            s.job = plan[nxt]
            s.carve(pattern.rules[s.job[0]])
            nxt += 1
            submit(s, write=False)
            loaded.append(s)

    t0 = time.perf_counter()
    try:
        refill()
        while loaded or nxt < len(plan):
            if not loaded:
                refill(need=True)
            s = loaded.popleft()
            settle(s)
            if s.job[4]:
                submit(s, write=True)
                writing.append(s)
            else:  # offload_nvme [Note: a read pass writes nothing]
                free.append(s)
            refill()
        for s in writing:
            settle(s)
        dt = time.perf_counter() - t0
    finally:  # nothing left in flight on the sets, whatever raised
        for s in sets:
            for fu in s.futs:
                fu.exception()
            s.futs = []
    return {"seconds": dt, "bytes": moved, "GBps": moved / dt / 1e9, "requests": count}


def spread(values: Sequence[float]) -> dict:
    """median, min, max and n of the samples."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def paired(step_GBps: Sequence[float], probe_GBps: Sequence[float]) -> List[float]:
    """Interleaved samples (probe, step, probe, ..., step, probe): each step's GB/s as a
    percentage of the mean of the two probes around it (the disk as it was during that step)."""
    if len(probe_GBps) != len(step_GBps) + 1:
        raise ValueError(f"paired: need one probe more than steps (probe, step, ..., probe), got "
                         f"{len(probe_GBps)} probes for {len(step_GBps)} steps")
    return [200 * s / (probe_GBps[i] + probe_GBps[i + 1]) for i, s in enumerate(step_GBps)]


def fraction(step_GBps: Sequence[float], probe_GBps: Sequence[float], direct: bool) -> dict:
    """The step's bytes/time as a fraction of the probe's, in percent: median over median and
    the range over all samples, min(step)/max(probe) .. max(step)/min(probe); with interleaved
    samples (one probe more than steps) also `paired` (spread of `paired`), the headline then.
    `note` says why a headline above 100% is not a step faster than the disk, or that the
    range passes 100% because the disk drifted (None otherwise)."""
    s, p = spread(step_GBps), spread(probe_GBps)
    out = {"median_pct": 100 * s["median"] / p["median"],
           "min_pct": 100 * s["min"] / p["max"], "max_pct": 100 * s["max"] / p["min"],
           "paired": None, "note": None}
    if len(probe_GBps) == len(step_GBps) + 1:
        out["paired"] = spread(paired(step_GBps, probe_GBps))
    head, top = ((out["paired"]["median"], out["paired"]["max"]) if out["paired"] else
                 (out["median_pct"], out["max_pct"]))
    if head > 100:
        out["note"] = ("the step moved its bytes faster than the I/O-only replay of the same "
                       "requests: " + (
                           "the disk's bandwidth changed between samples (probe "
                           f"{p['min']:.2f}-{p['max']:.2f} GB/s), so the probe is no ceiling "
                           "for this run" if direct else
                           "O_DIRECT is unavailable here and buffered I/O can be served by the "
                           "page cache, so neither figure is the disk's"))
    elif top > 100:
        out["note"] = (f"the range reaches {top:.0f}%: the disk drifted between samples (probe "
                       f"{p['min']:.2f}-{p['max']:.2f} GB/s)")
    return out
