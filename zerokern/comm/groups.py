"""`Comm`: the process groups a ZeroAdamW runs over, each named by what it is for.

[Note: two groups, named by role]
One group used to mean two things. With a data-parallel mesh they differ, so every call site
says which one it means:
- `shard` (layout): the ranks a flat buffer is sharded over. Its rank and size give the
  partition (`partition.FlatLayout`), it reduce-scatters the grads and all-gathers the params.
- `world` (agreement): every data-parallel rank, everyone who must agree. The grad stats
  all-reduce (found_inf, sumsq: the overflow skip and the clip norm) and the averaging divisor,
  the NVMe commit flag, the checkpoint's `agree`, the ZEROKERN_DEBUG_COLLECTIVES fingerprint,
  and the rank in file names (unique per rank: replicas hold the same shard).
- `replicate` (HSDP only, None otherwise): the ranks holding the same shard (one per shard
  group). The reduce-scattered shard is all-reduced over it, so each rank holds the sum over
  the whole world of its shard, as with a flat world.
A 1-D mesh (or `process_group=`, or none) makes `world` the very same GroupComm as `shard`:
today's behaviour, collective for collective. A 2-D mesh (replicate, shard) makes three groups.

[Note: HSDP stats count each element once]
After the replicate all-reduce every replica holds the same shard, so a world sum of sumsq would
count each element once per replica. `count_once_` zeroes a sum-type statistic on every rank but
replica 0 before the world all-reduce: the sum is then exactly the shard group's (x + 0 is exact),
with no division (1/3 is not exact), while found_inf and the step's agreement stay world-wide.

All GroupComms of one optimizer share one CommStats (comm_stats() per dim) and one debug log,
checked over the world group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zerokern.platform.device import handle

from .abort import Watch
from .collectives import CommStats, GroupComm, _Done
from .debug import CollectiveLog
from .debug import enabled as _debug_enabled
from .pieces import contiguous
from .quantized import Level, _side_stream, all_gather_quantized_, reduce_scatter_quantized_
from .ring import FutureWork


def _replicate_after(h, out: torch.Tensor, issue):
    """Issue the replicate all-reduce now, right after its reduce-scatter, ordered after it.

    [Note: HSDP all-reduce at a fixed point] NCCL needs one order of collectives across both
    groups on every rank, so the all-reduce is issued where its reduce-scatter is, not when a
    caller waits for the handle: when that happens follows the staging pool and the buckets'
    readiness, which differ by rank (issue 34 finding 8; the fake-CUDA run of HSDP 2x4 at
    stage 2 with rank-dependent skips saw the orders differ). On a GPU the wait for the
    reduce-scatter and the issue run on a side stream, so the compute stream goes on with the
    backward; the returned handle is the all-reduce's. On the host the reduce-scatter is
    waited for first (gloo's own collectives, ZEROKERN_GLOO_RING=0)."""
    if not handle(out).has_streams:
        h.wait()
        return issue()
    side = _side_stream(out.device)
    dev = handle(out)
    side.wait_stream(dev.current_stream(out.device))
    with dev.use_stream(side):
        h.wait()  # this stream waits for the reduce-scatter (and qgZ's decode runs here)
        return issue()  # the replicate group's stream waits for this one


class _Then:
    """A handle whose wait() waits for the first op, then runs the second (issued only then:
    on NCCL a collective issued before the first landed would read the buffer too early)."""

    def __init__(self, first, then) -> None:
        self._first, self._then = first, then

    def wait(self) -> bool:
        if self._then is not None:
            self._first.wait()
            then, self._then = self._then, None
            then().wait()
        return True

    def is_completed(self) -> bool:
        return self._then is None


class Comm:
    """The shard, replicate and world groups of one optimizer ([Note: two groups, named by
    role]). `Comm(process_group)`: 1-D, the shard group is the world group (default WORLD, or
    world size 1 without init_process_group). `Comm.mesh(shard_pg, replicate_pg, world_pg)`:
    HSDP."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 _groups: Optional[tuple] = None, hpz: Optional[GroupComm] = None) -> None:
        # hpZ (stage3/hpz.py): the node group the secondary param copies are sharded over;
        # the shard group is then the whole world.
        self.hpz = hpz
        # ZeRO++'s quantized collectives (comm/quantized.py), set by `quantize`: qwZ's
        # forward/backward param gathers, qgZ's grad reduce-scatter over `q_levels`.
        self.qwz = False
        self.qgz_bits: Optional[int] = None
        self.q_levels = None
        self.codec_for = None
        self.q_gather = None  # qwZ with hpZ: quantized.HierGather (two hops); else flat
        if _groups is None:
            self.shard = GroupComm(process_group, dim="shard")
            self.world = self.shard
            self.replicate: Optional[GroupComm] = None
        else:
            self.shard, self.replicate, self.world = _groups

    @classmethod
    def hpz_mesh(cls, world_pg, node_pg) -> Comm:
        """hpZ: shard over world_pg (every rank of the mesh), the secondary over node_pg."""
        shard = GroupComm(world_pg, dim="shard")
        node = GroupComm(node_pg, dim="hpz", stats=shard.stats, tag="hpz")
        return cls(_groups=(shard, None, shard), hpz=node)

    @classmethod
    def mesh(cls, shard_pg, replicate_pg, world_pg) -> Comm:
        """HSDP: shard inside shard_pg, all-reduce the shard across replicate_pg; world_pg is
        every rank of both (all process groups, this rank in each)."""
        stats = CommStats()
        shard = GroupComm(shard_pg, dim="shard", stats=stats, tag="main")
        replicate = GroupComm(replicate_pg, dim="replicate", stats=stats, tag="replicate")
        world = GroupComm(world_pg, dim="world", stats=stats, tag="world")
        if replicate.world_size == 1:  # (N, 1)... is 1-D after all: no replicate all-reduce
            replicate = None
        return cls(_groups=(shard, replicate, world))

    def quantize(self, weights: bool, grad_bits: Optional[int], codec_for, levels=None,
                 gather=None) -> None:
        """Turn on qwZ (`weights`: over `gather`, a quantized.HierGather, or the shard group)
        and qgZ (`grad_bits` 8 or 4, over `levels`: default one hop over the shard group) with
        the kernels' `codec_for(device)`."""
        self.qwz, self.qgz_bits, self.codec_for = weights, grad_bits, codec_for
        self.q_gather = gather
        if grad_bits is not None:
            self.q_levels = levels or [Level(self.shard)]

    def gather_quantized_(self, full: torch.Tensor, src: torch.Tensor,
                          label: Optional[str] = None):
        """qwZ: full = every shard-group rank's piece, int8 except this rank's own (exact);
        a handle (comm/quantized.py)."""
        if self.q_gather is not None:
            return self.q_gather.all_gather_(full, src, self.codec_for, label)
        return all_gather_quantized_(self.shard, full, src, self.codec_for, label)

    def group_comms(self):
        """Every GroupComm this Comm runs collectives on, once each (qgZ's hops and qwZ's
        gathers included)."""
        out = {}
        gcs = [self.shard, self.replicate, self.world, self.hpz]
        gcs += [lv.gc for lv in self.q_levels or ()]
        if self.q_gather is not None:
            gcs += [self.q_gather.cross, self.q_gather.node]
        for gc in gcs:
            if gc is not None:
                out[id(gc)] = gc
        return list(out.values())

    # -- what the optimizer reads ---------------------------------------------------------------
    @property
    def stats(self) -> CommStats:
        return self.shard.stats

    @property
    def log(self) -> Optional[CollectiveLog]:
        return self.world.log

    @property
    def dims(self) -> dict:
        """Group sizes by role: {"shard": n, "replicate": m, "world": n*m} (and "hpz": the
        node group's size with hpZ)."""
        out = {"shard": self.shard.world_size,
               "replicate": 1 if self.replicate is None else self.replicate.world_size,
               "world": self.world.world_size}
        if self.hpz is not None:
            out["hpz"] = self.hpz.world_size
        return out

    def _groups(self):
        seen = []
        qs = [lv.gc for lv in self.q_levels or ()]
        if self.q_gather is not None:
            qs += [self.q_gather.cross, self.q_gather.node]
        for g in (self.shard, self.replicate, self.world, self.hpz, *qs):
            if g is not None and all(g is not s for s in seen):
                seen.append(g)
        return seen

    def count_once_(self, t: torch.Tensor) -> torch.Tensor:
        """Zero t on replicas other than 0 ([Note: HSDP stats count each element once]), so a
        world SUM of it counts each shard once; t unchanged without replicas."""
        if self.replicate is not None and self.replicate.rank != 0:
            t.zero_()
        return t

    def signal_failure(self, error: BaseException) -> None:
        """This rank raises `error`: post it on every group's failure channel (comm/abort.py),
        so peers waiting in a collective on any of them raise too."""
        for g in self._groups():
            g.signal_failure(error)

    # -- grads ---------------------------------------------------------------------------------
    def reduce_grads_(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                      label: Optional[str] = None):
        """out = this rank's shard of the sum over the world of inp (consumed, as
        GroupComm.reduce_scatter_): a reduce-scatter over the shard group, then (HSDP) an
        all-reduce of the shard over the replicate group.

        [Note: HSDP reduction order] On the gloo ring both run on the shard group's ring
        thread, the all-reduce right after its reduce-scatter, so it overlaps backward like
        the reduce-scatter and the replicate group sees one static order (the reduce-scatter
        order). Elsewhere (NCCL, native gloo) the all-reduce is issued when the caller waits
        for the handle, which every caller does in issue order."""
        if self.qgz_bits is not None:  # qgZ: quantized all-to-all(s), reduced in fp32
            h = reduce_scatter_quantized_(self.q_levels, out, contiguous(inp), self.qgz_bits,
                                          self.codec_for, async_op=True, label=label)
        else:
            h = self.shard.reduce_scatter_(out, inp, async_op=True, label=label)
        rep = self.replicate
        if rep is not None:
            ring = self.shard.ring
            if ring is not None and isinstance(h, FutureWork):
                rep.account("all_reduce", out, label)
                fut = ring.submit(_after, h, out, rep.group)
                # watched on both groups (comm/abort.py): a replica that failed never joins
                watch = Watch((self.shard.abort, h.index),
                              (rep.abort, rep.abort.next_index() if rep.abort else 0))
                h = FutureWork(fut, watch, 0)
            else:
                h = _replicate_after(h, out, lambda: rep.all_reduce_(out, async_op=True,
                                                                      label=label))
        if not async_op:
            h.wait()
            return _Done()
        return h

    def prepare_pieces(self) -> None:
        """Collective over the shard group: set its shared-memory exchange up now (where its
        ring can have one), so `reads_pieces` holds from the first reduce-scatter on."""
        ring = self.shard.ring
        if ring is not None and self.shard.world_size > 1:  # (every rank: the set-up says
            # collectively whether all of them can)
            self.shard._on_ring(False, ring.connect_shm)

    @property
    def reads_pieces(self) -> bool:
        """reduce_grads_ reads a Pieces input where it lies (the shared-memory exchange carries
        the shard group, no qgZ): [Note: grads read where they lie] (pieces.py). Elsewhere it
        would only be copied into one buffer first."""
        ring = self.shard.ring
        return self.qgz_bits is None and self.shard.world_size > 1 and ring is not None \
            and ring.uses_shm

    def all_reduce_grads_(self, t: torch.Tensor, async_op: bool = False,
                          label: Optional[str] = None):
        """Sum t over the world (stage 0: every rank holds every grad, as DDP)."""
        return self.world.all_reduce_(t, async_op=async_op, label=label)

    def split(self) -> Comm:
        """Stage 3's reduce-scatters on a shard group of their own ([Note: stage-3 collective
        order]); the replicate all-reduce after each stays on the one replicate group (only
        reduce_grads_ uses it) and the agreement on the world."""
        shard = self.shard.split()
        out = Comm(_groups=(shard, self.replicate, self.world), hpz=self.hpz)
        levels = None
        if self.q_levels is not None:  # the hops on split groups too (the node group's
            # gathers (hpZ) must not meet its reduce-scatters); a hop over the shard group
            # takes the very split group the plain reduce-scatter would use
            levels = [Level(shard, lv.perm) if lv.gc is self.shard else lv.split()
                      for lv in self.q_levels]
        out.quantize(self.qwz, self.qgz_bits, self.codec_for, levels, self.q_gather)
        return out

    # -- debug log ([Note: collective fingerprints], comm/debug.py) --------------------------
    def enable_debug_log(self) -> None:
        """ZEROKERN_DEBUG_COLLECTIVES=1: one log over every group of this optimizer (call
        before split())."""
        if self.world.log is None and _debug_enabled():
            log = CollectiveLog()
            for g in self._groups():
                g.log = log

    def check_collectives(self, where: str = "step()") -> None:
        """Raise on every rank if the ranks issued different collectives since the last check,
        over the world group (a no-op when the mode is off)."""
        if self.world.log is not None:
            self.world.log.check(self.world.group, where)


def _after(h, out: torch.Tensor, group) -> None:
    """On the ring thread: the reduce-scatter (already queued before this), then the
    replicate all-reduce of its result."""
    h.wait()
    dist.all_reduce(out, group=group)
