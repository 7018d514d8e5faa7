"""offload_params: where the shards live between uses (param_offload.py [Note: param offload
choices]): host tensors, or for "nvme" files of two halves (O_DIRECT, preallocated), the fetch,
step and read-ahead buffers, the journal's commit, and the reports."""

from __future__ import annotations

import os
import uuid
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from zerokern.platform.device import handle
from zerokern.state import aligned_io as aio
from zerokern.state import pinned
from zerokern.state.nvme_state import cleanup as _cleanup
from zerokern.state.offload_nvme import StepPhase

from .param_offload import OffloadedShardedFlat
from .param_offload_checks import formula_


class _ParamFile:
    """One buffer's param file: `halves` regions of align_up(S·e) bytes (2 for a trainable
    buffer, the journal; 1 for a frozen one, which no step writes). Named like _Files'."""

    def __init__(self, path: str, half: int, halves: int) -> None:
        self.paths = [path]
        self.fds: List[int] = []
        self.half, self.halves = half, halves
        self.map: Optional[torch.Tensor] = None
        self.cur = 0


class ParamHomes:
    """Every offloaded buffer's home, for one optimizer: host tensors or param files, the
    "nvme" I/O buffers (a fetch bounce buffer and a step staging buffer, one shard each), the
    journal's commit, and the reports."""

    def __init__(self, kind: str, device: torch.device, host_update: bool,
                 root: Optional[str] = None, rank: int = 0) -> None:
        self.kind, self.device, self.rank = kind, device, rank
        self.pin = handle(device).pins_host_memory
        self.host_update = host_update  # offload="cpu"/"nvme": the host writes the params
        self.flats: List[OffloadedShardedFlat] = []
        self.files: List[_ParamFile] = []
        self.root = root
        self.offloader = None
        self.bounce = self.stage_buf = None
        # "nvme" reads ([Note: param offload choices] 1): every read runs on the I/O thread
        # (`io`, one worker: reads run in the order issued) into a pinned read buffer, and the
        # host waits for a shard's read only where it copies the shard to the device (`load`).
        # `ahead`: id(flat) -> (read in flight, buffer index), valid only within the pass that
        # issued it (new_pass drops it). Buffer 0 is the bounce buffer (a read issued at use),
        # 1.. the read-ahead buffers; `copied[i]`: the event of the last H2D copy out of buffer
        # i (None on the CPU), which the next read into it waits for, on the I/O thread.
        self.ahead: Dict[int, Tuple[Future, int]] = {}
        self.ahead_bufs: List[torch.Tensor] = []
        self.free_ahead: List[int] = []
        self.copied: List[Optional[object]] = []
        self._unit_flats: Dict[int, List[OffloadedShardedFlat]] = {}
        self.read_ahead_hits = 0
        if kind == "nvme":
            self.direct = aio.direct_supported(root)
            self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zk-param-read")
            self._finalizer = weakref.finalize(self, _cleanup, self.files, self.io,
                                               os.getpid())

    def make(self, params, dtype, world_size, rank, group_index, unit_index,
             trainable=True, placement=None, slot_align=1) -> OffloadedShardedFlat:
        try:
            f = OffloadedShardedFlat(params, dtype, world_size, rank, group_index, unit_index,
                                     trainable, placement, homes=self, slot_align=slot_align)
        except OSError as e:
            self.close()
            raise ValueError(f"offload_path {self.root!r}: cannot create the param files "
                             f"({e.strerror}: {e.filename})") from e
        self.flats.append(f)
        return f

    def adopt(self, f: OffloadedShardedFlat, shard: torch.Tensor) -> torch.Tensor:
        """The home of f's shard, holding its current values."""
        if self.kind == "cpu":
            home = pinned.host_empty(shard.numel(), shard.dtype, self.pin)
            home.copy_(shard)
            return home
        e = shard.element_size()
        half = aio.align_up(shard.numel() * e)
        which = f"g{f.group_index}" if f.trainable else "frozen"
        path = os.path.join(self.root, f"zerokern-{self.tag}-rank{self.rank}-unit"
                                       f"{f.unit_index}-{which}-params.bin")
        pf = _ParamFile(path, half, 2 if f.trainable else 1)
        self.files.append(pf)
        fd = aio.open_state(path, False, create=True)
        pf.fds.append(fd)
        try:
            os.posix_fallocate(fd, 0, pf.halves * half)  # now: no ENOSPC in a step (as state)
        except OSError as err:
            raise OSError(err.errno, err.strerror, path) from err
        pf.map = torch.from_file(path, shared=True, size=pf.halves * half // e,
                                 dtype=shard.dtype)
        pf.map[:shard.numel()].copy_(shard.to("cpu"))
        aio.drop_cache(fd)
        if self.direct:
            os.close(fd)
            pf.fds[0] = aio.open_state(path, True, create=False)
        f.file = pf
        return self._view(pf, shard.numel())

    @staticmethod
    def _view(pf: _ParamFile, n: int) -> torch.Tensor:
        off = pf.cur * pf.half // pf.map.element_size()
        return pf.map[off:off + n]

    def finalize(self) -> None:
        """After every buffer exists: the "nvme" bounce and staging buffers (one shard each)."""
        if self.kind != "nvme" or not self.flats:
            return
        self.bounce = aio.aligned_empty(max(f.file.half for f in self.flats), self.pin)
        train = [f.file.half for f in self.flats if f.trainable]
        self.stage_buf = aio.aligned_empty(max(train), self.pin) if train else None
        # read-ahead: one buffer per buffer of the unit with the most (groups + frozen)
        n = max(Counter(f.unit_index for f in self.flats).values())
        self.ahead_bufs = [aio.aligned_empty(self.bounce.numel(), self.pin) for _ in range(n)]
        self.free_ahead = list(range(1, n + 1))
        self.copied = [None] * (n + 1)
        for f in self.flats:
            self._unit_flats.setdefault(f.unit_index, []).append(f)

    def attach(self, offloader) -> None:
        """"nvme": journal the trainable param files with the optimizer's state files."""
        self.offloader = offloader
        if self.kind == "nvme":
            offloader.extra_files += [f.file for f in self.flats if f.trainable]
            offloader.commit_hooks.append(self.commit)

    # -- I/O ---------------------------------------------------------------------------------
    def gather_stream(self, device: torch.device):
        """The stream the shard's fetch and all-gather are issued on (a GPU with pinned homes),
        else None: [Note: stage-3 gather stream] in gather_stream.py."""
        from . import gather_stream

        return gather_stream.for_device(device) if self.pin else None

    def load(self, f: OffloadedShardedFlat, dev: torch.Tensor) -> None:
        """Copy f's shard from its home into `dev` (the unit's gather is issued next). "nvme":
        from the read issued ahead for it, else from a read issued now; either way the host
        waits here, where the bytes are needed, and nowhere else ([Note: param offload
        choices] 1)."""
        if self.kind == "cpu":
            dev.copy_(f.param_shard, non_blocking=self.pin)  # stream-ordered before the all-gather
            return
        entry = self.ahead.pop(id(f), None)
        if entry is None:  # not issued ahead (a pass's first units): read it now, and the
            fut, i = self._read(f, 0), 0  # rest of its unit behind it
            for g in self._unit_flats.get(f.unit_index, ()):
                if g is not f:
                    self.read_ahead(g)
        else:
            fut, i = entry
            self.read_ahead_hits += 1
        try:
            fut.result()  # the one wait: f's bytes are needed now (a failed read raises here)
        finally:
            if i:
                self.free_ahead.append(i)
        # Pinned buffer, non_blocking: queued on the current (gather) stream before the
        # all-gather that reads dev; the buffer is read again only after the copy's event.
        dev.copy_(self._buf(i)[:f._dev_bytes].view(dev.dtype), non_blocking=self.pin)
        self.copied[i] = self._copy_event()

    def _buf(self, i: int) -> torch.Tensor:
        return self.bounce if i == 0 else self.ahead_bufs[i - 1]

    def _copy_event(self):
        """An event after the H2D copy just queued on the current stream (a GPU), else None."""
        if not self.pin:
            return None
        return handle(self.device).recorded_event()

    def _read(self, f: OffloadedShardedFlat, i: int) -> Future:
        """Issue the read of f's current half into buffer i on the I/O thread."""
        pf = f.file
        mv = memoryview(self._buf(i).numpy())[:pf.half]
        return self.io.submit(_read_into, self.copied[i], pf.fds[0], mv, pf.cur * pf.half,
                              pf.paths[0], self.direct)

    def read_ahead(self, f: OffloadedShardedFlat) -> None:
        """Start reading f's shard in the background (a unit the schedule gathers next)."""
        if (self.kind != "nvme" or f.file is None or f._live or f.gathered
                or f.handle is not None or id(f) in self.ahead or not self.free_ahead):
            return
        i = self.free_ahead.pop()
        self.ahead[id(f)] = (self._read(f, i), i)

    def new_pass(self) -> None:
        """Drop every read-ahead: user code may have written a home since it was issued
        (a checkpoint load writes the files through their mappings, unseen here). Nothing is
        waited for: the one I/O thread runs reads in the order issued, so a later read into a
        dropped read's buffer starts after it, and a dropped read's error is left unread (the
        read that uses the shard raises it)."""
        for _, i in self.ahead.values():
            self.free_ahead.append(i)
        self.ahead.clear()

    def staging(self, f: OffloadedShardedFlat) -> torch.Tensor:
        return self.stage_buf[:f._dev_bytes].view(f.dtype)

    def write_step(self, f: OffloadedShardedFlat) -> None:
        """Journal f's new shard into the half it does not read; a failure is recorded for
        the offloader's finish(), which rolls back on every rank (offload_nvme.py)."""
        off = self.offloader
        if off.error is not None or off.phase is StepPhase.SKIPPED:
            return
        pf = f.file
        mv = memoryview(self.stage_buf.numpy())[:pf.half]
        try:
            aio.write_chunk(pf.fds[0], mv, (1 - pf.cur) * pf.half, pf.paths[0], self.direct,
                            off.fault_hook)
            off.bytes_moved += pf.half
        except OSError as e:
            off.error = e

    def commit(self) -> None:
        """Every write of every rank landed: the new halves are current (with master/m/v)."""
        self.new_pass()
        for f in self.flats:
            if f.params_journaled:
                pf = f.file
                pf.cur = 1 - pf.cur
                e = pf.map.element_size()
                pf.map = torch.from_file(pf.paths[0], shared=True, size=2 * pf.half // e,
                                         dtype=f.dtype)
                os.posix_fadvise(pf.fds[0], 0, 0, os.POSIX_FADV_DONTNEED)
                f.param_shard = self._view(pf, f.layout.shard_numel)

    def close(self) -> None:
        if self.kind == "nvme":
            self.new_pass()
            for f in self.flats:
                f.param_shard = torch.empty(0, dtype=f.dtype)
                f.file.map = None
            self._finalizer()

    def paths(self) -> List[str]:
        return [p for pf in self.files for p in pf.paths]

    # -- reports -----------------------------------------------------------------------------
    def host_bytes(self) -> dict:
        out = {"params": 0, "frozen": 0, "param_staging": 0}
        if self.kind == "cpu":
            for f in self.flats:
                held = f.param_shard.untyped_storage().nbytes()
                out["params" if f.trainable else "frozen"] += held
        else:
            out["param_staging"] = sum(t.untyped_storage().nbytes() for t in
                                       [self.bounce, self.stage_buf] + self.ahead_bufs
                                       if t is not None)
        return out

    def disk_bytes(self) -> dict:
        out = {"params": 0, "frozen": 0}
        for f in self.flats:
            if f.file is not None:
                out["params" if f.trainable else "frozen"] += f.file.halves * f.file.half
        return out

    def report(self, out: dict, formula: dict) -> None:
        """memory_report(): host (pinned / pageable) and disk bytes of the param homes, and
        the formula with the param column moved off the device."""
        host = out.get("host_measured") or {}
        host.update(self.host_bytes())
        out["host_measured"] = host
        out["host_measured_total"] = sum(host.values())
        out["host_pinned_total"] = out["host_measured_total"] if self.pin else 0
        out["host_pageable_total"] = 0 if self.pin else out["host_measured_total"]
        formula_(formula, self.kind)
        out["host_formula_total"] = formula.get("host", 0)
        if self.kind == "nvme":
            disk = out.get("disk_measured") or {}
            disk.update(self.disk_bytes())
            out["disk_measured"] = disk
            out["disk_measured_total"] = sum(disk.values())
            out["disk_formula_total"] = formula["disk"]


def _read_into(copied, fd: int, buf, off: int, path: str, direct: bool) -> None:
    """On the I/O thread: once the last H2D copy out of the buffer has run (its event; the
    host's main thread never waits for it), read the shard into it."""
    if copied is not None:
        copied.synchronize()
    aio.read_chunk(fd, buf, off, path, direct)
