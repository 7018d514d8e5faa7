"""Stage-3 param offload (`offload_params="cpu" | "nvme"`): ZeRO-Infinity's param half.

Between uses a unit's param shard (S elements of the model dtype per (unit, group) buffer, and
the frozen buffers too) lives at its *home*: a host tensor (pinned when the device is a GPU,
pageable on a CPU-only machine, as offload="cpu"'s buffers) or a file under `offload_path`.
The device holds only a working shard, fetched right before the unit's all-gather and released
once the gather has landed; so between steps the device holds no param bytes at all, and in a
step only the live units (their full buffers) and the shards being gathered.

    home (host / file) --fetch--> device shard (S,) --all-gather--> full unit (E,) --> free

`OffloadedShardedFlat` is a ShardedFlat whose `flat` attribute is the home: everything that
reads or writes the shard between steps (state_dict, zerokern.checkpoint, model.load_state_dict,
gathered_params(modify=True)) therefore reads and writes the host tensor or the file (an mmap
view of its current half), never the device. `device_flat` is the device shard (0 bytes when
released); memory_report counts that as the device's `params`.

[Note: param offload choices]
1. When to fetch. The shard is fetched when its all-gather is launched, so a prefetched gather
   (Stage3Sync prefetches one unit ahead) fetches one unit ahead too: the H2D copy is queued on
   the current stream before the all-gather, which waits for it in stream order, and the host
   does not wait (pinned memory). Fetching earlier than the gather would hold a second unit's
   shard on the device for nothing on a GPU (a shard is 1/N of a unit: 2·S bytes bf16 at
   25 GB/s is 40 us per MiB, well under a block's compute). A disk read is slower and blocks
   the host, so for "nvme" the read starts one unit earlier still: when unit k+1's gather is
   prefetched, a background thread reads unit k+2's shard (O_DIRECT, into a buffer of its
   own), and unit k+2's fetch takes it from there (`read_ahead_hits`; on the test model every
   forward and backward hits). A read-ahead is used only within the pass (forward, backward,
   gather_all, frozen_whole) that issued it and is dropped when the next one starts, and by
   any write of a home the code sees (step commit, write-back): between passes user code may
   write a home through its file mapping (checkpoint load, load_state_dict), unseen here.
2. What moves. Only the model-dtype param shard. The fp32 master is optimizer state and stays
   where `offload=` puts it (device, host or disk), as DeepSpeed splits offload_param and
   offload_optimizer: the knobs stay orthogonal, and moving the master with the params would
   make offload_params a second optimizer offload. At fp32 the param shard *is* the master
   (K = 8), so with offload=None it moves with the params, and the step fetches it to the
   device, updates it there and stores it home (one fetch and one store per unit per step).
   With offload="cpu"/"nvme" the host update writes the new 16-bit params straight into the
   home, so the step moves no param bytes to the device at all.
3. Journal for "nvme". offload_params="nvme" needs offload="nvme" (a ValueError otherwise):
   a param file has two halves like the state files, a step writes the new shard into the half
   it does not read, and the half flips together with master/m/v when every write of every
   rank has landed (offload_nvme.py [Note: all or nothing]); a failed step (ENOSPC, EIO, a
   truncated file) flips nothing, so params, master, m and v are all as before it. With the
   optimizer state in RAM or on the device (offload None/"cpu") a failed param write would
   leave master/m/v stepped and the params not: all-or-nothing would need a copy of the
   12·S bytes of state. And a model whose 2·S bytes of params per rank do not fit in host RAM
   has 6x that of optimizer state, which then does not fit either: params on disk with the
   state in RAM is not a configuration anyone needs.
4. Host writes. With offload=None on a GPU the step's new shard goes home with a blocking D2H
   copy per unit (the home must be complete before a host reader such as a checkpoint sees it,
   and the device shard is released right after); pair offload_params with offload="cpu" to
   keep the step free of that wait.
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from .. import aligned_io as aio
from .param_offload_checks import (  # noqa: F401 (re-exported)
    KINDS,
    NOTES,
    check_args,
    check_space,
    estimate_,
    formula_,
)
from .sharded_flat import ShardedFlat


def _host_empty(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    from .. import pinned

    return pinned.empty(n, dtype) if pin else torch.empty(n, dtype=dtype)


class _ParamFile:
    """One buffer's param file: `halves` regions of align_up(S·e) bytes (2 for a trainable
    buffer, the journal; 1 for a frozen one, which no step writes). Named like _Files'."""

    def __init__(self, path: str, half: int, halves: int) -> None:
        self.paths = [path]
        self.fds: List[int] = []
        self.half, self.halves = half, halves
        self.map: Optional[torch.Tensor] = None
        self.cur = 0


class OffloadedShardedFlat(ShardedFlat):
    """A ShardedFlat whose shard lives at `homes` (host or file) between uses."""

    def __init__(self, params, dtype, world_size, rank, group_index, unit_index,
                 trainable=True, *, homes: ParamHomes) -> None:
        self.homes = homes
        self.dev = None  # (set below: ShardedFlat.__init__ calls free() first)
        super().__init__(params, dtype, world_size, rank, group_index, unit_index, trainable)
        S = self.layout.shard_numel
        self._dev_bytes = S * self.flat.element_size()
        self.dev = self.flat  # the device shard storage; released below, fetched per use
        self.file: Optional[_ParamFile] = None
        self.flat = homes.adopt(self, self.flat)  # the home: host tensor or file view
        self._live = False    # dev holds the shard
        self._working = False  # dev is this step's update target (offload=None)
        self._staged = False   # "nvme": this step's new shard is in the staging buffer
        self.params_journaled = homes.kind == "nvme" and trainable
        self.dev.untyped_storage().resize_(0)

    @property
    def device_flat(self) -> torch.Tensor:
        return self.dev

    # -- device shard ------------------------------------------------------------------------
    def _fetch(self) -> torch.Tensor:
        if not self._live:
            self.dev.untyped_storage().resize_(self._dev_bytes)
            self.homes.load(self, self.dev)
            self._live = True
        return self.dev

    def _release(self) -> None:
        if self.dev is not None and self._live and not self._working:
            self.dev.untyped_storage().resize_(0)
            self._live = False

    # -- gather / free -----------------------------------------------------------------------
    def start_gather(self, comm, label=None) -> None:
        if self.gathered or self.handle is not None:
            return
        src = self._fetch()  # [Note: param offload choices] 1: with the (pre)fetched gather
        self.full.untyped_storage().resize_(self._full_bytes)
        self.handle = comm.all_gather_(self.full, src, async_op=True, label=label)

    def finish_gather(self) -> None:
        landed = self.handle is not None
        super().finish_gather()
        if landed:
            self._release()

    def free(self) -> None:
        super().free()  # (waits for a gather in flight first)
        self._release()

    def write_back_(self) -> None:
        self.homes.new_pass()  # (a read-ahead of this home would be stale)
        piece = self.full[slice(*self.layout.piece_range(0, self.rank))]
        if self.master is not None:
            changed = piece != self.flat.to(piece.device)
            master = self.master.to(piece.device)
            self.master.copy_(torch.where(changed, piece.float(), master))
        self.flat.copy_(piece)

    # -- the step ----------------------------------------------------------------------------
    def _work(self) -> torch.Tensor:
        """offload=None: the update runs on the device, on a fetched shard (Note: 2)."""
        self._fetch()
        self._working = True
        return self.dev

    def master_piece(self, k: int) -> torch.Tensor:
        if self.master is not None:
            return self.master
        return self.flat if self.homes.host_update else self._work()

    def param_out_piece(self, k: int) -> Optional[torch.Tensor]:
        if self.master is None:
            return None
        if self.params_journaled:  # into the staging buffer, written at publish (Note: 3)
            self._staged = True
            return self.homes.staging(self)
        return self.flat if self.homes.host_update else self._work()

    def publish_piece(self, comm, k: int):
        """After the update of the shard: store it home (offload=None) or journal it."""
        if self._working:
            self.flat.copy_(self.dev)  # blocking on a GPU (Note: 4)
            self._working = False
            self._release()
        if self._staged:
            self._staged = False
            self.homes.write_step(self)
        return None


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
             trainable=True) -> OffloadedShardedFlat:
        try:
            f = OffloadedShardedFlat(params, dtype, world_size, rank, group_index, unit_index,
                                     trainable, homes=self)
        except OSError as e:
            self.close()
            raise ValueError(f"offload_path {self.root!r}: cannot create the param files "
                             f"({e.strerror}: {e.filename})") from e
        self.flats.append(f)
        return f

    def adopt(self, f: OffloadedShardedFlat, shard: torch.Tensor) -> torch.Tensor:
        """The home of f's shard, holding its current values."""
        if self.kind == "cpu":
            home = _host_empty(shard.numel(), shard.dtype, self.pin)
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
    def load(self, f: OffloadedShardedFlat, dev: torch.Tensor) -> None:
        if self.kind == "cpu":
            dev.copy_(f.flat, non_blocking=self.pin)  # stream-ordered before the all-gather
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
        if off.error is not None or off.skip:
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
                f.flat = self._view(pf, f.layout.shard_numel)

    def close(self) -> None:
        if self.kind == "nvme":
            self.new_pass()
            for f in self.flats:
                f.flat = torch.empty(0, dtype=f.dtype)
                f.file.map = None
            self._finalizer()

    def paths(self) -> List[str]:
        return [p for pf in self.files for p in pf.paths]

    # -- reports -----------------------------------------------------------------------------
    def host_bytes(self) -> dict:
        out = {"params": 0, "frozen": 0, "param_staging": 0}
        if self.kind == "cpu":
            for f in self.flats:
                out["params" if f.trainable else "frozen"] += f.flat.untyped_storage().nbytes()
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
        host = out.get("host_measured") or {k: 0 for k in ("master", "exp_avg", "exp_avg_sq",
                                                          "host_staging")}
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


def _cleanup(files: List[_ParamFile], io, pid: int) -> None:
    """Close and remove the param files (close, GC and exit; only in the creating process)."""
    if os.getpid() != pid:
        return
    io.shutdown(wait=True)
    for pf in files:
        for fd in pf.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        pf.fds = []
        for p in pf.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


# -- Stage3Sync's calls (runtime.py, backward.py) ------------------------------------------------
def _homes(sync) -> Optional[ParamHomes]:
    bufs = list(sync.groups) + list(sync.frozen)
    return getattr(bufs[0], "homes", None) if bufs else None


def new_pass(sync) -> None:
    """A forward, a backward, gather_all or frozen_whole starts: read-aheads issued before it
    are dropped (only one issued and used within one pass is known to be current)."""
    homes = _homes(sync)
    if homes is not None and homes.ahead:
        homes.new_pass()
    elif homes is not None:
        homes.pass_id += 1


def read_ahead(sync, sched: List[int], pos: int) -> None:
    """offload_params="nvme": while sched[pos - 1]'s gather is prefetched, start the disk read
    of sched[pos]'s shards ([Note: param offload choices] 1)."""
    homes = _homes(sync)
    if homes is None or homes.kind != "nvme" or pos >= len(sched):
        return
    for ui in sync._need(sync.units[sched[pos]]):
        for f in sync._bufs(ui):
            homes.read_ahead(f)
