"""offload_params: where the shards live between uses (param_offload.py [Note: param offload
choices]): host tensors, or for "nvme" files of two halves (O_DIRECT, preallocated), the fetch,
step and read-ahead buffers, the journal's commit, and the reports."""

from __future__ import annotations

import os
import uuid
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

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
        self.pin = device.type == "cuda"
        self.host_update = host_update  # offload="cpu"/"nvme": the host writes the params
        self.flats: List[OffloadedShardedFlat] = []
        self.files: List[_ParamFile] = []
        self.root = root
        self.offloader = None
        self.bounce = self.stage_buf = None
        # "nvme" read-ahead ([Note: param offload choices] 1): id(flat) -> (read in flight,
        # buffer index, pass); valid only within the pass that issued it (new_pass drops it).
        self.ahead: Dict[int, Tuple[object, int, int]] = {}
        self.ahead_bufs: List[torch.Tensor] = []
        self.free_ahead: List[int] = []
        self.pass_id = 0
        self.read_ahead_hits = 0
        if kind == "nvme":
            self.direct = aio.direct_supported(root)
            self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zk-param-read")
            self._finalizer = weakref.finalize(self, _cleanup, self.files, self.io,
                                               os.getpid())

    def make(self, params, dtype, world_size, rank, group_index, unit_index,
             trainable=True, placement=None) -> OffloadedShardedFlat:
        try:
            f = OffloadedShardedFlat(params, dtype, world_size, rank, group_index, unit_index,
                                     trainable, placement, homes=self)
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
        self.free_ahead = list(range(n))

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
        if self.kind == "cpu":
            dev.copy_(f.param_shard, non_blocking=self.pin)  # stream-ordered before the all-gather
            return
        pf = f.file
        entry = self.ahead.pop(id(f), None)
        if entry is not None:
            fut, i, pid = entry
            try:
                fut.result()  # (a failed read raises here, as the read below would)
            finally:
                self.free_ahead.append(i)
            if pid == self.pass_id:
                self.read_ahead_hits += 1
                dev.copy_(self.ahead_bufs[i][:f._dev_bytes].view(dev.dtype))
                return
        mv = memoryview(self.bounce.numpy())[:pf.half]
        aio.read_chunk(pf.fds[0], mv, pf.cur * pf.half, pf.paths[0], self.direct)
        dev.copy_(self.bounce[:f._dev_bytes].view(dev.dtype))

    def read_ahead(self, f: OffloadedShardedFlat) -> None:
        """Start reading f's shard in the background (a unit the schedule gathers next)."""
        if (self.kind != "nvme" or f.file is None or f._live or f.gathered
                or f.handle is not None or id(f) in self.ahead or not self.free_ahead):
            return
        i = self.free_ahead.pop()
        pf = f.file
        mv = memoryview(self.ahead_bufs[i].numpy())[:pf.half]
        fut = self.io.submit(aio.read_chunk, pf.fds[0], mv, pf.cur * pf.half, pf.paths[0],
                             self.direct)
        self.ahead[id(f)] = (fut, i, self.pass_id)

    def new_pass(self) -> None:
        """Drop every read-ahead: user code may have written a home since it was issued
        (a checkpoint load writes the files through their mappings, unseen here)."""
        self.pass_id += 1
        for fut, i, _ in self.ahead.values():
            try:
                fut.result()
            except OSError:
                pass  # (the read that uses the shard will raise it)
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
