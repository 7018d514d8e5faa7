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
released); memory_report counts that as the device's `params`. The homes themselves (host
tensors, param files, the "nvme" buffers and read-ahead, the journal's commit, the reports) are
`ParamHomes` in param_homes.py; the argument checks and estimate bytes param_offload_checks.py.

[Note: param offload choices]
1. When to fetch. The shard is fetched when its all-gather is launched, so a prefetched gather
   (Stage3Runtime prefetches one unit ahead) fetches one unit ahead too: the H2D copy is queued on
   the current stream before the all-gather, which waits for it in stream order, and the host
   does not wait (pinned memory). Fetching earlier than the gather would hold a second unit's
   shard on the device for nothing on a GPU (a shard is 1/N of a unit: 2·S bytes bf16 at
   25 GB/s is 40 us per MiB, well under a block's compute). A disk read is slower and blocks
   the host, so for "nvme" the read starts one unit earlier still: when unit k+1's gather is
   prefetched, a background thread reads unit k+2's shard (O_DIRECT, into a buffer of its
   own), and unit k+2's fetch takes it from there (`read_ahead_hits`; on the test model every
   forward and backward hits). Measured on the 23.2M-param GPT (`20m`, bf16, one process,
   O_DIRECT on this VM's virtio disk, 2 loaded cores), a no_grad forward (its 7 fetches) with
   and without the read-ahead, interleaved, medians of 10: 113.6 vs 137.5, 105.9 vs 109.8,
   103.6 vs 133.0 ms (4-22% faster). A read-ahead is used only within the pass (forward, backward,
   gather_all, frozen_whole) that issued it and is dropped when the next one starts, and by
   any write of a home the code sees (step commit, write-back): between passes user code may
   write a home through its file mapping (checkpoint load, load_state_dict), unseen here.
   The host waits for a read in one place, the fetch that copies the shard to the device, and
   never reads the disk itself: a shard not read ahead (a pass's first units) is read on the
   I/O thread too (with the rest of its unit issued behind it), a dropped read-ahead is not
   waited for, and the H2D copy out of a pinned read buffer is non_blocking; the next read into
   that buffer waits for the copy's event on the I/O thread (param_homes.py). A blocking
   copy there would synchronize the gather stream, i.e. wait for every all-gather queued
   before it, once per buffer per unit.
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

from typing import List, Optional

import torch

from . import gather_stream
from .param_offload_checks import (  # noqa: F401 (re-exported)
    KINDS,
    NOTES,
    check_args,
    check_space,
    estimate_,
    formula_,
)
from .sharded_flat import ShardedFlat


class OffloadedShardedFlat(ShardedFlat):
    """A ShardedFlat whose shard lives at `homes` (host or file) between uses."""

    def __init__(self, params, dtype, world_size, rank, group_index, unit_index,
                 trainable=True, placement=None, *, homes, slot_align=1) -> None:
        self.homes = homes  # param_homes.ParamHomes (not imported: it builds this class)
        self.dev = None  # (set below: ShardedFlat.__init__ calls free() first)
        super().__init__(params, dtype, world_size, rank, group_index, unit_index, trainable,
                         placement, slot_align)
        S = self.layout.shard_numel
        self._dev_bytes = S * self.param_shard.element_size()
        self.dev = self.param_shard  # the device shard storage; released below, fetched per use
        self.file = None  # "nvme": its param_homes._ParamFile
        self.param_shard = homes.adopt(self, self.param_shard)  # the home: host tensor or file view
        self._live = False    # dev holds the shard
        self._working = False  # dev is this step's update target (offload=None)
        self._staged = False   # "nvme": this step's new shard is in the staging buffer
        self.params_journaled = homes.kind == "nvme" and trainable
        self.dev.untyped_storage().resize_(0)

    @property
    def device_flat(self) -> torch.Tensor:
        return self.dev

    def param_buffers(self):
        # On the device: the working shard (0 bytes between uses) and the gathered unit; the
        # home (param_shard) is host or disk bytes, reported by ParamHomes.
        yield ("params" if self.trainable else "frozen"), self.dev, self.state_padding
        yield "live_units", self.full, self.layout.padding

    # -- device shard ------------------------------------------------------------------------
    def _fetch(self) -> torch.Tensor:
        if not self._live:
            self.dev.untyped_storage().resize_(self._dev_bytes)
            self.homes.load(self, self.dev)
            self._live = True
        return self.dev

    def _release(self, after_gather: bool = False) -> None:
        if self.dev is not None and self._live and not self._working:
            gs = self._gather_stream() if after_gather else None
            if gs is not None:  # fetched on the gather stream, freed from the compute stream
                gs.used_by_compute(self.dev)
            self.dev.untyped_storage().resize_(0)
            self._live = False

    # -- gather / free -----------------------------------------------------------------------
    def _gather_source(self) -> torch.Tensor:
        # [Note: param offload choices] 1: fetched with its (pre)fetched gather; on a GPU the
        # H2D copy runs on the gather stream ([Note: stage-3 gather stream], gather_stream.py)
        return self._fetch()

    def _gather_stream(self):
        return self.homes.gather_stream(self.full.device)

    def finish_gather(self) -> None:
        landed = self.handle is not None
        super().finish_gather()
        if landed:
            self._release(after_gather=True)

    def free(self) -> None:
        gathering = self.handle is not None
        super().free()  # (waits for a gather in flight first)
        self._release(after_gather=gathering)

    def write_back_(self) -> None:
        self.homes.new_pass()  # (a read-ahead of this home would be stale)
        piece = self.full[slice(*self.layout.piece_range(0, self.rank))]
        if self.master is not None:
            changed = piece != self.param_shard.to(piece.device)
            master = self.master.to(piece.device)
            self.master.copy_(torch.where(changed, piece.float(), master))
        self.param_shard.copy_(piece)

    # -- the step ----------------------------------------------------------------------------
    def _work(self) -> torch.Tensor:
        """offload=None: the update runs on the device, on a fetched shard (Note: 2)."""
        self._fetch()
        self._working = True
        return self.dev

    def master_piece(self, k: int) -> torch.Tensor:
        if self.master is not None:
            return self.master
        return self.param_shard if self.homes.host_update else self._work()

    def param_out_piece(self, k: int) -> Optional[torch.Tensor]:
        if self.master is None:
            return None
        if self.params_journaled:  # into the staging buffer, written at publish (Note: 3)
            self._staged = True
            return self.homes.staging(self)
        return self.param_shard if self.homes.host_update else self._work()

    def store_piece(self, k: int) -> None:
        """After the update of the shard: store it home (offload=None) or journal it (stage 3
        publishes nothing: ShardBuffer.publish_piece)."""
        if self._working:
            self.param_shard.copy_(self.dev)  # blocking on a GPU (Note: 4)
            self._working = False
            self._release()
        if self._staged:
            self._staged = False
            self.homes.write_step(self)


# -- Stage3Runtime's calls (runtime.py) ---------------------------------------------
def _homes(sync):
    bufs = sync.groups or sync.frozen  # (O(1): called at every prefetch)
    return getattr(bufs[0], "homes", None) if bufs else None


def has_homes(sync) -> bool:
    """Whether the shards live on the host or disk between uses (offload_params)."""
    return _homes(sync) is not None


def new_pass(sync) -> None:
    """A forward, a backward, gather_all or frozen_whole starts: read-aheads issued before it
    are dropped (only one issued and used within one pass is known to be current), and on a
    GPU the gather stream waits for the compute stream ([Note: stage-3 gather stream], 2)."""
    bufs = sync.groups or sync.frozen
    gs = gather_stream.for_device(bufs[0].device) if bufs else None
    if gs is not None:
        gs.new_epoch()
    homes = _homes(sync)
    if homes is not None:
        homes.new_pass()


def read_ahead(sync, sched: List[int], pos: int) -> None:
    """offload_params="nvme": while sched[pos - 1]'s gather is prefetched, start the disk read
    of sched[pos]'s shards ([Note: param offload choices] 1)."""
    homes = _homes(sync)
    if homes is None or homes.kind != "nvme" or pos >= len(sched):
        return
    for ui in sync._need(sync.units[sched[pos]]):
        for f in sync._bufs(ui):
            homes.read_ahead(f)
